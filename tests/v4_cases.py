"""Tiny DeepSeek-V4 models for the tests: a transformers model with every zero-initialised
parameter randomised (sinks, position biases, mHC bases and scales, norms, ``tid2eid``, the
correction bias: zeros hide their bugs), the same weights in mlafx's reference model, and a
paged-cache driver that runs a sequence through the step function in chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM, cache_shapes
from mlafx.models.deepseek_v4.step import SequenceStep, v4_step_metadata

# Odd widths; all three layer types and both MLP types; a window, compression rates and
# index_topk small enough that prompts of a few hundred tokens cross many windows and the
# selection matters. 16 indexer heads: an entry scores exactly 0 (a tie) only when every
# head's ReLU is 0.
TINY_V4 = dict(
    vocab_size=97,
    hidden_size=40,
    moe_intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=24,
    q_lora_rank=20,
    qk_rope_head_dim=8,
    num_experts_per_tok=2,
    n_routed_experts=5,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=8,
    o_groups=2,
    o_lora_rank=12,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    hc_mult=3,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    max_position_embeddings=512,
    initializer_range=0.2,
)


def transformers_v4(seed: int = 0, **overrides):
    """A seeded random transformers ``DeepseekV4ForCausalLM`` (float32, eval)."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    torch.manual_seed(seed)
    model = HFModel(HFConfig(**{**TINY_V4, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("sinks", "position_bias", "base", "scale", "norm")):
                centre = 1.0 if ("norm" in name or "scale" in name) else 0.0
                p.copy_(torch.randn_like(p) * 0.5 + centre)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    return model


def mlafx_v4(hf_model) -> DeepseekV4ForCausalLM:
    """mlafx's reference model with ``hf_model``'s weights (every key must match)."""
    cfg = DeepseekV4Config.from_hf_dict(hf_model.config.to_dict())
    model = DeepseekV4ForCausalLM(cfg).eval()
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


class PagedRun:
    """Paged caches for a few sequences; ``step`` runs one step over some of them."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        block_size: int,
        num_blocks: int = 256,
        sparse: bool = False,
    ):
        """``sparse``: attention on mlafx's ops (the engine's path), else the dense reference."""
        self.model, self.block_size, self.sparse = model, block_size, sparse
        cfg = model.config
        self.caches = [torch.zeros(s) for s in cache_shapes(cfg, num_blocks, block_size)]
        self.next_block = 1  # block 0 stays unused: a wrong slot would land there unnoticed

    def new_blocks(self, tokens: int) -> list[int]:
        count = -(-tokens // self.block_size)
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def step(self, parts: Sequence[tuple[Sequence[int], int, list[int]]]) -> list[torch.Tensor]:
        """parts: (token ids of the sequence so far, cached tokens, block table) per sequence;
        the new tokens are the ids after the cached ones. Returns each part's log-softmax
        [new, vocab]."""
        cfg = self.model.config
        seqs = [SequenceStep(ctx, len(ids) - ctx, bt) for ids, ctx, bt in parts]
        meta = v4_step_metadata(
            seqs, self.block_size, cfg.sliding_window, cfg.compress_rates, sparse=self.sparse
        )
        input_ids = torch.tensor([t for ids, ctx, _ in parts for t in ids[ctx:]])
        with torch.no_grad():
            logits = self.model(input_ids, self.caches, meta, torch.arange(len(input_ids)))
        return list(logits.float().log_softmax(-1).split([s.new_tokens for s in seqs]))

    def run(
        self,
        ids: Sequence[int],
        chunks: Sequence[int],
        blocks: list[int] | None = None,
        context: int = 0,
    ) -> torch.Tensor:
        """One sequence in chunks (after ``context`` tokens already in ``blocks``)."""
        blocks = blocks if blocks is not None else []
        blocks = blocks + self.new_blocks(len(ids) - len(blocks) * self.block_size)
        out, done = [], context
        for c in chunks:
            out += self.step([(ids[: done + c], done, blocks)])
            done += c
        assert done == len(ids)
        return torch.cat(out)


def reference_logprobs(hf_model, ids: Sequence[int]) -> torch.Tensor:
    """transformers' cache-free forward over the whole sequence: [len, vocab] log-softmax."""
    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0].float().log_softmax(-1)

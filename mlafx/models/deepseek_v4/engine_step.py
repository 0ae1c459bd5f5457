"""The engine's step (``StepFn``) over DeepSeek-V4's model, its attention on mlafx's ops.

The engine builds every step's inputs with the MLA step ABI (``models/step.py``); this step
reads the per-sequence facts of its metadata (``block_table``, ``kv_lens``,
``query_start_loc``: each sequence's cache blocks, cached tokens after the step and new
tokens) and turns them into V4's own (``v4_step_metadata``: window rows, pool entries closing
and read, and the paged form the attention ops read, ``sparse_step.py``). The caches are
``DeepseekV4Config.cache_block_shapes``' paged tensors. The pool caches share the block ids of
the engine's block tables: the pool entries a token's window closes live in the token's block,
so prefix hits, copies of leading rows, preemption and KV stores work on them as on a latent
cache. The token caches (window rows, compressor inputs) share them too, unless the engine
binds a token-block map (``bind_token_blocks``: ``runtime/token_rows.py``): then block ``b``'s
token rows live in token block ``token_blocks[b]`` (0: none held), and a sequence holds only
those its next steps read.
"""

from __future__ import annotations

import torch

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlafx.models.deepseek_v4.step import SequenceStep, V4StepMetadata, v4_step_metadata
from mlafx.models.step import StepMetadata


class V4StepInputs:
    """What V4's steps (this eager one, ``CompiledV4Step``) share: the engine's step metadata
    turned into V4's, through the token-block map the engine may bind."""

    reads_key_rows = False  # V4's window and pool rows come from the block tables
    model: DeepseekV4ForCausalLM
    block_size: int
    token_blocks: torch.Tensor | None = None  # [num_blocks] int32: block -> its token block

    def bind_token_blocks(self, token_blocks: torch.Tensor) -> None:
        """Read token rows through ``token_blocks`` (kept by reference: the engine updates it
        in place between steps)."""
        self.token_blocks = token_blocks

    def v4_metadata(self, meta: StepMetadata, positions: torch.Tensor) -> V4StepMetadata:
        return v4_sparse_metadata(
            self.model.config, meta, positions, self.block_size, self.token_blocks
        )


class V4EngineStep(V4StepInputs):
    """``step(input_ids, positions, caches, meta, logits_indices) -> logits`` of ``model``
    over caches paged in blocks of ``block_size`` tokens."""

    def __init__(self, model: DeepseekV4ForCausalLM, block_size: int) -> None:
        cfg = model.config
        cfg.cache_block_shapes(block_size)  # the block size must suit every compression rate
        self.model, self.block_size = model, block_size

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[torch.Tensor],  # ``cache_block_shapes`` order, written in place
        meta: StepMetadata,
        logits_indices: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, vocab]
        return self.model(input_ids, caches, self.v4_metadata(meta, positions), logits_indices)


def sequence_steps(
    meta: StepMetadata, block_size: int, token_blocks: torch.Tensor | None = None
) -> list[SequenceStep]:
    """Each sequence's context, new tokens, block table and (``token_blocks`` given) the
    blocks of its token rows."""
    starts = meta.query_start_loc.tolist()
    kv_lens = meta.kv_lens.tolist()
    ids = meta.block_table[:, : -(-max(kv_lens, default=0) // block_size)]
    tokens = None if token_blocks is None else token_blocks[ids.long()].tolist()
    table = ids.tolist()
    seqs = []
    for b, kv_len in enumerate(kv_lens):
        new, count = starts[b + 1] - starts[b], -(-kv_len // block_size)
        own = None if tokens is None else tokens[b][:count]
        seqs.append(SequenceStep(kv_len - new, new, table[b][:count], own))
    return seqs


def v4_sparse_metadata(
    cfg: DeepseekV4Config,
    meta: StepMetadata,
    positions: torch.Tensor,
    block_size: int,
    token_blocks: torch.Tensor | None = None,
) -> V4StepMetadata:
    """The engine's step metadata as V4's, in the sparse form its attention ops read."""
    v4_meta = v4_step_metadata(
        sequence_steps(meta, block_size, token_blocks), block_size, cfg.sliding_window,
        cfg.compress_rates, sparse=True, overlapping_rates=cfg.overlapping_rates,
    )  # fmt: skip
    if not torch.equal(v4_meta.positions, positions):
        raise ValueError("the step's positions disagree with its sequences' metadata")
    return v4_meta

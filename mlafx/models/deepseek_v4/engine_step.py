"""The engine's step (``StepFn``) over DeepSeek-V4's model, its attention on mlafx's ops.

The engine builds every step's inputs with the MLA step ABI (``models/step.py``); this step
reads the per-sequence facts of its metadata (``block_table``, ``kv_lens``,
``query_start_loc``: each sequence's cache blocks, cached tokens after the step and new
tokens) and turns them into V4's own (``v4_step_metadata``: window rows, pool entries closing
and read, and the paged form the attention ops read, ``sparse_step.py``). The caches are
``DeepseekV4Config.cache_block_shapes``' paged tensors, sharing the block ids of the engine's
block tables: a token's rows and the pool entries its window closes live in the token's block,
so prefix hits, copies of leading rows, preemption and KV stores work on them as on a latent
cache.
"""

from __future__ import annotations

import torch

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlafx.models.deepseek_v4.step import SequenceStep, V4StepMetadata, v4_step_metadata
from mlafx.models.step import StepMetadata


class V4EngineStep:
    """``step(input_ids, positions, caches, meta, logits_indices) -> logits`` of ``model``
    over caches paged in blocks of ``block_size`` tokens."""

    reads_key_rows = False  # V4's window and pool rows come from the block tables

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
        v4_meta = v4_sparse_metadata(self.model.config, meta, positions, self.block_size)
        return self.model(input_ids, caches, v4_meta, logits_indices)


def sequence_steps(meta: StepMetadata, block_size: int) -> list[SequenceStep]:
    """Each sequence's context, new tokens and block table."""
    starts = meta.query_start_loc.tolist()
    kv_lens = meta.kv_lens.tolist()
    table = meta.block_table.tolist()
    seqs = []
    for b, kv_len in enumerate(kv_lens):
        new = starts[b + 1] - starts[b]
        seqs.append(SequenceStep(kv_len - new, new, table[b][: -(-kv_len // block_size)]))
    return seqs


def v4_sparse_metadata(
    cfg: DeepseekV4Config, meta: StepMetadata, positions: torch.Tensor, block_size: int
) -> V4StepMetadata:
    """The engine's step metadata as V4's, in the sparse form its attention ops read."""
    v4_meta = v4_step_metadata(
        sequence_steps(meta, block_size), block_size, cfg.sliding_window, cfg.compress_rates,
        sparse=True,
    )  # fmt: skip
    if not torch.equal(v4_meta.positions, positions):
        raise ValueError("the step's positions disagree with its sequences' metadata")
    return v4_meta

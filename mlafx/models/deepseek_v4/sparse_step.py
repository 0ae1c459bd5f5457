"""The index tensors V4's attention reads on mlafx's ops (``kernels/v4_attention.py``,
``kernels/dsa_ops.py``) instead of the reference's dense masks: per sequence its block table,
per query the positions it may read.

The window rows are the token caches' positions (``block_table``: the sequences' token
blocks, ``block_size`` rows a block). Pool entry ``w`` of rate ``m`` lives at row ``w % rows``
of block ``pool_table[b, w // rows]`` with ``rows = pool_rows_per_block(m, block_size)``
(``step.py``'s layout read as a paged cache): the sequence's block table itself when ``m``
divides the block size, else the block of each entry's last token. A query at position ``p``
reads the window positions ``p - W < j <= p`` and the entries ``w < (p + 1) // m``; a CSA
layer's indexer picks ``index_topk`` of those.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlafx.config.deepseek_v4 import pool_rows_per_block

if TYPE_CHECKING:
    from mlafx.models.deepseek_v4.step import SequenceStep


@dataclass(frozen=True)
class SparsePool:
    """One compression rate's pool as a paged cache.

    table         [B, M'] int32  pool blocks of each sequence
    lens          [B] int32      entries closed once the step is done
    last_visible  [T] int64      ``(p + 1) // m - 1``: the last entry each query may read
    visible       [T, E] int64   every entry each query may read, -1 where it may not (what an
                                 HCA layer attends to; made on first use, once per step)
    """

    table: torch.Tensor
    lens: torch.Tensor
    last_visible: torch.Tensor

    @functools.cached_property
    def visible(self) -> torch.Tensor:
        entries = torch.arange(int(self.lens.max()) if self.lens.numel() else 0)
        return torch.where(entries[None, :] <= self.last_visible[:, None], entries[None, :], -1)


@dataclass(frozen=True)
class SparseStep:
    """T new tokens of B sequences.

    query_start_loc [B + 1] int32  each sequence's first new token
    block_table     [B, M] int32   token cache blocks of each sequence (0 where it holds none)
    kv_lens         [B] int32      tokens cached once the step is done
    window          [T, W] int64   each query's window positions ``p - W < j <= p``, -1 for
                                   those before the sequence's start
    pools           one ``SparsePool`` per compression rate (``rate`` -> pool)
    """

    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    window: torch.Tensor
    pools: dict[int, SparsePool]


def _tables(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int32).view(len(rows), width)


def _pool(
    seqs: Sequence[SequenceStep], positions: torch.Tensor, rate: int, block_size: int
) -> SparsePool:
    pool_rows_per_block(rate, block_size)  # ValueError unless one divides the other
    tables = []
    for s in seqs:
        if block_size % rate == 0:  # the pool pages with the tokens
            tables.append(list(s.block_table))
        else:  # one entry a block: the block of the entry's last token
            closed = (s.context + s.new_tokens) // rate
            tables.append(
                [s.block_table[(w * rate + rate - 1) // block_size] for w in range(closed)]
            )
    return SparsePool(
        table=_tables(tables),
        lens=torch.tensor([(s.context + s.new_tokens) // rate for s in seqs], dtype=torch.int32),
        last_visible=(positions + 1) // rate - 1,
    )


def sparse_step(
    seqs: Sequence[SequenceStep], block_size: int, sliding_window: int, rates: Sequence[int]
) -> SparseStep:
    """The sparse step inputs of ``seqs`` (see the module docstring)."""
    new = torch.tensor([s.new_tokens for s in seqs], dtype=torch.int64)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = new.cumsum(0)
    context = torch.tensor([s.context for s in seqs], dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), new)
    positions = context[seq_of] + torch.arange(int(starts[-1])) - starts[:-1][seq_of]  # [T]
    window = positions[:, None] - (sliding_window - 1) + torch.arange(sliding_window)[None, :]
    return SparseStep(
        query_start_loc=starts.to(torch.int32),
        block_table=_tables([list(s.token_blocks) for s in seqs]),
        kv_lens=(context + new).to(torch.int32),
        window=window.masked_fill(window < 0, -1),
        pools={m: _pool(seqs, positions, m, block_size) for m in sorted(set(rates))},
    )

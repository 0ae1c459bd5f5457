"""The index tensors V4's attention reads on mlafx's ops (``kernels/v4_attention.py``,
``kernels/dsa_ops.py``) instead of the reference's dense masks: per sequence its block table,
per query the positions it may read.

The window rows are the token caches' positions (``block_table``, ``block_size`` rows a
block). Pool entry ``w`` of rate ``m`` lives at row ``w % rows`` of block ``pool_table[b, w //
rows]`` with ``rows = pool_rows_per_block(m, block_size)`` (``step.py``'s layout read as a paged
cache): the token block table itself when ``m`` divides the block size, else the block of each
entry's last token. A query at position ``p`` reads the window positions ``p - W < j <= p`` and
the entries ``w < (p + 1) // m``; a CSA layer's indexer picks ``index_topk`` of those.
"""

from __future__ import annotations

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
    visible       [T, E] int64   every entry each query may read, ascending, -1 padded (what
                                 an HCA layer attends to)
    """

    table: torch.Tensor
    lens: torch.Tensor
    last_visible: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class SparseStep:
    """T new tokens of B sequences.

    query_start_loc [B + 1] int32  each sequence's first new token
    block_table     [B, M] int32   token cache blocks of each sequence
    kv_lens         [B] int32      tokens cached once the step is done
    window          [T, W] int64   each query's window positions ``p - W < j <= p``, -1 padded
    pools           one ``SparsePool`` per compression rate (``rate`` -> pool)
    """

    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    window: torch.Tensor
    pools: dict[int, SparsePool]


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).view(
        len(rows), width
    )


def _pool(seqs: Sequence[SequenceStep], rate: int, block_size: int) -> SparsePool:
    pool_rows_per_block(rate, block_size)  # ValueError unless one divides the other
    tables, lens, last, visible = [], [], [], []
    for s in seqs:
        end = s.context + s.new_tokens
        if block_size % rate == 0:  # the pool pages with the tokens
            tables.append(list(s.block_table))
        else:  # one entry a block: the block of the entry's last token
            tables.append(
                [s.block_table[(w * rate + rate - 1) // block_size] for w in range(end // rate)]
            )
        lens.append(end // rate)
        for p in range(s.context, end):
            last.append((p + 1) // rate - 1)
            visible.append(list(range((p + 1) // rate)))
    width = max((len(t) for t in tables), default=0)
    return SparsePool(
        table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(
            len(seqs), width
        ),
        lens=torch.tensor(lens, dtype=torch.int32),
        last_visible=torch.tensor(last, dtype=torch.int64),
        visible=_padded(visible, max((len(v) for v in visible), default=0)),
    )


def sparse_step(
    seqs: Sequence[SequenceStep], block_size: int, sliding_window: int, rates: Sequence[int]
) -> SparseStep:
    """The sparse step inputs of ``seqs`` (see the module docstring)."""
    starts, windows = [0], []
    for s in seqs:
        starts.append(starts[-1] + s.new_tokens)
        for p in range(s.context, s.context + s.new_tokens):
            windows.append(list(range(max(0, p - sliding_window + 1), p + 1)))
    width = max(len(t) for t in (s.block_table for s in seqs)) if seqs else 0
    return SparseStep(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_table=torch.tensor(
            [list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs],
            dtype=torch.int32,
        ).view(len(seqs), width),
        kv_lens=torch.tensor([s.context + s.new_tokens for s in seqs], dtype=torch.int32),
        window=_padded(windows, sliding_window),
        pools={m: _pool(seqs, m, block_size) for m in sorted(set(rates))},
    )

"""DeepSeek-V4's step inputs: the index tensors one forward step over a flat batch reads.

A step is T new tokens from B sequences (prefill chunks and decodes mixed), each sequence's
cache in paged blocks of ``block_size`` token slots (``block_table``). Every layer keeps:
  - token rows (slot ``block * BS + offset``, one per token): the window cache (the layer's
    normed, roped K=V row) and, on compressed layers, the compressor's inputs (its ``kv`` and
    ``gate`` projections, CSA: the indexer's too), read until their window closes;
  - pool rows (compressed layers): one entry per ``m = compress_rate`` tokens. Entry ``w``
    (tokens ``w*m .. w*m+m-1``) lives in the block of its *last* token ``e = w*m+m-1``, at
    slot ``block * per_block + (e % BS) // m`` with ``per_block = max(1, BS // m)`` (one of
    ``BS`` and ``m`` must divide the other). So the pool pages with the tokens, and the step
    that closes a window writes its entry into a block it owns: a sequence that shares another's
    full blocks (a prefix hit at any block boundary) never writes into them, whatever m.

Token rows may live in blocks of their own (``token_block_table``, the engine's
``TokenRowBlocks``): a sequence then holds token blocks only from the block of
``DeepseekV4Config.first_token_row_read(context)`` on, and the step reads none before it (a
non-overlapping rate's closing entries name their own window twice, the first half unread).

A query at position p reads the window rows ``p - W < position <= p`` of its sequence
(W = ``sliding_window``) and the pool entries ``w < (p + 1) // m`` (windows that closed at or
before p); a CSA layer's indexer picks ``index_topk`` of those. An entry closes in the step
that writes its window's last token: ``PoolStep.close_*`` say which, and where its source rows
are (CSA's entry ``w`` pools window ``w``'s rows with window ``w-1``'s: two series).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlafx.config.deepseek_v4 import pool_rows_per_block
from mlafx.models.deepseek_v4.sparse_step import SparseStep, sparse_step


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: ``new_tokens`` tokens after ``context`` cached ones, its
    cache blocks ``block_table`` (enough for ``context + new_tokens`` slots) and the blocks of
    its token rows (``token_block_table``, the same length; None: ``block_table``'s; 0 where
    the sequence holds no token rows)."""

    context: int
    new_tokens: int
    block_table: Sequence[int]
    token_block_table: Sequence[int] | None = None

    @property
    def token_blocks(self) -> Sequence[int]:
        return self.block_table if self.token_block_table is None else self.token_block_table


@dataclass(frozen=True)
class PoolStep:
    """The pool of one compression rate ``rate`` (m): N entries closing, E entries read.

    close_slots    [N] int64     pool slot of each entry that closes this step
    close_sources  [N, 2m] int64 token slots of its window ``w-1`` (m), then window ``w`` (m)
                                 (w = 0: the first half repeats window 0, masked by
                                 ``close_has_previous``)
    close_has_previous [N] bool  False for w = 0 (no window before it)
    close_positions [N] int64    ``w * m``: the RoPE position of the entry
    entry_slots    [E] int64     pool slots of every closed entry of the step's sequences that
                                 a query of the step may read, sequence by sequence, in order
    entry_seq_ids  [E] int64     step-local sequence of each
    entry_index    [E] int64     ``w`` of each
    """

    rate: int
    close_slots: torch.Tensor
    close_sources: torch.Tensor
    close_has_previous: torch.Tensor
    close_positions: torch.Tensor
    entry_slots: torch.Tensor
    entry_seq_ids: torch.Tensor
    entry_index: torch.Tensor


@dataclass(frozen=True)
class V4StepMetadata:
    """T new tokens of B sequences; K window rows the step reads.

    positions      [T] int64  position of each new token in its sequence
    slot_mapping   [T] int64  token slot each new token's rows go to
    query_seq_ids  [T] int64  step-local sequence (0..B-1) of each new token
    key_slots      [K] int64  token slots of the window rows any query of the step may read:
                              per sequence, positions ``max(0, first new - W + 1) ..`` its last
    key_seq_ids    [K] int64
    key_positions  [K] int64
    pools          one ``PoolStep`` per compression rate the model uses (``rate`` ascending)
    sparse         the same step as paged caches and per-query positions
                   (``sparse_step.py``): given, attention runs on mlafx's ops instead of the
                   reference's dense masks, and the fields only those read (``key_*``, the
                   pools' ``entry_*``) are empty
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_seq_ids: torch.Tensor
    key_slots: torch.Tensor
    key_seq_ids: torch.Tensor
    key_positions: torch.Tensor
    pools: tuple[PoolStep, ...]
    sparse: SparseStep | None = None

    def pool(self, rate: int) -> PoolStep:
        for p in self.pools:
            if p.rate == rate:
                return p
        raise KeyError(f"the step has no pool of compression rate {rate}")


def _token_slot(token_blocks: Sequence[int], position: int, block_size: int) -> int:
    block = position // block_size
    if block >= len(token_blocks):
        raise ValueError(f"position {position} is past the sequence's {len(token_blocks)} blocks")
    if token_blocks[block] == 0:
        raise ValueError(f"position {position}: the sequence holds no token rows there")
    return token_blocks[block] * block_size + position % block_size


def _pool_slot(block_table: Sequence[int], entry: int, rate: int, block_size: int) -> int:
    last = entry * rate + rate - 1
    per_block = pool_rows_per_block(rate, block_size)
    return block_table[last // block_size] * per_block + (last % block_size) // rate


def _pool_step(
    seqs: Sequence[SequenceStep],
    rate: int,
    block_size: int,
    long: torch.dtype,
    entries: bool,
    overlap: bool,
) -> PoolStep:
    """The pool's closing entries; ``entries``: also every readable one (the dense path's).
    Without ``overlap`` an entry's first m sources (unread) repeat its own window."""
    close_slots, sources, has_prev, close_pos = [], [], [], []
    entry_slots, entry_seq, entry_idx = [], [], []
    for b, s in enumerate(seqs):
        bt, tt, end = s.block_table, s.token_blocks, s.context + s.new_tokens
        for w in range(s.context // rate, end // rate):  # windows whose last token is new
            close_slots.append(_pool_slot(bt, w, rate, block_size))
            prev = (w - 1 if w else 0) if overlap else w
            sources.append(
                [_token_slot(tt, prev * rate + j, block_size) for j in range(rate)]
                + [_token_slot(tt, w * rate + j, block_size) for j in range(rate)]
            )
            has_prev.append(w > 0)
            close_pos.append(w * rate)
        for w in range(end // rate if entries else 0):
            entry_slots.append(_pool_slot(bt, w, rate, block_size))
            entry_seq.append(b)
            entry_idx.append(w)
    return PoolStep(
        rate=rate,
        close_slots=torch.tensor(close_slots, dtype=long),
        close_sources=torch.tensor(sources, dtype=long).view(-1, 2 * rate),
        close_has_previous=torch.tensor(has_prev, dtype=torch.bool),
        close_positions=torch.tensor(close_pos, dtype=long),
        entry_slots=torch.tensor(entry_slots, dtype=long),
        entry_seq_ids=torch.tensor(entry_seq, dtype=long),
        entry_index=torch.tensor(entry_idx, dtype=long),
    )


def v4_step_metadata(
    seqs: Sequence[SequenceStep],
    block_size: int,
    sliding_window: int,
    rates: Sequence[int],
    sparse: bool = False,
    overlapping_rates: Sequence[int] | None = None,
) -> V4StepMetadata:
    """The step inputs of ``seqs`` (see the module docstring); with ``sparse`` the paged form
    attention takes on mlafx's ops (``sparse_step.py``) instead of the dense key and entry
    lists. ``overlapping_rates``: the rates whose entries pool two windows
    (``DeepseekV4Config.overlapping_rates``; None: every rate's sources name both)."""
    overlapping = set(rates if overlapping_rates is None else overlapping_rates)
    long = torch.int64
    positions, slots, seq_ids, key_slots, key_seq, key_pos = [], [], [], [], [], []
    for b, s in enumerate(seqs):
        if s.new_tokens < 1 or s.context < 0:
            raise ValueError(f"sequence {b}: {s.new_tokens} new tokens after {s.context}")
        end = s.context + s.new_tokens
        for p in range(s.context, end):
            positions.append(p)
            slots.append(_token_slot(s.token_blocks, p, block_size))
            seq_ids.append(b)
        for p in range(max(0, s.context - sliding_window + 1), end if not sparse else 0):
            key_slots.append(_token_slot(s.token_blocks, p, block_size))
            key_seq.append(b)
            key_pos.append(p)
    return V4StepMetadata(
        positions=torch.tensor(positions, dtype=long),
        slot_mapping=torch.tensor(slots, dtype=long),
        query_seq_ids=torch.tensor(seq_ids, dtype=long),
        key_slots=torch.tensor(key_slots, dtype=long),
        key_seq_ids=torch.tensor(key_seq, dtype=long),
        key_positions=torch.tensor(key_pos, dtype=long),
        pools=tuple(
            _pool_step(seqs, m, block_size, long, not sparse, m in overlapping)
            for m in sorted(set(rates))
        ),
        sparse=sparse_step(seqs, block_size, sliding_window, rates) if sparse else None,
    )

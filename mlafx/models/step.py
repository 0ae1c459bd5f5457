"""The step ABI: the index tensors the host builds for one forward step.

A step is a flat batch of T new tokens from B sequences (decodes and prefill rows mixed).
Every per-sequence decision arrives as an index tensor whose sizes are the step's shapes,
so the model never loops over sequences and exports with dynamic shapes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from mlafx.models.attention_path import AttentionPath, choose_path

# Version of the bytes of a latent-cache row (``[kv_c_normed | k_pe_roped]``, k_pe in
# interleaved pair order). Compiled packages and KV-store keys include it; bump it whenever
# the row layout changes, so stale caches are never reused.
CACHE_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class StepMetadata:
    """Shapes: T new tokens, B sequences, M block-table columns, K key rows read this step.

    slot_mapping     [T] int64    cache slot (``block * BS + offset``) each new token goes to
    query_seq_ids    [T] int64    step-local sequence index (0..B-1) of each new token
    block_table      [B, M] int32 cache block ids of each sequence (unused columns are 0)
    kv_lens          [B] int32    cached tokens of each sequence after this step's writes
    query_start_loc  [B+1] int32  new tokens of sequence b are ``query_start_loc[b] .. [b+1]-1``
    key_seq_ids      [K] int64    step-local sequence index of each key row this step reads
    key_positions    [K] int64    position in its sequence of each key row
    The key rows of sequence b are its positions ``0 .. kv_lens[b] - 1`` (context plus the
    step's new tokens); a query at position p sees the rows of its own sequence with
    position <= p. The reference model reads the flat key rows; the lowered kernels read
    ``block_table``/``kv_lens``/``query_start_loc`` (the same facts, per sequence).

    The host's choice of compute path per sequence (``mlafx.models.attention_path``) splits
    the batch into two sub-batches, each sequence-contiguous and in step order:
    absorbed (TA tokens of BA sequences: one absorbed pass over the paged cache)
      absorbed_token_index     [TA] int64     step-token index of each absorbed row
      absorbed_block_table     [BA, M] int32  block_table rows of the absorbed sequences
      absorbed_kv_lens         [BA] int32     their kv_lens (context plus new rows)
      absorbed_query_start_loc [BA+1] int32   their rows within the absorbed sub-batch
    split (TS tokens of BS sequences: causal MHA over their own new rows, decompressed)
      split_token_index        [TS] int64     step-token index of each split row
      split_cu_seqlens         [BS+1] int32   their rows within the split sub-batch (queries
                                              and keys alike: the new rows are the keys)
    context half of the split sequences that have context (TC rows of BC sequences: an
    absorbed pass over the cached rows only, merged with the split rows' result)
      context_split_rows       [TC] int64     row within the split sub-batch of each query
      context_block_table      [BC, M] int32  block_table rows of those sequences
      context_lens             [BC] int32     their cached rows before this step
      context_query_start_loc  [BC+1] int32   their queries within ``context_split_rows``
    The reference model ignores the sub-batches (they restate the facts above).
    """

    slot_mapping: torch.Tensor
    query_seq_ids: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    key_seq_ids: torch.Tensor
    key_positions: torch.Tensor
    absorbed_token_index: torch.Tensor
    absorbed_block_table: torch.Tensor
    absorbed_kv_lens: torch.Tensor
    absorbed_query_start_loc: torch.Tensor
    split_token_index: torch.Tensor
    split_cu_seqlens: torch.Tensor
    context_split_rows: torch.Tensor
    context_block_table: torch.Tensor
    context_lens: torch.Tensor
    context_query_start_loc: torch.Tensor


@dataclass(frozen=True)
class StepInputs:
    """Everything one forward step takes besides the weights and the caches."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: StepMetadata
    logits_indices: torch.Tensor  # [S] int64: the last new token of each sampling sequence

    def args(self, caches: list[torch.Tensor]) -> tuple:
        """The step's arguments around ``caches``: ``step(*inputs.args(caches))``."""
        return (self.input_ids, self.positions, caches, self.meta, self.logits_indices)


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a step: compute positions ``start .. end-1``, whose token ids
    are ``new_token_ids``; its cache rows live in ``blocks`` (in position order). ``sample``
    is False for a prompt chunk that does not reach the prompt's end: its rows are cached
    but no token is drawn, so it adds nothing to ``logits_indices``. ``path`` fixes the
    attention path of its new tokens; None leaves it to the host's cost rule."""

    new_token_ids: list[int]
    start: int
    end: int
    blocks: list[int]
    sample: bool = True
    path: AttentionPath | None = None


def key_slots_and_mask(
    meta: StepMetadata, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the reference attention reads from the flat key rows: where each key row lives in
    the paged cache (``key_slots [K]`` int64) and which rows each query may see (``mask
    [T, K]`` bool: its own sequence, not in its future). Built once per step and shared by
    every layer (the compiled step lowers attention onto the sub-batches instead)."""
    key_blocks = meta.block_table[meta.key_seq_ids, meta.key_positions // block_size]
    key_slots = key_blocks.to(torch.int64) * block_size + meta.key_positions % block_size
    mask = (meta.query_seq_ids[:, None] == meta.key_seq_ids[None, :]) & (
        meta.key_positions[None, :] <= positions[:, None]
    )
    return key_slots, mask


def build_step_inputs(
    spans: list[SequenceSpan], block_size: int, absorb_threshold: float | None = None
) -> StepInputs:
    """The host side of the step ABI: index tensors for a batch of sequences.

    A span without a fixed ``path`` takes ``choose_path(start, end - start,
    absorb_threshold)``; without a threshold it is absorbed (one exact pass for any row,
    the choice for callers that do not tune the compiled step)."""
    input_ids: list[int] = []
    positions, query_seq, key_seq, key_pos = [], [], [], []
    logits_indices: list[int] = []
    block_table = torch.zeros(len(spans), max(len(s.blocks) for s in spans), dtype=torch.int32)
    for b, span in enumerate(spans):
        if len(span.new_token_ids) != span.end - span.start or span.start >= span.end:
            raise ValueError(f"sequence {b}: bad span {span.start}..{span.end}")
        input_ids += span.new_token_ids
        positions.append(torch.arange(span.start, span.end, dtype=torch.int64))
        query_seq.append(torch.full((span.end - span.start,), b, dtype=torch.int64))
        key_pos.append(torch.arange(span.end, dtype=torch.int64))
        key_seq.append(torch.full((span.end,), b, dtype=torch.int64))
        block_table[b, : len(span.blocks)] = torch.tensor(span.blocks, dtype=torch.int32)
        if span.sample:
            logits_indices.append(len(input_ids) - 1)
    pos = torch.cat(positions)
    seq_ids = torch.cat(query_seq)
    blocks = block_table[seq_ids, pos // block_size].to(torch.int64)
    paths = [_path_of(span, absorb_threshold) for span in spans]
    meta = StepMetadata(
        slot_mapping=blocks * block_size + pos % block_size,
        query_seq_ids=seq_ids,
        block_table=block_table,
        kv_lens=torch.tensor([s.end for s in spans], dtype=torch.int32),
        query_start_loc=_starts([s.end - s.start for s in spans]),
        key_seq_ids=torch.cat(key_seq),
        key_positions=torch.cat(key_pos),
        **_sub_batches(spans, paths, block_table),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=pos,
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


def _path_of(span: SequenceSpan, absorb_threshold: float | None) -> AttentionPath:
    if span.path is not None:
        return span.path
    if absorb_threshold is None:
        return AttentionPath.ABSORBED
    return choose_path(span.start, span.end - span.start, absorb_threshold)


def _starts(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 offsets: 0, l0, l0 + l1, ..."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _rows(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """[sum of lengths] int64: the concatenated ``range(first, end)`` of each pair."""
    return torch.tensor([i for first, end in ranges for i in range(first, end)], dtype=torch.int64)


def _sub_batches(
    spans: list[SequenceSpan], paths: list[AttentionPath], block_table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The absorbed, split and context-half sub-batches of ``StepMetadata``."""
    token_ranges, first = [], 0
    for span in spans:
        token_ranges.append((first, first + span.end - span.start))
        first += span.end - span.start
    absorbed = [b for b, path in enumerate(paths) if path is AttentionPath.ABSORBED]
    split = [b for b, path in enumerate(paths) if path is AttentionPath.SPLIT]
    # rows of each split sequence within the split sub-batch
    split_ranges, first = [], 0
    for b in split:
        split_ranges.append((first, first + spans[b].end - spans[b].start))
        first += spans[b].end - spans[b].start
    with_context = [i for i, b in enumerate(split) if spans[b].start > 0]
    context = [split[i] for i in with_context]

    def table_rows(seqs: list[int]) -> torch.Tensor:
        return block_table[torch.tensor(seqs, dtype=torch.int64)]

    return {
        "absorbed_token_index": _rows([token_ranges[b] for b in absorbed]),
        "absorbed_block_table": table_rows(absorbed),
        "absorbed_kv_lens": torch.tensor([spans[b].end for b in absorbed], dtype=torch.int32),
        "absorbed_query_start_loc": _starts([spans[b].end - spans[b].start for b in absorbed]),
        "split_token_index": _rows([token_ranges[b] for b in split]),
        "split_cu_seqlens": _starts([spans[b].end - spans[b].start for b in split]),
        "context_split_rows": _rows([split_ranges[i] for i in with_context]),
        "context_block_table": table_rows(context),
        "context_lens": torch.tensor([spans[b].start for b in context], dtype=torch.int32),
        "context_query_start_loc": _starts([spans[b].end - spans[b].start for b in context]),
    }


# A pytree node (fields in declaration order), so torch.export and torch.compile see each
# field as a separate graph input.
torch.export.register_dataclass(StepMetadata, serialized_type_name="mlafx.StepMetadata")

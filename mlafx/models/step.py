"""The step ABI: the index tensors the host builds for one forward step.

A step is a flat batch of T new tokens from B sequences (decodes and prefill rows mixed).
Every per-sequence decision arrives as an index tensor whose sizes are the step's shapes,
so the model never loops over sequences and exports with dynamic shapes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
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
    step's new tokens; K = sum of kv_lens); a query at position p sees the rows of its own
    sequence with position <= p. The reference model reads the flat key rows; the lowered
    kernels read ``block_table``/``kv_lens``/``query_start_loc`` (the same facts, per
    sequence), so steps that do not read them (``StepFn.reads_key_rows`` False) get K = 0:
    the key rows are the only fields that grow with the cached tokens.

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
    logits_indices: torch.Tensor  # [S] int64: rows with logits (SequenceSpan.num_logits)

    def args(self, caches: list[torch.Tensor]) -> tuple:
        """The step's arguments around ``caches``: ``step(*inputs.args(caches))``."""
        return (self.input_ids, self.positions, caches, self.meta, self.logits_indices)


class StepFn(Protocol):
    """A step the engine runs: the reference model, a compiled package, an artifact's runner,
    or the tensor-parallel driver. ``reads_key_rows``: whether it reads ``meta.key_seq_ids``
    and ``key_positions`` (only the reference model does); the host builds them only for a
    step that does (``build_step_inputs(..., key_rows=step.reads_key_rows)``)."""

    reads_key_rows: bool

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[torch.Tensor],  # per layer [NB, BS, Lkv+R], written in place
        meta: StepMetadata,
        logits_indices: torch.Tensor,  # [S] int64
    ) -> torch.Tensor: ...  # [S, vocab]


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a step: compute positions ``start .. end-1``, whose token ids
    are ``new_token_ids``; its cache rows live in ``blocks`` (in position order). ``sample``
    is False for a prompt chunk that does not reach the prompt's end: its rows are cached
    but no token is drawn, so it adds nothing to ``logits_indices``. ``all_logits``: every
    new token gets a logits row, in position order (prompt logprobs; the last is the sample
    row when ``sample``). ``path`` fixes the attention path of its new tokens; None leaves it
    to the host's cost rule."""

    new_token_ids: list[int]
    start: int
    end: int
    blocks: list[int]
    sample: bool = True
    path: AttentionPath | None = None
    all_logits: bool = False

    @property
    def num_logits(self) -> int:
        """Rows this span adds to ``logits_indices``."""
        return self.end - self.start if self.all_logits else int(self.sample)


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
    spans: list[SequenceSpan],
    block_size: int,
    split_threshold: float | None = None,
    *,
    key_rows: bool = True,
) -> StepInputs:
    """The host side of the step ABI: index tensors for a batch of sequences.

    A span without a fixed ``path`` takes ``choose_path(start, end - start,
    split_threshold)``; without a threshold it is absorbed (one exact pass for any row,
    the choice for callers that do not tune the compiled step).

    ``key_rows``: build ``key_seq_ids``/``key_positions``, one row per cached token of every
    sequence, for a step that reads them (``StepFn.reads_key_rows``: the reference model).
    Without them both are empty (K = 0) and the work is O(batch + new tokens) tensor ops,
    plus copying each sequence's block ids into ``block_table`` (one id per cached block)."""
    for b, span in enumerate(spans):
        if len(span.new_token_ids) != span.end - span.start or span.start >= span.end:
            raise ValueError(f"sequence {b}: bad span {span.start}..{span.end}")
    new = [s.end - s.start for s in spans]
    ends = [s.end for s in spans]
    block_table = _block_table(spans)
    seq_ids = _sequence_ids(new)
    pos = _concat_ranges([s.start for s in spans], new)
    blocks = block_table[seq_ids, pos // block_size].to(torch.int64)
    last_tokens = [end - 1 for end in itertools.accumulate(new)]  # of each sequence
    if key_rows:
        key_seq_ids, key_positions = _sequence_ids(ends), _concat_ranges([0] * len(spans), ends)
    else:  # K = 0: the captured graphs take K as a dynamic extent and lowered ones ignore it
        key_seq_ids, key_positions = (torch.empty(0, dtype=torch.int64) for _ in range(2))
    paths = [_path_of(span, split_threshold) for span in spans]
    meta = StepMetadata(
        slot_mapping=blocks * block_size + pos % block_size,
        query_seq_ids=seq_ids,
        block_table=block_table,
        kv_lens=torch.tensor(ends, dtype=torch.int32),
        query_start_loc=_starts(new),
        key_seq_ids=key_seq_ids,
        key_positions=key_positions,
        **_sub_batches(spans, paths, block_table),
    )
    return StepInputs(
        input_ids=torch.tensor(
            [t for span in spans for t in span.new_token_ids], dtype=torch.int64
        ),
        positions=pos,
        meta=meta,
        logits_indices=torch.tensor(
            [
                t
                for last, span in zip(last_tokens, spans, strict=True)
                for t in range(last - span.num_logits + 1, last + 1)
            ],
            dtype=torch.int64,
        ),
    )


def check_key_rows(meta: StepMetadata) -> None:
    """Raise ``ValueError`` unless ``meta`` holds the flat key rows (K = sum of ``kv_lens``),
    which a step that reads them needs: inputs built with ``key_rows=False`` have K = 0, and
    attention over them would silently see no keys."""
    want = int(meta.kv_lens.sum())
    got = (meta.key_seq_ids.shape[0], meta.key_positions.shape[0])
    if got != (want, want):
        raise ValueError(
            f"the step's key rows (key_seq_ids, key_positions: {got[0]}, {got[1]} rows) do "
            f"not cover its sequences' {want} cached tokens (the sum of kv_lens): this step "
            "reads them (reads_key_rows); build its inputs with "
            "build_step_inputs(..., key_rows=True)"
        )


def _path_of(span: SequenceSpan, split_threshold: float | None) -> AttentionPath:
    if span.path is not None:
        return span.path
    if split_threshold is None:
        return AttentionPath.ABSORBED
    return choose_path(span.start, span.end - span.start, split_threshold)


def _starts(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 offsets: 0, l0, l0 + l1, ..."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _sequence_ids(lengths: list[int]) -> torch.Tensor:
    """[sum of lengths] int64: ``i`` repeated ``lengths[i]`` times, for each i."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(lengths)), counts, output_size=sum(lengths))


def _concat_ranges(firsts: list[int], lengths: list[int]) -> torch.Tensor:
    """[sum of lengths] int64: the concatenated ``range(firsts[i], firsts[i] + lengths[i])``,
    in a fixed number of tensor ops (no Python work per row)."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    # row j of range i is (its index in the output) - (range i's offset there) + firsts[i]
    shift = torch.tensor(firsts, dtype=torch.int64) - (torch.cumsum(counts, 0) - counts)
    total = sum(lengths)
    return torch.arange(total) + torch.repeat_interleave(shift, counts, output_size=total)


def _block_table(spans: list[SequenceSpan]) -> torch.Tensor:
    """[B, M] int32: each sequence's block ids, zero-padded to the longest. numpy converts
    the Python ids ~4x faster than ``torch.tensor`` (17 vs 60 ns an id here), and the block
    ids are the one input that grows with the cached tokens (one id per block)."""
    table = np.zeros((len(spans), max(len(s.blocks) for s in spans)), dtype=np.int32)
    for b, span in enumerate(spans):
        table[b, : len(span.blocks)] = span.blocks
    return torch.from_numpy(table)


def _sub_batches(
    spans: list[SequenceSpan], paths: list[AttentionPath], block_table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The absorbed, split and context-half sub-batches of ``StepMetadata``."""
    new = [s.end - s.start for s in spans]
    first_token = [0, *itertools.accumulate(new)]  # of each sequence, in step order
    absorbed = [b for b, path in enumerate(paths) if path is AttentionPath.ABSORBED]
    split = [b for b, path in enumerate(paths) if path is AttentionPath.SPLIT]
    split_new = [new[b] for b in split]
    first_split_row = [0, *itertools.accumulate(split_new)]  # within the split sub-batch
    with_context = [i for i, b in enumerate(split) if spans[b].start > 0]
    context = [split[i] for i in with_context]

    def table_rows(seqs: list[int]) -> torch.Tensor:
        return block_table[torch.tensor(seqs, dtype=torch.int64)]

    return {
        "absorbed_token_index": _concat_ranges(
            [first_token[b] for b in absorbed], [new[b] for b in absorbed]
        ),
        "absorbed_block_table": table_rows(absorbed),
        "absorbed_kv_lens": torch.tensor([spans[b].end for b in absorbed], dtype=torch.int32),
        "absorbed_query_start_loc": _starts([new[b] for b in absorbed]),
        "split_token_index": _concat_ranges([first_token[b] for b in split], split_new),
        "split_cu_seqlens": _starts(split_new),
        "context_split_rows": _concat_ranges(
            [first_split_row[i] for i in with_context], [split_new[i] for i in with_context]
        ),
        "context_block_table": table_rows(context),
        "context_lens": torch.tensor([spans[b].start for b in context], dtype=torch.int32),
        "context_query_start_loc": _starts([new[b] for b in context]),
    }


# A pytree node (fields in declaration order), so torch.export and torch.compile see each
# field as a separate graph input.
torch.export.register_dataclass(StepMetadata, serialized_type_name="mlafx.StepMetadata")

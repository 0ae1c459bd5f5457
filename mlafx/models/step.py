"""The step ABI: the index tensors the host builds for one forward step.

A step is a flat batch of T new tokens from B sequences (decodes and prefill rows mixed).
Every per-sequence decision arrives as an index tensor whose sizes are the step's shapes,
so the model never loops over sequences and exports with dynamic shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """

    slot_mapping: torch.Tensor
    query_seq_ids: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    key_seq_ids: torch.Tensor
    key_positions: torch.Tensor


@dataclass(frozen=True)
class StepInputs:
    """Everything one forward step takes besides the weights and the caches."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: StepMetadata
    logits_indices: torch.Tensor  # [S] int64: the last new token of each sampling sequence


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a step: compute positions ``start .. end-1``, whose token ids
    are ``new_token_ids``; its cache rows live in ``blocks`` (in position order). ``sample``
    is False for a prompt chunk that does not reach the prompt's end: its rows are cached
    but no token is drawn, so it adds nothing to ``logits_indices``."""

    new_token_ids: list[int]
    start: int
    end: int
    blocks: list[int]
    sample: bool = True


def build_step_inputs(spans: list[SequenceSpan], block_size: int) -> StepInputs:
    """The host side of the step ABI: index tensors for a batch of sequences."""
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
    new_tokens = torch.tensor([s.end - s.start for s in spans], dtype=torch.int32)
    meta = StepMetadata(
        slot_mapping=blocks * block_size + pos % block_size,
        query_seq_ids=seq_ids,
        block_table=block_table,
        kv_lens=torch.tensor([s.end for s in spans], dtype=torch.int32),
        query_start_loc=torch.nn.functional.pad(new_tokens.cumsum(0, dtype=torch.int32), (1, 0)),
        key_seq_ids=torch.cat(key_seq),
        key_positions=torch.cat(key_pos),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=pos,
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


# A pytree node (fields in declaration order), so torch.export and torch.compile see each
# field as a separate graph input.
torch.export.register_dataclass(StepMetadata, serialized_type_name="mlafx.StepMetadata")

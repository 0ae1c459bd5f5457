"""Turns a scheduled batch into the step's input tensors (the step ABI of DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlafx.models.step import StepMetadata
from mlafx.runtime.scheduler import ScheduledSequence


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: StepMetadata
    logits_indices: torch.Tensor  # [S] int64: the last new token of each sequence


def build_step_inputs(batch: list[ScheduledSequence], block_size: int) -> StepInputs:
    input_ids: list[int] = []
    query_seq: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    key_seq: list[torch.Tensor] = []
    key_pos: list[torch.Tensor] = []
    logits_indices: list[int] = []
    max_blocks = max(len(s.request.blocks) for s in batch)
    block_table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
    for b, seq in enumerate(batch):
        request = seq.request
        input_ids += request.token_ids(seq.start, seq.end)
        num_new = seq.end - seq.start
        positions.append(torch.arange(seq.start, seq.end, dtype=torch.int64))
        query_seq.append(torch.full((num_new,), b, dtype=torch.int64))
        key_pos.append(torch.arange(seq.end, dtype=torch.int64))
        key_seq.append(torch.full((seq.end,), b, dtype=torch.int64))
        block_table[b, : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
        logits_indices.append(len(input_ids) - 1)
    pos = torch.cat(positions)
    seq_ids = torch.cat(query_seq)
    slot_mapping = (
        block_table[seq_ids, pos // block_size].to(torch.int64) * block_size + pos % block_size
    )
    meta = StepMetadata(
        slot_mapping=slot_mapping,
        query_seq_ids=seq_ids,
        block_table=block_table,
        key_seq_ids=torch.cat(key_seq),
        key_positions=torch.cat(key_pos),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=pos,
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )

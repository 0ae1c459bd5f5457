"""The step ABI: the index tensors the host builds for one forward step.

A step is a flat batch of T new tokens from B sequences (decodes and prefill rows mixed).
Every per-sequence decision arrives as an index tensor whose sizes are the step's shapes,
so the model never loops over sequences and exports with dynamic shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepMetadata:
    """Shapes: T new tokens, B sequences, M block-table columns, K key rows read this step.

    slot_mapping   [T] int64    cache slot (``block * BS + offset``) each new token is written to
    query_seq_ids  [T] int64    step-local sequence index (0..B-1) of each new token
    block_table    [B, M] int32 cache block ids of each sequence (unused columns are 0)
    key_seq_ids    [K] int64    step-local sequence index of each key row this step reads
    key_positions  [K] int64    position in its sequence of each key row
    The key rows of sequence b are its positions ``0 .. kv_len_b - 1`` (context plus the
    step's new tokens); a query at position p sees the rows of its own sequence with
    position <= p.
    """

    slot_mapping: torch.Tensor
    query_seq_ids: torch.Tensor
    block_table: torch.Tensor
    key_seq_ids: torch.Tensor
    key_positions: torch.Tensor


# A pytree node (fields in declaration order), so torch.export and torch.compile see each
# field as a separate graph input.
torch.export.register_dataclass(StepMetadata, serialized_type_name="mlafx.StepMetadata")

"""What crosses the driver <-> worker pipes: small tuples of numpy arrays, never torch
tensors (``multiprocessing`` would move every tensor through a new shared-memory file per
message). bf16/fp16 tensors travel as their int16 bit patterns."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import numpy as np
import torch

from mlafx.models.step import StepMetadata

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def tensor_to_wire(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """(torch dtype name, array of the same bytes)."""
    t = t.detach().contiguous()
    as_bits = _BITS.get(t.dtype)
    array = (t.view(as_bits) if as_bits is not None else t).numpy()
    return str(t.dtype).removeprefix("torch."), array


def tensor_from_wire(wire: tuple[str, np.ndarray]) -> torch.Tensor:
    dtype_name, array = wire
    dtype = getattr(torch, dtype_name)
    t = torch.from_numpy(array)
    return t.view(dtype) if dtype in _BITS else t


def step_to_wire(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: StepMetadata,
    logits_indices: torch.Tensor,
) -> tuple[tuple[str, np.ndarray], ...]:
    """The step's inputs in ABI order, ``meta``'s fields in declaration order."""
    fields = [getattr(meta, f.name) for f in dataclasses.fields(StepMetadata)]
    return tuple(tensor_to_wire(t) for t in (input_ids, positions, *fields, logits_indices))


def step_from_wire(
    wire: tuple[tuple[str, np.ndarray], ...],
) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
    """Inverse of ``step_to_wire``: (input_ids, positions, meta, logits_indices)."""
    input_ids, positions, *fields, logits_indices = (tensor_from_wire(w) for w in wire)
    return input_ids, positions, StepMetadata(*fields), logits_indices


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)

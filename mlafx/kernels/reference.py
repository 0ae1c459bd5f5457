"""Slow, obviously correct Python references for the ``torch.ops.mlafx`` ops.

Tests compare the C++ kernels with these. They favour clarity over speed: per-token loops,
torch's own dtype conversions, no tricks.
"""

from __future__ import annotations

import torch


def write_latent_cache_ref(
    kv_c: torch.Tensor,  # [T, Lkv]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R], written in place
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Reference for ``mlafx::write_latent_cache``: row ``[kv_c[t] | k_pe[t]]`` cast with
    ``.to(kv_cache.dtype)`` goes to slot ``slot_mapping[t]``; ``-1`` skips the token, any
    other out-of-range slot raises ``IndexError`` before anything is written."""
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    num_blocks, block_size, width = kv_cache.shape
    kv_lora_rank = kv_c.shape[1]
    if width != kv_lora_rank + k_pe.shape[1]:
        raise ValueError(f"kv_cache rows are {width} wide, kv_c + k_pe is not")
    num_slots = num_blocks * block_size
    slots = slot_mapping.tolist()
    for t, slot in enumerate(slots):
        if slot != -1 and not 0 <= slot < num_slots:
            raise IndexError(f"slot_mapping[{t}] = {slot} is out of range (0..{num_slots - 1})")
    rows = kv_cache.view(num_slots, width)
    for t, slot in enumerate(slots):
        if slot == -1:
            continue
        rows[slot, :kv_lora_rank] = kv_c[t].to(kv_cache.dtype)
        rows[slot, kv_lora_rank:] = k_pe[t].to(kv_cache.dtype)

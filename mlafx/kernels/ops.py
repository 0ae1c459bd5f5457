"""Typed Python wrappers and fake (meta) implementations of the ``torch.ops.mlafx`` ops.

Each schema is written once, in C++ (``csrc/<family>.cpp``). Here each op gets its fake,
which torch.compile / torch.export use to trace without running the kernel, and a wrapper
with type hints that calls ``torch.ops.mlafx.<op>``. Slow references: ``reference.py``.
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.register_fake("mlafx::write_latent_cache")
def _write_latent_cache_fake(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # Shape and dtype checks only (the C++ entry repeats them); slot values are data and are
    # checked when the kernel runs.
    torch._check(kv_c.dtype in _FLOAT_DTYPES, lambda: f"kv_c dtype {kv_c.dtype} unsupported")
    torch._check(k_pe.dtype in _FLOAT_DTYPES, lambda: f"k_pe dtype {k_pe.dtype} unsupported")
    torch._check(
        kv_cache.dtype in _FLOAT_DTYPES, lambda: f"kv_cache dtype {kv_cache.dtype} unsupported"
    )
    torch._check(
        slot_mapping.dtype == torch.int64,
        lambda: f"slot_mapping must be int64, got {slot_mapping.dtype}",
    )
    torch._check(kv_c.dim() == 2 and k_pe.dim() == 2 and kv_cache.dim() == 3)
    torch._check(slot_mapping.dim() == 1)
    torch._check(kv_c.shape[0] == slot_mapping.shape[0] and k_pe.shape[0] == slot_mapping.shape[0])
    torch._check(
        kv_cache.shape[2] == kv_c.shape[1] + k_pe.shape[1],
        lambda: (
            f"kv_cache rows are {kv_cache.shape[2]} wide, kv_c + k_pe is "
            f"{kv_c.shape[1]} + {k_pe.shape[1]}"
        ),
    )


def write_latent_cache(
    kv_c: torch.Tensor,  # [T, Lkv]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R], written in place
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write row ``[kv_c[t] | k_pe[t]]``, cast to the cache dtype (round to nearest even), at
    slot ``slot_mapping[t]`` (``block * BS + offset``) of ``kv_cache``; ``-1`` skips a token.
    Any other out-of-range slot raises ``IndexError`` before anything is written."""
    torch.ops.mlafx.write_latent_cache(kv_c, k_pe, kv_cache, slot_mapping)

"""K-format (k8 / k4) weights for the kernel tests: random valid GGUF K-quant blocks
(``gguf_files.random_k_blocks``) repacked as the GGUF loader does."""

from __future__ import annotations

import numpy as np
import torch
from gguf_files import Q, random_k_blocks

from mlafx.kernels.ggml_repack import GGML_LOSSLESS_FORMATS, repack_ggml_weight

__all__ = ["Q", "kquant_moe_case", "kquant_weight"]


def _rng(gen: torch.Generator) -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))


def kquant_weight(qtype: Q, n: int, k: int, gen: torch.Generator, fmt: str | None = None):
    """A random ``qtype`` weight [n, k] repacked into ``fmt`` (default: its smallest)."""
    blocks = torch.from_numpy(random_k_blocks((n, k), qtype, _rng(gen)))
    fmt = fmt or GGML_LOSSLESS_FORMATS[qtype.name][0]
    return repack_ggml_weight(qtype.name, blocks, n, k, fmt)


def kquant_stack(qtype: Q, e: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([kquant_weight(qtype, n, k, gen) for _ in range(e)])


def kquant_moe_case(T: int, D: int, inter: int, E: int, k: int, gen: torch.Generator):
    """moe_experts_quantized's arguments with a Q4_K_M-like stack: gate/up rows k4 (Q4_K),
    down rows k8 (Q6_K). Activations of unit size (the random blocks' weights are ~1e-2)."""
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    w13 = kquant_stack(Q.Q4_K, E, 2 * inter, D, gen)
    w2 = kquant_stack(Q.Q6_K, E, D, inter, gen)
    return x, ids, weights, w13, w2, inter

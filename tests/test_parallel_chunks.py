"""Kernels that share their work out in chunks taken dynamically (csrc/parallel_chunks.h)
give bitwise the same result however the chunks land on threads: each chunk writes its own
output rows, in a fixed order of arithmetic. Checked by running each kernel with 1, 2 and 3
threads (other chunk lengths and other assignments) and while another process takes one
core (the running threads then take the parked one's chunks), against the 1-thread result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from mlafx.kernels import (
    gather_latent,
    linear_packed,
    linear_quantized,
    merge_attn_states,
    moe_experts,
    moe_experts_quantized,
    pack_linear_weight,
    quantize_linear_weight,
)

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def _linear(rows: int) -> Callable[[], torch.Tensor]:
    weight = _randn(1000, 512) / 512**0.5
    packed, x = pack_linear_weight(weight), _randn(rows, 512)
    return lambda: linear_packed(x, packed, 1000)


def _linear_int4() -> Callable[[], torch.Tensor]:
    packed, x = quantize_linear_weight(_randn(1000, 512), 4), _randn(3, 512)
    return lambda: linear_quantized(x, packed, 1000)


def _moe(tokens: int, quantized: bool = False) -> Callable[[], torch.Tensor]:
    E, D, inter, k = 4, 256, 320, 2
    x = _randn(tokens, D)
    ids = torch.randint(0, E, (tokens, k), generator=GEN)
    weights = torch.rand(tokens, k, generator=GEN)
    w13, w2 = _randn(E, 2 * inter, D) / D**0.5, _randn(E, D, inter) / inter**0.5
    if quantized:
        q13 = torch.stack([quantize_linear_weight(w, 8) for w in w13])
        q2 = torch.stack([quantize_linear_weight(w, 8) for w in w2])
        return lambda: moe_experts_quantized(x, ids, weights, q13, q2, inter)
    return lambda: moe_experts(x, ids, weights, w13, w2)


def _merge() -> Callable[[], torch.Tensor]:
    T, H, D = 300, 16, 128
    a, b = _randn(T, H, D), _randn(T, H, D)
    la, lb = torch.randn(H, T, generator=GEN), torch.randn(H, T, generator=GEN)
    return lambda: torch.cat([t.flatten().float() for t in merge_attn_states(a, la, b, lb)])


def _gather() -> Callable[[], torch.Tensor]:
    cache = _randn(64, 16, 576)
    slots = torch.randperm(64 * 16, generator=GEN)[:700]
    return lambda: gather_latent(cache, slots)


KERNELS = {
    "linear_packed decode": lambda: _linear(4),
    "linear_packed prefill": lambda: _linear(96),
    "linear_quantized int4": _linear_int4,
    "moe_experts decode": lambda: _moe(2),
    "moe_experts prefill": lambda: _moe(200),
    "moe_experts_quantized": lambda: _moe(24, quantized=True),
    "merge_attn_states": _merge,
    "gather_latent": _gather,
}


@pytest.fixture(scope="module")
def busy_core():
    """Another process spinning on core 0 while a test runs."""
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    yield
    spinner.kill()
    spinner.wait()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_result_does_not_depend_on_how_chunks_land(name, busy_core):
    run = KERNELS[name]()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = run()
        for count in (2, 3):  # 3 threads on 2 cores: one is always waiting for a core
            torch.set_num_threads(count)
            for _ in range(5):
                assert torch.equal(run(), expected), f"{count} threads"
    finally:
        torch.set_num_threads(threads)

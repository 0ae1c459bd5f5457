"""bf16 linear (``linear_decode``, ``linear_packed``), ``batched_matmul`` (default and
batch-invariant mode) and ``merge_attn_states`` accuracy
against fp64, per case (not a test module; scored and reported as ``tests/bf16_accuracy.py``
describes): ``python -m tests.linear_accuracy``."""

from __future__ import annotations

import torch

from mlafx.kernels import (
    batch_invariant_mode,
    batched_matmul,
    linear_decode,
    linear_packed,
    merge_attn_states,
    pack_linear_weight,
)
from mlafx.kernels.attention_reference import merge_attn_states_ref
from tests.bf16_accuracy import BF16, errors, report

# name -> (rows, in_features, out_features, bias): decode rows (streamed), prefill rows
# (linear_packed's compute-bound path), odd widths
LINEARS = {
    "decode_m1_kv_a": (1, 2048, 576, False),
    "decode_m8_q": (8, 2048, 3072, False),
    "decode_m32_odd": (32, 333, 77, True),
    "prefill_m300_o_proj": (300, 2048, 2048, False),
    "prefill_m64_bias_odd": (64, 129, 200, True),
    "prefill_m300_bias": (300, 256, 96, True),
}
# name -> (heads, rows, K, N): the absorbed per-head products (q_nope W_UK, out W_UV^T) at
# decode and prefill row counts, odd widths
BMMS = {
    "bmm_m1_uk": (16, 1, 128, 512),
    "bmm_m8_uv": (16, 8, 512, 128),
    "bmm_m300_uk": (16, 300, 128, 512),
    "bmm_m40_odd": (3, 40, 70, 45),
}
# name -> (tokens, heads, head_dim): the context merge of prefill rows with cached context
MERGES = {"merge_t64_h16_d512": (64, 16, 512), "merge_odd": (7, 3, 33)}


def measure() -> dict[str, dict[str, float]]:
    results = {}
    for seed, (name, (M, K, N, with_bias)) in enumerate(LINEARS.items()):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(M, K, generator=gen).to(BF16)
        w = (torch.randn(N, K, generator=gen) / K**0.5).to(BF16)
        bias = torch.randn(N, generator=gen).to(BF16) if with_bias else None
        ref = x.double() @ w.double().T + (bias.double() if with_bias else 0.0)
        packed = pack_linear_weight(w)
        if not with_bias:
            results[name + "/linear_decode"] = errors(linear_decode(x, packed, N), ref)
        results[name + "/linear_packed"] = errors(linear_packed(x, packed, N, bias), ref)
    for seed, (name, (B, M, K, N)) in enumerate(BMMS.items()):
        gen = torch.Generator().manual_seed(50 + seed)
        x = torch.randn(B, M, K, generator=gen).to(BF16)
        w = (torch.randn(B, K, N, generator=gen) / K**0.5).to(BF16)
        ref = torch.bmm(x.double(), w.double())
        for invariant in (False, True):
            with batch_invariant_mode(invariant):
                out = batched_matmul(x, w)
            results[name + ("/invariant" if invariant else "")] = errors(out, ref)
    for seed, (name, (T, H, D)) in enumerate(MERGES.items()):
        gen = torch.Generator().manual_seed(100 + seed)
        prefix, suffix = (torch.randn(T, H, D, generator=gen).to(BF16) for _ in range(2))
        prefix_lse, suffix_lse = (torch.randn(H, T, generator=gen) * 3 for _ in range(2))
        out, _ = merge_attn_states(prefix, prefix_lse, suffix, suffix_lse)
        args = (prefix.double(), prefix_lse.double(), suffix.double(), suffix_lse.double())
        results[name] = errors(out, merge_attn_states_ref(*args)[0])
    return results


if __name__ == "__main__":
    report(measure)

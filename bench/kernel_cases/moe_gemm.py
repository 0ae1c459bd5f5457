"""moe_experts, linear_decode and linear_packed: decode-shaped (bandwidth-bound) and prefill
(compute-bound).

Cases (bf16, the embedded default's widths: D=2048, I=1408, 4 experts, top-2):
- moe_experts decode, 8 tokens: bytes = the weights of the experts the tokens touched
  (3 * D * I * 2 B each); judged against the measured read bandwidth.
- moe_experts prefill, 4096 tokens (512 with --quick): flops = 6 * D * I per (token, choice)
  pair; judged against the measured bf16 matmul rate.
- linear_decode: lm_head 8 x 2048 -> 102400, and the projections (q 2048->3072, kv_a
  2048->576, kv_b 512->4096, o 2048->2048, shared experts 2048->5632 and 2816->2048) at 1
  and 8 rows: bytes = the weight; judged against the read bandwidth.
- linear_packed, long rows (64, 512 and 2048 rows of q 2048->3072 and kv_a 2048->576; lm_head
  2048->102400 at 64): the packed weight, the only copy a compiled step keeps, unpacked a chunk
  of rows at a time for ATen's mm; flops = 2 * M * K * N, judged against the matmul rate (or
  the read bandwidth, whichever is the floor) and against ``F.linear`` on the row-major weight.
Weights are cold, as in a real decode step (~0.7 GB of weights per step, more than this
CPU's L3): every call uses the next of several copies whose total exceeds 512 MB. With
--quick there is one copy, so weights may be cache-hot: a smoke test, not a measurement.
Baselines: the model's eager MoE (``routed_experts_reference``), ``F.linear``, and oneDNN's
prepacked linear (``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``); for
moe_experts and linear_packed also the same op in batch-invariant mode (its cost).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.models.moe import routed_experts_reference

COLD_BYTES = 512 << 20  # the rotating copies of a weight together exceed the L3

D, INTER, EXPERTS, TOP_K = 2048, 1408, 4, 2
PROJECTIONS = [  # name, in_features, out_features
    ("q_proj", 2048, 16 * 192),
    ("kv_a_proj", 2048, 512 + 64),
    ("kv_b_proj", 512, 16 * 256),
    ("o_proj", 2048, 2048),
    ("shared gate_up", 2048, 2 * 2816),
    ("shared down", 2816, 2048),
]


def _copies(nbytes: int, quick: bool) -> int:
    return 1 if quick else max(2, -(-COLD_BYTES // nbytes))


def _rotating(fn, sets):
    """A callable that runs fn on the next weight set each call."""
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def _moe_rows(roofline, quick, threads, num_tokens, gen) -> list[Row]:
    dtype = torch.bfloat16
    expert_bytes = 3 * D * INTER * dtype.itemsize
    copies = _copies(EXPERTS * expert_bytes, quick)
    sets = [
        (
            (torch.randn(EXPERTS, 2 * INTER, D, generator=gen) / D**0.5).to(dtype),
            (torch.randn(EXPERTS, D, INTER, generator=gen) / INTER**0.5).to(dtype),
        )
        for _ in range(copies)
    ]
    x = torch.randn(num_tokens, D, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    touched = int(ids.unique().numel())
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        experts = _rotating(lambda a, b: K.moe_experts(x, ids, weights, a, b), sets)
        ours = median_seconds(experts)
        with K.batch_invariant_mode(True):
            invariant = median_seconds(experts, repeats=3 if num_tokens > 64 else 7)
        eager = median_seconds(
            _rotating(lambda a, b: routed_experts_reference(x, ids, weights, a, b), sets),
            repeats=3 if num_tokens > 64 else 7,
        )
        rows.append(
            make_row(
                roofline,
                op="moe_experts",
                case=f"T={num_tokens} E={EXPERTS} top{TOP_K} ({touched} hit)",
                dtype=dtype,
                threads=t,
                seconds=ours,
                num_bytes=touched * expert_bytes,
                flops=6 * D * INTER * num_tokens * TOP_K,
                baselines_s={"eager": eager, "batch-invariant": invariant},
            )
        )
    return rows


def _linear_weights(in_f, out_f, copies, gen) -> tuple[list, list]:
    """``copies`` bf16 weights [out_f, in_f] (rotated so each timed call reads cold ones) and
    their packed layouts, as ``_rotating`` argument tuples."""
    weights = [
        (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(torch.bfloat16)
        for _ in range(copies)
    ]
    return weights, [(K.pack_linear_weight(w),) for w in weights]


def _linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen) -> list[Row]:
    dtype = torch.bfloat16
    nbytes = in_f * out_f * dtype.itemsize
    weights, packed = _linear_weights(in_f, out_f, _copies(nbytes, quick), gen)
    rows = []
    for m in batches:
        x = torch.randn(m, in_f, generator=gen).to(dtype)
        onednn = [(torch.ops.mkldnn._reorder_linear_weight(w, m),) for w in weights]
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(_rotating(lambda p, x=x: K.linear_decode(x, p, out_f), packed))
            eager = median_seconds(
                _rotating(lambda w, x=x: F.linear(x, w), [(w,) for w in weights])
            )
            prepacked = median_seconds(
                _rotating(
                    lambda w, x=x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    onednn,
                )
            )
            rows.append(
                make_row(
                    roofline,
                    op="linear_decode",
                    case=f"{name} {m}x{in_f}->{out_f}",
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=nbytes,
                    flops=2 * m * in_f * out_f,
                    baselines_s={"F.linear": eager, "onednn-packed": prepacked},
                )
            )
        del onednn
    return rows


LONG_ROWS = [  # name, in_features, out_features, rows of x
    ("q_proj", 2048, 16 * 192, [64, 512, 2048]),
    ("kv_a_proj", 2048, 512 + 64, [64, 512, 2048]),
    ("lm_head", 2048, 102400, [64]),
]


def _long_linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen) -> list[Row]:
    dtype = torch.bfloat16
    nbytes = in_f * out_f * dtype.itemsize
    weights, packed = _linear_weights(in_f, out_f, _copies(nbytes, quick), gen)
    rows = []
    for m in batches:
        x = torch.randn(m, in_f, generator=gen).to(dtype)
        repeats = 3 if 2 * m * in_f * out_f > 2e10 else 7
        for t in threads:
            torch.set_num_threads(t)
            linear = _rotating(lambda p, x=x: K.linear_packed(x, p, out_f), packed)
            ours = median_seconds(linear, repeats=repeats)
            with K.batch_invariant_mode(True):
                invariant = median_seconds(linear, repeats=repeats)
            eager = median_seconds(
                _rotating(lambda w, x=x: F.linear(x, w), [(w,) for w in weights]), repeats=repeats
            )
            rows.append(
                make_row(
                    roofline,
                    op="linear_packed",
                    case=f"{name} {m}x{in_f}->{out_f}",
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=nbytes,
                    flops=2 * m * in_f * out_f,
                    baselines_s={"F.linear": eager, "batch-invariant": invariant},
                )
            )
    return rows


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    rows = _moe_rows(roofline, quick, threads, 8, gen)
    rows += _moe_rows(roofline, quick, threads, 512 if quick else 4096, gen)
    rows += _linear_rows(roofline, quick, threads, "lm_head", 2048, 102400, [8], gen)
    projections = PROJECTIONS[:2] if quick else PROJECTIONS
    for name, in_f, out_f in projections:
        rows += _linear_rows(roofline, quick, threads, name, in_f, out_f, [1, 8], gen)
    long_rows = [("q_proj", 2048, 16 * 192, [64, 512])] if quick else LONG_ROWS
    for name, in_f, out_f, batches in long_rows:
        rows += _long_linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen)
    return rows

"""How bf16 kernel outputs are scored against fp64 (issue 27), shared by the per-kernel
accuracy modules (``attention_accuracy``, ``moe_accuracy``, ``linear_accuracy``), each run as a
child process so that each ISA path is chosen by its environment and printing JSON
``{"isa", "cases": {name: {"rel", "rel_rounded", "over_bound"}}}``.

``rel``: the largest |out - ref| / |ref| where |ref| > 0.05 (ref: the fp64 reference on the
same bf16 inputs, outputs O(1)); ``rel_rounded``: the same for ref rounded to bf16 (a correctly
rounded kernel); ``over_bound``: outputs with |out - ref| > 1.5 * 2^-8 * |ref| + 1e-4 (1.5x the
bf16 rounding bound, plus fp32-accumulation slack)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from mlafx.kernels import cpu_isa

BF16 = torch.bfloat16


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    out, ref = out.double(), ref.double()
    rounded = ref.to(BF16).double()
    big = ref.abs() > 0.05

    def rel(x: torch.Tensor) -> float:
        return float(((x - ref).abs() / ref.abs())[big].max())

    bound = 1.5 * 2**-8 * ref.abs() + 1e-4
    return {
        "rel": rel(out),
        "rel_rounded": rel(rounded),
        "over_bound": int(((out - ref).abs() > bound).sum()),
    }


def report(measure: Callable[[], dict[str, dict[str, float]]]) -> None:
    print(json.dumps({"isa": cpu_isa(), "cases": measure()}))

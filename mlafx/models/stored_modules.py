"""Where a checkpoint module stored in a quantized format (block FP8, compressed-tensors int4)
goes in the model: shared by both formats' planners (``block_fp8_checkpoint.py``,
``packed_int4_checkpoint.py``), which differ only in the tensors each module stores.

A module is a routed expert's linear (``...mlp.experts.{e}.{gate|up|down}_proj``, into its
layer's ``RoutedExperts`` stack), a plain ``nn.Linear``, skipped (a layer or an expert beyond
the model's: checkpoints of deeper models serve shallower configs), or a problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from mlafx.models.layers import submodule
from mlafx.models.moe import RoutedExperts

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj$")
EXPERT_PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class StoredTarget:
    """The model's place for a stored module, with its weight's ``[n, k]``: a plain linear
    (``linear``), or part ``part`` of expert ``expert`` of the stack at ``stack``."""

    n: int
    k: int
    linear: nn.Linear | None = None
    stack: str = ""
    expert: int = -1
    part: str = ""


SKIPPED = "skipped"


def stored_target(
    model: nn.Module, owned: dict[str, nn.Module], name: str, num_hidden_layers: int
) -> StoredTarget | str | None:
    """``name``'s place in ``model`` (``owned``: its ``named_modules()``), ``SKIPPED``, or
    None when the model has no such linear or expert."""
    layer = _LAYER.match(name)
    if layer is not None and int(layer.group(1)) >= num_hidden_layers:
        return SKIPPED
    expert = _EXPERT.match(name)
    if expert is not None and isinstance(owned.get(expert.group(1)), RoutedExperts):
        stack, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
        num, two_i, d = submodule(model, stack, RoutedExperts).gate_up_proj.shape
        if e >= num:
            return SKIPPED
        n, k = (d, two_i // 2) if part == "down" else (two_i // 2, d)
        return StoredTarget(n, k, stack=stack, expert=e, part=part)
    linear = owned.get(name)
    if isinstance(linear, nn.Linear):
        return StoredTarget(linear.out_features, linear.in_features, linear=linear)
    return None


def incomplete_stacks(model: nn.Module, stacks: dict[str, dict], format_name: str) -> list[str]:
    """One problem per expert stack whose ``(expert, part)`` keys in ``stacks`` do not cover
    every expert linear: a stack must be stored in ``format_name`` whole."""
    problems = []
    for stack, parts in stacks.items():
        num = submodule(model, stack, RoutedExperts).gate_up_proj.shape[0]
        absent = [
            f"{stack}.{e}.{p}_proj" for e in range(num) for p in EXPERT_PARTS if (e, p) not in parts
        ]
        if absent:
            problems.append(
                f"{stack}: experts are {format_name} but {len(absent)} expert linears are not "
                f"(first: {absent[0]}): a stack must be {format_name} whole"
            )
    return problems

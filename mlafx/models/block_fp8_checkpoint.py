"""Load a block-scaled FP8 checkpoint (DeepSeek-V3/V3.1/V3.2/R1, Kimi K2;
``config/stored_quantization.py``) from its own bytes (``kernels/fp8_format.py``).

An FP8 module ``<m>`` is two checkpoint tensors::

    <m>.weight            F8_E4M3  [N, K]
    <m>.weight_scale_inv  F32      [ceil(N/bn), ceil(K/bk)]

and lands as:
- an ``nn.Linear`` ``<m>`` -> an ``Fp8Linear`` whose weight *is* the file's bytes (a mapping:
  never copied) and whose scales are a copy (1/16384 of the weight);
- per-expert ``<experts>.<e>.(gate|up|down)_proj`` of a ``RoutedExperts`` -> an ``Fp8Experts``
  (expert e's gate and up rows stacked into ``gate_up_weight[e]``, their scales into
  ``gate_up_scale[e]``, each part with its own blocks), all of its experts or none;
- ``kv_b_proj`` (kept in the model dtype, ``models/quantized.py``): dequantized to the model
  dtype, since its absorbed ``W_UK`` / ``W_UV^T`` are model-dtype constants anyway.

Everything else (norms, router, embeddings, lm_head: DeepSeek keeps them in bf16) loads through
``models/weights.py``, which skips the keys and targets planned here. The plan reads headers
only and raises one ``WeightLoadError`` with every problem before any weight is read.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from mlafx.config.stored_quantization import BlockFp8
from mlafx.kernels.fp8_format import dequantize_fp8, scale_shape
from mlafx.models.checkpoint_keys import text_model_tensors
from mlafx.models.fp8 import Fp8Experts, Fp8Linear
from mlafx.models.layers import submodule
from mlafx.models.moe import RoutedExperts
from mlafx.models.packed_int4_checkpoint import CheckpointReader, replace_module
from mlafx.models.safetensors_file import StoredTensor
from mlafx.models.stored_modules import SKIPPED, StoredTarget, incomplete_stacks, stored_target
from mlafx.models.weights import WeightLoadError

logger = logging.getLogger(__name__)

_PART = re.compile(r"^(.*)\.(weight|weight_scale_inv)$")
_DEQUANTIZED = ("kv_b_proj",)
_FP8 = "F8_E4M3"

Location = tuple[Path, StoredTensor]


@dataclass(frozen=True)
class _Fp8:
    """One FP8 module of the checkpoint: where its weight and scales are, and its (N, K)."""

    name: str
    weight: Location
    scale: Location
    out_features: int
    in_features: int


@dataclass
class Fp8Plan:
    """What ``load_block_fp8`` fills, found from the headers by ``plan_block_fp8``."""

    fmt: BlockFp8
    linears: dict[str, _Fp8] = field(default_factory=dict)  # model nn.Linear name ->
    dequantized: dict[str, _Fp8] = field(default_factory=dict)  # kv_b_proj name ->
    # RoutedExperts name -> {(expert, "gate" | "up" | "down"): module}
    experts: dict[str, dict[tuple[int, str], _Fp8]] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # checkpoint keys handled here
    skipped: int = 0  # modules of layers >= num_hidden_layers or experts >= E

    def targets(self) -> set[str]:
        """The model tensors this plan fills (after ``install_fp8_modules``)."""
        names = {f"{m}.{t}" for m in self.linears for t in ("weight", "weight_scale_inv")}
        names |= {f"{m}.weight" for m in self.dequantized}
        for m in self.experts:
            names |= {f"{m}.{t}" for t in ("gate_up_weight", "gate_up_scale")}
            names |= {f"{m}.{t}" for t in ("down_weight", "down_scale")}
        return names


def _fp8_modules(files: list[Path]) -> tuple[dict[str, dict[str, Location]], list[str]]:
    """Module name -> {"weight", "weight_scale_inv"} for every module with a scale or an e4m3
    weight (a bf16 ``.weight`` without scales is an ordinary tensor, not ours)."""
    parts: dict[str, dict[str, Location]] = {}
    problems = []
    for file in files:
        for key, stored in text_model_tensors(file).items():
            m = _PART.match(key)
            if m is None:
                continue
            entry = parts.setdefault(m.group(1), {})
            if m.group(2) in entry:
                problems.append(f"{key}: duplicate, in {entry[m.group(2)][0].name} and {file.name}")
            entry[m.group(2)] = (file, stored)
    ours = {
        name: entry
        for name, entry in parts.items()
        if "weight_scale_inv" in entry or entry["weight"][1].dtype == _FP8
    }
    return ours, problems


def _check(
    name: str, entry: dict[str, Location], n: int, k: int, block: tuple[int, int]
) -> list[str]:
    if "weight" not in entry:
        return [f"{name}.weight: missing from the checkpoint (it has {name}.weight_scale_inv)"]
    if "weight_scale_inv" not in entry:
        return [f"{name}.weight_scale_inv: missing from the checkpoint (an FP8 weight needs it)"]
    problems = []
    weight, scale = entry["weight"][1], entry["weight_scale_inv"][1]
    if weight.dtype != _FP8 or weight.shape != (n, k):
        problems.append(
            f"{name}.weight: {weight.dtype} {list(weight.shape)} != expected {_FP8} {[n, k]}"
        )
    want = scale_shape(n, k, block)
    if scale.dtype != "F32" or scale.shape != want:
        problems.append(
            f"{name}.weight_scale_inv: {scale.dtype} {list(scale.shape)} != expected F32 "
            f"{list(want)} (one per {list(block)} block)"
        )
    return problems


def plan_block_fp8(
    model: nn.Module, files: list[Path], num_hidden_layers: int, fmt: BlockFp8
) -> Fp8Plan:
    """Match the checkpoint's FP8 modules to ``model``'s linears and expert stacks, from the
    headers alone; raise ``WeightLoadError`` with every problem."""
    plan = Fp8Plan(fmt)
    modules, problems = _fp8_modules(files)
    owned = dict(model.named_modules())
    for name, entry in sorted(modules.items()):
        plan.keys |= {f"{name}.{p}" for p in entry}
        place = stored_target(model, owned, name, num_hidden_layers)
        if place == SKIPPED:
            plan.skipped += 1
            continue
        if not isinstance(place, StoredTarget):
            problems.append(f"{name}.weight_scale_inv: no such linear or expert in the model")
            continue
        if place.linear is None:
            target: dict[Any, _Fp8] = plan.experts.setdefault(place.stack, {})
            key: Any = (place.expert, place.part)
        else:
            if place.linear.bias is not None:
                problems.append(f"{name}: an FP8 linear with a bias is not supported")
            target = plan.dequantized if name.rpartition(".")[2] in _DEQUANTIZED else plan.linears
            key = name
        found = _check(name, entry, place.n, place.k, fmt.block)
        problems += found
        if not found:
            target[key] = _Fp8(name, entry["weight"], entry["weight_scale_inv"], place.n, place.k)
    problems += incomplete_stacks(model, plan.experts, "FP8")
    if problems:
        raise WeightLoadError(problems)
    if plan.skipped:
        logger.info(
            "skipped %d FP8 modules of layers >= %d or experts beyond the model's",
            plan.skipped,
            num_hidden_layers,
        )
    return plan


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def install_fp8_modules(model: nn.Module, plan: Fp8Plan) -> None:
    """Swap each planned linear / expert stack for its FP8 module, its buffers still on the
    meta device (``load_block_fp8`` fills them)."""
    block = plan.fmt.block
    for name, fp8 in plan.linears.items():
        n, k = fp8.out_features, fp8.in_features
        weight = _meta((n, k), torch.float8_e4m3fn)
        replace_module(
            model, name, Fp8Linear(weight, _meta(scale_shape(n, k, block), torch.float32), block)
        )
    for stack in plan.experts:
        e, two_i, d = submodule(model, stack, RoutedExperts).gate_up_proj.shape
        i = two_i // 2
        gate_rows, d_blocks = scale_shape(i, d, block)
        experts = Fp8Experts(
            _meta((e, two_i, d), torch.float8_e4m3fn),
            _meta((e, 2 * gate_rows, d_blocks), torch.float32),
            _meta((e, d, i), torch.float8_e4m3fn),
            _meta((e, *scale_shape(d, i, block)), torch.float32),
            block,
        )
        replace_module(model, stack, experts)


def load_block_fp8(model: nn.Module, plan: Fp8Plan, *, progress: bool = True) -> None:
    """Fill what ``install_fp8_modules`` left on the meta device."""
    block = plan.fmt.block
    total = len(plan.linears) + len(plan.dequantized) + len(plan.experts)
    bar = tqdm(total=total, desc="loading fp8", unit="module", file=sys.stderr,
               disable=not progress)  # fmt: skip
    reader = CheckpointReader()
    try:
        with torch.no_grad(), bar:
            for name, fp8 in plan.linears.items():
                module = submodule(model, name, Fp8Linear)
                module.weight = reader.read(fp8.weight)  # stays mapped from the file
                module.weight_scale_inv = reader.read(fp8.scale).clone()
                bar.update()
            for name, fp8 in plan.dequantized.items():
                linear = submodule(model, name, nn.Linear)
                full = dequantize_fp8(reader.read(fp8.weight), reader.read(fp8.scale), block)
                linear.weight = nn.Parameter(full.to(linear.weight.dtype), requires_grad=False)
                bar.update()
            for stack, parts in plan.experts.items():
                _load_experts(submodule(model, stack, Fp8Experts), parts, reader)
                bar.update()
    finally:
        reader.close()


def _load_experts(
    module: Fp8Experts, parts: dict[tuple[int, str], _Fp8], reader: CheckpointReader
) -> None:
    gate_up = torch.empty(module.gate_up_weight.shape, dtype=torch.float8_e4m3fn)
    gate_up_scale = torch.empty(module.gate_up_scale.shape, dtype=torch.float32)
    down = torch.empty(module.down_weight.shape, dtype=torch.float8_e4m3fn)
    down_scale = torch.empty(module.down_scale.shape, dtype=torch.float32)
    inter, gate_rows = module.intermediate_size, gate_up_scale.shape[1] // 2
    for e in range(gate_up.shape[0]):
        gate, up, dn = (parts[(e, p)] for p in ("gate", "up", "down"))
        gate_up[e, :inter] = reader.read(gate.weight)
        gate_up[e, inter:] = reader.read(up.weight)
        gate_up_scale[e, :gate_rows] = reader.read(gate.scale)
        gate_up_scale[e, gate_rows:] = reader.read(up.scale)
        down[e] = reader.read(dn.weight)
        down_scale[e] = reader.read(dn.scale)
    module.gate_up_weight, module.gate_up_scale = gate_up, gate_up_scale
    module.down_weight, module.down_scale = down, down_scale

"""Load a compressed-tensors pack-quantized int4 checkpoint (``config/stored_quantization.py``)
from its own bytes: each packed module is repacked losslessly into mlafx's int4 layout
(``kernels/quant_format.py``), never widened.

A packed module ``<m>`` is three checkpoint tensors::

    <m>.weight_packed  I32            [N, ceil(K/8)]   eight nibbles v + 8 per int32
    <m>.weight_scale   BF16/F16/F32   [N, ceil(K/g)]   ([N, 1] per channel)
    <m>.weight_shape   I64/I32        [2]              = (N, K)

and lands as:
- an ``nn.Linear`` ``<m>`` -> a ``QuantizedLinear`` (so it runs ``mlafx::linear_quantized``);
- per-expert ``<experts>.<e>.(gate|up|down)_proj`` of a ``RoutedExperts`` -> a
  ``QuantizedExperts`` (gate and up rows of expert e packed into ``gate_up_qweight[e]``), all
  of its experts or none;
- ``kv_b_proj`` (kept in the model dtype, ``models/quantized.py``): dequantized to the model
  dtype (exact in float32; bfloat16 rounds ``d * (q - 8)`` to 8 significant bits), since its
  absorbed ``W_UK`` / ``W_UV^T`` are model-dtype constants anyway.

Everything else in the file (what the format's ``ignore`` list keeps: norms, router,
embeddings, often attention and shared experts) loads through ``models/weights.py``, which
skips the keys and targets planned here. The plan reads headers only and raises one
``WeightLoadError`` with every problem before any weight is read; the load then reads one
module at a time (a mapping of its bytes, dropped after the repack).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from mlafx.config.stored_quantization import PackedInt4
from mlafx.kernels.quant_format import (
    BLOCK_ROWS,
    dequantize_compressed_int4,
    packed_shape,
    repack_compressed_int4,
)
from mlafx.models.checkpoint_keys import text_model_tensors
from mlafx.models.layers import submodule
from mlafx.models.moe import RoutedExperts
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear
from mlafx.models.safetensors_file import StoredTensor, map_stored
from mlafx.models.stored_modules import SKIPPED, StoredTarget, incomplete_stacks, stored_target
from mlafx.models.weights import WeightLoadError

logger = logging.getLogger(__name__)

_PART = re.compile(r"^(.*)\.weight_(packed|scale|shape)$")
_DEQUANTIZED = ("kv_b_proj",)
_SCALE_DTYPES = ("BF16", "F16", "F32")
# rows repacked at once: bounds the int16 scratch of a vocabulary-sized lm_head (~0.5 GiB)
_CHUNK_ROWS = 256 * BLOCK_ROWS


@dataclass(frozen=True)
class _Packed:
    """One packed module of the checkpoint: where its three tensors are, and its (N, K)."""

    name: str  # the checkpoint's module name
    parts: dict[str, tuple[Path, StoredTensor]]  # "packed" | "scale" | "shape" -> location
    out_features: int
    in_features: int


@dataclass
class PackedPlan:
    """What ``load_packed_int4`` fills, found from the headers by ``plan_packed_int4``."""

    fmt: PackedInt4
    linears: dict[str, _Packed] = field(default_factory=dict)  # model nn.Linear name ->
    dequantized: dict[str, _Packed] = field(default_factory=dict)  # kv_b_proj name ->
    # RoutedExperts name -> {(expert, "gate" | "up" | "down"): packed}
    experts: dict[str, dict[tuple[int, str], _Packed]] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # checkpoint keys handled here
    skipped: int = 0  # modules of layers >= num_hidden_layers or experts >= E

    def targets(self) -> set[str]:
        """The model tensors this plan fills (after ``install_packed_modules``)."""
        names = {f"{m}.qweight" for m in self.linears}
        names |= {f"{m}.weight" for m in self.dequantized}
        for m in self.experts:
            names |= {f"{m}.gate_up_qweight", f"{m}.down_qweight"}
        return names


def _group_by_module(files: list[Path]) -> tuple[dict[str, dict[str, tuple]], list[str]]:
    modules: dict[str, dict[str, tuple[Path, StoredTensor]]] = {}
    problems = []
    for file in files:
        for key, stored in text_model_tensors(file).items():
            m = _PART.match(key)
            if m is None:
                continue
            parts = modules.setdefault(m.group(1), {})
            if m.group(2) in parts:
                problems.append(f"{key}: duplicate, in {parts[m.group(2)][0].name} and {file.name}")
            parts[m.group(2)] = (file, stored)
    return modules, problems


def _check_parts(
    name: str, parts: dict[str, tuple[Path, StoredTensor]], n: int, k: int, fmt: PackedInt4
) -> list[str]:
    """Problems with one module's three tensors against its expected (N, K)."""
    missing = [f"{name}.weight_{p}" for p in ("packed", "scale", "shape") if p not in parts]
    if missing:
        return [f"{key}: missing from the checkpoint (a packed int4 module)" for key in missing]
    problems = []
    packed, scale, shape = (parts[p][1] for p in ("packed", "scale", "shape"))
    want = (n, -(-k // 8))
    if packed.dtype != "I32" or packed.shape != want:
        problems.append(
            f"{name}.weight_packed: {packed.dtype} {list(packed.shape)} != expected I32 "
            f"{list(want)}"
        )
    scale_cols = 1 if fmt.group_size is None else -(-k // fmt.group_size)
    if scale.dtype not in _SCALE_DTYPES or scale.shape != (n, scale_cols):
        problems.append(
            f"{name}.weight_scale: {scale.dtype} {list(scale.shape)} != expected "
            f"{'/'.join(_SCALE_DTYPES)} {[n, scale_cols]}"
        )
    if shape.dtype not in ("I64", "I32") or shape.shape != (2,):
        problems.append(f"{name}.weight_shape: {shape.dtype} {list(shape.shape)} != I64 [2]")
    return problems


def plan_packed_int4(
    model: nn.Module, files: list[Path], num_hidden_layers: int, fmt: PackedInt4
) -> PackedPlan:
    """Match the checkpoint's packed modules to ``model``'s linears and expert stacks, from the
    headers alone; raise ``WeightLoadError`` with every problem."""
    plan = PackedPlan(fmt)
    modules, problems = _group_by_module(files)
    owned = dict(model.named_modules())
    for name, parts in sorted(modules.items()):
        plan.keys |= {f"{name}.weight_{p}" for p in parts}
        place = stored_target(model, owned, name, num_hidden_layers)
        if place == SKIPPED:
            plan.skipped += 1
            continue
        if not isinstance(place, StoredTarget):
            problems.append(f"{name}.weight_packed: no such linear or expert in the model")
            continue
        packed = _Packed(name, parts, place.n, place.k)
        if place.linear is None:
            plan.experts.setdefault(place.stack, {})[(place.expert, place.part)] = packed
        else:
            if place.linear.bias is not None:
                problems.append(f"{name}: a packed linear with a bias is not supported")
            kind = plan.dequantized if name.rpartition(".")[2] in _DEQUANTIZED else plan.linears
            kind[name] = packed
        problems += _check_parts(name, parts, place.n, place.k, fmt)
    problems += incomplete_stacks(model, plan.experts, "packed int4")
    if problems:
        raise WeightLoadError(problems)
    if plan.skipped:
        logger.info(
            "skipped %d packed modules of layers >= %d or experts beyond the model's",
            plan.skipped,
            num_hidden_layers,
        )
    return plan


def install_packed_modules(model: nn.Module, plan: PackedPlan) -> None:
    """Swap each planned linear / expert stack for its quantized module, its buffers still on
    the meta device (``load_packed_int4`` fills them); the full-precision weights never exist."""
    for name, packed in plan.linears.items():
        shape = packed_shape(packed.out_features, packed.in_features, 4)
        meta = torch.empty(shape, dtype=torch.uint8, device="meta")
        replace_module(model, name, QuantizedLinear(packed.in_features, packed.out_features, meta))
    for stack in plan.experts:
        num, two_i, d = submodule(model, stack, RoutedExperts).gate_up_proj.shape
        i = two_i // 2
        gate_up = torch.empty((num, *packed_shape(two_i, d, 4)), dtype=torch.uint8, device="meta")
        down = torch.empty((num, *packed_shape(d, i, 4)), dtype=torch.uint8, device="meta")
        replace_module(model, stack, QuantizedExperts(i, gate_up, down))


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class CheckpointReader:
    """Maps checkpoint tensors, one file descriptor per file kept open for the load."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, file: Path) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        return self.fds[file]

    def read(self, location: tuple[Path, StoredTensor]) -> torch.Tensor:
        file, stored = location
        return map_stored(self.fd(file), stored)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _tensors(reader: CheckpointReader, packed: _Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) of a module, its ``weight_shape`` checked."""
    shape = tuple(int(v) for v in reader.read(packed.parts["shape"]))
    if shape != (packed.out_features, packed.in_features):
        raise WeightLoadError(
            [
                f"{packed.name}.weight_shape: {list(shape)} != expected "
                f"{[packed.out_features, packed.in_features]}"
            ]
        )
    return reader.read(packed.parts["packed"]), reader.read(packed.parts["scale"])


def _repack_into(
    out: torch.Tensor, reader: CheckpointReader, packed: _Packed, fmt: PackedInt4
) -> None:
    """Repack one module into ``out`` [ceil(N/16), ceil(K/32), S], a chunk of rows at a time."""
    weight, scale = _tensors(reader, packed)
    for start in range(0, packed.out_features, _CHUNK_ROWS):
        stop = start + _CHUNK_ROWS
        try:
            chunk = repack_compressed_int4(
                weight[start:stop], scale[start:stop], packed.in_features, fmt.group_size
            )
        except ValueError as e:
            raise WeightLoadError([f"{packed.name}.weight_scale: {e}"]) from None
        out[start // BLOCK_ROWS : start // BLOCK_ROWS + chunk.shape[0]] = chunk


def load_packed_int4(model: nn.Module, plan: PackedPlan, *, progress: bool = True) -> None:
    """Fill what ``install_packed_modules`` left on the meta device."""
    total = len(plan.linears) + len(plan.dequantized) + len(plan.experts)
    bar = tqdm(total=total, desc="repacking int4", unit="module", file=sys.stderr,
               disable=not progress)  # fmt: skip
    reader = CheckpointReader()
    try:
        with torch.no_grad(), bar:
            for name, packed in plan.linears.items():
                module = submodule(model, name, QuantizedLinear)
                out = torch.empty(module.qweight.shape, dtype=torch.uint8)
                _repack_into(out, reader, packed, plan.fmt)
                module.qweight = out
                bar.update()
            for name, packed in plan.dequantized.items():
                linear = submodule(model, name, nn.Linear)
                weight, scale = _tensors(reader, packed)
                full = dequantize_compressed_int4(weight, scale, packed.in_features,
                                                  plan.fmt.group_size)  # fmt: skip
                linear.weight = nn.Parameter(full.to(linear.weight.dtype), requires_grad=False)
                bar.update()
            for stack, parts in plan.experts.items():
                experts = submodule(model, stack, QuantizedExperts)
                gate_up = torch.empty(experts.gate_up_qweight.shape, dtype=torch.uint8)
                down = torch.empty(experts.down_qweight.shape, dtype=torch.uint8)
                for e in range(gate_up.shape[0]):
                    _repack_gate_up(gate_up[e], reader, parts[(e, "gate")], parts[(e, "up")],
                                    plan.fmt)  # fmt: skip
                    _repack_into(down[e], reader, parts[(e, "down")], plan.fmt)
                experts.gate_up_qweight, experts.down_qweight = gate_up, down
                bar.update()
    finally:
        reader.close()


def _repack_gate_up(
    out: torch.Tensor, reader: CheckpointReader, gate: _Packed, up: _Packed, fmt: PackedInt4
) -> None:
    """An expert's gate [I, K] and up [I, K] as one [2I, K] weight (gate rows first): a
    16-row block may hold rows of both when I is not a multiple of 16."""
    (gate_w, gate_s), (up_w, up_s) = _tensors(reader, gate), _tensors(reader, up)
    try:
        out.copy_(repack_compressed_int4(torch.cat([gate_w, up_w]), torch.cat([gate_s, up_s]),
                                         gate.in_features, fmt.group_size))  # fmt: skip
    except ValueError as e:
        raise WeightLoadError([f"{gate.name}.weight_scale / {up.name}.weight_scale: {e}"]) from None

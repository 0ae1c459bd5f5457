"""Fill an mlafx model with checkpoint weights (safetensors) or seeded dummy weights.

Target layout: the model's ``state_dict()`` keys, which are transformers 5's in-memory keys
for DeepseekV2/V3ForCausalLM and Glm4MoeLiteForCausalLM, among them::

    model.embed_tokens.weight                          [V, D]
    model.layers.{i}.mlp.gate.weight                   [E, D]      router; fp32 in any model dtype
    model.layers.{i}.mlp.gate.e_score_correction_bias  [E]         fp32 buffer (noaux_tc routers)
    model.layers.{i}.mlp.experts.gate_up_proj          [E, 2I, D]  rows [0, I) gate, [I, 2I) up
    model.layers.{i}.mlp.experts.down_proj             [E, D, I]
    lm_head.weight                                     [V, D]      may BE the embedding (tied)

Checkpoint layouts accepted (``model.safetensors``, an index + shards, or any ``*.safetensors``):

    fused       the target keys themselves
    per expert  model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, D] -> gate_up_proj[e, :I]
                model.layers.{i}.mlp.experts.{e}.up_proj.weight   [I, D] -> gate_up_proj[e, I:]
                model.layers.{i}.mlp.experts.{e}.down_proj.weight [D, I] -> down_proj[e]
                (Hub checkpoints and transformers 5's ``save_pretrained`` write this one)

Skipped on purpose, logged at INFO: layers ``i >= num_hidden_layers`` (a depth-shrunk model;
DeepSeek-V3's MTP layer 61), experts ``e >= E`` of the target (a shrunk ``n_routed_experts``:
the router's gate/bias and fused expert tensors keep their first E rows), rotary ``inv_freq``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_IGNORED = re.compile(r"\.rotary_emb\.(original_)?inv_freq$")
# Targets whose dim 0 is the routed-expert axis; a checkpoint with more experts keeps the first E.
_EXPERT_AXIS = re.compile(
    r"\.mlp\.(gate\.weight|gate\.e_score_correction_bias|experts\.gate_up_proj|experts\.down_proj)$"
)
_FUSED_PARTS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_WHOLE = "whole"  # coverage unit of a tensor that is not a fused expert stack

_DUMMY_STD = 0.02  # transformers' initializer_range
# fp32 scratch per chunk (64 MiB); the draws depend on it, so changing it changes dummy values.
_DUMMY_CHUNK_ELEMS = 16 * 1024 * 1024


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model; ``problems`` lists every problem, naming the tensor."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) loading weights:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class _Copy:
    """Copy checkpoint tensor ``ckpt_key`` of ``file`` into ``target[dst_index]``."""

    file: Path
    ckpt_key: str
    target: str  # canonical name: the first state_dict key of that tensor (tied ones share it)
    dst_index: tuple[int | slice, ...]  # () for the whole tensor, else (expert, rows)
    shape: tuple[int, ...]  # of target[dst_index], which the checkpoint tensor must match
    units: tuple[str, ...]  # coverage units this copy fills
    src_rows: int | None = None  # copy only the first rows (experts) of the checkpoint tensor


def _units(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Coverage units of a target: one per (expert, part) for fused experts, else the whole."""
    prefix, _, last = name.rpartition(".")
    parts = _FUSED_PARTS.get(last) if prefix.endswith(".mlp.experts") else None
    if parts is None or len(shape) != 3:
        return (_WHOLE,)
    return tuple(f"{e}.{p}" for e in range(shape[0]) for p in parts)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read: the single file, the index's shards, or all of them."""
    if (model_dir / _SINGLE_FILE).is_file():
        return [model_dir / _SINGLE_FILE]
    index = model_dir / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightLoadError(
                [f"shard file {s} listed in {index} does not exist" for s in missing]
            )
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError([f"no {_SINGLE_FILE}, {_INDEX_FILE} or *.safetensors in {model_dir}"])
    return files


def _per_expert(key: str, targets: dict[str, torch.Tensor]) -> tuple[str, int, str] | None:
    """(fused target, expert, part) of a per-expert checkpoint key whose fused target exists."""
    m = _PER_EXPERT.match(key)
    if m is None:
        return None
    prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
    fused = f"{prefix}.down_proj" if part == "down" else f"{prefix}.gate_up_proj"
    if fused not in targets or targets[fused].dim() != 3:
        return None
    return fused, e, part


def _place(
    key: str, file: Path, targets: dict[str, torch.Tensor], alias: dict[str, str]
) -> _Copy | None:
    """Where checkpoint tensor ``key`` goes; None if the model has no such tensor."""
    if key in targets:
        name, shape = alias[key], tuple(targets[key].shape)
        return _Copy(file, key, name, (), shape, _units(name, shape))
    expert = _per_expert(key, targets)
    if expert is None:
        return None
    fused, e, part = expert
    full = tuple(targets[fused].shape)  # gate_up_proj [E, 2I, D] | down_proj [E, D, I]
    if part == "down":
        return _Copy(file, key, alias[fused], (e,), full[1:], (f"{e}.down",))
    i = full[1] // 2
    rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
    return _Copy(file, key, alias[fused], (e, rows), (i, full[2]), (f"{e}.{part}",))


def _fit(copy: _Copy, shape: tuple[int, ...]) -> _Copy | None:
    """``copy`` if the checkpoint tensor's shape fits, else None. A router or fused-expert tensor
    from a checkpoint with more experts (a shrunk ``n_routed_experts``) keeps its first E rows."""
    want = copy.shape
    if shape == want:
        return copy
    more_experts = len(shape) == len(want) > 0 and shape[1:] == want[1:] and shape[0] > want[0]
    if more_experts and _EXPERT_AXIS.search(copy.ckpt_key):
        return replace(copy, src_rows=want[0])
    return None


def _missing(
    targets: dict[str, torch.Tensor], alias: dict[str, str], claimed: set[tuple[str, str]]
) -> list[str]:
    """A problem for each target tensor, or fused expert slice, that no checkpoint key fills."""
    names_of: dict[str, list[str]] = {}
    for name, canon in alias.items():
        names_of.setdefault(canon, []).append(name)
    problems = []
    for canon, names in names_of.items():
        for unit in _units(canon, tuple(targets[canon].shape)):
            if (canon, unit) in claimed:
                continue
            if unit == _WHOLE:
                problems.append(f"{' = '.join(names)}: missing from the checkpoint")
            else:
                e, part = unit.split(".")
                per_expert = f"{canon.rpartition('.')[0]}.{e}.{part}_proj.weight"
                problems.append(
                    f"{per_expert}: missing from the checkpoint (expert {e} of {canon})"
                )
    return problems


def _plan(model: nn.Module, files: list[Path], num_hidden_layers: int) -> list[_Copy]:
    """Check the checkpoint against the model from headers alone; raise with every problem."""
    targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    canonical: dict[int, str] = {}
    alias = {name: canonical.setdefault(id(t), name) for name, t in targets.items()}
    copies: list[_Copy] = []
    claimed: set[tuple[str, str]] = set()  # (target, unit) filled, or already reported misfit
    problems: list[str] = []
    unexpected: list[str] = []
    found: dict[str, Path] = {}
    skipped_layers = skipped_experts = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in found:
                    problems.append(f"{key}: duplicate, in both {found[key].name} and {file.name}")
                    continue
                found[key] = file
                layer = _LAYER.match(key)
                if layer is not None and int(layer.group(1)) >= num_hidden_layers:
                    skipped_layers += 1
                    continue
                expert = _per_expert(key, targets)
                if expert is not None and expert[1] >= targets[expert[0]].shape[0]:
                    skipped_experts += 1
                    continue
                copy = _place(key, file, targets, alias)
                if copy is None:
                    if not _IGNORED.search(key):
                        unexpected.append(key)
                    continue
                claimed.update((copy.target, unit) for unit in copy.units)
                shape = tuple(f.get_slice(key).get_shape())
                fitted = _fit(copy, shape)
                if fitted is not None:
                    copies.append(fitted)
                else:
                    where = f" (a slice of {copy.target})" if copy.dst_index else ""
                    problems.append(
                        f"{key}: checkpoint shape {list(shape)} != expected "
                        f"{list(copy.shape)}{where}"
                    )
    problems += [
        f"{key}: unexpected checkpoint key (no such tensor in the model)" for key in unexpected
    ]
    if any(key.endswith("weight_scale_inv") for key in unexpected):
        problems.append(
            "the checkpoint is block-quantised FP8 (*.weight_scale_inv): "
            "dequantise it to bf16 first"
        )
    problems += _missing(targets, alias, claimed)
    if problems:
        raise WeightLoadError(problems)
    truncated = sum(c.src_rows is not None for c in copies)
    if skipped_layers or skipped_experts or truncated:
        logger.info(
            "skipped %d tensors of layers >= %d and %d of experts beyond the model's; "
            "kept the first E rows of %d router/fused-expert tensors",
            skipped_layers,
            num_hidden_layers,
            skipped_experts,
            truncated,
        )
    return copies


def load_safetensors_weights(
    model: nn.Module, model_dir: str | Path, *, num_hidden_layers: int, progress: bool = True
) -> None:
    """Copy a safetensors checkpoint into ``model``'s parameters and buffers, cast to their dtypes.

    Every header is checked before any tensor is read, so a mismatch raises ``WeightLoadError``
    (listing missing, unexpected, wrongly shaped and duplicate tensors) with the model untouched.
    Files are memory-mapped and read one tensor at a time, never the whole checkpoint at once.
    """
    model_dir = Path(model_dir)
    copies = _plan(model, _checkpoint_files(model_dir), num_hidden_layers)
    targets = model.state_dict(keep_vars=True)
    bar = tqdm(
        total=len(copies),
        desc=f"loading {model_dir.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    with torch.no_grad(), bar:
        for file, group in itertools.groupby(copies, key=lambda c: c.file):
            with safe_open(str(file), framework="pt") as f:
                for c in group:
                    if c.src_rows is None:
                        src = f.get_tensor(c.ckpt_key)
                    else:
                        src = f.get_slice(c.ckpt_key)[: c.src_rows]
                    targets[c.target].data[c.dst_index].copy_(src)
                    bar.update()


def _tensor_seed(name: str, seed: int) -> int:
    """A per-tensor seed from its name, so values do not depend on iteration order."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _fill_normal(dst: torch.Tensor, generator: torch.Generator) -> None:
    """``dst ~ normal(0, _DUMMY_STD)``, drawn in fp32 row chunks of about 64 MiB, then cast."""
    rows_view = dst if dst.dim() > 0 else dst.unsqueeze(0)
    row_elems = max(1, rows_view[0].numel())
    chunk_rows = max(1, _DUMMY_CHUNK_ELEMS // row_elems)
    scratch_rows = min(chunk_rows, rows_view.shape[0])
    scratch = torch.empty((scratch_rows, *rows_view.shape[1:]), dtype=torch.float32)
    for start in range(0, rows_view.shape[0], chunk_rows):
        out = rows_view[start : start + chunk_rows]
        buf = scratch[: out.shape[0]]
        buf.normal_(0.0, _DUMMY_STD, generator=generator)
        out.copy_(buf)


def init_dummy_weights(model: nn.Module, *, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer in place, deterministically for a given seed.

    Norm weights (names ending in ``norm.weight``) are 1, biases (including the router's
    ``e_score_correction_bias``) are 0, everything else is normal(0, 0.02). Each tensor gets its
    own generator seeded from ``seed`` and its name; tied tensors are filled once.
    """
    filled: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in filled or not tensor.is_floating_point():
                continue
            filled.add(id(tensor))
            if name.endswith("norm.weight"):
                tensor.data.fill_(1.0)
            elif name.endswith("bias"):
                tensor.data.zero_()
            else:
                generator = torch.Generator().manual_seed(_tensor_seed(name, seed))
                _fill_normal(tensor.data, generator)

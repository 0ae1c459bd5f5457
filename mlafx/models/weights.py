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

Mapped or copied: a checkpoint tensor that is a whole target (not a slice of a fused expert stack,
not truncated to the first E rows) in the target's dtype and shape becomes the target itself, a
tensor over a private, copy-on-write mapping of its bytes in the file: no anonymous copy, the
pages are the page cache's. Each such tensor has its own mapping, unmapped when the tensor is
freed, so a weight replaced after load leaves RSS (why not one mapping per file:
``safetensors_file``). A target still on the meta device is then never allocated. Every other
checkpoint tensor (per-expert slices, dtype casts such as a bf16 router into the fp32 one,
truncated rows, tensors whose file offset is not a multiple of their element size) is mapped
just long enough to be copied into a target allocated for it. So a fused checkpoint in the
model's dtype is mapped whole (the router too if the file holds it in fp32, as mlafx's model
does); a Hub (per-expert) checkpoint has its routed experts copied into the fused stacks and
the rest mapped. The model never writes a weight after load; if something did, the write would
stay in this process (copy-on-write), never reach the file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from mlafx.models.checkpoint_keys import text_model_tensors
from mlafx.models.safetensors_file import (
    STORED_DTYPES,
    StoredTensor,
    map_stored,
)

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
class _Placement:
    """Checkpoint tensor ``ckpt_key`` (``stored`` in ``file``) fills ``target[dst_index]``."""

    file: Path
    ckpt_key: str
    stored: StoredTensor
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


def checkpoint_files(model_dir: Path) -> list[Path]:
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
    key: str,
    file: Path,
    stored: StoredTensor,
    targets: dict[str, torch.Tensor],
    alias: dict[str, str],
) -> _Placement | None:
    """Where checkpoint tensor ``key`` goes; None if the model has no such tensor."""
    if key in targets:
        name, shape = alias[key], tuple(targets[key].shape)
        return _Placement(file, key, stored, name, (), shape, _units(name, shape))
    expert = _per_expert(key, targets)
    if expert is None:
        return None
    fused, e, part = expert
    full = tuple(targets[fused].shape)  # gate_up_proj [E, 2I, D] | down_proj [E, D, I]
    if part == "down":
        return _Placement(file, key, stored, alias[fused], (e,), full[1:], (f"{e}.down",))
    i = full[1] // 2
    rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
    units = (f"{e}.{part}",)
    return _Placement(file, key, stored, alias[fused], (e, rows), (i, full[2]), units)


def _fit(placement: _Placement) -> _Placement | None:
    """``placement`` if the checkpoint tensor's shape fits, else None. A router or fused-expert
    tensor from a checkpoint with more experts (a shrunk ``n_routed_experts``) keeps its first E
    rows."""
    shape, want = placement.stored.shape, placement.shape
    if shape == want:
        return placement
    more_experts = len(shape) == len(want) > 0 and shape[1:] == want[1:] and shape[0] > want[0]
    if more_experts and _EXPERT_AXIS.search(placement.ckpt_key):
        return replace(placement, src_rows=want[0])
    return None


def _aliases(targets: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each target name -> its canonical name: the first name of that tensor (tied ones share)."""
    canonical: dict[int, str] = {}
    return {name: canonical.setdefault(id(t), name) for name, t in targets.items()}


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


def _plan(
    model: nn.Module,
    files: list[Path],
    num_hidden_layers: int,
    elsewhere: Elsewhere | None = None,
) -> list[_Placement]:
    """Check the checkpoint against the model from headers alone; raise with every problem."""
    targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    if elsewhere is not None:
        targets = {n: t for n, t in targets.items() if n not in elsewhere.targets}
    alias = _aliases(targets)
    placements: list[_Placement] = []
    claimed: set[tuple[str, str]] = set()  # (target, unit) filled, or already reported misfit
    problems: list[str] = []
    unexpected: list[str] = []
    found: dict[str, Path] = {}
    skipped_layers = skipped_experts = 0
    for file in files:
        # safe_open checks the header (offsets contiguous, sizes match shapes and dtypes, the
        # data ends at the end of the file); text_model_tensors reads where each tensor's bytes
        # are, by the text model's names (a multimodal wrapper's prefixes and vision tower gone)
        with safe_open(str(file), framework="pt"):
            locations = text_model_tensors(file)
            for key in locations:
                if key in found:
                    problems.append(f"{key}: duplicate, in both {found[key].name} and {file.name}")
                    continue
                found[key] = file
                if elsewhere is not None and key in elsewhere.keys:
                    continue
                layer = _LAYER.match(key)
                if layer is not None and int(layer.group(1)) >= num_hidden_layers:
                    skipped_layers += 1
                    continue
                expert = _per_expert(key, targets)
                if expert is not None and expert[1] >= targets[expert[0]].shape[0]:
                    skipped_experts += 1
                    continue
                stored = locations[key]
                placement = _place(key, file, stored, targets, alias)
                if placement is None:
                    if not _IGNORED.search(key):
                        unexpected.append(key)
                    continue
                claimed.update((placement.target, unit) for unit in placement.units)
                if stored.dtype not in STORED_DTYPES:
                    problems.append(f"{key}: checkpoint dtype {stored.dtype} is not supported")
                    continue
                fitted = _fit(placement)
                if fitted is not None:
                    placements.append(fitted)
                else:
                    where = f" (a slice of {placement.target})" if placement.dst_index else ""
                    problems.append(
                        f"{key}: checkpoint shape {list(stored.shape)} != expected "
                        f"{list(placement.shape)}{where}"
                    )
    problems += [
        f"{key}: unexpected checkpoint key (no such tensor in the model)" for key in unexpected
    ]
    problems += _missing(targets, alias, claimed)
    if problems:
        raise WeightLoadError(problems)
    truncated = sum(p.src_rows is not None for p in placements)
    if skipped_layers or skipped_experts or truncated:
        logger.info(
            "skipped %d tensors of layers >= %d and %d of experts beyond the model's; "
            "kept the first E rows of %d router/fused-expert tensors",
            skipped_layers,
            num_hidden_layers,
            skipped_experts,
            truncated,
        )
    return placements


@dataclass(frozen=True)
class Elsewhere:
    """Checkpoint ``keys`` and model ``targets`` another loader handles (a stored quantized
    format's, ``models/packed_int4_checkpoint.py``): skipped here, neither unexpected nor
    missing."""

    keys: frozenset[str]
    targets: frozenset[str]


def _is_whole(placement: _Placement, target: torch.Tensor) -> bool:
    """Whether the checkpoint tensor is all of ``target`` in its dtype (so it can be the target)."""
    whole = placement.dst_index == () and placement.src_rows is None
    return whole and STORED_DTYPES[placement.stored.dtype] == target.dtype


def _aligned(stored: StoredTensor) -> bool:
    """Whether the tensor's bytes start at a multiple of its element size (a mapping keeps the
    file offset's alignment: it starts at a page boundary)."""
    return stored.offset % STORED_DTYPES[stored.dtype].itemsize == 0


def _read(fd: int, placement: _Placement) -> torch.Tensor:
    """The checkpoint tensor (its first ``src_rows`` rows, if set) in its own dtype, over a
    private mapping of its bytes, or over an aligned copy of them if they are misaligned."""
    stored = placement.stored
    if placement.src_rows is not None:
        rows = math.prod((placement.src_rows, *stored.shape[1:]))
        stored = replace(
            stored,
            shape=(placement.src_rows, *stored.shape[1:]),
            length=rows * STORED_DTYPES[stored.dtype].itemsize,
        )
    return map_stored(fd, stored)


def _install(
    model: nn.Module, names: list[str], old: torch.Tensor, new: torch.Tensor
) -> torch.Tensor:
    """Make ``new`` the model's tensor under every name in ``names`` (tied names share one).

    A materialised ``old`` keeps its identity (``.data`` swapped: ties and references stay); a
    meta one is replaced in its modules (meta tensors cannot take CPU data)."""
    if not old.is_meta:
        old.data = new
        return old
    value = nn.Parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new
    for name in names:
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, value)
    return value


# Called with (names, tensor) once a tensor (all names tied to it) holds all its values.
OnFilled = Callable[[list[str], torch.Tensor], None]


def _remaining_placements(placements: list[_Placement]) -> dict[str, int]:
    """Target -> how many placements fill it (a fused expert stack takes one per slice)."""
    counts: dict[str, int] = {}
    for p in placements:
        counts[p.target] = counts.get(p.target, 0) + 1
    return counts


def load_safetensors_weights(
    model: nn.Module,
    model_dir: str | Path,
    *,
    num_hidden_layers: int,
    progress: bool = True,
    on_filled: OnFilled | None = None,
    elsewhere: Elsewhere | None = None,
) -> None:
    """Fill ``model``'s parameters and buffers from a safetensors checkpoint.

    A checkpoint tensor that is a whole target in its dtype becomes that target, mapped from the
    file (see the module docstring); everything else is copied in and cast to the target's
    dtype. Targets may be on the meta device (``build_model``'s): a mapped one is then never
    allocated, a copied one is allocated just before its first copy. Every header is checked
    before any tensor is read, so a mismatch raises ``WeightLoadError`` (listing missing,
    unexpected, wrongly shaped and duplicate tensors) with the model untouched.

    ``on_filled(names, tensor)`` runs as soon as a target holds all its values (the quantizer
    replaces it then, so its source is dropped before the next one is read). ``elsewhere``
    names checkpoint keys and targets left to another loader.
    """
    model_dir = Path(model_dir)
    placements = _plan(model, checkpoint_files(model_dir), num_hidden_layers, elsewhere)
    live: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    names_of: dict[str, list[str]] = {}
    for name, canonical in _aliases(live).items():
        names_of.setdefault(canonical, []).append(name)
    remaining = _remaining_placements(placements)
    mapped = copied = mapped_bytes = copied_bytes = 0
    bar = tqdm(
        total=len(placements),
        desc=f"loading {model_dir.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    with torch.no_grad(), bar:
        for file, group in itertools.groupby(placements, key=lambda p: p.file):
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)  # mappings outlive it
            try:
                for p in group:
                    target = live[p.target]
                    if _is_whole(p, target):
                        live[p.target] = _install(model, names_of[p.target], target, _read(fd, p))
                        if _aligned(p.stored):
                            mapped, mapped_bytes = mapped + 1, mapped_bytes + p.stored.length
                        else:
                            copied, copied_bytes = copied + 1, copied_bytes + p.stored.length
                            logger.debug(
                                "copied %s: its bytes start at offset %d of %s, not a multiple "
                                "of its %d-byte elements",
                                p.ckpt_key,
                                p.stored.offset,
                                file.name,
                                target.element_size(),
                            )
                    else:
                        if target.is_meta:
                            empty = torch.empty(target.shape, dtype=target.dtype)
                            target = live[p.target] = _install(
                                model, names_of[p.target], target, empty
                            )
                        target.data[p.dst_index].copy_(_read(fd, p))
                        copied += 1
                        copied_bytes += math.prod(p.shape) * target.element_size()
                    remaining[p.target] -= 1
                    if on_filled is not None and remaining[p.target] == 0:
                        on_filled(names_of[p.target], live.pop(p.target))
                    bar.update()
            finally:
                os.close(fd)
    logger.info(
        "loaded %s: %d tensors (%.1f MiB) mapped from the file, %d copied (%.1f MiB: "
        "fused experts, dtype casts, truncated or misaligned tensors)",
        model_dir.name,
        mapped,
        mapped_bytes / 2**20,
        copied,
        copied_bytes / 2**20,
    )


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


def init_dummy_weights(
    model: nn.Module, *, seed: int = 0, on_filled: OnFilled | None = None
) -> None:
    """Fill every parameter and persistent buffer, deterministically for a given seed, one
    tensor at a time: a tensor still on the meta device is allocated just before it is filled
    (and handed to ``on_filled(names, tensor)`` right after, as the checkpoint loader does).

    Norm weights (names ending in ``norm.weight``) are 1, biases (including the router's
    ``e_score_correction_bias``) are 0, everything else is normal(0, 0.02). Each tensor gets its
    own generator seeded from ``seed`` and its name; tied tensors are filled once.
    """
    live: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    names_of: dict[str, list[str]] = {}
    for name, canonical in _aliases(live).items():
        names_of.setdefault(canonical, []).append(name)
    with torch.no_grad():
        for name, names in names_of.items():
            tensor = live[name]
            if not tensor.is_floating_point():
                continue
            if tensor.is_meta:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype)
                tensor = _install(model, names, tensor, empty)
            if name.endswith("norm.weight"):
                tensor.data.fill_(1.0)
            elif name.endswith("bias"):
                tensor.data.zero_()
            else:
                generator = torch.Generator().manual_seed(_tensor_seed(name, seed))
                _fill_normal(tensor.data, generator)
            if on_filled is not None:
                on_filled(names, tensor)

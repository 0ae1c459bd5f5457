"""An artifact's weights: one safetensors file of the step's constants, keyed by FQN.

The names are the model's parameter and buffer names, which is also how the AOTInductor
package, the ``torch.export`` program and the ONNX initializers name them, so every format
reads the same file. Tensors that share storage (tied embeddings: ``lm_head.weight`` is
``model.embed_tokens.weight``) are written once under their first name; the other names
are returned as aliases for the manifest (safetensors refuses to store shared memory).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from mlafx.models.safetensors_file import map_file

WEIGHTS_FILE = "weights.safetensors"


def save_weights(constants: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    """Write ``constants`` to ``path``; returns ``{alias: stored name}`` for shared tensors."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in constants.items():
        tensor = tensor.detach()
        ptr = tensor.untyped_storage().data_ptr()
        view = (
            ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
        )  # fmt: skip
        if view in by_view:
            aliases[name] = by_view[view]
            continue
        by_view[view] = name
        # another view of a storage already written (or a strided view) is stored as a copy
        shared = ptr in storages
        storages.add(ptr)
        stored[name] = tensor.clone() if shared or not tensor.is_contiguous() else tensor
    save_file(stored, str(path))
    return aliases


def load_weights(path: Path, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every weight by name (aliases share their target's tensor), each over its own private
    mapping of the file (``models/safetensors_file.py``): nothing is copied, and a weight the
    step replaces by a derived layout gives its pages back when it is dropped."""
    weights = map_file(path)
    missing = sorted(target for target in aliases.values() if target not in weights)
    if missing:
        raise ValueError(f"{path.name}: aliased weights {missing[:5]} are not in the file")
    for alias, target in aliases.items():
        weights[alias] = weights[target]
    return weights

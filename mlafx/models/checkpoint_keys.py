"""Checkpoint tensor names as the text model's: multimodal wrappers (Kimi K2.5's ``kimi_k25``)
keep the language model under a prefix and ship a vision tower beside it.

    language_model.model.X      -> model.X       (the Hub's layout, and save_pretrained's)
    language_model.lm_head.X    -> lm_head.X
    model.language_model.X      -> model.X       (transformers 5's in-memory layout)
    [model.]vision_tower.*, [model.]mm_projector.*, [model.]multi_modal_projector.*
                                -> skipped (served as a text model; one logged line per file)

Under those prefixes ``model.blocks.{i}`` is ``model.layers.{i}``: transformers 5.25 writes a
``kimi_k25`` checkpoint with every ``layers`` renamed ``blocks`` (its vision tower's rename,
applied in reverse to the whole file on save), and reads it back the same way.

Every other name is the text model's already. The loaders (safetensors, compressed-tensors
int4, block FP8) read checkpoint names through :func:`text_model_tensors`, so each sees the
model's own names whatever wrapper the file came from.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mlafx.models.safetensors_file import StoredTensor, tensor_locations

logger = logging.getLogger(__name__)

_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_SAVED_LAYERS, _LAYERS = "model.blocks.", "model.layers."
_NOT_TEXT = re.compile(r"^(model\.)?(vision_tower|mm_projector|multi_modal_projector)\.")


def text_model_key(key: str) -> str | None:
    """The text model's name for checkpoint key ``key``; None for a vision-side tensor."""
    if _NOT_TEXT.match(key):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if key.startswith(prefix):
            name = replacement + key[len(prefix) :]
            if name.startswith(_SAVED_LAYERS):
                name = _LAYERS + name[len(_SAVED_LAYERS) :]
            return name
    return key


def text_model_tensors(path: Path) -> dict[str, StoredTensor]:
    """``tensor_locations(path)`` by the text model's names, vision-side tensors left out."""
    tensors: dict[str, StoredTensor] = {}
    skipped = 0
    for key, stored in tensor_locations(path).items():
        name = text_model_key(key)
        if name is None:
            skipped += 1
            continue
        if name in tensors:
            raise ValueError(f"{path}: two checkpoint tensors are both the text model's {name}")
        tensors[name] = stored
    if skipped:
        logger.info(
            "skipped %d vision-tower / projector tensors of %s (served as a text model)",
            skipped,
            path.name,
        )
    return tensors

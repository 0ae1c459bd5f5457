"""Layer kinds: the decoder layers of a model that one compiled graph can serve.

A model's layers repeat (DeepSeek: a few dense layers, then MoE layers): the compiler
captures, lowers and AOT-compiles one :class:`~mlafx.graph.capture.LayerStep` per kind and
runs it for every layer of that kind with that layer's weights and cache. Two layers are of
one kind when everything the graph is specialised on is equal: the module tree (types and
names), every tensor's name, shape and dtype, and the tensor-parallel all-reduce. The config
is the same for every layer of a model; it goes into the package key separately.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from torch import nn

from mlafx.models.deepseek import MLAForCausalLM


@dataclass(frozen=True)
class LayerKind:
    name: str  # readable: the MLP's module type ("SwiGLU", "MoE"), numbered if repeated
    signature: str  # sha256 of the layer's structure (``layer_signature``)
    layers: tuple[int, ...]  # the model's layers of this kind, ascending


def layer_structure(layer: nn.Module) -> dict[str, object]:
    """What a layer's graph is specialised on besides the config."""
    tensors = [
        (name, tuple(t.shape), str(t.dtype))
        for name, t in (
            *layer.named_parameters(remove_duplicate=False),
            *layer.named_buffers(remove_duplicate=False),
        )
    ]
    modules = [(name, type(m).__qualname__) for name, m in layer.named_modules()]
    all_reduce = getattr(layer, "all_reduce", None)  # set on tensor-parallel shards
    all_reduce = None if all_reduce is None else str(all_reduce)
    return {"tensors": tensors, "modules": modules, "all_reduce": all_reduce}


def layer_signature(layer: nn.Module) -> str:
    facts = json.dumps(layer_structure(layer), sort_keys=True, default=str)
    return hashlib.sha256(facts.encode()).hexdigest()


def layer_kinds(model: MLAForCausalLM) -> list[LayerKind]:
    """The model's layer kinds, in the order of their first layer."""
    by_signature: dict[str, list[int]] = {}
    for index, layer in enumerate(model.model.layers):
        by_signature.setdefault(layer_signature(layer), []).append(index)
    kinds, seen = [], Counter[str]()
    for signature, layers in by_signature.items():
        base = type(model.model.layers[layers[0]].mlp).__name__
        seen[base] += 1
        name = base if seen[base] == 1 else f"{base}{seen[base]}"
        kinds.append(LayerKind(name, signature, tuple(layers)))
    return kinds


def kind_of_layers(kinds: list[LayerKind], num_layers: int) -> list[int]:
    """Index into ``kinds`` of each layer ``0 .. num_layers - 1``."""
    index = {layer: k for k, kind in enumerate(kinds) for layer in kind.layers}
    if sorted(index) != list(range(num_layers)):
        raise ValueError(f"layer kinds cover layers {sorted(index)}, not 0..{num_layers - 1}")
    return [index[layer] for layer in range(num_layers)]

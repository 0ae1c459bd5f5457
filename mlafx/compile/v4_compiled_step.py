"""DeepSeek-V4's compiled step: one AOTInductor package per layer kind, run for every layer of
that kind, as the MLA step (``compiled_step.py``) does.

    meta     = v4_sparse_metadata(step)                       (host: window, pools, tables)
    x        = embed(input_ids) copied onto hc_mult streams   (host)
    for each layer i:  x = package[kind(i)](x, input_ids, caches of layer i,
                                            v4_layer_leaves(meta, rate(i)))
                       (a ``V4LayerStep``: the decoder layer with its attention on mlafx's
                       ops, its experts on ``moe_experts*``, mHC, norms and the compressor
                       fused by inductor; captured and compiled once per kind, loaded once per
                       layer with that layer's weights)
    logits   = lm_head(norm(hc_head(x[logits_indices])))     (host, the reference modules)

A layer kind is a layer type (sliding, CSA, HCA) with an MLP type (routed or hash MoE) and
the same tensors: a 43-layer V4-Flash compiles at most six packages. Packages hold code only
(weights are handed over by ``load_constants`` and shared with the model: one copy), cached on
disk under the layer's config, structure, dtype, block size and versions, built under a lock
and renamed into place (``compiled_step.layer_package``'s rules).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from pathlib import Path

import torch

from mlafx.compile.aoti_runner import PackageRunner
from mlafx.compile.compiled_step import (
    LM_HEAD,
    LoweringError,
    build_aoti_package,
    default_cache_dir,
    layer_constants,
    load_aoti_package,
    model_constants,
    package_versions,
    release_weight,
)
from mlafx.compile.layer_kinds import LayerKind, layer_signature
from mlafx.compile.package_lock import free_first, package_lock
from mlafx.graph.capture import LAYER_PREFIX
from mlafx.graph.capture_v4 import v4_layer_leaves
from mlafx.models.deepseek_v4.engine_step import V4StepInputs
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM, caches_by_layer
from mlafx.models.deepseek_v4.step import V4StepMetadata
from mlafx.models.step import StepMetadata
from mlafx.passes.derived_constants import packed_name, with_derived_constants
from mlafx.passes.v4_pipeline import lower_v4_layer

log = logging.getLogger(__name__)


def v4_layer_kinds(model: DeepseekV4ForCausalLM) -> list[LayerKind]:
    """The model's layer kinds, in the order of their first layer, named by layer and MLP
    type (numbered if two kinds share both)."""
    cfg = model.config
    by_signature: dict[str, list[int]] = {}
    for index, layer in enumerate(model.model.layers):
        by_signature.setdefault(layer_signature(layer), []).append(index)
    kinds, seen = [], Counter[str]()
    for signature, layers in by_signature.items():
        first = layers[0]
        base = f"{cfg.layer_types[first]}+{cfg.mlp_layer_types[first]}"
        seen[base] += 1
        name = base if seen[base] == 1 else f"{base}{seen[base]}"
        kinds.append(LayerKind(name, signature, tuple(layers)))
    return kinds


def v4_package_path(
    model: DeepseekV4ForCausalLM, kind: LayerKind, block_size: int, cache_dir: Path | None = None
) -> Path:
    """Where the package of ``kind`` lives in the on-disk cache: keyed on the whole config
    (a layer's graph depends on its own type's entries, which the config lists per layer),
    the layer's structure, dtype, block size and the versions of everything that shapes it."""
    facts = {
        "family": "deepseek_v4",
        "config": model.config.to_dict(),
        "layer": kind.signature,
        "dtype": str(model.dtype),
        "block_size": block_size,
        **package_versions(),
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
    return (cache_dir or default_cache_dir()) / f"v4-layer-{key[:20]}.pt2"


def v4_layer_package(
    model: DeepseekV4ForCausalLM,
    kind: LayerKind,
    block_size: int,
    cache_dir: Path | None,
    wait: bool,
) -> Path | None:
    """The package of ``kind`` from the cache, captured and compiled first if missing; with
    ``wait=False``, None while another process holds its lock (``package_lock.free_first``)."""
    package = v4_package_path(model, kind, block_size, cache_dir)
    with package_lock(package, wait=wait) as held:
        if not held:
            return None
        if package.exists():
            return package
        start = time.perf_counter()
        log.warning(
            "compiling DeepSeek-V4 layer kind %s (layers %s, block size %d) into %s",
            kind.name,
            list(kind.layers),
            block_size,
            package,
        )
        lowering = lower_v4_layer(model, kind.layers[0], block_size)
        if lowering.verify_error is not None:
            raise LoweringError(
                f"DeepSeek-V4 layer kind {kind.name} (layers {list(kind.layers)}): "
                f"{lowering.verify_error}. Nothing was cached."
            )
        build_aoti_package(lowering.program, package)
        log.warning("  compiled in %.1f s", time.perf_counter() - start)
        return package


class CompiledV4Step(V4StepInputs):
    """The engine's step (``StepFn``) over ``model``'s compiled layers, caches paged in blocks
    of ``block_size`` tokens."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        block_size: int,
        packages: dict[int, Path],
        *,
        release_replaced_weights: bool = False,
    ) -> None:
        """``packages``: each layer's package. ``release_replaced_weights``: the model gives up
        the weights no package reads (those a packed copy replaced: they become meta tensors,
        and the model no longer runs eagerly), each as soon as its layer is loaded, so that
        one copy of every weight stays."""
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.packages = packages
        self.compile_seconds = 0.0  # set by compile_v4_step
        constants = model_constants(model)
        self.layers: list[PackageRunner] = []
        for i in range(cfg.num_hidden_layers):
            own = layer_constants(constants, i)
            runner = load_aoti_package(packages[i], own)
            self.layers.append(runner)
            if release_replaced_weights:
                for name in sorted(own.keys() - set(runner.get_constant_fqns())):
                    release_weight(model, f"model.layers.{i}.{name[len(LAYER_PREFIX) :]}")
            del own
        self.rates = [cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)]
        # the lm_head as linear_packed reads it (the embedding's own copy when tied)
        lm_head = model.lm_head.weight
        self.lm_head_packed = with_derived_constants({LM_HEAD: lm_head}, [packed_name(LM_HEAD)])[
            packed_name(LM_HEAD)
        ]
        if release_replaced_weights and not cfg.tie_word_embeddings:
            release_weight(model, LM_HEAD)
        del lm_head

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[torch.Tensor],  # ``cache_block_shapes`` order, written in place
        meta: StepMetadata,
        logits_indices: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, vocab]
        return self.run(input_ids, caches, self.v4_metadata(meta, positions), logits_indices)

    def run(
        self,
        input_ids: torch.Tensor,
        caches: list[torch.Tensor],
        v4_meta: V4StepMetadata,  # sparse
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The step on V4's own metadata (``v4_step_metadata(..., sparse=True)``), as the
        reference model's forward takes it."""
        model, cfg = self.model, self.model.config
        with torch.no_grad():
            x = model.model.embed_tokens(input_ids)
            x = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
            layers = zip(self.layers, caches_by_layer(cfg, caches), strict=True)
            for i, (runner, own) in enumerate(layers):
                leaves = v4_layer_leaves(v4_meta, self.rates[i], cfg.layer_types[i])
                (x,) = runner.run_flat([x, input_ids, *own, *leaves])
            h = model.model.norm(model.model.hc_head(x.index_select(0, logits_indices)))
            return torch.ops.mlafx.linear_packed(h, self.lm_head_packed, cfg.vocab_size, None)


def compile_v4_step(
    model: DeepseekV4ForCausalLM,
    block_size: int,
    *,
    cache_dir: Path | None = None,
    release_replaced_weights: bool = False,
) -> CompiledV4Step:
    """Compile (or load from the cache) one package per layer kind of ``model`` and load it
    for each of its layers (``release_replaced_weights``: ``CompiledV4Step``'s)."""
    start = time.perf_counter()
    model.config.cache_block_shapes(block_size)  # the block size must suit every rate
    kinds = v4_layer_kinds(model)
    built = free_first(
        len(kinds), lambda k, wait: v4_layer_package(model, kinds[k], block_size, cache_dir, wait)
    )
    packages = {
        layer: package for kind, package in zip(kinds, built, strict=True) for layer in kind.layers
    }
    step = CompiledV4Step(
        model, block_size, packages, release_replaced_weights=release_replaced_weights
    )
    step.compile_seconds = time.perf_counter() - start
    return step

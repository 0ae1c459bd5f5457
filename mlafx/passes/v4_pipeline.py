"""The passes of a DeepSeek-V4 layer (``graph/capture_v4.py``'s ``V4LayerStep``).

V4's model already calls mlafx's ops where the MLA passes would put them: attention on
``v4_attention`` (``kernels/v4_attention.py``), the indexer on
``dsa_indexer_topk``, experts on ``moe_experts*`` (the capture records them), FP8 linears on
``linear_fp8``. What is left to lower:

    lower_linears  -> mlafx.linear_packed for every linear over a graph weight (projections,
                      compressors, the indexer's query and head weights, the shared expert,
                      the router); the grouped ``o_a_proj`` splits its weight per group in the
                      graph and the mHC mixes cast theirs to float32, so those linears stay
                      ``aten.linear``
    verify         -> the lowered layer against the captured one on the sample step: output
                      and every cache write
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mlafx.graph.capture import size_oblivious
from mlafx.graph.capture_v4 import capture_v4_layer, layer_dynamic_shapes
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlafx.passes.graph_utils import copy_graph, finish
from mlafx.passes.lower_linears import lower_linears
from mlafx.passes.pipeline import Stage


@dataclass(frozen=True)
class V4Lowering:
    program: torch.export.ExportedProgram  # the lowered layer, dynamic extents
    captured: torch.fx.GraphModule
    lowered: torch.fx.GraphModule
    linears: int  # linears rewritten
    verify_error: str | None  # set: the lowered layer disagrees with the captured one
    stages: tuple[Stage, ...]  # captured, lower_linears, verify (``mlafx inspect``)


def lower_v4_layer(model: DeepseekV4ForCausalLM, index: int, block_size: int) -> V4Lowering:
    """Capture layer ``index``, lower its linears, verify, and re-export the lowered layer with
    the step's dynamic extents (the captured layer's program if verification failed)."""
    start = time.perf_counter()
    program, args = capture_v4_layer(model, index, block_size)
    captured = program.module()
    stages = [Stage("captured", captured, time.perf_counter() - start)]
    start = time.perf_counter()
    lowered = copy_graph(captured)
    linears = lower_linears(lowered)
    finish(lowered)
    stages.append(Stage("lower_linears", lowered, time.perf_counter() - start, linears))
    start = time.perf_counter()
    error = verify_error(captured, lowered, args)
    if error is None:
        dynamic = layer_dynamic_shapes(model.config, index)
        with size_oblivious(), torch.no_grad():
            program = torch.export.export(lowered, args, dynamic_shapes=dynamic, strict=False)
    stages.append(Stage("verify", captured if error else lowered, time.perf_counter() - start))
    return V4Lowering(program, captured, lowered, linears, error, tuple(stages))


def verify_error(captured: torch.nn.Module, lowered: torch.nn.Module, args: tuple) -> str | None:
    """How the two layers' outputs and cache writes on ``args`` (fresh copies of the caches
    each) differ beyond the dtype's rounding of a reordered sum; None if they agree."""
    x, input_ids, caches, leaves = args
    results = []
    for graph in (captured, lowered):
        own = [c.clone() for c in caches]
        with torch.no_grad():
            results.append((graph(x, input_ids, own, leaves), own))
    tol = 1e-4 if x.dtype == torch.float32 else 5e-2
    (want_out, want_caches), (got_out, got_caches) = results
    pairs = [("output", want_out, got_out)]
    pairs += [
        (f"cache {i}", a, b) for i, (a, b) in enumerate(zip(want_caches, got_caches, strict=True))
    ]
    for name, want, got in pairs:
        scale = max(float(want.float().abs().max()), 1.0)
        err = float((want.float() - got.float()).abs().max())
        if not err <= tol * scale:  # NaN fails too
            return (
                f"the lowered layer's {name} differs from the captured one by {err:.3g} "
                f"(tolerance {tol * scale:.3g})"
            )
    return None

"""The pass pipeline: one explicit, ordered list (no registration by import).

    find_mla_attention  -> MLASite records (and logged refusals)
    lower_attention     -> per site: write_latent_cache; mla_attention_paged for the
                           absorbed rows; varlen_attention + mla_attention_paged (context)
                           + merge_attn_states for the split rows (absorb_weights: the
                           absorbed W_UK / W_UV^T, contiguous derived constants of
                           kv_b_proj.weight); a DSA site: mla_attention_sparse for every row
    lower_linears       -> mlafx.linear_packed for every linear over a graph weight
                           (packed copies as new constants ``<weight>_packed``, which
                           replace the weights they are derived from)
    verify              -> numeric check against the captured graph on a sample step whose
                           rows take both paths; a mismatch keeps the captured graph and
                           reports why (compiling it is then an error)
Each rewriting pass ends with the one shared clean-up (``graph_utils.finish``: dead-code
elimination, lint, recompile). Each stage's graph is kept (for ``mlafx inspect``) with its op
histogram and time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from mlafx.passes.find_mla_attention import find_mla_sites
from mlafx.passes.graph_utils import copy_graph, finish
from mlafx.passes.lower_attention import lower_attention
from mlafx.passes.lower_linears import lower_linears
from mlafx.passes.mla_site import MLASite, Refusal, SiteLowering
from mlafx.passes.verify import (
    Sample,
    VerificationError,
    VerifyReport,
    random_caches,
    verify_rewrite,
)

log = logging.getLogger(__name__)


# Sources of those layers that never shape the step graph (weight loading, the host's path
# rule, reports).
_NOT_IN_GRAPH = {
    "models/weights.py",
    "models/loader.py",
    "models/safetensors_file.py",  # reads bytes; the modules it fills are keyed
    "models/attention_path.py",
    "passes/report.py",
    "passes/report_html.py",
}


def lowering_source_sha256() -> str:
    """sha256 of the Python sources that decide the lowered step graph: the model
    (``models/``), its capture (``graph/``) and these passes. Compiled packages are keyed on
    it, so changing any of them never loads a stale package."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for layer in ("models", "graph", "passes"):
        for path in sorted((package / layer).glob("*.py")):
            if f"{layer}/{path.name}" in _NOT_IN_GRAPH:
                continue
            digest.update(f"{layer}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def op_histogram(gm: fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@dataclass
class Stage:
    name: str
    graph: fx.GraphModule
    seconds: float
    rewrites: int = 0

    @property
    def ops(self) -> Counter[str]:
        return op_histogram(self.graph)


@dataclass
class LoweringResult:
    graph: fx.GraphModule  # the final graph (the captured one if verification failed)
    sites: list[MLASite]
    refusals: list[Refusal]
    lowerings: list[SiteLowering]  # what each site was lowered to (before verification)
    stages: list[Stage] = field(default_factory=list)
    verify: VerifyReport | None = None
    verify_error: str | None = None


def lower_step_graph(
    captured: fx.GraphModule,
    sample: Sample,
    sample_caches: list[torch.Tensor],
    capture_seconds: float = 0.0,
) -> LoweringResult:
    """Lower a captured graph (the whole step, or one layer: ``sample`` says which inputs it
    takes), then verify it. A rejected rewrite is reported (``verify_error``), not raised:
    whoever compiles must refuse it (``compile.compiled_step``), ``mlafx inspect`` shows it."""
    stages = [Stage("captured", captured, capture_seconds)]
    gm = copy_graph(captured)

    start = time.perf_counter()
    sites, refusals = find_mla_sites(gm)
    seconds = time.perf_counter() - start
    stages.append(Stage("find_mla_attention", copy_graph(gm), seconds))

    start = time.perf_counter()
    lowerings = lower_attention(gm, sites)
    finish(gm)
    seconds = time.perf_counter() - start
    stages.append(Stage("lower_attention", copy_graph(gm), seconds, len(lowerings)))

    start = time.perf_counter()
    linears = lower_linears(gm)
    finish(gm)
    stages.append(Stage("lower_linears", gm, time.perf_counter() - start, linears))

    start = time.perf_counter()
    result = LoweringResult(gm, sites, refusals, lowerings, stages)
    try:
        result.verify = verify_rewrite(captured, gm, sample, random_caches(sample_caches))
    except VerificationError as error:
        log.warning("verify: rewrite rejected, keeping the captured graph: %s", error)
        result.graph, result.verify_error = captured, str(error)
    stages.append(Stage("verify", result.graph, time.perf_counter() - start))
    return result

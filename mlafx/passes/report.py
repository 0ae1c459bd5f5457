"""A lowering's stages as plain data: what ``mlafx inspect`` prints, as text or JSON."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mlafx.passes.pipeline import LoweringResult, Stage
from mlafx.passes.v4_pipeline import V4Lowering


def op_diff(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """Ops whose count changed between two stages: op -> after minus before."""
    return {
        op: after[op] - before[op]
        for op in sorted(set(before) | set(after))
        if after[op] != before[op]
    }


def stage_report(stage: Stage, previous: Stage | None, with_graph: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "name": stage.name,
        "seconds": round(stage.seconds, 4),
        "rewrites": stage.rewrites,
        "num_nodes": len(stage.graph.graph.nodes),
        "ops": dict(sorted(stage.ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "diff_from_previous": op_diff(previous.ops, stage.ops) if previous else {},
    }
    if with_graph:
        report["graph"] = stage.graph.code
    return report


def site_lowering(result: LoweringResult, layer: int) -> dict[str, Any]:
    """The ops a site runs per attention path (empty when the rewrite was rejected)."""
    if result.verify_error:
        return {"lowered_to": [], "paths": {}}
    lowering = next(lo for lo in result.lowerings if lo.layer == layer)
    ops = lowering.cache_write + lowering.absorbed + lowering.split
    return {
        "lowered_to": list(dict.fromkeys(ops)),  # every custom op, once, in graph order
        "paths": {
            "cache_write": list(lowering.cache_write),
            "absorbed": list(lowering.absorbed),
            "split": list(lowering.split),
        },
    }


def lowering_report(result: LoweringResult, *, with_graphs: bool = False) -> dict[str, Any]:
    stages = result.stages
    return {
        "sites": [
            {
                "layer": s.layer,
                "anchor": s.sdpa.name,
                "cache_input": s.cache.name,
                "kv_b_proj_weight": str(s.kv_b_weight.target),
                "heads": s.num_heads,
                "kv_lora_rank": s.kv_lora_rank,
                "qk_rope_head_dim": s.qk_rope_head_dim,
                "qk_nope_head_dim": s.qk_nope_head_dim,
                "v_head_dim": s.v_head_dim,
                "scale": s.scale,
                **site_lowering(result, s.layer),
            }
            for s in result.sites
        ],
        "refused": [{"anchor": r.anchor, "reason": r.reason} for r in result.refusals],
        "verify": (
            {"ok": False, "error": result.verify_error}
            if result.verify_error
            else {
                "ok": True,
                "max_abs_output_diff": result.verify.max_abs_output_diff,
                "sample_coverage": result.verify.coverage,
            }
            if result.verify
            else None
        ),
        "stages": [
            stage_report(stage, stages[i - 1] if i else None, with_graphs)
            for i, stage in enumerate(stages)
        ],
    }


def describe_paths(site: dict[str, Any]) -> str:
    """One line: the cache write and the ops of each attention path."""
    paths = site["paths"]
    if not paths:
        return "not lowered"
    return (
        f"{' + '.join(paths['cache_write'])}; absorbed rows: {' + '.join(paths['absorbed'])}; "
        f"split rows: {' + '.join(paths['split'])}"
    )


def format_text(report: dict[str, Any], stage: str | None = None) -> str:
    lines = []
    for entry in report["stages"]:
        if stage and entry["name"] != stage:
            continue
        lines.append(
            f"== stage {entry['name']}: {entry['num_nodes']} nodes, "
            f"{entry['rewrites']} rewrite(s), {entry['seconds'] * 1e3:.1f} ms"
        )
        top = ", ".join(f"{op} x{n}" for op, n in list(entry["ops"].items())[:12])
        lines.append(f"   ops: {top}")
        if entry["diff_from_previous"]:
            diff = ", ".join(f"{op} {n:+d}" for op, n in entry["diff_from_previous"].items())
            lines.append(f"   diff: {diff}")
        if "graph" in entry:
            lines.append(entry["graph"])
    for site in report["sites"]:
        lines.append(
            f"site layer {site['layer']}: {site['anchor']} (H={site['heads']}, "
            f"Lkv={site['kv_lora_rank']}, R={site['qk_rope_head_dim']}) -> {describe_paths(site)}"
        )
    for refusal in report["refused"]:
        lines.append(f"refused {refusal['anchor']}: {refusal['reason']}")
    if report["verify"] is not None:
        lines.append(f"verify: {report['verify']}")
    return "\n".join(lines)


def v4_lowering_report(
    kinds: list[tuple[str, tuple[int, ...], V4Lowering]], *, with_graphs: bool = False
) -> dict[str, Any]:
    """DeepSeek-V4's lowering, one entry per layer kind ``(name, layers, lowering)``: the
    mlafx ops its layer runs, and its stages named ``<kind>: <stage>`` (what ``format_text``
    and the HTML report show; V4 has no MLA sites)."""
    stages: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    for name, layers, lowering in kinds:
        own = lowering.stages
        stages += [
            {
                **stage_report(st, own[i - 1] if i else None, with_graphs),
                "name": f"{name}: {st.name}",
            }
            for i, st in enumerate(own)
        ]
        ops = own[-1].ops
        entries.append(
            {
                "name": name,
                "layers": list(layers),
                "linears_lowered": lowering.linears,
                "mlafx_ops": {op: n for op, n in sorted(ops.items()) if op.startswith("mlafx.")},
                "verify": {"ok": lowering.verify_error is None, "error": lowering.verify_error},
            }
        )
    errors = {name: lo.verify_error for name, _, lo in kinds if lo.verify_error is not None}
    return {
        "layer_kinds": entries,
        "sites": [],
        "refused": [],
        "verify": {"ok": not errors, **({"errors": errors} if errors else {})},
        "stages": stages,
    }


def format_v4_text(report: dict[str, Any], stage: str | None = None) -> str:
    """Each layer kind's ops, then ``format_text``'s stages (``stage``: those whose name ends
    with it) and the verdict."""
    lines = []
    for kind in report["layer_kinds"]:
        ops = ", ".join(f"{op} x{n}" for op, n in kind["mlafx_ops"].items())
        lines.append(
            f"layer kind {kind['name']} (layers {kind['layers']}): "
            f"{kind['linears_lowered']} linear(s) -> mlafx.linear_packed; runs {ops}"
        )
    chosen = dict(report)
    if stage:
        chosen["stages"] = [s for s in report["stages"] if s["name"].endswith(f": {stage}")]
    return "\n".join([*lines, format_text(chosen)])

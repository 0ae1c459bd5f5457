"""The layers of DESIGN.md import downwards only: config -> models -> graph -> passes ->
kernels -> compile -> runtime / export -> serve. A module may import its own layer and those
listed as below it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlafx"
# layer -> the mlafx layers it may import
ALLOWED = {
    "config": set(),
    "kernels": set(),
    "models": {"config", "kernels"},
    "graph": {"config", "models", "kernels"},
    "passes": {"config", "models", "graph", "kernels"},
    # the compiler: capture -> passes -> AOTInductor packages (engine, ranks and artifacts)
    "compile": {"config", "models", "graph", "passes", "kernels"},
    # runtime runs the compiled step that export/ packages (one code path for both)
    "runtime": {"config", "models", "graph", "passes", "kernels", "compile", "export", "parallel"},
    # tensor-parallel ranks: shard models, run the (compiled) step per rank
    "parallel": {"config", "models", "graph", "passes", "kernels", "compile", "export"},
    "export": {"config", "models", "graph", "passes", "kernels", "compile"},
    # the HTTP server sits on top: it drives runtime's LLM; no layer imports it
    "serve": {
        "config",
        "models",
        "graph",
        "passes",
        "kernels",
        "compile",
        "runtime",
        "export",
        "parallel",
    },
}


def imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mlafx" and len(parts) > 1:
                layers.add(parts[1])
    return layers


def test_no_layer_imports_upwards():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            bad = imported_layers(path) - allowed - {layer}
            if bad:
                violations.append(f"{path.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)

"""``mlafx inspect --html``: one self-contained HTML file (inline CSS and SVG, no scripts
or network), one section per stage: op histogram, op diff, the graph drawn by graphviz and
as text; then the matched sites and the refused candidates."""

from __future__ import annotations

import html
import shutil
import subprocess
from typing import Any

from torch import fx

from mlafx.passes.report import describe_paths

_CSS = """
body{font-family:sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px}
.plus{color:#070}.minus{color:#a00}pre{background:#f6f6f6;padding:.5em;overflow:auto;
max-height:30em}details{margin:.5em 0}.svg{overflow:auto;max-height:40em;border:1px solid #ddd}
"""


def graph_dot(gm: fx.GraphModule) -> str:
    """A DOT drawing of the graph: one box per node, labelled with its op."""
    lines = ["digraph G {", "rankdir=TB; node [shape=box, fontsize=10];"]
    for node in gm.graph.nodes:
        label = node.name if node.op in ("placeholder", "output", "get_attr") else str(node.target)
        color = (
            "lightblue"
            if "mlafx" in label
            else ("salmon" if "scaled_dot_product" in label or "index_copy" in label else "white")
        )
        lines.append(
            f'"{node.name}" [label="{html.escape(label)}", style=filled, fillcolor={color}];'
        )
        for arg in node.all_input_nodes:
            lines.append(f'"{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def graph_svg(gm: fx.GraphModule) -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("drawing graphs needs graphviz's `dot` (apt-get install graphviz)")
    result = subprocess.run(
        [dot, "-Tsvg"],
        input=graph_dot(gm),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    svg = result.stdout
    return svg[svg.index("<svg") :]  # drop the XML prologue: the SVG is inlined


def render_html(report: dict[str, Any], svgs: dict[str, str], title: str) -> str:
    out = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    out.append(
        "<h2>Matched MLA sites</h2><table><tr><th>layer</th><th>anchor</th><th>H</th>"
        "<th>Lkv</th><th>R</th><th>P</th><th>V</th><th>lowered to</th></tr>"
    )
    for s in report["sites"]:
        out.append(
            f"<tr><td>{s['layer']}</td><td>{s['anchor']}</td><td>{s['heads']}</td>"
            f"<td>{s['kv_lora_rank']}</td><td>{s['qk_rope_head_dim']}</td>"
            f"<td>{s['qk_nope_head_dim']}</td><td>{s['v_head_dim']}</td>"
            f"<td>{html.escape(describe_paths(s))}</td></tr>"
        )
    out.append("</table><h2>Refused candidates</h2><ul>")
    out += [
        f"<li>{html.escape(r['anchor'])}: {html.escape(r['reason'])}</li>"
        for r in report["refused"]
    ] or ["<li>none</li>"]
    out.append(f"</ul><p>verify: {html.escape(str(report['verify']))}</p>")
    for stage in report["stages"]:
        name = stage["name"]
        out.append(
            f"<section class='stage' id='stage-{name}'><h2>Stage {html.escape(name)}</h2>"
            f"<p>{stage['num_nodes']} nodes, {stage['rewrites']} rewrite(s), "
            f"{stage['seconds'] * 1e3:.1f} ms</p>"
        )
        if stage["diff_from_previous"]:
            out.append("<h3>Op diff from the previous stage</h3><table>")
            for op, n in stage["diff_from_previous"].items():
                cls = "plus" if n > 0 else "minus"
                out.append(f"<tr><td>{html.escape(op)}</td><td class='{cls}'>{n:+d}</td></tr>")
            out.append("</table>")
        out.append("<details><summary>Op histogram</summary><table>")
        out += [
            f"<tr><td>{html.escape(op)}</td><td>{n}</td></tr>" for op, n in stage["ops"].items()
        ]
        out.append("</table></details>")
        if name in svgs:
            out.append(
                f"<details><summary>Graph drawing</summary><div class='svg'>{svgs[name]}"
                "</div></details>"
            )
        if "graph" in stage:
            out.append(
                f"<details><summary>Graph code</summary><pre>{html.escape(stage['graph'])}"
                "</pre></details>"
            )
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out)

"""PNG plots of the result rows (matplotlib, Agg backend): decode throughput against context
length and against batch size, and prefill throughput against prompt length."""

from __future__ import annotations

from pathlib import Path

from bench.e2e.report import LABELS, Row

# one colour per engine in every panel
COLORS = {
    "mlafx": "C0",
    "mlafx_reference": "C1",
    "hf_eager": "C2",
    "hf_compile": "C3",
    "mlafx_invariant": "C4",
}


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[Row], phase: str, fixed: str, fixed_value: int, axis: str):  # type: ignore[no-untyped-def]
    """backend -> sorted [(axis value, tokens/s)] among rows whose ``fixed`` key matches."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["phase"] == phase and row[fixed] == fixed_value and "error" not in row:
            out.setdefault(row["backend"], []).append((row[axis], row["tokens_per_s"]))
    return {k: sorted(v) for k, v in out.items() if v}


def _draw(ax, series, xlabel: str, title: str) -> None:  # type: ignore[no-untyped-def]
    for backend, points in series.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=LABELS[backend], color=COLORS[backend])
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def draw_plots(rows: list[Row], out_dir: Path, target: tuple[int, int], title: str) -> list[Path]:
    """Write the PNGs into ``out_dir``; returns their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    batch, length = target
    batches = sorted({r["batch"] for r in rows if r["phase"] == "decode"})
    written = []
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        series = _series(rows, "decode", "batch", b, "length")
        floors = [r["floor_ms"] for r in rows if "floor_ms" in r and r["batch"] == b]
        if floors:  # the throughput a step reading only the weights would reach
            ax.axhline(b / floors[0] * 1e3, color="gray", ls="--", label="weight-read bound")
        _draw(ax, series, "context (tokens)", f"decode, batch {b}")
    fig.suptitle(f"{title}: decode throughput vs context")
    fig.tight_layout()
    written.append(out_dir / "e2e_decode_vs_context.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    panels = [
        (
            _series(rows, "decode", "length", length, "batch"),
            "batch size",
            f"decode vs batch, context {length}",
        ),
        (
            _series(rows, "prefill", "batch", 1, "length"),
            "prompt length (tokens)",
            "prefill vs prompt length, batch 1",
        ),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (series, xlabel, name) in zip(axes, panels, strict=True):
        _draw(ax, series, xlabel, name)
    fig.suptitle(title)
    fig.tight_layout()
    written.append(out_dir / "e2e_batch_and_prefill.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written

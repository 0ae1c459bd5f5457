"""Constants a lowered graph derives from a checkpoint weight: made by a pass, never stored in
a checkpoint or an artifact, and derived again by whoever loads the compiled graph.

Each lives next to its source weight (same module) under a name that says how to derive it:

- ``<w>_packed``: ``pack_linear_weight(w)`` (``lower_linears``: the layout every lowered
  linear reads, which replaces ``w`` in the step: ``mlafx::unpack_linear_weight`` inverts it).
- ``<w>_uk_h<H>_p<P>``: ``w.view(H, P + V, Lkv)[:, :P]`` as a contiguous ``[H, P, Lkv]``
  (``absorb_weights``: ``W_UK`` of ``kv_b_proj``).
- ``<w>_uvt_h<H>_p<P>``: ``w.view(H, P + V, Lkv)[:, P:]`` transposed to a contiguous
  ``[H, Lkv, V]`` (``W_UV^T``).

The absorbed weights are copies rather than views so that the absorbed attention's two
batched products read them in the layout they want: views made inductor copy them into that
layout on every step (about 2 ms a decode step on the embedded default). They cost one more
``kv_b_proj`` per layer in memory.
"""

from __future__ import annotations

import re

import torch
from torch import fx

from mlafx.kernels.gemm_ops import pack_linear_weight

_NAME = re.compile(
    r"^(?P<source>.+)_(?:(?P<packed>packed)|(?P<kind>uk|uvt)_h(?P<h>\d+)_p(?P<p>\d+))$"
)


def packed_name(weight_name: str) -> str:
    return f"{weight_name}_packed"


def absorbed_names(weight_name: str, num_heads: int, nope_dim: int) -> tuple[str, str]:
    """Names of ``W_UK`` and ``W_UV^T`` derived from ``kv_b_proj`` weight ``weight_name``."""
    dims = f"h{num_heads}_p{nope_dim}"
    return f"{weight_name}_uk_{dims}", f"{weight_name}_uvt_{dims}"


def source_of(name: str) -> str | None:
    """The weight a derived constant comes from, or None when ``name`` is not one."""
    match = _NAME.match(name)
    return match["source"] if match else None


def derive(name: str, source: torch.Tensor) -> torch.Tensor:
    """The derived constant ``name`` computed from its source weight."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not the name of a derived constant")
    with torch.no_grad():
        if match["packed"]:
            return pack_linear_weight(source)
        heads, nope = int(match["h"]), int(match["p"])
        rows, lkv = source.shape
        if rows % heads != 0 or rows // heads <= nope:
            raise ValueError(f"{name!r} does not fit a kv_b_proj weight of shape {(rows, lkv)}")
        per_head = source.view(heads, rows // heads, lkv)
        if match["kind"] == "uk":
            return per_head[:, :nope].contiguous()
        return per_head[:, nope:].transpose(1, 2).contiguous()


def derived_attr(gm: fx.GraphModule, name: str) -> fx.Node:
    """A ``get_attr`` node (inserted at the graph's current insertion point) for derived
    constant ``name``, registered on ``gm`` as a non-persistent buffer the first time."""
    owner_path, _, attr = name.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if not hasattr(owner, attr):
        source = source_of(name)
        assert source is not None, name
        source_attr = source.rpartition(".")[2]
        owner.register_buffer(attr, derive(name, getattr(owner, source_attr).detach()),
                              persistent=False)  # fmt: skip
    return gm.graph.get_attr(name)


def with_derived_constants(
    constants: dict[str, torch.Tensor], wanted: list[str]
) -> dict[str, torch.Tensor]:
    """``constants`` plus the derived constants among ``wanted`` that it lacks, derived now
    from their source weights."""
    derived = {}
    for name in wanted:
        source = source_of(name)
        if name not in constants and source in constants:
            derived[name] = derive(name, constants[source])
    return {**constants, **derived} if derived else constants

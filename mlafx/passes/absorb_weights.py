"""Absorb ``kv_b_proj`` into the query and the output: ``W_UK``/``W_UV`` as views.

Pattern: a site's ``kv_b_proj.weight`` [H*(P+V), Lkv] (a graph constant).
Replacement: two view nodes inserted before the site's anchor,
    W_UK = weight.view(H, P+V, Lkv)[:, :P, :]   [H, P, Lkv]
    W_UV = weight.view(H, P+V, Lkv)[:, P:, :]   [H, V, Lkv]
Requires: ``MLASite`` records from ``find_mla_attention``.
Ensures: no new constants (views of the checkpoint tensor, never copies); the views are
unused until ``lower_attention`` consumes them (dead-code elimination would drop them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from mlafx.passes.mla_site import MLASite

aten = torch.ops.aten


@dataclass(frozen=True)
class AbsorbedWeights:
    w_uk: fx.Node  # [H, P, Lkv]
    w_uv: fx.Node  # [H, V, Lkv]


def absorb_weights(gm: fx.GraphModule, site: MLASite) -> AbsorbedWeights:
    h, p, v, lkv = site.num_heads, site.qk_nope_head_dim, site.v_head_dim, site.kv_lora_rank
    graph = gm.graph
    with graph.inserting_before(site.sdpa):
        per_head = graph.call_function(aten.view.default, (site.kv_b_weight, [h, p + v, lkv]))
        w_uk = graph.call_function(aten.slice.Tensor, (per_head, 1, 0, p))
        w_uv = graph.call_function(aten.slice.Tensor, (per_head, 1, p, p + v))
    return AbsorbedWeights(w_uk=w_uk, w_uv=w_uv)

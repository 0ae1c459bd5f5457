"""Absorb ``kv_b_proj`` into the query and the output: ``W_UK`` and ``W_UV^T`` as constants.

Pattern: a site's ``kv_b_proj.weight`` [H*(P+V), Lkv] (a graph constant).
Replacement: two ``get_attr`` nodes inserted before the site's anchor, for derived constants
(``passes/derived_constants.py``) next to the weight:
    W_UK   = weight.view(H, P+V, Lkv)[:, :P, :]                  [H, P, Lkv]
    W_UV^T = weight.view(H, P+V, Lkv)[:, P:, :].transpose(1, 2)  [H, Lkv, V]
each contiguous, the layouts the absorbed attention's batched products read.
Requires: ``MLASite`` records from ``find_mla_attention``.
Ensures: the constants are derived, never checkpoint weights (loaders derive them again);
sites sharing a weight share them; the nodes are unused until ``lower_attention`` consumes
them (dead-code elimination would drop them).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from mlafx.passes.derived_constants import absorbed_names, derived_attr
from mlafx.passes.mla_site import MLASite


@dataclass(frozen=True)
class AbsorbedWeights:
    w_uk: fx.Node  # [H, P, Lkv]
    w_uv_t: fx.Node  # [H, Lkv, V]


def absorb_weights(gm: fx.GraphModule, site: MLASite) -> AbsorbedWeights:
    uk_name, uvt_name = absorbed_names(
        site.kv_b_weight.target, site.num_heads, site.qk_nope_head_dim
    )
    with gm.graph.inserting_before(site.sdpa):
        return AbsorbedWeights(w_uk=derived_attr(gm, uk_name), w_uv_t=derived_attr(gm, uvt_name))

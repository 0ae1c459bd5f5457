"""Lower each matched MLA site to the paged latent-cache kernels (absorbed, one pass).

Pattern: an ``MLASite`` (naive write, gather, decompression and masked SDPA).
Replacement, with ``W_UK``/``W_UV`` from ``absorb_weights``:
    mlafx.write_latent_cache(kv_c, k_pe, cache, slot_mapping)
    q_lat = [bmm(q_nope^T, W_UK)^T | q_pe]                           [T, H, Lkv+R]
    out_lat, lse = mlafx.mla_attention_paged(q_lat, cache, block_table, kv_lens,
                                             query_start_loc, positions, scale, Lkv)
    out = bmm(out_lat^T, W_UV^T)^T .reshape(T, H*V)                 (feeds o_proj)
The kernel's visibility rule (query at position p of sequence b sees cache positions
``j < min(kv_lens[b], p+1)``) is the step's mask for every row: decodes, fresh prefills and
prefill rows with context alike, so one absorbed pass is exact for any step.
Requires: sites from ``find_mla_attention``; the step inputs ``positions``,
``meta_block_table``, ``meta_kv_lens``, ``meta_query_start_loc`` as placeholders.
Ensures: per site exactly one ``write_latent_cache`` and one ``mla_attention_paged``; the
anchors (SDPA, ``index_copy_``, the gather) are erased explicitly — dead-code elimination
keeps in-place and attention nodes alive.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

import mlafx.kernels  # noqa: F401  (registers the mlafx ops and their fakes)
from mlafx.passes.absorb_weights import absorb_weights
from mlafx.passes.mla_site import MLASite

log = logging.getLogger(__name__)
aten = torch.ops.aten
STEP_INPUTS = ("positions", "meta_block_table", "meta_kv_lens", "meta_query_start_loc")


def step_placeholders(gm: fx.GraphModule) -> dict[str, fx.Node]:
    found = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in STEP_INPUTS}
    missing = sorted(set(STEP_INPUTS) - set(found))
    if missing:
        raise ValueError(f"lower_attention: the step graph has no input(s) {missing}")
    return found


def lower_site(gm: fx.GraphModule, site: MLASite, inputs: dict[str, fx.Node]) -> None:
    graph = gm.graph
    weights = absorb_weights(gm, site)
    call = graph.call_function
    with graph.inserting_before(site.sdpa):
        call(
            torch.ops.mlafx.write_latent_cache.default,
            (site.kv_c, site.k_pe, site.cache, site.slot_mapping),
        )
        q_heads = call(aten.transpose.int, (site.q_nope, 0, 1))  # [H, T, P]
        q_lat = call(aten.bmm.default, (q_heads, weights.w_uk))  # [H, T, Lkv]
        q_lat = call(aten.transpose.int, (q_lat, 0, 1))  # [T, H, Lkv]
        query = call(aten.cat.default, ([q_lat, site.q_pe], -1))  # [T, H, Lkv+R]
        attn = call(
            torch.ops.mlafx.mla_attention_paged.default,
            (
                query,
                site.cache,
                inputs["meta_block_table"],
                inputs["meta_kv_lens"],
                inputs["meta_query_start_loc"],
                inputs["positions"],
                site.scale,
                site.kv_lora_rank,
            ),
        )
        out_lat = call(operator.getitem, (attn, 0))  # [T, H, Lkv]
        out_heads = call(aten.transpose.int, (out_lat, 0, 1))  # [H, T, Lkv]
        w_uv_t = call(aten.transpose.int, (weights.w_uv, 1, 2))  # [H, Lkv, V]
        out = call(aten.bmm.default, (out_heads, w_uv_t))  # [H, T, V]
        out = call(aten.transpose.int, (out, 0, 1))  # [T, H, V]
        # a contiguous copy, then a view: reshaping the strided tensor would make export
        # specialise on T != 1
        out = call(aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
        num_tokens = call(aten.sym_size.int, (site.q_nope, 0))
        out = call(aten.view.default, (out, [num_tokens, site.num_heads * site.v_head_dim]))
    site.output.replace_all_uses_with(out)
    # The anchors first (their users are gone now), then what only they used.
    for node in _dead_after(site):
        graph.erase_node(node)


def _dead_after(site: MLASite) -> list[fx.Node]:
    """Nodes from the output back to the write that nothing else uses, users first."""
    order: list[fx.Node] = []
    frontier = [site.output]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        order.append(node)
        if node is site.cache_write:
            continue  # stop at the write: the new rows' producers stay (the op reads them)
        frontier.extend(a for a in node.all_input_nodes)
    keep = {site.kv_c, site.k_pe, site.q_nope, site.q_pe, site.slot_mapping, site.mask}
    candidates = [n for n in order if n not in keep]
    # export's dtype/layout assertions hang off the values they check: they go with them
    candidates += [
        user
        for node in candidates
        for user in node.users
        if user.target is aten._assert_tensor_metadata.default
    ]
    dead: list[fx.Node] = []
    removed: set[fx.Node] = set()
    changed = True
    while changed:  # erase in an order where each node's users are already gone
        changed = False
        for node in candidates:
            if node not in removed and all(u in removed for u in node.users):
                dead.append(node)
                removed.add(node)
                changed = True
    return dead


def lower_attention(gm: fx.GraphModule, sites: list[MLASite]) -> int:
    inputs = step_placeholders(gm) if sites else {}
    for site in sites:
        lower_site(gm, site, inputs)
    log.info(
        "lower_attention: lowered %d site(s) to write_latent_cache + mla_attention_paged",
        len(sites),
    )
    return len(sites)

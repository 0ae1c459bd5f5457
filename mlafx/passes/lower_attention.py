"""Lower each matched MLA site to the latent-cache kernels, on the path the host chose per row.

Pattern: an ``MLASite`` (naive write, gather, decompression and masked SDPA).
Replacement, with ``W_UK``/``W_UV`` from ``absorb_weights`` and the host's sub-batches
(``StepMetadata``: ``absorbed_*``, ``split_*``, ``context_*``); fragments in
``attention_subgraphs.py``:
    mlafx.write_latent_cache(kv_c, k_pe, cache, slot_mapping)
    absorbed rows a = absorbed_token_index:
        out_a = W_UV . mla_attention_paged([q_nope[a] W_UK | q_pe[a]], cache,
                    absorbed_block_table, absorbed_kv_lens, absorbed_query_start_loc,
                    positions[a])                                        [TA, H, V]
    split rows s = split_token_index:
        k_nope | v = kv_b_proj(kv_c[s]);  suffix, lse_s = varlen_attention(
                    [q_nope[s] | q_pe[s]], k_nope, k_pe[s], v, split_cu_seqlens, causal)
        rows with context c = context_split_rows (into the split rows):
        ctx, lse_c = W_UV . mla_attention_paged(absorbed q of s[c], cache,
                    context_block_table, context_lens, context_query_start_loc,
                    positions[s][c])                                     [TC, H, V]
        out_s = suffix with rows c replaced by merge_attn_states(ctx, lse_c,
                    suffix[c], lse_s[:, c])                              [TS, H, V]
    out = zeros[T, H, V].index_copy(a, out_a).index_copy(s, out_s).view(T, H*V)  (o_proj)
Both paths are exact: the paged kernel's rule (query at position p of sequence b sees
``j < min(kv_lens[b], p+1)``) is the step's mask with ``kv_lens`` = all rows, or, with
``kv_lens`` = the context length, exactly the context; the causal varlen pass covers the
new rows; the merge adds the two halves by their log-sum-exps. Sub-batches of any size,
0 included, run the same graph (no ``.item()``, no loop over sequences).
Requires: sites from ``find_mla_attention``; the step inputs ``positions`` and the
``meta_*`` sub-batch fields above as placeholders.
A DSA site (``MLASite.selected``: the mask restricts each query to an indexer's selection)
runs every row through one pass instead, as the selection is per query:
    out = W_UV . mla_attention_sparse([q_nope W_UK | q_pe], cache, block_table, kv_lens,
                    query_start_loc, selected)                           [T, H, V]
Ensures: per dense site exactly one ``write_latent_cache``, two ``mla_attention_paged``
(absorbed rows; context half), one ``varlen_attention`` and one ``merge_attn_states``; per DSA
site one ``write_latent_cache`` and one ``mla_attention_sparse``; the anchors
(SDPA, ``index_copy_``, the gather) are erased explicitly — dead-code elimination keeps
in-place and attention nodes alive.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from mlafx.passes.absorb_weights import absorb_weights
from mlafx.passes.attention_subgraphs import (
    Emitter,
    absorbed_attention,
    decompressed_suffix,
    merged_with_context,
    sparse_attention,
)
from mlafx.passes.mla_site import MLASite, SiteLowering

log = logging.getLogger(__name__)
aten = torch.ops.aten
STEP_INPUTS = (
    "positions",
    "meta_block_table",
    "meta_kv_lens",
    "meta_query_start_loc",
    "meta_absorbed_token_index",
    "meta_absorbed_block_table",
    "meta_absorbed_kv_lens",
    "meta_absorbed_query_start_loc",
    "meta_split_token_index",
    "meta_split_cu_seqlens",
    "meta_context_split_rows",
    "meta_context_block_table",
    "meta_context_lens",
    "meta_context_query_start_loc",
)


def step_placeholders(gm: fx.GraphModule) -> dict[str, fx.Node]:
    found = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in STEP_INPUTS}
    missing = sorted(set(STEP_INPUTS) - set(found))
    if missing:
        raise ValueError(f"lower_attention: the step graph has no input(s) {missing}")
    return found


def _custom_ops_since(graph: fx.Graph, before: set[fx.Node]) -> tuple[str, ...]:
    """The ``mlafx::`` ops among the nodes added since ``before``, in graph order."""
    return tuple(
        str(n.target).removesuffix(".default").replace("mlafx.", "mlafx::", 1)
        for n in graph.nodes
        if n not in before and n.op == "call_function" and str(n.target).startswith("mlafx.")
    )


def lower_site(gm: fx.GraphModule, site: MLASite, inputs: dict[str, fx.Node]) -> SiteLowering:
    graph = gm.graph
    emit = Emitter(graph, site, absorb_weights(gm, site))
    with graph.inserting_before(site.sdpa):
        seen = set(graph.nodes)
        emit(
            torch.ops.mlafx.write_latent_cache.default,
            site.kv_c,
            site.k_pe,
            site.cache,
            site.slot_mapping,
        )
        cache_write, seen = _custom_ops_since(graph, seen), set(graph.nodes)
        if site.selected is not None:
            out = _sparse_site(emit, site, inputs)
            site.output.replace_all_uses_with(out)
            for node in _dead_after(site):
                graph.erase_node(node)
            return SiteLowering(site.layer, cache_write, _custom_ops_since(graph, seen), ())

        absorbed_rows = inputs["meta_absorbed_token_index"]
        absorbed_out, _ = absorbed_attention(
            emit,
            emit.rows(site.q_nope, absorbed_rows),
            emit.rows(site.q_pe, absorbed_rows),
            inputs["absorbed_positions"],
            inputs["meta_absorbed_block_table"],
            inputs["meta_absorbed_kv_lens"],
            inputs["meta_absorbed_query_start_loc"],
        )
        absorbed_ops, seen = _custom_ops_since(graph, seen), set(graph.nodes)

        split_rows = inputs["meta_split_token_index"]
        q_nope, q_pe = emit.rows(site.q_nope, split_rows), emit.rows(site.q_pe, split_rows)
        suffix_out, suffix_lse = decompressed_suffix(
            emit,
            q_nope,
            q_pe,
            emit.rows(site.kv_c, split_rows),
            emit.rows(site.k_pe, split_rows),
            inputs["meta_split_cu_seqlens"],
        )
        context_rows = inputs["meta_context_split_rows"]
        context_out, context_lse = absorbed_attention(
            emit,
            emit.rows(q_nope, context_rows),
            emit.rows(q_pe, context_rows),
            inputs["context_positions"],
            inputs["meta_context_block_table"],
            inputs["meta_context_lens"],
            inputs["meta_context_query_start_loc"],
        )
        split_out = merged_with_context(
            emit, suffix_out, suffix_lse, context_rows, context_out, context_lse
        )
        split_ops = _custom_ops_since(graph, seen)

        # scatter both sub-batches back into token order (together they cover every token)
        num_tokens = emit(aten.sym_size.int, site.q_nope, 0)
        h, v = site.num_heads, site.v_head_dim
        out = emit(aten.new_zeros.default, absorbed_out, [num_tokens, h, v])
        out = emit(aten.index_copy.default, out, 0, absorbed_rows, absorbed_out)
        out = emit(aten.index_copy.default, out, 0, split_rows, split_out)
        out = emit(aten.view.default, out, [num_tokens, h * v])
    site.output.replace_all_uses_with(out)
    # The anchors first (their users are gone now), then what only they used.
    for node in _dead_after(site):
        graph.erase_node(node)
    return SiteLowering(site.layer, cache_write, absorbed_ops, split_ops)


def _sparse_site(emit: Emitter, site: MLASite, inputs: dict[str, fx.Node]) -> fx.Node:
    """A DSA site: every query attends to its selected positions of the paged cache (the
    selection is per query, so there is no split path to choose)."""
    assert site.selected is not None
    out, _ = sparse_attention(
        emit,
        site.q_nope,
        site.q_pe,
        site.selected,
        inputs["meta_block_table"],
        inputs["meta_kv_lens"],
        inputs["meta_query_start_loc"],
    )
    num_tokens = emit(aten.sym_size.int, site.q_nope, 0)
    return emit(aten.view.default, out, [num_tokens, site.num_heads * site.v_head_dim])


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
    keep |= {site.selected} if site.selected is not None else set()
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


def _sub_batch_positions(gm: fx.GraphModule, inputs: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Positions of the absorbed rows and of the context-half queries, selected once per
    step (right after the inputs) and shared by every site."""
    graph = gm.graph
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    select = aten.index_select.default
    with graph.inserting_after(last_input):
        absorbed = graph.call_function(
            select, (inputs["positions"], 0, inputs["meta_absorbed_token_index"])
        )
    with graph.inserting_after(absorbed):
        split = graph.call_function(
            select, (inputs["positions"], 0, inputs["meta_split_token_index"])
        )
    with graph.inserting_after(split):
        context = graph.call_function(select, (split, 0, inputs["meta_context_split_rows"]))
    return {**inputs, "absorbed_positions": absorbed, "context_positions": context}


def lower_attention(gm: fx.GraphModule, sites: list[MLASite]) -> list[SiteLowering]:
    inputs = _sub_batch_positions(gm, step_placeholders(gm)) if sites else {}
    lowered = [lower_site(gm, site, inputs) for site in sites]
    for site in lowered:
        log.info(
            "lower_attention: layer %d -> %s; absorbed rows: %s; split rows: %s",
            site.layer,
            " + ".join(site.cache_write),
            " + ".join(site.absorbed),
            " + ".join(site.split),
        )
    log.info("lower_attention: lowered %d site(s) onto both attention paths", len(lowered))
    return lowered

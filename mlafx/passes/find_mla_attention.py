"""Find MLA attention sites by meaning.

Pattern (per layer, as ``mlafx.models.attention`` writes it, in any equivalent layout):
    index_copy_(cache.view(-1, Lkv+R), 0, slot_mapping, cat([kv_c, k_pe]))   -- the write
    rows   = index_select(<the written cache>, 0, key_slots)                  -- the gather
    k_nope, v = split(linear(rows[:, :Lkv], kv_b_proj.weight).view(K, H, P+V), [P, V])
    SDPA(cat([q_nope, q_pe]), cat([k_nope, expand(rows[:, Lkv:])]), v, attn_mask, scale)
A DSA layer (``mlafx.models.dsa``) builds its mask from a selection: the site records it
(``MLASite.selected``: the ``mlafx::dsa_indexer_topk`` node the capture made of the layer's
indexer, or a shared layer's ``selected`` input), found within a few ops of the mask.
Replacement: none; this pass only records ``MLASite``s (``mla_site.py``).
Requires: a captured step graph (pre-dispatch ATen IR) with ``meta["val"]`` on nodes.
Ensures: the graph is unchanged; every SDPA node is either a site or a logged refusal
(with the reason), and so is every hand-written softmax attention (matmul -> softmax).

Walks go from the anchor to producers through layout-only ops (casts, views, transposes,
copies); any other op on the q/k/v paths refuses the candidate. Whether the mask is the
step's causal/sequence mask cannot be proven from structure: the ``verify`` pass checks it
numerically after lowering.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import fx

from mlafx.passes.graph_utils import (
    LAYOUT_OPS,
    getitem_of,
    is_call,
    strip_layout,
    tensor_shape,
)
from mlafx.passes.mla_site import MLASite, Refusal

log = logging.getLogger(__name__)
aten = torch.ops.aten
_SPLIT = aten.split_with_sizes.default
_SDPA = aten.scaled_dot_product_attention.default
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_MATMUL = {aten.matmul.default, aten.bmm.default, aten.mm.default}


class _Refuse(Exception):
    pass


def _expect(condition: bool, reason: str) -> None:
    if not condition:
        raise _Refuse(reason)


def _cat_pair(node: fx.Node, what: str) -> tuple[fx.Node, fx.Node]:
    node = strip_layout(node)
    _expect(is_call(node, aten.cat.default), f"{what} is not a concatenation ({node.target})")
    parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
    _expect(len(parts) == 2, f"{what} concatenates {len(parts)} tensors, not 2")
    ndim = len(tensor_shape(node) or ())
    _expect(dim in (-1, ndim - 1), f"{what} is not concatenated on the last dim")
    return parts[0], parts[1]


def _split_part(node: fx.Node, what: str) -> tuple[fx.Node, int]:
    found = getitem_of(strip_layout(node), _SPLIT)
    _expect(found is not None, f"{what} is not a split of a wider tensor")
    return found  # type: ignore[return-value]


def _sdpa_args(sdpa: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None, float | None]:
    args, kwargs = sdpa.args, sdpa.kwargs
    q, k, v = args[:3]
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    _expect(dropout == 0.0, f"dropout_p={dropout}")
    _expect(not causal, "is_causal=True (the step's mask must be explicit)")
    return q, k, v, mask, kwargs.get("scale")


def _output_node(sdpa: fx.Node) -> fx.Node:
    """Follow single-user layout ops from the SDPA output to the [T, H*V] tensor."""
    node = sdpa
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not is_call(user, *LAYOUT_OPS):
            break
        node = user
    shape = tensor_shape(node)
    _expect(shape is not None and len(shape) == 2, "SDPA output does not reach a [T, H*V] tensor")
    return node


def match_site(sdpa: fx.Node, layer: int) -> MLASite:
    q, k, v, mask, scale = _sdpa_args(sdpa)
    _expect(mask is not None, "no attention mask (the step's mask is explicit)")
    # value and key share one decompression of the gathered latent rows
    kv_split, v_index = _split_part(v, "value")
    _expect(v_index == 1, "value is not the second part of the kv_b_proj output")
    k_nope_src, k_rope_src = _cat_pair(k, "key")
    k_split, k_index = _split_part(k_nope_src, "key nope part")
    _expect(k_split is kv_split and k_index == 0, "key and value come from different splits")
    p_dim, v_dim = kv_split.args[1]
    decompress = strip_layout(kv_split.args[0])
    _expect(
        is_call(decompress, aten.linear.default), f"k/v come from {decompress.target}, not a linear"
    )
    _expect(len(decompress.args) < 3 or decompress.args[2] is None, "kv_b_proj has a bias")
    kv_b_weight = decompress.args[1]
    _expect(
        isinstance(kv_b_weight, fx.Node) and kv_b_weight.op == "get_attr",
        "kv_b_proj's weight is computed in the graph, not a weight of it",
    )
    latent_split, latent_index = _split_part(decompress.args[0], "kv_b_proj input")
    _expect(latent_index == 0, "kv_b_proj does not read the latent part of the rows")
    rope_rows = k_rope_src
    while is_call(rope_rows, aten.expand.default, *LAYOUT_OPS):
        rope_rows = rope_rows.args[0]
    rope_split, rope_index = _split_part(rope_rows, "key rope part")
    _expect(rope_split is latent_split and rope_index == 1, "key rope part is not the rows' tail")
    lkv, r = latent_split.args[1]
    gather = strip_layout(latent_split.args[0])
    _expect(is_call(gather, aten.index_select.default), f"key rows come from {gather.target}")
    _expect(gather.args[1] == 0, "the gather is not over cache rows")
    write = strip_layout(gather.args[0])
    _expect(is_call(write, aten.index_copy_.default), "the gathered cache is not the written one")
    _expect(write.args[1] == 0, "the cache write is not over rows")
    cache = strip_layout(write.args[0])
    _expect(cache.op == "placeholder", "the written cache is not a step input")
    kv_c, k_pe = _cat_pair(write.args[3], "new cache rows")
    q_nope, q_pe = _cat_pair(q, "query")
    q_shape, qpe_shape = tensor_shape(q_nope), tensor_shape(q_pe)
    _expect(q_shape is not None and len(q_shape) == 3, "q_nope is not [T, H, P]")
    _expect(qpe_shape is not None and len(qpe_shape) == 3, "q_pe is not [T, H, R]")
    _expect(q_shape[2] == p_dim and qpe_shape[2] == r, "query widths do not match the keys")
    cache_shape = tensor_shape(cache)
    _expect(cache_shape is not None and cache_shape[2] == lkv + r, "cache rows are not Lkv+R")
    if scale is None:
        scale = float((p_dim + r) ** -0.5)
    selected = _selection_in(mask)
    if selected is not None:
        sel_shape = tensor_shape(selected)
        _expect(sel_shape is not None and len(sel_shape) == 2, "the selection is not [T, topk]")
    return MLASite(
        layer=layer,
        cache=cache,
        cache_write=write,
        slot_mapping=write.args[2],
        kv_c=kv_c,
        k_pe=k_pe,
        gather=gather,
        kv_b_weight=kv_b_weight,
        q_nope=q_nope,
        q_pe=q_pe,
        mask=mask,
        scale=float(scale),
        sdpa=sdpa,
        output=_output_node(sdpa),
        num_heads=int(q_shape[1]),
        qk_nope_head_dim=int(p_dim),
        qk_rope_head_dim=int(r),
        v_head_dim=int(v_dim),
        kv_lora_rank=int(lkv),
        selected=selected,
    )


_INDEXER_TOPK = "mlafx.dsa_indexer_topk"
_SELECTION_DEPTH = 12  # selection_mask is a handful of ops between the selection and the mask


def _selection_in(mask: fx.Node) -> fx.Node | None:
    """The DSA selection the mask is built from (``models/dsa.selection_mask``): an
    ``mlafx::dsa_indexer_topk`` node or a layer input named ``selected``, within a few ops of
    the mask; None for a dense site."""
    found: list[fx.Node] = []
    frontier, seen = [(mask, 0)], set()
    while frontier:
        node, depth = frontier.pop()
        if node in seen or depth > _SELECTION_DEPTH:
            continue
        seen.add(node)
        if (node.op == "call_function" and str(node.target).startswith(_INDEXER_TOPK)) or (
            node.op == "placeholder" and node.name == "selected"
        ):
            found.append(node)
            continue
        frontier.extend((n, depth + 1) for n in node.all_input_nodes)
    _expect(len(found) <= 1, f"the mask is built from {len(found)} DSA selections")
    return found[0] if found else None


def _hand_written_attention(softmax: fx.Node) -> bool:
    """A softmax over scores that a matmul produced (not a router's softmax)."""
    node, seen = softmax.args[0], 0
    while isinstance(node, fx.Node) and node.op == "call_function" and seen < 8:
        if node.target in _MATMUL:
            return True
        node, seen = node.args[0], seen + 1
    return False


def _score_path_ops(softmax: fx.Node) -> list[str]:
    ops, node = [], softmax.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target not in _MATMUL:
        ops.append(str(node.target).split(".")[-2] if "." in str(node.target) else str(node.target))
        node = node.args[0]
    return ops


def find_mla_sites(gm: fx.GraphModule) -> tuple[list[MLASite], list[Refusal]]:
    sites: list[MLASite] = []
    refusals: list[Refusal] = []
    for node in gm.graph.nodes:
        if is_call(node, _SDPA):
            try:
                sites.append(match_site(node, layer=len(sites)))
            except _Refuse as reason:
                refusals.append(Refusal(node.name, str(reason)))
        elif is_call(node, *_SOFTMAX) and _hand_written_attention(node):
            ops = ", ".join(_score_path_ops(node)) or "none"
            refusals.append(Refusal(node.name, f"hand-written attention (score path: {ops})"))
    # layers are numbered by the order of their caches among the step's inputs
    order = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    sites.sort(key=lambda s: order[s.cache])
    sites = [replace(s, layer=i) for i, s in enumerate(sites)]
    for refusal in refusals:
        log.info("find_mla_attention: refused %s: %s", refusal.anchor, refusal.reason)
    log.info("find_mla_attention: %d site(s), %d refused", len(sites), len(refusals))
    return sites, refusals

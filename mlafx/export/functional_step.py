"""The functional step (for ONNX): each layer's cache write becomes a step output.

torch's ONNX exporter drops in-place writes into graph inputs without a word, so an ORT
run of the in-place step would read a stale cache and emit wrong tokens. This rewrite makes
the step pure; the host writes the returned rows into its cache (:func:`write_rows`).

Pattern -> replacement, per cache input ``c`` (one write per cache):
    write_latent_cache(kv_c, k_pe, c, slot_mapping)   -> rows_c = cat([kv_c, k_pe], -1) in
                                                          c's dtype (a step output)
    mla_attention_paged(q, c, ...)   after the write  -> mlafx_export.mla_attention_paged_with_rows(
                                                          q, c, rows_c, slot_mapping, ...)
    gather_latent(c, slots)          after the write  -> mlafx_export.gather_latent_with_rows(
                                                          c, rows_c, slot_mapping, slots)
The ``*_with_rows`` ops read the cache as if ``rows`` had been written at ``slot_mapping``
(slot ``-1`` skipped), without writing it. Reads before the write are left alone.
Requires: the lowered step (``write_latent_cache`` into cache placeholders).
Ensures: no op mutates an input; the step returns ``(logits, [rows per cache])``, rows
``[T, Lkv+R]``; host-written, it equals the in-place step (checked by :func:`check`).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import fx
from torch.utils import _pytree as pytree

import mlafx.kernels  # noqa: F401  (registers the mlafx ops and their fakes)
from mlafx.models.step import StepInputs
from mlafx.passes.verify import VerifyReport, random_caches, verify_rewrite

log = logging.getLogger(__name__)
aten = torch.ops.aten
mlafx_ops = torch.ops.mlafx
export_ops = torch.ops.mlafx_export  # the *_with_rows ops defined below


def cache_with_rows(
    kv_cache: torch.Tensor,  # [NB, BS, Lkv+R]
    rows: torch.Tensor,  # [T, Lkv+R]
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """A copy of ``kv_cache`` with ``rows`` written at ``slot_mapping`` (``-1`` skipped)."""
    cache = kv_cache.clone()
    write_rows([cache], [rows], slot_mapping)
    return cache


def write_rows(
    caches: list[torch.Tensor], rows: list[torch.Tensor], slot_mapping: torch.Tensor
) -> None:
    """The host's half of the functional step: write each layer's new rows into its cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, new in zip(caches, rows, strict=True):
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, new[keep].to(cache.dtype))


@torch.library.custom_op("mlafx_export::mla_attention_paged_with_rows", mutates_args=())
def mla_attention_paged_with_rows(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_attention_paged`` over ``cache_with_rows(kv_cache, rows, slot_mapping)``."""
    cache = cache_with_rows(kv_cache, rows, slot_mapping)
    return mlafx_ops.mla_attention_paged(
        q, cache, block_table, kv_lens, query_start_loc, positions, scale, kv_lora_rank
    )


@mla_attention_paged_with_rows.register_fake
def _(
    q,
    kv_cache,
    rows,
    slot_mapping,
    block_table,
    kv_lens,
    query_start_loc,
    positions,
    scale,
    kv_lora_rank,
):  # noqa: E501
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty((num_tokens, num_heads, kv_lora_rank))
    return out, q.new_empty((num_heads, num_tokens), dtype=torch.float32)


@torch.library.custom_op("mlafx_export::gather_latent_with_rows", mutates_args=())
def gather_latent_with_rows(
    kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``gather_latent`` over ``cache_with_rows(kv_cache, rows, slot_mapping)``."""
    return mlafx_ops.gather_latent(cache_with_rows(kv_cache, rows, slot_mapping), slots)


@gather_latent_with_rows.register_fake
def _(kv_cache, rows, slot_mapping, slots):
    return kv_cache.new_empty((slots.shape[0], kv_cache.shape[2]))


def make_functional(lowered: fx.GraphModule) -> fx.GraphModule:
    """A copy of the lowered step with its cache writes turned into outputs (module doc)."""
    gm = copy.deepcopy(lowered)
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    writes = [n for n in graph.nodes if n.target is mlafx_ops.write_latent_cache.default]
    cache_inputs = [n for n in graph.nodes if n.op == "placeholder" and _is_written(n, writes)]
    rows_of: dict[fx.Node, fx.Node] = {}
    for write in writes:
        kv_c, k_pe, cache, slot_mapping = write.args
        if cache in rows_of:
            raise ValueError(f"functional step: cache {cache.name} is written twice in one step")
        dtype = cache.meta["val"].dtype
        with graph.inserting_before(write):
            parts = [_cast(graph, x, dtype) for x in (kv_c, k_pe)]
            rows = graph.call_function(aten.cat.default, (parts, -1))  # [T, Lkv+R]
        rows_of[cache] = rows
        for reader in sorted(cache.users, key=order.__getitem__):
            if reader is write or order[reader] < order[write]:
                continue
            _read_with_rows(graph, reader, cache, rows, slot_mapping)
        graph.erase_node(write)
    output = graph.output_node()
    (flat_outputs,) = output.args
    if len(flat_outputs) != 1:
        raise ValueError(f"functional step: expected one output (logits), got {len(flat_outputs)}")
    rows = [rows_of[c] for c in cache_inputs]
    output.args = ([flat_outputs[0], *rows],)
    info = graph._codegen.pytree_info
    out_spec = pytree.tree_structure((0, [0] * len(rows)))
    graph._codegen.pytree_info = info._replace(out_spec=out_spec)
    graph.lint()
    gm.recompile()
    log.info("functional step: %d cache write(s) turned into outputs", len(writes))
    return gm


def _is_written(placeholder: fx.Node, writes: list[fx.Node]) -> bool:
    return any(w.args[2] is placeholder for w in writes)


def _cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    if node.meta["val"].dtype == dtype:
        return node
    return graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})


def _read_with_rows(
    graph: fx.Graph, reader: fx.Node, cache: fx.Node, rows: fx.Node, slot_mapping: fx.Node
) -> None:
    if reader.target is mlafx_ops.mla_attention_paged.default:
        q, _, *rest = reader.args
        target, args = (
            export_ops.mla_attention_paged_with_rows.default,
            (q, cache, rows, slot_mapping, *rest),
        )
    elif reader.target is mlafx_ops.gather_latent.default:
        _, slots = reader.args
        target, args = (
            export_ops.gather_latent_with_rows.default,
            (cache, rows, slot_mapping, slots),
        )
    else:
        raise ValueError(
            f"functional step: {reader.target} reads cache {cache.name} after its write; only "
            "mla_attention_paged and gather_latent can read the new rows functionally"
        )
    with graph.inserting_before(reader):
        replacement = graph.call_function(target, args)
    replacement.meta = dict(reader.meta)
    reader.replace_all_uses_with(replacement)
    graph.erase_node(reader)


class HostWrittenStep:
    """The functional step behind the in-place step ABI: runs it, writes the rows."""

    def __init__(self, functional):  # type: ignore[no-untyped-def]
        self.functional = functional

    def __call__(self, input_ids, positions, caches, meta, logits_indices):  # type: ignore[no-untyped-def]
        logits, rows = self.functional(input_ids, positions, caches, meta, logits_indices)
        write_rows(caches, rows, meta.slot_mapping)
        return logits


def check(
    lowered: fx.GraphModule, functional, sample: StepInputs, caches: list[torch.Tensor]
) -> VerifyReport:  # type: ignore[no-untyped-def]
    """Host-written functional step == in-place lowered step (logits and caches), on the
    passes' sample step from random caches; raises ``VerificationError`` otherwise."""
    return verify_rewrite(lowered, HostWrittenStep(functional), sample, random_caches(caches))

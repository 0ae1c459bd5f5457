"""Typed wrappers and fake (meta) implementations of the DeepSeek Sparse Attention ops
(DSA: DeepSeek-V3.2, GLM-5): the lightning indexer's top-k and the sparse absorbed MLA.

Schemas and CPU kernels: ``csrc/dsa_indexer.cpp`` (``dsa_indexer_topk``; AVX-512 BF16 scores in
``csrc/dsa_indexer_avx512.cpp``), ``csrc/dsa_attention.cpp`` (``mla_attention_sparse``, on the
attention core of ``mla_attention_paged``). References: ``dsa_reference.py``.

Symbols: ``T`` query tokens of ``B`` sequences (``query_start_loc``), ``Hi``/``Di`` indexer
heads and width, ``H`` attention heads, ``Lkv`` = kv_lora_rank, ``R`` rope width. One step::

    selected = dsa_indexer_topk(q_idx, weights, index_cache, block_table, kv_lens,
                                query_start_loc, positions, topk)          # [T, topk]
    out, lse = mla_attention_sparse(q, kv_cache, block_table, kv_lens,
                                    query_start_loc, selected, scale, Lkv)  # [T, H, Lkv], [H, T]
"""

from __future__ import annotations

import torch

from mlafx.kernels.attention_ops import _check_float, _check_index, latent_attention_fake
from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them


# ---- dsa_indexer_topk ----------------------------------------------------------------------


@torch.library.register_fake("mlafx::dsa_indexer_topk")
def _dsa_indexer_topk_fake(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    _check_float("q", q)
    torch._check(index_cache.dtype == q.dtype, lambda: "index_cache must have q's dtype")
    torch._check(weights.dtype == torch.float32, lambda: "weights must be float32")
    torch._check(q.dim() == 3 and index_cache.dim() == 3 and weights.dim() == 2)
    torch._check(index_cache.shape[2] == q.shape[2], lambda: "index_cache and q widths differ")
    torch._check(weights.shape[0] == q.shape[0] and weights.shape[1] == q.shape[1])
    _check_index("block_table", block_table, torch.int32, 2)
    _check_index("kv_lens", kv_lens, torch.int32, 1)
    _check_index("query_start_loc", query_start_loc, torch.int32, 1)
    _check_index("positions", positions, torch.int64, 1)
    torch._check(topk >= 1, lambda: "topk must be at least 1")
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)


def dsa_indexer_topk(
    q: torch.Tensor,  # [T, Hi, Di] indexer queries (rotated)
    weights: torch.Tensor,  # [T, Hi] float32, every scale folded in
    index_cache: torch.Tensor,  # [NB, BS, Di], q's dtype
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    topk: int,
) -> torch.Tensor:  # [T, topk] int64
    """The ``topk`` visible positions with the highest indexer scores, per query.

    Query ``t`` of sequence ``b`` sees positions ``j < min(kv_lens[b], positions[t] + 1)``
    (``mla_attention_paged``'s rule); position ``j`` lives at
    ``index_cache[block_table[b, j // BS], j % BS]``. Scores, in fp32::

        score(t, j) = sum_h weights[t, h] * relu(q[t, h] . index_cache row of j)

    Returns the selected positions **in ascending order**, padded at the end with ``-1`` when
    fewer than ``topk`` positions are visible. Tie rule: positions rank by (score descending,
    position ascending), so among equal scores the earlier position wins (what a stable
    descending sort of the scores gives). Never reads rows past a sequence's ``kv_lens``.
    """
    return torch.ops.mlafx.dsa_indexer_topk(
        q, weights, index_cache, block_table, kv_lens, query_start_loc, positions, topk
    )


# ---- mla_attention_sparse ------------------------------------------------------------------


@torch.library.register_fake("mlafx::mla_attention_sparse")
def _mla_attention_sparse_fake(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_index("selected", selected, torch.int64, 2)
    torch._check(selected.shape[0] == q.shape[0], lambda: "selected must have a row per query")
    return latent_attention_fake(q, kv_cache, block_table, kv_lens, query_start_loc, kv_lora_rank)


def mla_attention_sparse(
    q: torch.Tensor,  # [T, H, Lkv + R]: [q_nope @ W_UK | q_pe]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    selected: torch.Tensor,  # [T, topk] int64
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Lkv], lse [H, T] fp32
    """Absorbed MLA attention of each query over its ``selected`` cache positions only.

    ``selected[t]`` holds distinct positions of query ``t``'s own sequence; ``-1`` entries
    (anywhere in the row) are ignored, and a position ``>= kv_lens[b]`` or ``< -1`` raises
    ``IndexError`` (a repeated one ``ValueError``), naming the query. Keys are whole cache rows,
    values their first ``kv_lora_rank`` columns; LSE is the natural log over the scaled logits.
    A query with no selected position gets output 0 and LSE ``-inf``. The causal limit is the
    selection's business (``dsa_indexer_topk`` only selects visible positions)."""
    return torch.ops.mlafx.mla_attention_sparse(
        q, kv_cache, block_table, kv_lens, query_start_loc, selected, scale, kv_lora_rank
    )

"""Typed wrappers and fake (meta) implementations of the attention ops.

Schemas and CPU kernels: ``csrc/attention.cpp`` (``mla_attention_paged``,
``varlen_attention``), ``csrc/attn_merge.cpp`` (``merge_attn_states``), ``csrc/attn_gather.cpp``
(``gather_latent``). References: ``attention_reference.py``.

Conventions (``DESIGN.md``, "Op contracts"): index tensors ``block_table``, ``kv_lens``,
``query_start_loc``, ``cu_seqlens_*`` are int32; ``slots`` and ``positions`` int64. Outputs
are new contiguous tensors in the query's dtype; LSEs are contiguous float32
``[num_heads, num_tokens]``, natural log over the scaled logits. A query that sees no key
gets output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_float(name: str, t: torch.Tensor) -> None:
    torch._check(t.dtype in _FLOAT_DTYPES, lambda: f"{name} dtype {t.dtype} unsupported")


def _check_index(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    torch._check(t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")
    torch._check(t.dim() == dim, lambda: f"{name} must have {dim} dims, got {t.dim()}")


# ---- gather_latent -------------------------------------------------------------------------


@torch.library.register_fake("mlafx::gather_latent")
def _gather_latent_fake(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    _check_float("kv_cache", kv_cache)
    _check_index("slots", slots, torch.int64, 1)
    torch._check(kv_cache.dim() == 3, lambda: "kv_cache must be [NB, BS, Lkv + R]")
    return kv_cache.new_empty((slots.shape[0], kv_cache.shape[2]))


def gather_latent(
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R]
    slots: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N, Lkv + R]
    """Rows of the paged latent cache at ``slots`` (``block * BS + offset``). Every slot must
    be in range (``-1`` is an error here); raises ``IndexError`` otherwise."""
    return torch.ops.mlafx.gather_latent(kv_cache, slots)


# ---- merge_attn_states ---------------------------------------------------------------------


@torch.library.register_fake("mlafx::merge_attn_states")
def _merge_attn_states_fake(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float("prefix_out", prefix_out)
    torch._check(suffix_out.dtype == prefix_out.dtype, lambda: "suffix_out dtype != prefix_out's")
    torch._check(prefix_lse.dtype == torch.float32 and suffix_lse.dtype == torch.float32)
    torch._check(prefix_out.dim() == 3 and suffix_out.shape == prefix_out.shape)
    num_tokens, num_heads, head_dim = prefix_out.shape
    torch._check(prefix_lse.shape == (num_heads, num_tokens))
    torch._check(suffix_lse.shape == (num_heads, num_tokens))
    out = prefix_out.new_empty((num_tokens, num_heads, head_dim))
    lse = prefix_lse.new_empty((num_heads, num_tokens))
    return out, lse


def merge_attn_states(
    prefix_out: torch.Tensor,  # [T, H, D]
    prefix_lse: torch.Tensor,  # [H, T] fp32
    suffix_out: torch.Tensor,  # [T, H, D]
    suffix_lse: torch.Tensor,  # [H, T] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D], lse [H, T]
    """Combine two attention results over disjoint key sets by their log-sum-exps.
    An infinite LSE (``+inf`` or ``-inf``) marks an empty half; both empty gives output 0
    and LSE ``-inf``, never NaN."""
    return torch.ops.mlafx.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)


# ---- mla_attention_paged -------------------------------------------------------------------


@torch.library.register_fake("mlafx::mla_attention_paged")
def _mla_attention_paged_fake(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_index("positions", positions, torch.int64, 1)
    return latent_attention_fake(q, kv_cache, block_table, kv_lens, query_start_loc, kv_lora_rank)


def latent_attention_fake(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks and outputs every absorbed-MLA op over the paged latent cache shares
    (``mla_attention_paged``, ``mla_attention_sparse``; csrc ``check_latent_attention``): out
    [T, H, kv_lora_rank] in q's dtype, lse [H, T] float32."""
    _check_float("q", q)
    torch._check(kv_cache.dtype == q.dtype, lambda: "kv_cache must have q's dtype")
    torch._check(q.dim() == 3 and kv_cache.dim() == 3)
    _check_index("block_table", block_table, torch.int32, 2)
    _check_index("kv_lens", kv_lens, torch.int32, 1)
    _check_index("query_start_loc", query_start_loc, torch.int32, 1)
    torch._check(kv_cache.shape[2] == q.shape[2], lambda: "kv_cache and q widths differ")
    torch._check(1 <= kv_lora_rank <= q.shape[2], lambda: "kv_lora_rank out of range")
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty((num_tokens, num_heads, kv_lora_rank))
    lse = q.new_empty((num_heads, num_tokens), dtype=torch.float32)
    return out, lse


def mla_attention_paged(
    q: torch.Tensor,  # [T, H, Lkv + R]: [q_nope @ W_UK | q_pe]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Lkv], lse [H, T] fp32
    """Absorbed MLA attention over the paged latent cache. Keys are whole cache rows, values
    their first ``kv_lora_rank`` columns; query ``t`` of sequence ``b`` sees cache positions
    ``j < min(kv_lens[b], positions[t] + 1)``."""
    return torch.ops.mlafx.mla_attention_paged(
        q, kv_cache, block_table, kv_lens, query_start_loc, positions, scale, kv_lora_rank
    )


# ---- varlen_attention ----------------------------------------------------------------------


@torch.library.register_fake("mlafx::varlen_attention")
def _varlen_attention_fake(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float("q", q)
    for name, t in (("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        torch._check(t.dtype == q.dtype, lambda name=name: f"{name} must have q's dtype")
    torch._check(q.dim() == 3 and k_nope.dim() == 3 and k_pe.dim() == 2 and v.dim() == 3)
    _check_index("cu_seqlens_q", cu_seqlens_q, torch.int32, 1)
    _check_index("cu_seqlens_k", cu_seqlens_k, torch.int32, 1)
    torch._check(q.shape[2] == k_nope.shape[2] + k_pe.shape[1], lambda: "q width != P + R")
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty((num_tokens, num_heads, v.shape[2]))
    lse = q.new_empty((num_heads, num_tokens), dtype=torch.float32)
    return out, lse


def varlen_attention(
    q: torch.Tensor,  # [T, H, P + R]
    k_nope: torch.Tensor,  # [S, H, P]
    k_pe: torch.Tensor,  # [S, R], shared by all heads
    v: torch.Tensor,  # [S, H, V]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, V], lse [H, T] fp32
    """Ragged multi-head attention; key ``j`` of head ``h`` is ``[k_nope[j, h] | k_pe[j]]``.
    ``causal`` aligns the mask at the bottom right: query ``i`` of a ``q_len x k_len`` block
    sees keys ``j <= i + k_len - q_len``."""
    return torch.ops.mlafx.varlen_attention(
        q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale, causal
    )

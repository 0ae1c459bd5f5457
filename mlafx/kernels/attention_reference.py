"""Slow, obviously correct Python references for the attention ops (tests import these).

Everything is computed in float64 on the inputs as given (bf16/fp16 values widen exactly),
one query (or one sequence) at a time, then cast to the query's dtype. Only the keys a
query may see are ever indexed, so rows past a sequence's length are never read.
"""

from __future__ import annotations

import math

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [H, Dk], k [H, L, Dk] or [L, Dk], v [H, L, Dv] or [L, Dv] -> (out [H, Dv], lse [H]);
    L == 0 gives out 0 and lse -inf."""
    num_heads = q.shape[0]
    dv = v.shape[-1]
    if k.shape[-2] == 0:
        return q.new_zeros((num_heads, dv)), q.new_full((num_heads,), -math.inf)
    if k.dim() == 2:
        logits = q @ k.T * scale  # [H, L]
    else:
        logits = torch.einsum("hd,hld->hl", q, k) * scale
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    out = probs @ v if v.dim() == 2 else torch.einsum("hl,hld->hd", probs, v)
    return out, lse


def mla_attention_paged_ref(
    q: torch.Tensor,  # [T, H, Lkv + R]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``mlafx::mla_attention_paged``: for query t of sequence b, gather cache
    rows j < min(kv_lens[b], positions[t] + 1) through the block table; keys are whole rows,
    values their first kv_lora_rank columns."""
    num_tokens, num_heads, _ = q.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        kv_len = int(kv_lens[b])
        for t in range(starts[b], starts[b + 1]):
            visible = max(0, min(kv_len, int(positions[t]) + 1))
            rows = [
                kv_cache[int(block_table[b, j // block_size]), j % block_size]
                for j in range(visible)
            ]
            keys = (
                torch.stack(rows).double()
                if rows
                else torch.zeros(0, q.shape[2], dtype=torch.float64)
            )
            o, s = _attend(q[t].double(), keys, keys[:, :kv_lora_rank], scale)
            out[t], lse[:, t] = o, s
    return out.to(q.dtype), lse.float()


def varlen_attention_ref(
    q: torch.Tensor,  # [T, H, P + R]
    k_nope: torch.Tensor,  # [S, H, P]
    k_pe: torch.Tensor,  # [S, R]
    v: torch.Tensor,  # [S, H, V]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``mlafx::varlen_attention``: per sequence and query, keys
    ``[k_nope[j, h] | k_pe[j]]``; causal: query i sees keys j <= i + k_len - q_len."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, v.shape[2], dtype=torch.float64)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float64)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q_len, k_len = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for i in range(q_len):
            t = cq[b] + i
            visible = max(0, min(k_len, i + k_len - q_len + 1)) if causal else k_len
            keys = slice(ck[b], ck[b] + visible)
            k = torch.cat(
                [
                    k_nope[keys].double().transpose(0, 1),  # [H, L, P]
                    k_pe[keys].double().expand(num_heads, -1, -1),  # [H, L, R]
                ],
                dim=-1,
            )
            o, s = _attend(q[t].double(), k, v[keys].double().transpose(0, 1), scale)
            out[t], lse[:, t] = o, s
    return out.to(q.dtype), lse.float()


def merge_attn_states_ref(
    prefix_out: torch.Tensor,  # [T, H, D]
    prefix_lse: torch.Tensor,  # [H, T]
    suffix_out: torch.Tensor,  # [T, H, D]
    suffix_lse: torch.Tensor,  # [H, T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``mlafx::merge_attn_states``: an infinite LSE marks an empty half (its
    output is ignored); both empty gives 0 and -inf."""
    p = prefix_lse.double().T[..., None]  # [T, H, 1]
    s = suffix_lse.double().T[..., None]
    po, so = prefix_out.double(), suffix_out.double()
    p_empty, s_empty = torch.isinf(p), torch.isinf(s)
    m = torch.maximum(p, s)  # NaN propagates
    safe_m = torch.where(p_empty | s_empty, 0.0, m)
    wp, ws = torch.exp(p - safe_m), torch.exp(s - safe_m)
    both = (wp * po + ws * so) / (wp + ws)
    lse_both = m + torch.log(wp + ws)
    out = torch.where(p_empty, so, torch.where(s_empty, po, both))
    out = torch.where(p_empty & s_empty, 0.0, out)
    lse = torch.where(p_empty, s, torch.where(s_empty, p, lse_both))
    lse = torch.where(p_empty & s_empty, -math.inf, lse)
    return out.to(prefix_out.dtype), lse[..., 0].T.float().contiguous()


def gather_latent_ref(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reference for ``mlafx::gather_latent``: rows at ``slots``; any slot out of range
    (``-1`` included) raises ``IndexError``."""
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if not 0 <= slot < num_slots:
            raise IndexError(f"slots[{i}] = {slot} is out of range (0..{num_slots - 1})")
    return kv_cache.reshape(num_slots, kv_cache.shape[2])[slots].clone()

"""The mlafx ops as standard ONNX ops (onnxscript), for ``torch.onnx.export``'s
``custom_translation_table``: stock onnxruntime then runs the step.

Each translation follows the op's contract in DESIGN.md ("Op contracts") and is written
for clarity over speed: attention is dense over the step's key rows with a mask, the
routed experts run every expert on every token and weight the results (E/k times the
kernel's FLOPs), and float accumulation is whatever ORT does in the model dtype. Paged
attention gathers each sequence's ``M * BS`` block-table rows; ``*_with_rows`` variants
overlay the step's new rows on what they gather (the functional step, see
``functional_step.py``). Masked-out rows score ``-inf``; a query that sees nothing gets
output 0 and LSE ``-inf`` (never NaN), as the kernels do. Every key set gets one extra
zero key that no query sees, so no softmax reduces over an empty axis (an empty sub-batch:
onnxruntime mis-shapes reductions over empty axes).

Shapes (symbols as in DESIGN.md): T queries, H heads, C = Lkv+R, B sequences, M
block-table columns, BS block size, L = M*BS key rows per sequence.
"""

from __future__ import annotations

import torch
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset20 as op

OPSET = 20  # the exporter's default opset; translations use the same one
_INF = float("inf")


# ---- helpers (traced into the caller's graph) ----------------------------------------------


def _dim(x, axis: int):
    """``x.shape[axis]`` as a 1-element int64 tensor."""
    return op.Shape(x, start=axis, end=axis + 1)


def _ints(*values: int):
    """A constant int64 vector (variadic inputs such as Concat's need typed tensors)."""
    return op.Constant(value_ints=list(values))


def _scalar(x):
    return op.Squeeze(x, [0])


def _arange(n):
    """``[0, 1, ..., n-1]`` for a 1-element int64 ``n``."""
    return op.Range(op.Constant(value_int=0), _scalar(n), op.Constant(value_int=1))


def _sequence_of(cu_seqlens, num):
    """Which sequence each of ``num`` flat rows belongs to: ``#{b : cu[b+1] <= t}`` -> [num]."""
    ends = op.Slice(op.Cast(cu_seqlens, to=INT64.dtype), [1], [2**62])  # [B]
    rows = _arange(num)
    before = op.LessOrEqual(op.Unsqueeze(ends, [0]), op.Unsqueeze(rows, [1]))  # [num, B]
    return op.ReduceSum(op.Cast(before, to=INT64.dtype), [1], keepdims=0)


def _pad_row(x):
    """``x`` with one zero row appended on axis 0."""
    zeros = op.ConstantOfShape(op.Concat(_ints(1), op.Shape(x, start=1), axis=0))
    return op.Concat(x, op.CastLike(zeros, x), axis=0)


def _pad_hidden_column(mask):
    """``mask [T, N]`` with a column of False appended: the padded key is never seen."""
    hidden = op.ConstantOfShape(op.Concat(_dim(mask, 0), _ints(1), axis=0))
    return op.Concat(mask, op.Cast(hidden, to=BOOL.dtype), axis=1)


def _attend(scores, values):
    """Softmax over the last axis of masked ``scores`` (``-inf`` = hidden), then
    ``@ values``. Returns ``out`` and the LSE (last axis dropped); a row that sees nothing
    gives 0 and ``-inf``."""
    top = op.ReduceMax(scores, [-1], keepdims=1)
    top = op.Where(op.IsInf(top), op.CastLike(0.0, top), top)  # all hidden: avoid inf - inf
    weights = op.Exp(op.Sub(scores, top))
    total = op.ReduceSum(weights, [-1], keepdims=1)
    out = op.MatMul(weights, values)
    seen = op.Greater(total, op.CastLike(0.0, total))
    out = op.Where(seen, op.Div(out, op.Where(seen, total, op.CastLike(1.0, total))), 0.0)
    lse = op.Squeeze(op.Add(op.Log(total), top), [-1])  # log(0) = -inf
    return out, lse


def _overlay(gathered, slots, flat_cache, rows, slot_mapping):
    """``gathered`` (rows of ``flat_cache [N, C]`` read at ``slots``) with the step's new
    ``rows`` in place wherever ``slots`` holds a slot of ``slot_mapping`` (-1 = not written).
    An inverse map ``slot -> new row`` (N+1 int64, the extra entry absorbing -1) avoids
    comparing every read slot with every written one."""
    num_slots = _dim(flat_cache, 0)
    skipped = op.Less(slot_mapping, op.Constant(value_int=0))
    targets = op.Where(skipped, _scalar(num_slots), slot_mapping)  # -1 -> the extra entry
    minus_one = op.Expand(op.Constant(value_int=-1), op.Add(num_slots, _ints(1)))
    new_row_of = op.ScatterElements(minus_one, targets, _arange(_dim(slot_mapping, 0)), axis=0)
    index = op.Gather(new_row_of, slots, axis=0)  # [...] -1 where nothing new was written
    written = op.GreaterOrEqual(index, op.Constant(value_int=0))
    new = op.Gather(rows, op.Max(index, op.Constant(value_int=0)), axis=0)  # [..., C]
    return op.Where(op.Unsqueeze(written, [-1]), new, gathered)


# ---- mla_attention_paged ------------------------------------------------------------------


def _paged_attention(q, kv_cache, block_table, kv_lens, query_start_loc, positions, scale,
                     kv_lora_rank, rows=None, slot_mapping=None):  # fmt: skip
    width = _dim(kv_cache, 2)
    block_size = _dim(kv_cache, 1)
    flat = op.Reshape(kv_cache, op.Concat(_ints(-1), width, axis=0))  # [NB*BS, C]
    tables = op.Cast(block_table, to=INT64.dtype)  # [B, M]
    lens = op.Cast(kv_lens, to=INT64.dtype)  # [B]
    per_seq = op.Mul(_dim(tables, 1), block_size)  # [1] = L
    j = _arange(per_seq)  # [L]
    bs = _scalar(block_size)
    slots = op.Add(op.Mul(op.Gather(tables, op.Div(j, bs), axis=1), bs), op.Mod(j, bs))  # [B, L]
    visible = op.Less(op.Unsqueeze(j, [0]), op.Unsqueeze(lens, [1]))  # rows < kv_lens[b]
    slots = op.Where(visible, slots, op.Constant(value_int=0))  # never read unused entries
    keys = op.Gather(flat, slots, axis=0)  # [B, L, C]
    # rows past kv_lens hold anything (NaN included): zero them, 0 * NaN would leak into P.V
    keys = op.Where(op.Unsqueeze(visible, [2]), keys, op.CastLike(0.0, keys))
    if rows is not None:
        keys = _overlay(keys, slots, flat, rows, slot_mapping)
    keys = op.Reshape(keys, op.Concat(_ints(-1), width, axis=0))  # [B*L, C]
    num_tokens = _dim(q, 0)
    seq = _sequence_of(query_start_loc, num_tokens)  # [T]
    limit = op.Min(op.Gather(lens, seq), op.Add(positions, op.Constant(value_int=1)))  # [T]
    k = _arange(_dim(keys, 0))  # flat key index -> (sequence, position)
    divisor = _scalar(op.Max(per_seq, _ints(1)))  # M = 0 (an empty sub-batch): no keys
    key_seq, key_pos = op.Div(k, divisor), op.Mod(k, divisor)
    mask = op.And(
        op.Equal(op.Unsqueeze(seq, [1]), op.Unsqueeze(key_seq, [0])),
        op.Less(op.Unsqueeze(key_pos, [0]), op.Unsqueeze(limit, [1])),
    )  # [T, B*L]
    keys, mask = _pad_row(keys), _pad_hidden_column(mask)  # [B*L+1, C], [T, B*L+1]
    scores = op.MatMul(q, op.Transpose(keys))  # [T, H, C] @ [C, B*L+1] -> [T, H, B*L+1]
    scores = op.Mul(scores, op.CastLike(scale, scores))
    scores = op.Where(op.Unsqueeze(mask, [1]), scores, op.CastLike(-_INF, scores))
    values = op.Slice(keys, [0], [kv_lora_rank], [1])  # [B*L+1, Lkv]
    out, lse = _attend(scores, values)  # [T, H, Lkv], [T, H]
    return out, op.Cast(op.Transpose(lse), to=FLOAT.dtype)  # lse [H, T]


def mla_attention_paged(q, kv_cache, block_table, kv_lens, query_start_loc, positions,
                        scale: float, kv_lora_rank: int):  # fmt: skip
    """``mlafx::mla_attention_paged``: query t of sequence b sees cache positions
    ``j < min(kv_lens[b], positions[t] + 1)``."""
    return _paged_attention(
        q, kv_cache, block_table, kv_lens, query_start_loc, positions, scale, kv_lora_rank
    )


def mla_attention_paged_with_rows(q, kv_cache, rows, slot_mapping, block_table, kv_lens,
                                  query_start_loc, positions, scale: float,
                                  kv_lora_rank: int):  # fmt: skip
    return _paged_attention(
        q, kv_cache, block_table, kv_lens, query_start_loc, positions, scale, kv_lora_rank,
        rows, slot_mapping,
    )  # fmt: skip


# ---- gather_latent ------------------------------------------------------------------------


def gather_latent(kv_cache, slots):
    """``mlafx::gather_latent``: rows of the flattened cache at ``slots``."""
    flat = op.Reshape(kv_cache, op.Concat(_ints(-1), _dim(kv_cache, 2), axis=0))
    return op.Gather(flat, slots, axis=0)


def gather_latent_with_rows(kv_cache, rows, slot_mapping, slots):
    flat = op.Reshape(kv_cache, op.Concat(_ints(-1), _dim(kv_cache, 2), axis=0))
    return _overlay(op.Gather(flat, slots, axis=0), slots, flat, rows, slot_mapping)


# ---- varlen_attention ---------------------------------------------------------------------


def varlen_attention(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, scale: float,
                     causal: bool):  # fmt: skip
    """``mlafx::varlen_attention``: ragged MHA, the rope key shared by all heads; ``causal``
    aligns at the bottom right (query i sees keys ``j <= i + k_len - q_len``)."""
    num_q, num_k = _dim(q, 0), _dim(k_nope, 0)
    shared = op.Expand(op.Unsqueeze(k_pe, [1]), op.Concat(num_k, _dim(q, 1), _dim(k_pe, 1), axis=0))
    keys = _pad_row(op.Concat(k_nope, shared, axis=2))  # [S+1, H, P+R]
    scores = op.MatMul(op.Transpose(q, perm=[1, 0, 2]), op.Transpose(keys, perm=[1, 2, 0]))
    scores = op.Mul(scores, op.CastLike(scale, scores))  # [H, T, S]
    seq_q, seq_k = _sequence_of(cu_seqlens_q, num_q), _sequence_of(cu_seqlens_k, num_k)
    mask = op.Equal(op.Unsqueeze(seq_q, [1]), op.Unsqueeze(seq_k, [0]))  # [T, S]
    if causal:
        cu_q, cu_k = op.Cast(cu_seqlens_q, to=INT64.dtype), op.Cast(cu_seqlens_k, to=INT64.dtype)
        one = op.Constant(value_int=1)
        q_start, q_end = op.Gather(cu_q, seq_q), op.Gather(cu_q, op.Add(seq_q, one))
        k_start, k_end = op.Gather(cu_k, seq_q), op.Gather(cu_k, op.Add(seq_q, one))
        i = op.Sub(_arange(num_q), q_start)  # position within its query block
        last = op.Add(i, op.Sub(op.Sub(k_end, k_start), op.Sub(q_end, q_start)))  # [T]
        j = op.Sub(_arange(num_k), op.Gather(cu_k, seq_k))  # position within its key block
        mask = op.And(mask, op.LessOrEqual(op.Unsqueeze(j, [0]), op.Unsqueeze(last, [1])))
    mask = _pad_hidden_column(mask)  # [T, S+1]
    scores = op.Where(op.Unsqueeze(mask, [0]), scores, op.CastLike(-_INF, scores))
    out, lse = _attend(scores, op.Transpose(_pad_row(v), perm=[1, 0, 2]))  # [H,T,V], [H,T]
    return op.Transpose(out, perm=[1, 0, 2]), op.Cast(lse, to=FLOAT.dtype)


# ---- merge_attn_states --------------------------------------------------------------------


def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """``mlafx::merge_attn_states``: LSE-weighted sum; an infinite LSE is an empty half."""
    neg_inf = op.Constant(value_float=-_INF)
    p = op.Where(op.IsInf(prefix_lse), neg_inf, prefix_lse)  # [H, T]
    s = op.Where(op.IsInf(suffix_lse), neg_inf, suffix_lse)
    top = op.Max(p, s)
    top = op.Where(op.IsInf(top), op.Constant(value_float=0.0), top)
    wp, ws = op.Exp(op.Sub(p, top)), op.Exp(op.Sub(s, top))
    total = op.Add(wp, ws)
    seen = op.Greater(total, op.Constant(value_float=0.0))
    safe = op.Where(seen, total, op.Constant(value_float=1.0))

    def per_token(w):  # [H, T] -> [T, H, 1] in the outputs' dtype
        return op.CastLike(op.Unsqueeze(op.Transpose(op.Div(w, safe)), [2]), prefix_out)

    out = op.Add(op.Mul(prefix_out, per_token(wp)), op.Mul(suffix_out, per_token(ws)))
    return out, op.Add(op.Log(total), top)


# ---- moe_experts --------------------------------------------------------------------------


def moe_experts(x, topk_ids, topk_weights, w13, w2):
    """``mlafx::moe_experts``, dense: every expert on every token, weighted by the token's
    routing weight for that expert (0 if not picked)."""
    hidden = op.MatMul(x, op.Transpose(w13, perm=[0, 2, 1]))  # [E, T, 2I]
    inter = _dim(w2, 2)
    gate = op.Slice(hidden, [0], inter, [2])
    up = op.Slice(hidden, inter, [2**62], [2])
    act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)  # silu(g) * u
    out = op.MatMul(act, op.Transpose(w2, perm=[0, 2, 1]))  # [E, T, D]
    experts = _arange(_dim(w13, 0))  # [E]
    picked = op.Cast(op.Equal(op.Unsqueeze(topk_ids, [2]), experts), to=FLOAT.dtype)  # [T,k,E]
    coef = op.ReduceSum(op.Mul(picked, op.Unsqueeze(topk_weights, [2])), [1], keepdims=0)
    coef = op.Unsqueeze(op.Transpose(coef), [2])  # [E, T, 1]
    return op.CastLike(op.ReduceSum(op.Mul(out, op.CastLike(coef, out)), [0], keepdims=0), x)


# ---- linear_decode ------------------------------------------------------------------------


def linear_decode(x, packed_weight, out_features: int):
    """``mlafx::linear_decode``: unpack ``packed[b, p, 2i + j] = W[16b + i, 2p + j]``, then
    ``x @ W^T``."""
    blocks, pairs = _dim(packed_weight, 0), _dim(packed_weight, 1)
    rows = op.Reshape(packed_weight, op.Concat(blocks, pairs, _ints(16, 2), axis=0))
    rows = op.Transpose(rows, perm=[0, 2, 1, 3])  # [blocks, 16, pairs, 2]
    weight = op.Reshape(rows, op.Concat(op.Mul(blocks, [16]), op.Mul(pairs, [2]), axis=0))
    weight = op.Slice(weight, [0, 0], op.Concat(_ints(out_features), _dim(x, 1), axis=0), [0, 1])
    return op.MatMul(x, op.Transpose(weight))


def batched_matmul(x, w):
    """``mlafx::batched_matmul``: ``torch.bmm``, a batched MatMul."""
    return op.MatMul(x, w)


def translation_table() -> dict[torch._ops.OpOverload, object]:
    """``{op overload: onnxscript translation}`` for ``torch.onnx.export``."""
    import mlafx.export.functional_step  # noqa: F401  (defines the *_with_rows ops)
    import mlafx.kernels  # noqa: F401  (registers the mlafx ops)

    mlafx, export_ops = torch.ops.mlafx, torch.ops.mlafx_export
    return {
        mlafx.mla_attention_paged.default: mla_attention_paged,
        mlafx.gather_latent.default: gather_latent,
        mlafx.varlen_attention.default: varlen_attention,
        mlafx.merge_attn_states.default: merge_attn_states,
        mlafx.moe_experts.default: moe_experts,
        mlafx.linear_decode.default: linear_decode,
        mlafx.batched_matmul.default: batched_matmul,
        export_ops.mla_attention_paged_with_rows.default: mla_attention_paged_with_rows,
        export_ops.gather_latent_with_rows.default: gather_latent_with_rows,
    }

// mla_attention_sparse: absorbed MLA over the paged latent cache, restricted per query to the
// positions DeepSeek Sparse Attention's indexer selected (dsa_indexer.cpp).
//
//   q:               [T, H, Lkv + R]   bf16/fp16/fp32, last dim contiguous
//   kv_cache:        [NB, BS, Lkv + R] q's dtype, contiguous
//   block_table:     [B, M] int32      kv_lens: [B] int32   query_start_loc: [B + 1] int32
//   selected:        [T, topk] int64   positions of the query's own sequence, distinct, each
//                                      in 0..kv_lens[b]-1; -1 entries (anywhere) are ignored
//   -> out [T, H, Lkv] (q dtype), lse [H, T] fp32 (natural log of the scaled logits); a query
//      with no selected position gets out 0 and lse -inf (mla_attention_paged's conventions)
//
// The attention core and driver of mla_attention_paged (attention.h, attention_driver.h): a
// group is one query's heads (up to kMaxRows of them), its keys the query's selected rows in
// the order given (the softmax does not depend on it), gathered through the block table. The
// selected rows are translated to cache rows once, up front, while they are checked.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "attention_driver.h"
#include "op_checks.h"

namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::kMaxRows;
using mlafx::op_checks::check_cpu;
using mlafx::op_checks::check_index;
using mlafx::op_checks::check_latent_attention;
using mlafx::op_checks::check_last_dim_contiguous;
using mlafx::op_checks::check_offsets;
using mlafx::op_checks::check_paged_table;
using mlafx::op_checks::is_supported_float;

struct SparseGroup {
  int64_t t, h0, nh;
};

struct SparseProblem {
  const char* q;
  int64_t q_st, q_sh;  // bytes
  const char* cache;
  int64_t row_bytes;
  char* out;
  int64_t out_row_bytes;  // one [Lkv] row
  float* lse;
  int64_t num_heads, num_tokens, topk;
  std::vector<int64_t> rows_of;  // [T, topk]: cache rows (block * BS + offset), valid first
  std::vector<int64_t> count;    // [T]: valid selected positions of each query
  std::vector<SparseGroup> groups;

  int64_t num_groups() const { return static_cast<int64_t>(groups.size()); }
  int64_t group_keys(int64_t g) const { return count[groups[g].t]; }
  int64_t group_rows(int64_t g) const { return groups[g].nh; }
  void rows(int64_t gi, const void** qp, int64_t* limits, void** outp, float** lsep) const {
    const SparseGroup& g = groups[gi];
    for (int64_t r = 0; r < g.nh; ++r) {
      const int64_t h = g.h0 + r;
      qp[r] = q + g.t * q_st + h * q_sh;
      limits[r] = count[g.t];
      outp[r] = out + (g.t * num_heads + h) * out_row_bytes;
      lsep[r] = lse + h * num_tokens + g.t;
    }
  }
  void keys(int64_t gi, int64_t j0, int64_t n, const void** ka, const void** kb,
            const void** v) const {
    const int64_t* rows = rows_of.data() + groups[gi].t * topk;
    for (int64_t k = 0; k < n; ++k) {
      const char* row = cache + rows[j0 + k] * row_bytes;
      ka[k] = row;
      kb[k] = nullptr;
      v[k] = row;
    }
  }
};

// Checks every selected position of every query (in range of its sequence, distinct) and
// translates the valid ones to cache rows, in their order, into p.rows_of / p.count.
void gather_selected(const char* op, SparseProblem& p, const at::Tensor& selected,
                     const at::Tensor& block_table, const at::Tensor& kv_lens,
                     const int32_t* qsl, int64_t qsl_s, int64_t block_size) {
  const int64_t B = block_table.size(0), T = p.num_tokens, K = p.topk;
  const int64_t* sel = selected.const_data_ptr<int64_t>();
  const int64_t s0 = selected.stride(0), s1 = selected.stride(1);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  p.rows_of.assign(static_cast<size_t>(T * K), 0);
  p.count.assign(static_cast<size_t>(T), 0);
  std::vector<int64_t> seen;  // seen[pos] = last query that selected pos (duplicates check)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b * kv_lens.stride(0)];
    seen.assign(static_cast<size_t>(len), -1);
    for (int64_t t = qsl[b * qsl_s]; t < qsl[(b + 1) * qsl_s]; ++t) {
      int64_t n = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t pos = sel[t * s0 + k * s1];
        if (pos == -1) {
          continue;
        }
        TORCH_CHECK_INDEX(pos >= 0 && pos < len, op, ": selected[", t, ", ", k, "] = ", pos,
                          " is out of range for query ", t, " of sequence ", b,
                          " (kv_lens[", b, "] = ", len, "; -1 marks an unused entry)");
        TORCH_CHECK_VALUE(seen[pos] != t, op, ": selected[", t, ", :] holds position ", pos,
                          " twice (query ", t, "); selected positions must be distinct");
        seen[pos] = t;
        const int64_t block = table[b * block_table.stride(0) + (pos / block_size) *
                                                                      block_table.stride(1)];
        p.rows_of[t * K + n++] = block * block_size + pos % block_size;
      }
      p.count[t] = n;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> mla_attention_sparse(
    const at::Tensor& q,                // [T, H, Lkv + R]
    const at::Tensor& kv_cache,         // [NB, BS, Lkv + R]
    const at::Tensor& block_table,      // [B, M] int32
    const at::Tensor& kv_lens,          // [B] int32
    const at::Tensor& query_start_loc,  // [B + 1] int32
    const at::Tensor& selected,         // [T, topk] int64
    double scale, int64_t kv_lora_rank) {
  constexpr const char* op = "mla_attention_sparse";
  check_cpu(op, {&q, &kv_cache, &block_table, &kv_lens, &query_start_loc, &selected});
  check_index(op, "selected", selected, at::kLong, 2);
  check_latent_attention(op, q, kv_cache, block_table, kv_lens, query_start_loc, scale,
                         kv_lora_rank);
  const int64_t T = q.size(0), H = q.size(1), W = q.size(2);
  const int64_t BS = kv_cache.size(1);
  TORCH_CHECK_VALUE(selected.size(0) == T, op, ": selected has ", selected.size(0),
                    " rows but q has ", T, " tokens");
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int64_t qsl_s = query_start_loc.stride(0);

  SparseProblem p;
  p.num_heads = H;
  p.num_tokens = T;
  p.topk = selected.size(1);
  gather_selected(op, p, selected, block_table, kv_lens, qsl, qsl_s, BS);

  at::Tensor out = at::empty({T, H, kv_lora_rank}, q.options());
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) {
    return {out, lse};
  }
  const int64_t elem = static_cast<int64_t>(q.element_size());
  p.q = static_cast<const char*>(q.const_data_ptr());
  p.q_st = q.stride(0) * elem;
  p.q_sh = q.stride(1) * elem;
  p.cache = static_cast<const char*>(kv_cache.const_data_ptr());
  p.row_bytes = W * elem;
  p.out = static_cast<char*>(out.data_ptr());
  p.out_row_bytes = kv_lora_rank * elem;
  p.lse = lse.data_ptr<float>();
  // Groups: head slices of one query (every query has its own keys).
  const int64_t heads_per_group = std::min(H, kMaxRows);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h0 = 0; h0 < H; h0 += heads_per_group) {
      p.groups.push_back({t, h0, std::min(heads_per_group, H - h0)});
    }
  }
  const CoreDims dims{W, 0, kv_lora_rank, static_cast<float>(scale)};
  mlafx::attn::run_attention(p, mlafx::attn::select_core(q.scalar_type(), dims), dims,
                             q.scalar_type());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "mla_attention_sparse(Tensor q, Tensor kv_cache, Tensor block_table, Tensor kv_lens, "
      "Tensor query_start_loc, Tensor selected, float scale, int kv_lora_rank) "
      "-> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("mla_attention_sparse", &mla_attention_sparse); }

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
// The attention core and driver of mla_attention_paged (attention.h, attention_driver.h) over
// a sparse_problem.h problem: a group is one query's heads, its keys the query's selected rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#include "attention.h"
#include "attention_driver.h"
#include "op_checks.h"
#include "sparse_problem.h"

namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::SparseProblem;
using mlafx::op_checks::check_cpu;
using mlafx::op_checks::check_index;
using mlafx::op_checks::check_latent_attention;

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
  TORCH_CHECK_VALUE(selected.size(0) == T, op, ": selected has ", selected.size(0),
                    " rows but q has ", T, " tokens");

  SparseProblem p;
  p.num_heads = H;
  p.reset_keys(T, selected.size(1));
  mlafx::attn::append_selected(op, "selected", "kv_lens", p, selected, kv_cache, block_table,
                               kv_lens, query_start_loc);

  at::Tensor out = at::empty({T, H, kv_lora_rank}, q.options());
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) {
    return {out, lse};
  }
  p.set_rows(q, out, lse);
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

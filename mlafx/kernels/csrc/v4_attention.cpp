// v4_attention: DeepSeek-V4's attention in one pass: each query over its sliding-window rows
// and (compressed layers) its pool entries, with the per-head sink in the softmax's
// denominator only.
//
//   q:               [T, H, c]          bf16/fp16/fp32 (rotated), last dim contiguous
//   query_start_loc: [B + 1] int32
//   window_cache:    [NB, BS, c]        q's dtype, contiguous: one K=V row per token
//   window_table:    [B, M] int32       window_lens: [B] int32 (tokens cached per sequence)
//   window_selected: [T, W] int64       each query's window positions (-1 = unused)
//   sinks:           [H] fp32
//   pool_cache:      [NB', BS', c]      optional, q's dtype, with pool_table [B, M'] int32,
//                                       pool_lens [B] int32 and pool_selected [T, K] int64:
//                                       each query's pool entries (-1 = unused)
//   -> out [T, H, c] (q's dtype):
//        out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}),  s_j = scale * q.k_j,
//      the keys j being the selected window rows and pool entries (v_j = k_j, the whole row).
//      A query with no key gets 0.
//
// One attention-driver problem (sparse_problem.h) whose keys are both caches' rows, so window
// and pool share one online softmax and the threads (a decode query's 128 window rows and 512
// pool entries are one 640-key group, split across threads like any other). Each row ends in
// fp32 and finish() scales it by the sink's factor sigmoid(lse - sink) = (sum e^s) /
// (sum e^s + e^sink) before its one rounding to q's dtype. The two-pass form it replaces
// (mla_attention_sparse per cache, merge_attn_states, the sink in torch) is measured against
// it by `mlafx bench kernels --only v4`.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "attention.h"
#include "attention_driver.h"
#include "gemm_aten.h"
#include "op_checks.h"
#include "sparse_problem.h"

namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::SparseProblem;
using mlafx::op_checks::check_cpu;
using mlafx::op_checks::check_index;
using mlafx::op_checks::check_latent_attention;

struct V4Problem : SparseProblem {
  const float* sinks = nullptr;  // [H]
  int64_t width = 0;
  at::ScalarType dtype = at::kFloat;

  void finish(int64_t gi, float* const* rows, float* const* lse) const {
    switch (dtype) {
      case at::kBFloat16:
        return finish_as<c10::BFloat16>(gi, rows, lse);
      case at::kHalf:
        return finish_as<c10::Half>(gi, rows, lse);
      default:
        return finish_as<float>(gi, rows, lse);
    }
  }

  template <typename Out>
  void finish_as(int64_t gi, float* const* rows, float* const* lse) const {
    const mlafx::attn::SparseGroup& g = groups[gi];
    for (int64_t r = 0; r < g.nh; ++r) {
      // sigmoid(lse - sink): 0 for a query without keys (lse = -inf)
      const float keep = 1.f / (1.f + std::exp(sinks[g.h0 + r] - *lse[r]));
      float* row = rows[r];
      for (int64_t i = 0; i < width; ++i) {
        row[i] *= keep;
      }
      mlafx::round_row(
          row, reinterpret_cast<Out*>(out + (g.t * num_heads + g.h0 + r) * out_row_bytes), width);
    }
  }
};

// The pool's tensors: all four or none; the cache is checked as the window's is.
void check_pool(const char* op, const at::Tensor& q, const at::Tensor& query_start_loc,
                double scale, const std::optional<at::Tensor>& cache,
                const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& lens,
                const std::optional<at::Tensor>& selected) {
  const int given = cache.has_value() + table.has_value() + lens.has_value() +
                    selected.has_value();
  TORCH_CHECK_VALUE(given == 0 || given == 4, op, ": pool_cache, pool_table, pool_lens and "
                    "pool_selected go together (all four or none), got ", given, " of them");
  if (given == 0) {
    return;
  }
  check_cpu(op, {&*cache, &*table, &*lens, &*selected});
  check_index(op, "pool_selected", *selected, at::kLong, 2);
  check_latent_attention(op, q, *cache, *table, *lens, query_start_loc, scale, q.size(2),
                         {"pool_cache", "pool_table", "pool_lens"});
  TORCH_CHECK_VALUE(selected->size(0) == q.size(0), op, ": pool_selected has ",
                    selected->size(0), " rows but q has ", q.size(0), " tokens");
}

at::Tensor v4_attention(const at::Tensor& q, const at::Tensor& query_start_loc,
                        const at::Tensor& window_cache, const at::Tensor& window_table,
                        const at::Tensor& window_lens, const at::Tensor& window_selected,
                        const at::Tensor& sinks, double scale,
                        const std::optional<at::Tensor>& pool_cache,
                        const std::optional<at::Tensor>& pool_table,
                        const std::optional<at::Tensor>& pool_lens,
                        const std::optional<at::Tensor>& pool_selected) {
  constexpr const char* op = "v4_attention";
  check_cpu(op, {&q, &query_start_loc, &window_cache, &window_table, &window_lens,
                 &window_selected, &sinks});
  check_index(op, "window_selected", window_selected, at::kLong, 2);
  // the window is a latent cache whose whole row is the value
  check_latent_attention(op, q, window_cache, window_table, window_lens, query_start_loc, scale,
                         q.dim() == 3 ? q.size(2) : 1,
                         {"window_cache", "window_table", "window_lens"});
  const int64_t T = q.size(0), H = q.size(1), c = q.size(2);
  TORCH_CHECK_VALUE(window_selected.size(0) == T, op, ": window_selected has ",
                    window_selected.size(0), " rows but q has ", T, " tokens");
  TORCH_CHECK_TYPE(sinks.scalar_type() == at::kFloat, op, ": sinks must be float32, got ",
                   sinks.scalar_type());
  TORCH_CHECK_VALUE(sinks.dim() == 1 && sinks.size(0) == H, op, ": sinks must be [", H,
                    "] (one per head), got shape ", sinks.sizes());
  check_pool(op, q, query_start_loc, scale, pool_cache, pool_table, pool_lens, pool_selected);
  const bool has_pool = pool_cache.has_value();

  V4Problem p;
  p.num_heads = H;
  p.reset_keys(T, window_selected.size(1) + (has_pool ? pool_selected->size(1) : 0));
  mlafx::attn::append_selected(op, "window_selected", "window_lens", p, window_selected,
                               window_cache, window_table, window_lens, query_start_loc);
  if (has_pool) {
    mlafx::attn::append_selected(op, "pool_selected", "pool_lens", p, *pool_selected,
                                 *pool_cache, *pool_table, *pool_lens, query_start_loc);
  }

  at::Tensor out = at::empty({T, H, c}, q.options());
  if (T == 0 || H == 0 || c == 0) {
    return out;
  }
  const at::Tensor sinks_c = sinks.contiguous();
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  p.set_rows(q, out, lse);
  p.sinks = sinks_c.const_data_ptr<float>();
  p.width = c;
  p.dtype = q.scalar_type();
  const CoreDims dims{c, 0, c, static_cast<float>(scale)};
  mlafx::attn::run_attention(p, mlafx::attn::select_core(q.scalar_type(), dims), dims,
                             q.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "v4_attention(Tensor q, Tensor query_start_loc, Tensor window_cache, "
      "Tensor window_table, Tensor window_lens, Tensor window_selected, Tensor sinks, "
      "float scale, Tensor? pool_cache=None, Tensor? pool_table=None, Tensor? pool_lens=None, "
      "Tensor? pool_selected=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("v4_attention", &v4_attention); }

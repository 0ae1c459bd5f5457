// moe_experts_fp8: moe_experts (moe.cpp) over block FP8 expert weights as DeepSeek stores
// them (fp8.h), stacked per expert:
//
//   x:            [T, D]      bf16/fp16/fp32, last dim contiguous (rows may be strided)
//   topk_ids:     [T, k]      int64 in [0, E); ids may repeat within a token
//   topk_weights: [T, k]      float32
//   w13:          [E, 2I, D]  float8_e4m3fn: gate rows [0, I), then up rows
//   w13_scale:    [E, 2 ceil(I/bn), ceil(D/bk)] float32: the gate's blocks, then the up's
//                 (each part keeps its own blocks, so I need not be a multiple of bn)
//   w2:           [E, D, I]   float8_e4m3fn
//   w2_scale:     [E, ceil(D/bn), ceil(I/bk)] float32
//   out:          [T, D]      x's dtype, contiguous:
//     [g | u] = x[t] @ W13[e]^T rounded to x's dtype (with swiglu_limit: g = min(g, limit),
//     u = clamp(u, -limit, limit), as DeepSeek-V4's experts), h = silu(g) * u in x's dtype
//     (silu in fp32 of the rounded g, rounded, times u), y = h @ W2[e]^T rounded to x's dtype;
//     every product as linear_fp8; out[t] = sum_j topk_weights[t, j] * y in fp32, rounded once.
//
// The driver is expert_stacks.h's (shared with moe_experts_fp4): pairs grouped by expert, each
// picked expert's weights read once per call.
// Python reference: models.fp8.moe_experts_fp8_reference.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "expert_stacks.h"
#include "fp8_aten.h"

namespace mlafx {
namespace {

// The block FP8 stacks for expert_stacks.h.
struct Fp8Stacks {
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  float swiglu_limit;
  int64_t block_n, block_k;
  const uint8_t* w13;
  const float* s13;
  const uint8_t* w2;
  const float* s2;
  int64_t s13_expert, s2_expert;  // scale floats per expert
  const float* weights;           // topk_weights, contiguous [T, k]
  float* sum;                     // fp32 [T, D]

  Fp8Weight gate(int64_t e) const {
    return fp8_view(w13 + e * 2 * inter * hidden, s13 + e * s13_expert, hidden, block_n, block_k);
  }
  Fp8Weight up(int64_t e) const {
    Fp8Weight w = gate(e);
    w.w += inter * hidden;
    w.scale += (inter + block_n - 1) / block_n * w.lds;
    return w;
  }
  Fp8Weight down(int64_t e) const {
    return fp8_view(w2 + e * hidden * inter, s2 + e * s2_expert, inter, block_n, block_k);
  }
  void dot(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
           int64_t ldo) const {
    fp8_dot(w, x, M, n0, n1, out, ldo);
  }
  void product(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
               int64_t ldo) const {
    fp8_product_f32(w, x, M, N, out, ldo);
  }
  int64_t row_grain(int64_t K) const { return fp8_row_grain(K); }
  bool uses_tiles(int64_t M) const { return fp8_uses_tiles(M, block_k); }
  at::Tensor empty_staging(int64_t M, int64_t K) const { return empty_tiles(M, K, block_k); }
  void stage(Fp8Activations& a) const { a.stage_tiles(block_k); }
  void stage_rows(const Fp8Rows& rows, int64_t M, int64_t K, uint16_t* tiles) const {
    mlafx::stage_rows(rows, M, K, block_k, tiles);
  }
};

at::Tensor moe_experts_fp8(const at::Tensor& x,             // [T, D]
                           const at::Tensor& topk_ids,      // [T, k] int64
                           const at::Tensor& topk_weights,  // [T, k] float32
                           const at::Tensor& w13,           // [E, 2I, D] e4m3
                           const at::Tensor& w13_scale,     // [E, 2 ceil(I/bn), ceil(D/bk)]
                           const at::Tensor& w2,            // [E, D, I] e4m3
                           const at::Tensor& w2_scale,      // [E, ceil(D/bn), ceil(I/bk)]
                           int64_t block_n, int64_t block_k,
                           std::optional<double> swiglu_limit) {
  constexpr const char* op = "moe_experts_fp8";
  const float limit = checked_swiglu_limit(op, swiglu_limit);
  expert_stacks::check_routing(op, x, topk_ids, topk_weights);
  TORCH_CHECK_VALUE(w13.dim() == 3 && w2.dim() == 3,
                    "moe_experts_fp8: w13 and w2 must be [num_experts, rows, cols], got shapes ",
                    w13.sizes(), " and ", w2.sizes());
  const int64_t D = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK_VALUE(block_n > 0, "moe_experts_fp8: block_n must be positive, got ", block_n);
  check_fp8_weight(op, "w13", w13, w13_scale, {E}, 2 * I, D, block_n, block_k,
                   2 * ((I + block_n - 1) / block_n));
  check_fp8_weight(op, "w2", w2, w2_scale, {E}, D, I, block_n, block_k);
  const auto* w13_bytes = static_cast<const uint8_t*>(w13.const_data_ptr());
  const auto* w2_bytes = static_cast<const uint8_t*>(w2.const_data_ptr());
  return expert_stacks::run_op(
      op, x, topk_ids, topk_weights, E, I, [&](int64_t k, const float* weights, float* sum) {
        return Fp8Stacks{k,
                         D,
                         I,
                         limit,
                         block_n,
                         block_k,
                         w13_bytes,
                         w13_scale.const_data_ptr<float>(),
                         w2_bytes,
                         w2_scale.const_data_ptr<float>(),
                         w13_scale.stride(0),
                         w2_scale.stride(0),
                         weights,
                         sum};
      });
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts_fp8(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
      "Tensor w13_scale, Tensor w2, Tensor w2_scale, int block_n, int block_k, "
      "float? swiglu_limit=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("moe_experts_fp8", &mlafx::moe_experts_fp8); }

// moe_experts_fp4: routed experts over FP4 expert weights as DeepSeek-V4 publishes them (fp4.h:
// e2m1 nibbles and a ue8m0 scale per 32 along K), stacked per expert:
//
//   x:            [T, D]       bf16/fp16/fp32, last dim contiguous (rows may be strided)
//   topk_ids:     [T, k]       int64 in [0, E); ids may repeat within a token
//   topk_weights: [T, k]       float32
//   w13:          [E, 2I, D/2] int8/uint8 packed nibbles: gate rows [0, I), then up rows
//   w13_scale:    [E, 2I, ceil(D/32)] uint8 / float8_e8m0fnu
//   w2:           [E, D, I/2]  int8/uint8 packed nibbles
//   w2_scale:     [E, D, ceil(I/32)]
//   swiglu_limit: float or None (the plain SwiGLU)
//   out:          [T, D]       x's dtype, contiguous:
//     [g | u] = x[t] @ W13[e]^T rounded to x's dtype; g = min(g, limit), u = clamp(u, -limit,
//     limit); h = silu(g) * u in x's dtype (silu in fp32 of the rounded g, rounded, times u);
//     y = h @ W2[e]^T rounded to x's dtype; every product exact per term with fp32 sums per 32
//     (fp4.h); out[t] = sum_j topk_weights[t, j] * y in fp32, rounded once.
//
// The driver is expert_stacks.h's (shared with moe_experts_fp8): pairs grouped by expert, each
// picked expert's bytes read once per call, never widened in memory but for a tile of rows at
// a time (many rows of x).
// Python reference: models.deepseek_v4.quantized.moe_experts_fp4_reference.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cpu_features.h"
#include "expert_stacks.h"
#include "fp4.h"
#include "fp8_aten.h"
#include "parallel_chunks.h"

namespace mlafx {
namespace {

bool is_byte(at::ScalarType t) {
  return t == at::kByte || t == at::kChar || t == at::ScalarType::Float8_e8m0fnu;
}

// w [E, N, K/2] packed nibbles and scale [E, N, ceil(K/32)] ue8m0 bytes, both contiguous.
void check_fp4_weight(const char* name, const at::Tensor& w, const at::Tensor& scale, int64_t E,
                      int64_t N, int64_t K) {
  TORCH_CHECK_TYPE(is_byte(w.scalar_type()) && is_byte(scale.scalar_type()),
                   "moe_experts_fp4: ", name, " and its scale must be bytes (int8/uint8 nibbles, "
                   "uint8/float8_e8m0fnu scales), got ", w.scalar_type(), " and ",
                   scale.scalar_type());
  TORCH_CHECK_VALUE(K % 2 == 0, "moe_experts_fp4: ", name, " packs two weights per byte, so its ",
                    "K must be even, got ", K);
  const int64_t groups = (K + kFp4Group - 1) / kFp4Group;
  TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == E && w.size(1) == N && w.size(2) == K / 2,
                    "moe_experts_fp4: ", name, " must be [", E, ", ", N, ", ", K / 2, "], got ",
                    w.sizes());
  TORCH_CHECK_VALUE(scale.dim() == 3 && scale.size(0) == E && scale.size(1) == N &&
                        scale.size(2) == groups,
                    "moe_experts_fp4: ", name, "_scale must be [", E, ", ", N, ", ", groups,
                    "], got ", scale.sizes());
  TORCH_CHECK_VALUE(w.is_contiguous() && scale.is_contiguous(), "moe_experts_fp4: ", name,
                    " and its scale must be contiguous");
}

// The FP4 stacks for expert_stacks.h.
struct Fp4Stacks {
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  float swiglu_limit;
  const uint8_t* w13;
  const uint8_t* s13;
  const uint8_t* w2;
  const uint8_t* s2;
  const float* weights;  // topk_weights, contiguous [T, k]
  float* sum;            // fp32 [T, D]

  static Fp4Weight view(const uint8_t* w, const uint8_t* scale, int64_t K) {
    return Fp4Weight{w, K / 2, scale, (K + kFp4Group - 1) / kFp4Group, K};
  }
  Fp4Weight gate(int64_t e) const {
    const Fp4Weight w = view(w13, s13, hidden);
    return view(w.w + e * 2 * inter * w.ldw, w.scale + e * 2 * inter * w.lds, hidden);
  }
  Fp4Weight up(int64_t e) const {
    Fp4Weight w = gate(e);
    w.w += inter * w.ldw;
    w.scale += inter * w.lds;
    return w;
  }
  Fp4Weight down(int64_t e) const {
    const Fp4Weight w = view(w2, s2, inter);
    return view(w.w + e * hidden * w.ldw, w.scale + e * hidden * w.lds, inter);
  }
  void dot(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
           int64_t ldo) const {
    fp4_dot(w, x, M, n0, n1, out, ldo);
  }
  void product(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
               int64_t ldo) const {
    fp4_product_f32(w, x, M, N, out, ldo);
  }
  int64_t row_grain(int64_t K) const { return fp8_row_grain(K / 2); }
  // bf16 rows staged once per call in the kernel's order: AMX tiles (fp4_uses_amx), else up to
  // 8 rows for the AVX-512 few-rows kernel
  bool uses_tiles(int64_t M) const {
    return use_avx512_bf16() && (fp4_uses_amx(M) || M <= 8);
  }
  at::Tensor empty_staging(int64_t M, int64_t K) const {
    const int64_t elements = fp4_uses_amx(M) ? avx512::fp4_tile_elements(M, K)
                                             : M * avx512::fp4_staged_ld(K);
    return at::empty({elements}, at::kShort);  // 64-byte aligned (ATen's CPU allocator)
  }
  void stage_rows(const Fp8Rows& rows, int64_t M, int64_t K, uint16_t* tiles) const {
    if (fp4_uses_amx(M)) {
      avx512::fp4_stage_tiles(rows.bf16, rows.ld, K, M, tiles);
    } else {
      avx512::fp4_stage_rows(rows.bf16, rows.ld, K, M, tiles);
    }
  }
  // an expert's many rows for product(): AMX tiles, 16 rows of x per thread chunk
  void stage(Fp8Activations& a) const {
    if (!a.is_bf16 || a.cols == 0 || !fp4_uses_amx(a.rows)) {
      return;
    }
    a.tiles = empty_staging(a.rows, a.cols);
    auto* tiles = reinterpret_cast<uint16_t*>(a.tiles.data_ptr<int16_t>());
    const int64_t per_block = avx512::fp4_tile_elements(16, a.cols);
    const Fp8Rows rows = a.view();
    mlafx::parallel_chunks(0, (a.rows + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
      avx512::fp4_stage_tiles(rows.bf16 + b0 * 16 * rows.ld, rows.ld, a.cols,
                              std::min(a.rows, b1 * 16) - b0 * 16, tiles + b0 * per_block);
    });
  }
};

at::Tensor moe_experts_fp4(const at::Tensor& x,             // [T, D]
                           const at::Tensor& topk_ids,      // [T, k] int64
                           const at::Tensor& topk_weights,  // [T, k] float32
                           const at::Tensor& w13,           // [E, 2I, D/2] nibbles
                           const at::Tensor& w13_scale,     // [E, 2I, ceil(D/32)] ue8m0
                           const at::Tensor& w2,            // [E, D, I/2] nibbles
                           const at::Tensor& w2_scale,      // [E, D, ceil(I/32)] ue8m0
                           std::optional<double> swiglu_limit) {
  constexpr const char* op = "moe_experts_fp4";
  const float limit = checked_swiglu_limit(op, swiglu_limit);
  expert_stacks::check_routing(op, x, topk_ids, topk_weights);
  TORCH_CHECK_VALUE(w13.dim() == 3 && w2.dim() == 3,
                    "moe_experts_fp4: w13 and w2 must be [num_experts, rows, bytes], got shapes ",
                    w13.sizes(), " and ", w2.sizes());
  const int64_t D = x.size(1), E = w13.size(0), I = 2 * w2.size(2);
  check_fp4_weight("w13", w13, w13_scale, E, 2 * I, D);
  check_fp4_weight("w2", w2, w2_scale, E, D, I);
  const auto bytes = [](const at::Tensor& t) {
    return static_cast<const uint8_t*>(t.const_data_ptr());
  };
  return expert_stacks::run_op(
      op, x, topk_ids, topk_weights, E, I, [&](int64_t k, const float* weights, float* sum) {
        return Fp4Stacks{k,         D,         I,
                         limit,     bytes(w13), bytes(w13_scale),
                         bytes(w2), bytes(w2_scale), weights,
                         sum};
      });
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts_fp4(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
      "Tensor w13_scale, Tensor w2, Tensor w2_scale, float? swiglu_limit=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("moe_experts_fp4", &mlafx::moe_experts_fp4); }

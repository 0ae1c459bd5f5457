// linear_fp8: y = x @ W^T (+ bias) for W stored as DeepSeek's block-scaled FP8 (fp8.h,
// mlafx/kernels/fp8_format.py):
//
//   linear_fp8(x [M, K], weight [N, K] float8_e4m3fn, weight_scale [ceil(N/bn), ceil(K/bk)]
//              float32, block_n = bn, block_k = bk, bias? [N]) -> out [M, N]  (x's dtype)
//       x bf16/fp16/fp32, last dim contiguous; bk a multiple of 32. Each product
//       x[m, k] * e4m3(W[n, k]) is exact in fp32; per k block the fp32 sum is scaled by the
//       block's scale once; the blocks' sum (fp32) is rounded once to x's dtype; the bias is
//       added after that rounding (as linear_quantized).
//
// Threads split the weight's rows, each a contiguous range of >= ~64 KB of weight, so with few
// rows of x every weight byte is read once, by one thread. Within a range the kernel runs a
// step of rows at a time over all rows of x into an fp32 scratch of at most ~256 KB, rounded
// into the output right away. Python reference: fp8_format.linear_fp8_reference.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "batch_invariant.h"
#include "cpu_features.h"
#include "fp8_aten.h"
#include "gemm_aten.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"

namespace mlafx {

Fp8Rows Fp8Activations::view(int64_t row0) const {
  if (is_bf16) {
    const uint16_t* staged = row0 == 0 && tiles.defined()
                                 ? static_cast<const uint16_t*>(tiles.const_data_ptr())
                                 : nullptr;
    return Fp8Rows{reinterpret_cast<const uint16_t*>(data.const_data_ptr<c10::BFloat16>()) +
                       row0 * ld,
                   nullptr, ld, staged};
  }
  return Fp8Rows{nullptr, data.const_data_ptr<float>() + row0 * ld, ld};
}

void Fp8Activations::stage_tiles(int64_t block_k) {
  tiles = mlafx::stage_tiles(view(), rows, cols, block_k);
}

bool fp8_uses_tiles(int64_t M, int64_t block_k) {
  if (fp8_tiles_are_amx(block_k)) {
    return M >= kFp8TileMinRows || (M > 0 && batch_invariant());
  }
  return M >= kFp8PairsMinRows && use_avx512_bf16() && !batch_invariant();
}

at::Tensor empty_tiles(int64_t M, int64_t K, int64_t block_k) {
  const int64_t elements = fp8_tiles_are_amx(block_k) ? avx512::fp8_tile_elements(M, K)
                                                      : avx512::fp8_pair_elements(M, K);
  at::Tensor tiles = at::empty({elements}, at::kShort);
  // ATen's CPU allocator aligns to 64 bytes: the tiles' rows never straddle two lines
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(tiles.data_ptr()) % 64 == 0);
  return tiles;
}

void stage_rows(const Fp8Rows& x, int64_t M, int64_t K, int64_t block_k, uint16_t* tiles) {
  if (fp8_tiles_are_amx(block_k)) {
    mlafx::parallel_chunks(0, (M + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
      avx512::fp8_stage_tiles(x.bf16, x.ld, K, b0 * 16, std::min(M, b1 * 16), tiles);
    });
    return;
  }
  const int64_t panels = (M + avx512::kFp8PanelRows - 1) / avx512::kFp8PanelRows;
  mlafx::parallel_chunks(0, panels, 1, [&](int64_t q0, int64_t q1) {
    avx512::fp8_stage_pairs(x.bf16, x.ld, K, M, q0, q1, tiles);
  });
}

at::Tensor stage_tiles(const Fp8Rows& x, int64_t M, int64_t K, int64_t block_k) {
  if (x.bf16 == nullptr || !fp8_uses_tiles(M, block_k) || K == 0) {
    return {};
  }
  at::Tensor tiles = empty_tiles(M, K, block_k);
  stage_rows(x, M, K, block_k, reinterpret_cast<uint16_t*>(tiles.data_ptr<int16_t>()));
  return tiles;
}

namespace {

Fp8Activations empty_activations(int64_t rows, int64_t cols, bool is_bf16) {
  Fp8Activations out;
  out.rows = rows;
  out.cols = cols;
  out.is_bf16 = is_bf16;
  const int64_t per_line = is_bf16 ? 32 : 16;  // elements per 64-byte line
  out.ld = std::max<int64_t>(per_line, (cols + per_line - 1) / per_line * per_line);
  if ((out.ld * (is_bf16 ? 2 : 4)) % 4096 == 0) {
    out.ld += per_line;
  }
  out.data = at::empty({rows, out.ld}, at::TensorOptions().dtype(is_bf16 ? at::kBFloat16 : at::kFloat));
  return out;
}

}  // namespace

Fp8Activations fp8_activations(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const bool is_bf16 = x.scalar_type() == at::kBFloat16 && use_avx512_bf16();
  Fp8Activations out = empty_activations(M, K, is_bf16);
  if (M == 0 || K == 0) {
    return out;
  }
  if (is_bf16) {
    const auto* src = x.const_data_ptr<c10::BFloat16>();
    auto* dst = out.data.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(dst + m * out.ld, src + m * ldx, K * sizeof(c10::BFloat16));
    }
    return out;
  }
  float* dst = out.data.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fp8_activations", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    mlafx::parallel_chunks(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t k = 0; k < K; ++k) dst[m * out.ld + k] = static_cast<float>(data[m * ldx + k]);
      }
    });
  });
  return out;
}

Fp8Activations gather_rows(const Fp8Activations& src, const std::vector<int64_t>& index) {
  Fp8Activations out = empty_activations(static_cast<int64_t>(index.size()), src.cols, src.is_bf16);
  const int64_t row_bytes = src.ld * static_cast<int64_t>(src.data.element_size());
  const auto* from = static_cast<const char*>(src.data.const_data_ptr());
  auto* to = static_cast<char*>(out.data.data_ptr());
  for (int64_t r = 0; r < out.rows; ++r) {
    std::memcpy(to + r * row_bytes, from + index[static_cast<size_t>(r)] * row_bytes, row_bytes);
  }
  return out;
}

void check_fp8_weight(const char* op, const char* name, const at::Tensor& w,
                      const at::Tensor& scale, at::IntArrayRef lead, int64_t N, int64_t K,
                      int64_t block_n, int64_t block_k, int64_t scale_rows) {
  TORCH_CHECK(w.device().is_cpu() && scale.device().is_cpu(), op, ": ", name,
              " and its scale must be on the CPU");
  TORCH_CHECK_VALUE(block_n > 0 && block_k > 0 && block_k % kFp8KStep == 0, op,
                    ": the block must be [block_n > 0, block_k a positive multiple of ",
                    kFp8KStep, "], got [", block_n, ", ", block_k, "]");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat8_e4m3fn, op, ": ", name,
                   " must be float8_e4m3fn, got ", w.scalar_type());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, op, ": ", name,
                   "'s scale must be float32, got ", scale.scalar_type());
  std::vector<int64_t> want_w(lead.begin(), lead.end());
  want_w.push_back(N);
  want_w.push_back(K);
  std::vector<int64_t> want_s(lead.begin(), lead.end());
  want_s.push_back(scale_rows >= 0 ? scale_rows : (N + block_n - 1) / block_n);
  want_s.push_back((K + block_k - 1) / block_k);
  TORCH_CHECK_VALUE(w.sizes() == at::IntArrayRef(want_w), op, ": ", name, " must be ",
                    at::IntArrayRef(want_w), ", got ", w.sizes());
  TORCH_CHECK_VALUE(scale.sizes() == at::IntArrayRef(want_s), op, ": ", name,
                    "'s scale must be ", at::IntArrayRef(want_s), " (one per [", block_n, ", ",
                    block_k, "] block), got ", scale.sizes());
  TORCH_CHECK_VALUE(w.is_contiguous() && scale.is_contiguous(), op, ": ", name,
                    " and its scale must be contiguous");
}

Fp8Weight fp8_view(const uint8_t* w, const float* scale, int64_t K, int64_t block_n,
                   int64_t block_k) {
  return Fp8Weight{w, K, scale, (K + block_k - 1) / block_k, K, block_n, block_k};
}

// whole 16-row tiles (the AMX kernel's)
int64_t fp8_row_grain(int64_t K) {
  return std::max<int64_t>(16, (int64_t{64} << 10) / std::max<int64_t>(K, 1) / 16 * 16);
}

namespace {

// Many fp32 rows of x (fp16/fp32 activations, or CPUs without AVX-512 BF16): the weight
// dequantized to fp32 a tile of rows at a time (w * s, rounded once: a relative 2^-24 per
// weight) and multiplied by an fp32 GEMM (at::mm: MKL/oneDNN). bf16 rows take the tile kernels.
constexpr int64_t kGemmTileRows = 1024;

// x rows as an fp32 [M, K] tensor (a view of the fp32 rows, else a widened copy).
at::Tensor rows_f32(const Fp8Rows& x, int64_t M, int64_t K) {
  if (x.bf16 == nullptr) {
    return at::from_blob(const_cast<float*>(x.f32), {M, K}, {x.ld, 1}, at::kFloat);
  }
  const at::Tensor bf16 = at::from_blob(const_cast<uint16_t*>(x.bf16), {M, K}, {x.ld, 1},
                                        at::kBFloat16);
  return bf16.to(at::kFloat);
}

void dequantize(const Fp8Weight& w, int64_t n0, int64_t n1, float* out) {
  fp8_dequantize(w, n0, n1, out);
}
void dequantize(const Fp4Weight& w, int64_t n0, int64_t n1, float* out) {
  fp4_dequantize(w, n0, n1, out);
}
void dot(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
         int64_t ldo) {
  fp8_dot(w, x, M, n0, n1, out, ldo);
}
void dot(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
         int64_t ldo) {
  fp4_dot(w, x, M, n0, n1, out, ldo);
}
int64_t row_bytes(const Fp8Weight& w) { return w.K; }
int64_t row_bytes(const Fp4Weight& w) { return w.K / 2; }

// Rows [n0, n1) of the dequantized weight, fp32 [n1 - n0, K].
template <typename Weight>
at::Tensor dequantized_rows(const Weight& w, int64_t n0, int64_t n1) {
  at::Tensor out = at::empty({n1 - n0, w.K}, at::kFloat);
  float* data = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, fp8_row_grain(row_bytes(w)) / 4);
  mlafx::parallel_chunks(n0, n1, grain, [&](int64_t a, int64_t b) {
    dequantize(w, a, b, data + (a - n0) * w.K);
  });
  return out;
}

template <typename Weight>
void gemm_product_f32(const Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                      int64_t ldo) {
  const at::Tensor x32 = rows_f32(x, M, w.K);
  const at::Tensor dst = at::from_blob(out, {M, N}, {ldo, 1}, at::kFloat);
  for (int64_t n0 = 0; n0 < N; n0 += kGemmTileRows) {
    const int64_t n1 = std::min(N, n0 + kGemmTileRows);
    dst.narrow(1, n0, n1 - n0).copy_(at::mm(x32, dequantized_rows(w, n0, n1).t()));
  }
}

template <typename Weight>
void product_f32(const Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                 int64_t ldo) {
  if (fp8_uses_gemm(M, x)) {
    gemm_product_f32(w, x, M, N, out, ldo);
    return;
  }
  mlafx::parallel_chunks(0, N, fp8_row_grain(row_bytes(w)), [&](int64_t n0, int64_t n1) {
    dot(w, x, M, n0, n1, out + n0, ldo);
  });
}

}  // namespace

bool fp8_uses_gemm(int64_t M, const Fp8Rows& x) {
  return M >= kFp8GemmRows && x.tiles == nullptr && !batch_invariant();
}

void fp8_product_f32(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                     int64_t ldo) {
  product_f32(w, x, M, N, out, ldo);
}

void fp4_product_f32(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                     int64_t ldo) {
  if (x.bf16 == nullptr || M < kFp4Bf16GemmRows || x.tiles != nullptr) {  // tiles: AMX
    product_f32(w, x, M, N, out, ldo);
    return;
  }
  // bf16 rows: the weight dequantized to bf16 (exact) a tile of rows at a time, a bf16 GEMM
  // contiguous: oneDNN's bf16 GEMM was seen to read A's row padding past K (uninitialised
  // here; a NaN there times B's zero padding made whole rows NaN)
  const at::Tensor xb = at::from_blob(const_cast<uint16_t*>(x.bf16), {M, w.K}, {x.ld, 1},
                                      at::kBFloat16).contiguous();
  const at::Tensor dst = at::from_blob(out, {M, N}, {ldo, 1}, at::kFloat);
  const int64_t grain = std::max<int64_t>(1, fp8_row_grain(w.K / 2) / 4);
  for (int64_t n0 = 0; n0 < N; n0 += kGemmTileRows) {
    const int64_t n1 = std::min(N, n0 + kGemmTileRows);
    at::Tensor tile = at::empty({n1 - n0, w.K}, at::kBFloat16);
    auto* bits = reinterpret_cast<uint16_t*>(tile.data_ptr<c10::BFloat16>());
    mlafx::parallel_chunks(n0, n1, grain, [&](int64_t a, int64_t b) {
      fp4_dequantize_bf16(w, a, b, bits + (a - n0) * w.K);
    });
    dst.narrow(1, n0, n1 - n0).copy_(at::mm(xb, tile.t()));
  }
}

namespace {

constexpr int64_t kScratchFloats = 64 << 10;  // 256 KB per thread

template <typename scalar_t>
void run_range(const Fp8Weight& w, const Fp8Activations& xa, int64_t M, int64_t N, int64_t n0,
               int64_t n1, scalar_t* out) {
  // whole 16-row tiles (the AMX kernel's); at least a 64-row chunk of the pairs GEMM, which
  // streams all of the staged x once per call
  const int64_t least = xa.tiles.defined() && !fp8_tiles_are_amx(w.block_k) ? 64 : 16;
  const int64_t step =
      std::clamp<int64_t>(kScratchFloats / std::max<int64_t>(M, 1), least, 1024) / 16 * 16;
  ScratchVector<float> scratch(static_cast<size_t>(M * std::min(step, n1 - n0)));
  const Fp8Rows x = xa.view();
  for (int64_t s0 = n0; s0 < n1; s0 += step) {
    const int64_t s1 = std::min(n1, s0 + step);
    const int64_t ld = s1 - s0;
    fp8_dot(w, x, M, s0, s1, scratch.data(), ld);
    for (int64_t m = 0; m < M; ++m) {
      round_row(scratch.data() + m * ld, out + m * N + s0, ld);
    }
  }
}

at::Tensor linear_fp8(const at::Tensor& x,       // [M, K]
                      const at::Tensor& weight,  // [N, K] float8_e4m3fn
                      const at::Tensor& scale,   // [ceil(N/bn), ceil(K/bk)] float32
                      int64_t block_n, int64_t block_k,
                      const std::optional<at::Tensor>& bias) {  // [N] or none
  TORCH_CHECK(x.device().is_cpu(), "linear_fp8: x must be on the CPU, got ", x.device());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "linear_fp8: x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "linear_fp8: x must be [num_rows, in_features], got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "linear_fp8: weight must be [out_features, "
                    "in_features], got shape ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_fp8_weight("linear_fp8", "weight", weight, scale, {}, N, K, block_n, block_k);
  TORCH_CHECK_VALUE(K <= 1 || x.stride(1) == 1,
                    "linear_fp8: x's last dim must be contiguous, got strides ", x.strides());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N,
                      "linear_fp8: bias must be [out_features] = [", N, "], got shape ",
                      bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "linear_fp8: bias dtype ",
                     bias->scalar_type(), " must equal x's dtype ", x.scalar_type());
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) {
    return out;
  }
  if (K == 0) {
    out.zero_();
  } else {
    Fp8Activations xa = fp8_activations(x);
    xa.stage_tiles(block_k);
    const Fp8Weight w = fp8_view(static_cast<const uint8_t*>(weight.const_data_ptr()),
                                 scale.const_data_ptr<float>(), K, block_n, block_k);
    if (fp8_uses_gemm(M, xa.view())) {
      at::Tensor full = at::empty({M, N}, at::kFloat);
      fp8_product_f32(w, xa.view(), M, N, full.data_ptr<float>(), N);
      out.copy_(full);
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_fp8", [&] {
        scalar_t* out_data = out.data_ptr<scalar_t>();
        mlafx::parallel_chunks(0, N, fp8_row_grain(K), [&](int64_t n0, int64_t n1) {
          run_range(w, xa, M, N, n0, n1, out_data);
        });
      });
    }
  }
  if (has_bias) {
    out.add_(*bias);
  }
  return out;
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "linear_fp8(Tensor x, Tensor weight, Tensor weight_scale, int block_n, int block_k, "
      "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("linear_fp8", &mlafx::linear_fp8); }

// linear_decode: y = x @ W^T for a few rows of x (decode-shaped GEMMs: lm_head, attention
// projections, shared experts, dense MLPs), streaming W once at memory bandwidth; and
// pack_linear_weight, which puts W once, at load time, into the layout that kernel reads.
//
//   pack_linear_weight(weight [N, K]) -> packed [ceil(N/16), ceil(K/2), 32]   (same dtype)
//       packed[b, p, 2*i + j] = weight[16*b + i, 2*p + j], zero where that is out of range
//   unpack_linear_weight(packed, out_features = N, in_features = K) -> weight [N, K]
//       the exact inverse of pack_linear_weight
//   linear_decode(x [M, K], packed, out_features = N) -> out [M, N]   (x's dtype)
//       x last-dim contiguous (rows may be strided); fp32 accumulation, one rounding at the end
//   linear_packed(x [M, K], packed, out_features = N, bias?) -> x @ W^T + bias, rounded once
//       what the compiler lowers a model's linears to, so the packed copy is the only copy of
//       W: linear_decode for M <= stream_max_rows(); above, where the product is
//       compute-bound, ATen's matmul (oneDNN) on W unpacked a chunk of output rows at a time
//
// Why a packed layout, and not oneDNN or the row-major weight (bench/kernel_cases/moe_gemm.py;
// 2 threads, cold weights, quiet machine, read bandwidth 18.6 GB/s, bf16):
//   lm_head 8 x 2048 -> 102400:    16.1 GB/s (86%); F.linear 1.3x and oneDNN's prepacked
//                                   linear (mkldnn::_linear_pointwise) 1.5x slower
//   projections, 1 row:            94-105%;        F.linear 1.4-2.4x, oneDNN 2.0-2.8x slower
//   projections, 8 rows:           58-92%;         F.linear 1.3-1.9x, oneDNN 1.3-1.6x slower
// (a Xeon with the FMA kernel); on Zen 4 with VDPBF16PS (read bandwidth ~30 GB/s) lm_head at
// 8 rows streams at ~100% and is 1.8x faster than F.linear.
// With lanes along the 16 rows of a block, each column pair of x is broadcast once per
// 16 * (blocks per tile) weight rows and no horizontal sums are needed. With lanes along K
// on the row-major weight (rows_dot, which moe_experts must use) every row of x is re-read
// per 2..8 weight rows: at 8 rows of x that traffic exceeds the weights' own, and it
// measured ~80 vs ~120 GFLOP/s per core.
// Any M works, but past ~32 rows the product is compute-bound and this kernel (on the Xeon,
// ~100-120 GFLOP/s per core) is far from ATen's matmul (oneDNN, ~650-750 GFLOP/s on 2
// threads). Keeping the checkpoint's row-major W for those rows would double the linears'
// memory; instead linear_packed unpacks W a chunk of rows at a time into a small row-major
// scratch that stays in cache while oneDNN multiplies it: the weight is still read from memory
// once per call, as oneDNN reads it, and the unpacking is a transpose of column pairs in cache.
//
// Python references: mlafx/kernels/gemm_reference.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "batch_invariant.h"
#include "cpu_features.h"
#include "gemm.h"
#include "gemm_aten.h"
#include "parallel_chunks.h"

namespace mlafx {
namespace {

// ---- Scalar references --------------------------------------------------------------------

// 16 explicit partial sums along K: a loop the compiler can vectorise without reassociating
// floating-point adds.
template <typename scalar_t>
void rows_dot_scalar(const scalar_t* x, int64_t ldx, int64_t M, const scalar_t* w, int64_t ldw,
                     int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo) {
  constexpr int kLanes = 16;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const scalar_t* w_row = w + n * ldw;
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* x_row = x + m * ldx;
      float lanes[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          lanes[l] += static_cast<float>(x_row[k + l]) * static_cast<float>(w_row[k + l]);
        }
      }
      for (int l = 0; k < K; ++k, ++l) {
        lanes[l] += static_cast<float>(x_row[k]) * static_cast<float>(w_row[k]);
      }
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) {
        sum += lanes[l];
      }
      out[m * ldo + (n - n_begin)] = sum;
    }
  }
}

// Lanes along the 16 rows of a block, as in the AVX-512 kernel.
template <typename scalar_t>
void packed_dot_scalar(const scalar_t* x, int64_t ldx, int64_t M, const scalar_t* wp, int64_t K,
                       int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const scalar_t* block = wp + b * K2 * 2 * kPackedBlockRows;
    for (int64_t m = 0; m < M; ++m) {
      const scalar_t* x_row = x + m * ldx;
      float acc[kPackedBlockRows] = {};
      for (int64_t p = 0; p < K2; ++p) {
        const float x_even = static_cast<float>(x_row[2 * p]);
        const float x_odd = 2 * p + 1 < K ? static_cast<float>(x_row[2 * p + 1]) : 0.0f;
        const scalar_t* pairs = block + p * 2 * kPackedBlockRows;
        for (int i = 0; i < kPackedBlockRows; ++i) {
          acc[i] += static_cast<float>(pairs[2 * i]) * x_even;
          acc[i] += static_cast<float>(pairs[2 * i + 1]) * x_odd;
        }
      }
      float* dst = out + m * ldo + (b - block_begin) * kPackedBlockRows;
      for (int i = 0; i < kPackedBlockRows; ++i) {
        dst[i] = acc[i];
      }
    }
  }
}

// Rows [n_begin, n_end) of W back out of the packed layout into dst (row stride ldd). A block
// is a [K2][16] array of column pairs; it is transposed to [16][K2] a tile of pairs at a time,
// so the reads stay in a few KB of L1 and the writes run along rows. Pure data movement: one
// instantiation per element size, whatever the float type.
template <typename element_t>
void unpack_rows(const element_t* packed, int64_t K, int64_t n_begin, int64_t n_end,
                 element_t* dst, int64_t ldd) {
  constexpr int64_t kTilePairs = 64;
  constexpr int64_t kBlockWidth = 2 * kPackedBlockRows;
  const int64_t K2 = (K + 1) / 2;
  const int64_t full_pairs = K / 2;
  for (int64_t n = n_begin; n < n_end;) {
    const int64_t b = n / kPackedBlockRows;
    const int64_t row0 = b * kPackedBlockRows;
    const int64_t i_begin = n - row0;
    const int64_t i_end = std::min(kPackedBlockRows, n_end - row0);
    const element_t* block = packed + b * K2 * kBlockWidth;
    element_t* rows = dst + (row0 - n_begin) * ldd;
    for (int64_t p0 = 0; p0 < full_pairs; p0 += kTilePairs) {
      const int64_t p1 = std::min(full_pairs, p0 + kTilePairs);
      for (int64_t i = i_begin; i < i_end; ++i) {
        element_t* row = rows + i * ldd;
        for (int64_t p = p0; p < p1; ++p) {
          std::memcpy(row + 2 * p, block + p * kBlockWidth + 2 * i, 2 * sizeof(element_t));
        }
      }
    }
    if (K % 2 != 0) {  // the last column, whose pair partner is padding
      for (int64_t i = i_begin; i < i_end; ++i) {
        rows[i * ldd + K - 1] = block[full_pairs * kBlockWidth + 2 * i];
      }
    }
    n = row0 + i_end;
  }
}

}  // namespace

void rows_dot(FloatKind kind, const void* x, int64_t ldx, int64_t M, const void* w, int64_t ldw,
              int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo) {
  switch (kind) {
    case FloatKind::kBFloat16:
      if (use_avx512_bf16()) {
        avx512::rows_dot_bf16(static_cast<const uint16_t*>(x), ldx, M,
                              static_cast<const uint16_t*>(w), ldw, K, n_begin, n_end, out, ldo);
      } else if (use_avx2()) {
        avx2::rows_dot_bf16(static_cast<const uint16_t*>(x), ldx, M,
                            static_cast<const uint16_t*>(w), ldw, K, n_begin, n_end, out, ldo);
      } else {
        rows_dot_scalar(static_cast<const c10::BFloat16*>(x), ldx, M,
                        static_cast<const c10::BFloat16*>(w), ldw, K, n_begin, n_end, out, ldo);
      }
      return;
    case FloatKind::kHalf:
      rows_dot_scalar(static_cast<const c10::Half*>(x), ldx, M, static_cast<const c10::Half*>(w),
                      ldw, K, n_begin, n_end, out, ldo);
      return;
    case FloatKind::kFloat:
      rows_dot_scalar(static_cast<const float*>(x), ldx, M, static_cast<const float*>(w), ldw, K,
                      n_begin, n_end, out, ldo);
      return;
  }
}

void packed_dot(FloatKind kind, const void* x, int64_t ldx, int64_t M, const void* wp, int64_t K,
                int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  switch (kind) {
    case FloatKind::kBFloat16:
      if (use_amx_bf16() && avx512::packed_dot_amx_supports(K)) {
        avx512::packed_dot_bf16_amx(static_cast<const uint16_t*>(x), ldx, M,
                                    static_cast<const uint16_t*>(wp), K, block_begin, block_end,
                                    out, ldo);
      } else if (use_avx512_bf16()) {
        avx512::packed_dot_bf16(static_cast<const uint16_t*>(x), ldx, M,
                                static_cast<const uint16_t*>(wp), K, block_begin, block_end, out,
                                ldo);
      } else if (use_avx2()) {
        avx2::packed_dot_bf16(static_cast<const uint16_t*>(x), ldx, M,
                              static_cast<const uint16_t*>(wp), K, block_begin, block_end, out,
                              ldo);
      } else {
        packed_dot_scalar(static_cast<const c10::BFloat16*>(x), ldx, M,
                          static_cast<const c10::BFloat16*>(wp), K, block_begin, block_end, out,
                          ldo);
      }
      return;
    case FloatKind::kHalf:
      packed_dot_scalar(static_cast<const c10::Half*>(x), ldx, M,
                        static_cast<const c10::Half*>(wp), K, block_begin, block_end, out, ldo);
      return;
    case FloatKind::kFloat:
      if (use_avx512_bf16()) {
        avx512::packed_dot_f32(static_cast<const float*>(x), ldx, M,
                               static_cast<const float*>(wp), K, block_begin, block_end, out,
                               ldo);
      } else {
        packed_dot_scalar(static_cast<const float*>(x), ldx, M, static_cast<const float*>(wp), K,
                          block_begin, block_end, out, ldo);
      }
      return;
  }
}

FloatKind float_kind(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return FloatKind::kBFloat16;
    case at::kHalf:
      return FloatKind::kHalf;
    case at::kFloat:
      return FloatKind::kFloat;
    default:
      TORCH_CHECK_TYPE(false, "mlafx: unsupported dtype ", dtype,
                       " (expected bfloat16, float16 or float32)");
  }
}

bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

namespace {

// ---- at::Tensor entries -------------------------------------------------------------------

// Blocks [b0, b1) of the packed layout from the row-major weight [N, K]: element (r, k) of
// block b is W[16b + r, k] at packed[b, k / 2, 2r + k % 2]; rows past N and the second half of
// an odd K's last pair are zero.
template <typename scalar_t>
void pack_blocks(const scalar_t* w, int64_t ldw, int64_t N, int64_t K, scalar_t* packed,
                 int64_t b0, int64_t b1) {
  constexpr int64_t kLine = 2 * kPackedBlockRows;  // one column pair of the block's 16 rows
  const int64_t K2 = (K + 1) / 2;
  const scalar_t zero(0);
  for (int64_t b = b0; b < b1; ++b) {
    scalar_t* block = packed + b * K2 * kLine;
    for (int64_t r = 0; r < kPackedBlockRows; ++r) {
      const int64_t n = b * kPackedBlockRows + r;
      scalar_t* out = block + 2 * r;
      if (n >= N) {
        for (int64_t kp = 0; kp < K2; ++kp) {
          out[kp * kLine] = zero;
          out[kp * kLine + 1] = zero;
        }
        continue;
      }
      const scalar_t* row = w + n * ldw;
      for (int64_t kp = 0; kp < K / 2; ++kp) {
        out[kp * kLine] = row[2 * kp];
        out[kp * kLine + 1] = row[2 * kp + 1];
      }
      if (K % 2 != 0) {
        out[(K2 - 1) * kLine] = row[K - 1];
        out[(K2 - 1) * kLine + 1] = zero;
      }
    }
  }
}

at::Tensor pack_linear_weight(const at::Tensor& weight  // [N, K]
) {
  TORCH_CHECK(weight.device().is_cpu(), "pack_linear_weight: weight must be on the CPU, got ",
              weight.device());
  TORCH_CHECK_TYPE(is_supported_float(weight.scalar_type()),
                   "pack_linear_weight: weight must be bfloat16, float16 or float32, got ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2,
                    "pack_linear_weight: weight must be [out_features, in_features], got shape ",
                    weight.sizes());
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  const int64_t blocks = (N + kPackedBlockRows - 1) / kPackedBlockRows;
  const int64_t K2 = (K + 1) / 2;
  // Runs for every linear when a model loads (lm_head alone is 400 MB in bf16): one pass that
  // writes each packed block once, in parallel over blocks, with no padded temporary (which
  // would hold a second copy of the weight at the load's peak).
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({blocks, K2, 2 * kPackedBlockRows}, weight.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pack_linear_weight",
                                  [&] {
                                    const scalar_t* src = w.const_data_ptr<scalar_t>();
                                    scalar_t* dst = packed.data_ptr<scalar_t>();
                                    mlafx::parallel_chunks(0, blocks, 4, [&](int64_t b0, int64_t b1) {
                                      pack_blocks(src, K, N, K, dst, b0, b1);
                                    });
                                  });
  return packed;
}

// packed_weight as pack_linear_weight makes it for out_features rows. Its in_features are
// checked by the callers (from x, or from their own argument).
void check_packed(const char* op, const at::Tensor& packed,  // [ceil(N/16), ceil(K/2), 32]
                  int64_t out_features) {
  TORCH_CHECK(packed.device().is_cpu(), op, ": packed_weight must be on the CPU, got ",
              packed.device());
  TORCH_CHECK_TYPE(is_supported_float(packed.scalar_type()), op,
                   ": packed_weight must be bfloat16, float16 or float32, got ",
                   packed.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == 2 * kPackedBlockRows, op,
                    ": packed_weight must come from pack_linear_weight "
                    "([ceil(N/16), ceil(K/2), 32]), got shape ",
                    packed.sizes());
  TORCH_CHECK_VALUE(packed.is_contiguous(), op, ": packed_weight must be contiguous");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK_VALUE(
      out_features >= 0 && (out_features + kPackedBlockRows - 1) / kPackedBlockRows == blocks, op,
      ": out_features = ", out_features, " does not match packed_weight's ", blocks,
      " blocks of ", kPackedBlockRows, " rows");
}

// x for a product with packed_weight (already checked): same dtype, [M, K] with K packed to
// ceil(K/2) column pairs, last dim contiguous (the streaming kernel reads rows as they lie).
void check_rows(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), op,
                   ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(packed.scalar_type() == x.scalar_type(), op, ": packed_weight dtype ",
                   packed.scalar_type(), " must equal x's dtype ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [num_rows, in_features], got shape ",
                    x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE((K + 1) / 2 == packed.size(1), op, ": x has ", K,
                    " features but packed_weight was packed for ", 2 * packed.size(1) - 1, " or ",
                    2 * packed.size(1));
  TORCH_CHECK_VALUE(K <= 1 || x.stride(1) == 1, op,
                    ": x's last dim must be contiguous, got strides ", x.strides());
}

// Rows [n_begin, n_end) of W out of the packed layout into dst (row stride ldd >= K), on one
// thread. bf16 and fp16 alike take the AVX-512 transpose: the pairs are moved, never read as
// numbers.
void unpack_rows_any(const at::Tensor& packed, int64_t K, int64_t n_begin, int64_t n_end,
                     void* dst, int64_t ldd) {
  if (packed.element_size() == 4) {
    unpack_rows(static_cast<const uint32_t*>(packed.const_data_ptr()), K, n_begin, n_end,
                static_cast<uint32_t*>(dst), ldd);
  } else if (use_avx512_bf16()) {
    avx512::unpack_rows_16bit(static_cast<const uint16_t*>(packed.const_data_ptr()), K, n_begin,
                              n_end, static_cast<uint16_t*>(dst), ldd);
  } else {
    unpack_rows(static_cast<const uint16_t*>(packed.const_data_ptr()), K, n_begin, n_end,
                static_cast<uint16_t*>(dst), ldd);
  }
}

// The same on all threads, each a contiguous range of blocks (at least ~64 KB of weight, as in
// linear_decode). dst: [n_end - n_begin, ldd].
void unpack_rows_parallel(const at::Tensor& packed, int64_t K, int64_t n_begin, int64_t n_end,
                          void* dst, int64_t ldd) {
  const int64_t element_size = static_cast<int64_t>(packed.element_size());
  const int64_t block_bytes = std::max<int64_t>(packed.size(1), 1) * 2 * kPackedBlockRows *
                              element_size;
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / block_bytes);
  mlafx::parallel_chunks(n_begin / kPackedBlockRows, (n_end + kPackedBlockRows - 1) / kPackedBlockRows,
                   grain, [&](int64_t b0, int64_t b1) {
                     const int64_t r0 = std::max(n_begin, b0 * kPackedBlockRows);
                     const int64_t r1 = std::min(n_end, b1 * kPackedBlockRows);
                     char* rows = static_cast<char*>(dst) + (r0 - n_begin) * ldd * element_size;
                     unpack_rows_any(packed, K, r0, r1, rows, ldd);
                   });
}

at::Tensor unpack_linear_weight(const at::Tensor& packed,  // [ceil(N/16), ceil(K/2), 32]
                                int64_t out_features,      // N
                                int64_t in_features        // K
) {
  check_packed("unpack_linear_weight", packed, out_features);
  TORCH_CHECK_VALUE(in_features >= 0 && (in_features + 1) / 2 == packed.size(1),
                    "unpack_linear_weight: in_features = ", in_features,
                    " does not match packed_weight's ", packed.size(1), " column pairs");
  at::Tensor weight = at::empty({out_features, in_features}, packed.options());  // [N, K]
  unpack_rows_parallel(packed, in_features, 0, out_features, weight.data_ptr(), in_features);
  return weight;
}

// Output rows computed per step of a thread: the fp32 scratch ([M, 256]) stays in L1/L2 and is
// rounded into the output right away, so no fp32 copy of the whole output is made.
constexpr int64_t kBlocksPerStep = 16;

// The streaming kernel on checked inputs.
// With a bias, it is added to the fp32 sums: one rounding, as for the product alone.
at::Tensor linear_streaming(const at::Tensor& x,       // [M, K]
                            const at::Tensor& packed,  // [ceil(N/16), ceil(K/2), 32]
                            int64_t N, const at::Tensor* bias = nullptr) {  // [N] or none
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  const int64_t blocks = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) {
    return out;
  }
  const FloatKind kind = float_kind(x.scalar_type());
  const void* x_data = x.const_data_ptr();
  const void* w_data = packed.const_data_ptr();
  const int64_t ldx = x.stride(0);
  // Each thread takes one contiguous range of blocks, at least ~64 KB of weight: waking a
  // thread costs microseconds, streaming 64 KB about as long.
  const int64_t block_bytes = std::max<int64_t>(packed.size(1), 1) * 2 * kPackedBlockRows *
                              static_cast<int64_t>(x.element_size());
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / block_bytes);
  constexpr int64_t step_rows = kBlocksPerStep * kPackedBlockRows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_decode", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const scalar_t* bias_data = bias != nullptr ? bias->const_data_ptr<scalar_t>() : nullptr;
    mlafx::parallel_chunks(0, blocks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>(M * step_rows));
      for (int64_t b0 = begin; b0 < end; b0 += kBlocksPerStep) {
        const int64_t b1 = std::min(end, b0 + kBlocksPerStep);
        packed_dot(kind, x_data, ldx, M, w_data, K, b0, b1, scratch.data(), step_rows);
        const int64_t n0 = b0 * kPackedBlockRows;
        const int64_t n1 = std::min(N, b1 * kPackedBlockRows);
        for (int64_t m = 0; m < M; ++m) {
          float* src = scratch.data() + m * step_rows - n0;
          if (bias_data != nullptr) {
            for (int64_t n = n0; n < n1; ++n) {
              src[n] += static_cast<float>(bias_data[n]);
            }
          }
          round_row(src + n0, out_data + m * N + n0, n1 - n0);
        }
      }
    }, /*align=*/kBlocksPerStep);
  });
  return out;
}

at::Tensor linear_decode(const at::Tensor& x,       // [M, K]
                         const at::Tensor& packed,  // [ceil(N/16), ceil(K/2), 32]
                         int64_t out_features       // N
) {
  check_packed("linear_decode", packed, out_features);
  check_rows("linear_decode", x, packed);
  return linear_streaming(x, packed, out_features);
}

// Weight bytes unpacked per chunk on the long-rows path: the row-major scratch stays in the L3
// while oneDNN reads it, and each call gets enough output columns to run near its matmul rate.
// Measured on Zen 4 (2 threads, bf16, cold weights, against F.linear; noisy to ~5%): 4 MB gave
// 0.90-0.97x at 512 and 2048 rows of q 2048->3072 and kv_a 2048->576; 2 MB 0.87-0.95x; 1 MB and
// 512 KB chunks given one per thread, each multiplied by a single-threaded mm, 0.82-0.98x. The
// unpacking itself (an AVX-512 transpose of column pairs) runs at ~35 GB/s in cache: ~120 us
// per 4 MB chunk. It is not overlapped with the products, which at 64 rows are short enough
// for that to show: ~0.7-0.8x of F.linear there.
constexpr int64_t kUnpackChunkBytes = int64_t{4} << 20;

// Whether ATen's GEMM in x's dtype runs at a usable rate here. bf16 and fp16 GEMMs need
// AVX-512 BF16 (and the AMX tiles) for that: without it oneDNN emulates them at ~1 GFLOP/s
// (measured on a 2-core AVX2 Zen 2, against ~64 GFLOP/s for fp32), so there the chunked
// product widens x and each unpacked chunk of W to fp32 and rounds the fp32 result once.
bool native_16bit_gemm(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || use_avx512_bf16();
}

// x [M, K] @ W^T on checked inputs, for M above stream_max_rows(): W unpacked a chunk of output
// rows (a multiple of 16) at a time into one row-major scratch, which ATen's mm (oneDNN)
// multiplies into those columns of the output. No copy of the whole W is ever made.
// A bias goes in through addmm, which oneDNN adds before its one rounding. Where the 16-bit
// GEMM is not native (native_16bit_gemm), the product runs in fp32 on widened copies of x and
// of the chunk (exact), bias added in fp32, and the result is rounded once to x's dtype.
at::Tensor linear_chunked_mm(const at::Tensor& x,       // [M, K]
                             const at::Tensor& packed,  // [ceil(N/16), ceil(K/2), 32]
                             int64_t N, const at::Tensor* bias = nullptr) {  // [N] or none
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) {
    return out;
  }
  const bool widen = !native_16bit_gemm(x);
  const at::Tensor x_mm = widen ? x.to(at::kFloat) : x;
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(x.element_size());
  const int64_t chunk_rows =
      std::min(packed.size(0) * kPackedBlockRows,
               std::max(kPackedBlockRows,
                        kUnpackChunkBytes / row_bytes / kPackedBlockRows * kPackedBlockRows));
  at::Tensor scratch = at::empty({chunk_rows, K}, x.options());  // [chunk_rows, K] rows of W
  at::Tensor wide = widen ? at::empty({chunk_rows, K}, at::kFloat) : scratch;
  at::Tensor product = widen ? at::empty({M, chunk_rows}, at::kFloat) : at::Tensor();
  const at::Tensor bias_mm = bias == nullptr ? at::Tensor() : widen ? bias->to(at::kFloat) : *bias;
  for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, N - n0);
    unpack_rows_parallel(packed, K, n0, n0 + rows, scratch.data_ptr(), K);
    if (widen) {
      wide.narrow(0, 0, rows).copy_(scratch.narrow(0, 0, rows));
    }
    at::Tensor columns = out.narrow(1, n0, rows);  // [M, rows], row stride N
    at::Tensor target = widen ? product.narrow(1, 0, rows) : columns;
    if (bias != nullptr) {
      at::addmm_out(target, bias_mm.narrow(0, n0, rows), x_mm, wide.narrow(0, 0, rows).t());
    } else {
      at::mm_out(target, x_mm, wide.narrow(0, 0, rows).t());
    }
    if (widen) {
      columns.copy_(target);
    }
  }
  return out;
}

// The most rows of x for which streaming the packed weight beats ATen's GEMM (oneDNN) on it.
// bf16 with VDPBF16PS and no AMX: 256. Measured on Zen 4 (2 threads, quiet; the embedded
// default's q/kv_a/o projections and lm_head): streaming beats the chunked oneDNN path by
// 1.5-2.2x at 48-64 rows, 1.2-1.4x at 128 and 1.07-1.2x at 256, and F.linear on a row-major
// weight by 1.0-1.3x through 192 rows (oneDNN's bf16 GEMM here is ~0.35-0.4 TFLOP/s, which
// VDPBF16PS streaming nearly matches). bf16 on the AMX tile unit: 32; there oneDNN's own AMX
// GEMM runs several times faster than streaming beyond the decode-sized range (a Xeon: ~0.7-2
// TFLOP/s), while the tile kernel stays at memory bandwidth through 32 rows. Elsewhere (fp32,
// fp16, the portable path) the scalar kernel only pays for a few rows.
int64_t stream_max_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16 && use_amx_bf16()) {
    return 32;
  }
  if (x.scalar_type() == at::kBFloat16 && use_avx512_bf16()) {
    return 256;
  }
  return 8;
}

at::Tensor linear_packed(const at::Tensor& x,       // [M, K]
                         const at::Tensor& packed,  // pack_linear_weight(W [N, K])
                         int64_t out_features,      // N
                         const std::optional<at::Tensor>& bias) {  // [N] or none
  check_packed("linear_packed", packed, out_features);
  check_rows("linear_packed", x, packed);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features,
                      "linear_packed: bias must be [out_features] = [", out_features,
                      "], got shape ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "linear_packed: bias dtype ",
                     bias->scalar_type(), " must equal x's dtype ", x.scalar_type());
  }
  const at::Tensor bias_values = has_bias ? bias->contiguous() : at::Tensor();
  const at::Tensor* b = has_bias ? &bias_values : nullptr;
  // Batch-invariant mode: every row streams, so its sums never depend on the row count.
  return x.size(0) <= stream_max_rows(x) || batch_invariant()
             ? linear_streaming(x, packed, out_features, b)
             : linear_chunked_mm(x, packed, out_features, b);
}

}  // namespace

void pack_rows_16bit(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* packed) {
  pack_blocks(w, ldw, N, K, packed, 0, (N + kPackedBlockRows - 1) / kPackedBlockRows);
}

}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("unpack_linear_weight(Tensor packed_weight, int out_features, int in_features) -> Tensor");
  m.def("linear_decode(Tensor x, Tensor packed_weight, int out_features) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) {
  m.impl("pack_linear_weight", &mlafx::pack_linear_weight);
  m.impl("unpack_linear_weight", &mlafx::unpack_linear_weight);
  m.impl("linear_decode", &mlafx::linear_decode);
  m.impl("linear_packed", &mlafx::linear_packed);
}

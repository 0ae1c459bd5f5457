// quantize_linear_weight: W [N, K] (fp32/bf16/fp16) -> the packed int8 or int4 layout of
// mlafx/kernels/quant_format.py, bit-identical to quant_format.quantize_weight_ref.
//
//   quantize_linear_weight(weight [N, K], bits = 8 | 4) -> packed uint8 [ceil(N/16),
//       ceil(K/32), S]   (S = 544 for int8, 288 for int4)
//
// It runs at model load for every weight (15.7 B for DeepSeek-V2-Lite), so it is one pass
// over W in parallel over blocks of 16 rows, each block written once; the per-group loops
// are fixed-length (32) so the compiler vectorises them, without reassociating anything.
//
// Bit-identity with the torch reference needs its fp32 arithmetic in its order:
// - the int8 scale d = fp16(amax / 127) (c10::Half rounds to nearest even, as .to(float16)),
//   q = round_half_even(w / d) clamped (a true division: w * (1/d) rounds differently);
// - int4: per candidate c, d = fp16(peak / c), q = round(w / d) clamped to [-8, 7], and the
//   squared error err = sum_k (w_k - d q_k)^2 summed as torch's CPU sum kernel does for a
//   contiguous inner dim of 32 on an AVX2 build (8 lanes of Vectorized<float>): lane l
//   = ((e_l + e_{l+8}) + e_{l+16}) + e_{l+24}, then the 8 lanes left to right. d * q is exact
//   (an 11-bit scale times a 4-bit integer), so only the subtraction, the square and the sum
//   round. The least error wins, the first on ties. A torch build whose sum dispatches to
//   16-lane AVX-512 adds in another order: there a near-tie between two candidates (errors
//   within an ulp) may resolve differently; either choice has the same error to an ulp.
// This object is compiled without FMA (setup.py's portable flags), so nothing is contracted.
// When use_avx2(), the per-group step runs 8 groups at a time in quant_weight_avx2.cpp, with
// the same per-element operations in the same order (bit-identical).
// Weights are assumed finite (NaN or inf weights give some packed value, not a contract).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "gemm_aten.h"
#include "quant.h"
#include "parallel_chunks.h"

namespace mlafx {
namespace {

constexpr int kGroup = static_cast<int>(kQuantGroup);
constexpr int kRows = static_cast<int>(kQuantBlockRows);
// quant_format.INT4_DIVISORS, in its order (the first wins ties).
constexpr std::array<float, 11> kInt4Divisors = {-8.0f, -7.75f, -7.5f, -7.25f, -7.0f, -6.75f,
                                                 -6.5f, 7.0f,   6.75f, 6.5f,   6.25f};

// Round half to even for |v| <= 2^22 (our values are clamped to a few hundred first): adding
// and subtracting 1.5 * 2^23 leaves the integer part in the mantissa, rounded by the FPU's
// default mode. Vectorises on SSE2, unlike std::nearbyint, and is exact without -ffast-math.
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

inline float to_half_and_back(float v) { return static_cast<float>(c10::Half(v)); }

// max_k |w_k| in 8 independent lanes (max is exact in any order; one serial chain of 32
// dependent MAXSS took ~100 cycles per group).
inline float group_amax(const float* w) {
  float lanes[8];
  for (int l = 0; l < 8; ++l) {
    lanes[l] = std::fabs(w[l]);
  }
  for (int k = 8; k < kGroup; k += 8) {
    for (int l = 0; l < 8; ++l) {
      const float a = std::fabs(w[k + l]);
      lanes[l] = lanes[l] < a ? a : lanes[l];
    }
  }
  float amax = lanes[0];
  for (int l = 1; l < 8; ++l) {
    amax = amax < lanes[l] ? lanes[l] : amax;
  }
  return amax;
}

// One group of 32 fp32 weights -> q (signed, in the format's range) and the fp16 scale bits.
void quantize_group_int8(const float* w, int8_t* q, uint16_t* scale_bits) {
  const float amax = group_amax(w);
  const c10::Half d_half(amax / 127.0f);
  const float d = static_cast<float>(d_half);
  for (int k = 0; k < kGroup; ++k) {
    q[k] = d > 0.0f ? static_cast<int8_t>(round_half_even(clampf(w[k] / d, -127.0f, 127.0f)))
                    : int8_t{0};
  }
  *scale_bits = d_half.x;
}

// Candidate d's squared error, in torch's summation order (see the file comment).
inline float candidate_error(const float* w, float d, float* q) {
  float e[kGroup];
  for (int k = 0; k < kGroup; ++k) {
    q[k] = d != 0.0f ? round_half_even(clampf(w[k] / d, -8.0f, 7.0f)) : 0.0f;
    const float diff = w[k] - d * q[k];
    e[k] = diff * diff;
  }
  float lanes[8];
  for (int l = 0; l < 8; ++l) {
    lanes[l] = ((e[l] + e[l + 8]) + e[l + 16]) + e[l + 24];
  }
  float err = 0.0f;
  for (int l = 0; l < 8; ++l) {
    err += lanes[l];
  }
  return err;
}

// q in [0, 15] (q + 8 of the signed value).
void quantize_group_int4(const float* w, int8_t* q, uint16_t* scale_bits) {
  const float peak_abs = group_amax(w);
  int peak_at = 0;  // first index of the largest magnitude, as torch.argmax
  while (peak_at < kGroup - 1 && std::fabs(w[peak_at]) != peak_abs) {
    ++peak_at;
  }
  const float peak = w[peak_at];
  float best_q[kGroup];
  float trial_q[kGroup];
  float best_d = 0.0f;
  float best_err = 0.0f;
  float last_d = 0.0f;
  for (size_t c = 0; c < kInt4Divisors.size(); ++c) {
    const float d = to_half_and_back(peak / kInt4Divisors[c]);
    // The same d as the previous candidate gives the same q and error: it cannot win.
    if (c > 0 && std::memcmp(&d, &last_d, sizeof(float)) == 0) {
      continue;
    }
    last_d = d;
    const float err = candidate_error(w, d, trial_q);
    if (c == 0 || err < best_err) {
      best_err = err;
      best_d = d;
      std::memcpy(best_q, trial_q, sizeof(best_q));
    }
  }
  for (int k = 0; k < kGroup; ++k) {
    q[k] = static_cast<int8_t>(best_q[k] + 8.0f);
  }
  *scale_bits = c10::Half(best_d).x;  // exact: best_d is a float16 value
}

// Writes row i's group (q, scale) into the block's group bytes, in the layout of quant.h.
void store_group(int bits, int i, const int8_t* q, uint16_t scale_bits, uint8_t* group) {
  if (bits == 8) {
    for (int s = 0; s < 8; ++s) {
      for (int j = 0; j < 4; ++j) {
        group[64 * s + 4 * i + j] = static_cast<uint8_t>(q[4 * s + j] + 128);
      }
    }
  } else {
    for (int s = 0; s < 4; ++s) {
      for (int j = 0; j < 4; ++j) {
        group[64 * s + 4 * i + j] =
            static_cast<uint8_t>(q[4 * s + j] | (q[16 + 4 * s + j] << 4));
      }
    }
  }
  std::memcpy(group + quant_bytes(bits) + 2 * i, &scale_bits, 2);  // little-endian fp16
}

// Blocks [b0, b1) of the packed weight from W (row stride ldw). A row is read once,
// contiguously; rows past N and columns past K quantize as zeros (scale 0, q 0).
template <typename scalar_t>
void quantize_blocks(const scalar_t* w, int64_t ldw, int64_t N, int64_t K, int bits,
                     uint8_t* packed, int64_t b0, int64_t b1) {
  const int64_t groups = (K + kGroup - 1) / kGroup;
  const int64_t S = quant_group_bytes(bits);
  float values[kGroup];
  int8_t q[kGroup];
  const bool vector = use_avx2();
  alignas(32) float values_t[kGroup * 8];
  int8_t q8[kGroup * 8];
  uint16_t scales8[8];
  for (int64_t b = b0; b < b1; ++b) {
    uint8_t* block = packed + b * groups * S;
    for (int i = 0; i < kRows; ++i) {
      const int64_t n = b * kRows + i;
      const scalar_t* row = w + n * ldw;
      if (vector) {
        // 8 groups of the row at a time, transposed (lane l = group g0 + l; zeros past K)
        for (int64_t g0 = 0; g0 < groups; g0 += 8) {
          for (int l = 0; l < 8; ++l) {
            const int64_t k0 = (g0 + l) * kGroup;
            const int64_t width = n < N ? std::clamp<int64_t>(K - k0, 0, kGroup) : 0;
            for (int k = 0; k < kGroup; ++k) {
              values_t[8 * k + l] = k < width ? static_cast<float>(row[k0 + k]) : 0.0f;
            }
          }
          avx2::quantize_groups8(bits, values_t, q8, scales8);
          const int count = static_cast<int>(std::min<int64_t>(8, groups - g0));
          for (int l = 0; l < count; ++l) {
            store_group(bits, i, q8 + kGroup * l, scales8[l], block + (g0 + l) * S);
          }
        }
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * kGroup;
        const int64_t width = n < N ? std::min<int64_t>(kGroup, K - k0) : 0;
        if (width == kGroup) {
          for (int k = 0; k < kGroup; ++k) {
            values[k] = static_cast<float>(row[k0 + k]);
          }
        } else {
          for (int k = 0; k < kGroup; ++k) {
            values[k] = k < width ? static_cast<float>(row[k0 + k]) : 0.0f;
          }
        }
        uint16_t scale_bits = 0;
        if (bits == 8) {
          quantize_group_int8(values, q, &scale_bits);
        } else {
          quantize_group_int4(values, q, &scale_bits);
        }
        store_group(bits, i, q, scale_bits, block + g * S);
      }
    }
  }
}

at::Tensor quantize_linear_weight(const at::Tensor& weight,  // [N, K]
                                  int64_t bits) {           // 8 or 4
  TORCH_CHECK(weight.device().is_cpu(), "quantize_linear_weight: weight must be on the CPU, got ",
              weight.device());
  TORCH_CHECK_TYPE(is_supported_float(weight.scalar_type()),
                   "quantize_linear_weight: weight must be bfloat16, float16 or float32, got ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2,
                    "quantize_linear_weight: weight must be [out_features, in_features], got "
                    "shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "quantize_linear_weight: bits must be 8 or 4, got ",
                    bits);
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t groups = (K + kGroup - 1) / kGroup;
  const int b = static_cast<int>(bits);
  at::Tensor packed =
      at::empty({blocks, groups, quant_group_bytes(b)}, weight.options().dtype(at::kByte));
  if (packed.numel() == 0) {
    return packed;
  }
  const at::Tensor w = K <= 1 || weight.stride(1) == 1 ? weight : weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, w.scalar_type(), "quantize_linear_weight", [&] {
        const scalar_t* src = w.const_data_ptr<scalar_t>();
        const int64_t ldw = w.stride(0);
        uint8_t* dst = packed.data_ptr<uint8_t>();
        mlafx::parallel_chunks(0, blocks, 1, [&](int64_t b0, int64_t b1) {
          quantize_blocks(src, ldw, N, K, b, dst, b0, b1);
        });
      });
  return packed;
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def("quantize_linear_weight(Tensor weight, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) {
  m.impl("quantize_linear_weight", &mlafx::quantize_linear_weight);
}

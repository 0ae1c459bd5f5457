// The quantized products' shared pieces: activation quantization, the portable integer-dot
// kernel, and the run-time choice between it, the AVX-512 VNNI and the AVX2 kernel (quant.h).
//
// The portable kernel is the reference the AVX-512 one specialises: per block and group it
// unpacks the 16 x 32 weights once to signed int16 (z removed), then for every row of x
// takes 16 exact int32 dot products of 32 (a fixed-length int16 loop that compilers turn
// into PMADDWD on plain x86-64) and adds (float)isum * d_x * d_w into fp32 lanes in group
// order. Python reference: mlafx/kernels/quant_format.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "quant_aten.h"
#include "parallel_chunks.h"

namespace mlafx {
namespace {

constexpr int kGroup = static_cast<int>(kQuantGroup);
constexpr int kRows = static_cast<int>(kQuantBlockRows);
// Rows of x from which the int formats take the AMX-INT8 kernel (a tile holds 16). Its
// per-group epilogue is VNNI's; what it saves is the VPDPBUSD work, against a signed copy of
// every group (staging) that only enough row tiles repay. Measured on a Xeon (6 Dec 2026, 2
// threads, ms AMX / VNNI, 2048 -> 3072 and 2048 -> 2816): int8 at 16 rows 0.47 / 0.44 and
// 0.44 / 0.43, 32 0.76 / 0.73 and 0.83 / 0.71, 48 0.90 / 1.09 and 0.85 / 1.02; int4 at 16
// 0.51 / 0.49 and 0.45 / 0.42, 32 0.67 / 0.81 and 0.61 / 0.74; at 1024 rows (2048 -> 3072)
// int4 ~15 / 27, int8 ~15 / 24.
constexpr int64_t amx_min_rows(int bits) { return bits == 8 ? 48 : 32; }

// Round half to even for |v| <= 2^22 (see quant_weight.cpp).
inline float round_half_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

// One group of 32 fp32 values (zero past K) -> q, d, sum q: d = amax / 127, inv = 1 / d
// (0 where d is 0), q = round_half_even(v * inv) clamped to +-127. NaN propagates through
// amax (as torch.amax): a group holding NaN or inf gets a non-finite d and q = 0. A zero
// stays 0 even when 1 / d overflows (quant_format.quantize_activations does the same).
void quantize_group(const float* v, int8_t* q, float* d_out, int32_t* sum_out) {
  float amax = 0.0f;
  bool nan = false;
  for (int k = 0; k < kGroup; ++k) {
    amax = std::max(amax, std::fabs(v[k]));
    nan |= std::isnan(v[k]);
  }
  const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
  *d_out = d;
  int32_t sum = 0;
  if (std::isfinite(d)) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < kGroup; ++k) {
      const float scaled = std::min(127.0f, std::max(-127.0f, v[k] * inv));
      q[k] = v[k] == 0.0f ? int8_t{0} : static_cast<int8_t>(round_half_even(scaled));
      sum += q[k];
    }
  } else {
    std::memset(q, 0, kGroup);
  }
  *sum_out = sum;
}

template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1,
                   QuantizedActivations& out) {
  const int64_t groups = out.groups;
  float values[kGroup];
  for (int64_t m = m0; m < m1; ++m) {
    const scalar_t* row = x + m * ldx;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * kGroup;
      const int64_t width = std::min<int64_t>(kGroup, K - k0);
      for (int k = 0; k < kGroup; ++k) {
        values[k] = k < width ? static_cast<float>(row[k0 + k]) : 0.0f;
      }
      quantize_group(values, out.q.data() + m * out.ldq + k0,
                     out.d.data() + m * groups + g, out.qsum.data() + m * groups + g);
    }
  }
}

inline float half_bits_to_float(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Block-group weights as signed int16 rows [16][32] (z removed) and fp32 scales [16].
template <int kBits>
void unpack_group(const uint8_t* group, int16_t (*w)[kGroup], float* scales) {
  unpack_quants<kBits>(group, kBits == 8 ? 128 : 8, w);
  for (int i = 0; i < kRows; ++i) {
    scales[i] = half_bits_to_float(group + quant_bytes(kBits) + 2 * i);
  }
}

template <int kBits>
void quant_dot_portable(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t groups,
                        int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t S = quant_group_bytes(kBits);
  std::vector<float> acc(static_cast<size_t>(M * kRows));
  int16_t w[kRows][kGroup];
  int16_t xs[kGroup];
  float scales[kRows];
  for (int64_t b = block_begin; b < block_end; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      unpack_group<kBits>(packed + (b * groups + g) * S, w, scales);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xq = x.q + m * x.ldq + g * kGroup;
        for (int k = 0; k < kGroup; ++k) {
          xs[k] = xq[k];
        }
        const float dx = x.d[m * x.ldd + g];
        float* lanes = acc.data() + m * kRows;
        for (int i = 0; i < kRows; ++i) {
          int32_t isum = 0;
          for (int k = 0; k < kGroup; ++k) {
            isum += static_cast<int32_t>(w[i][k]) * xs[k];
          }
          lanes[i] += static_cast<float>(isum) * dx * scales[i];
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(out + m * ldo + (b - block_begin) * kRows, acc.data() + m * kRows,
                  kRows * sizeof(float));
    }
  }
}

}  // namespace

QuantRows QuantizedActivations::view(int64_t row0) const {
  return QuantRows{q.data() + row0 * ldq, ldq, d.data() + row0 * groups,
                   qsum.data() + row0 * groups, groups};
}

QuantizedActivations quantize_activations(const at::Tensor& x) {
  QuantizedActivations out;
  out.rows = x.size(0);
  const int64_t K = x.size(1);
  out.groups = (K + kGroup - 1) / kGroup;
  out.ldq = quant_row_stride(out.groups);
  out.q.resize(static_cast<size_t>(out.rows * out.ldq));
  out.d.resize(static_cast<size_t>(out.rows * out.groups));
  out.qsum.resize(out.d.size());
  if (out.rows == 0 || out.groups == 0) {
    return out;
  }
  const int64_t ldx = x.stride(0);
  if (use_avx512_vnni()) {
    // ~0.15 us per 2048 values: a grain of 64 rows keeps thread wake-ups below the work.
    const ActivationType type = x.scalar_type() == at::kFloat      ? ActivationType::kFloat32
                                : x.scalar_type() == at::kBFloat16 ? ActivationType::kBFloat16
                                                                   : ActivationType::kFloat16;
    mlafx::parallel_chunks(0, out.rows, 64, [&](int64_t m0, int64_t m1) {
      avx512::quantize_rows_avx512(type, x.const_data_ptr(), ldx, K, m0, m1, out.groups,
                                   out.q.data(), out.ldq, out.d.data(), out.qsum.data());
    });
    return out;
  }
  // ~3 us per 2048 values: a grain of 16 rows keeps thread wake-ups below the work.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    mlafx::parallel_chunks(0, out.rows, 16, [&](int64_t m0, int64_t m1) {
      quantize_rows(data, ldx, K, m0, m1, out);
    });
  });
  return out;
}

QuantizedActivations gather_rows(const QuantizedActivations& src,
                                 const std::vector<int64_t>& index) {
  QuantizedActivations out;
  out.rows = static_cast<int64_t>(index.size());
  out.groups = src.groups;
  const int64_t G = src.groups;
  out.ldq = src.ldq;
  out.q.resize(static_cast<size_t>(out.rows * out.ldq));
  out.d.resize(static_cast<size_t>(out.rows * G));
  out.qsum.resize(out.d.size());
  for (int64_t r = 0; r < out.rows; ++r) {
    const int64_t from = index[static_cast<size_t>(r)];
    std::memcpy(out.q.data() + r * out.ldq, src.q.data() + from * src.ldq, G * kGroup);
    std::memcpy(out.d.data() + r * G, src.d.data() + from * G, G * sizeof(float));
    std::memcpy(out.qsum.data() + r * G, src.qsum.data() + from * G, G * sizeof(int32_t));
  }
  return out;
}

void quant_product_f32(int format, const QuantRows& x, int64_t M, const uint8_t* packed,
                       int64_t blocks, int64_t groups, int64_t N, float* out, int64_t ldo) {
  const int64_t block_bytes = std::max<int64_t>(groups, 1) * quant_group_bytes(format);
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / block_bytes);
  // Steps of blocks whose fp32 scratch ([M, 16 * step]) stays within ~256 KB, up to 32 (two
  // of the AMX kernel's chunks: it prefetches the second while it works on the first).
  const int64_t step = std::clamp<int64_t>((int64_t{64} << 10) / (std::max<int64_t>(M, 1) * kRows),
                                           1, 32);
  mlafx::parallel_chunks(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t ld = step * kRows;
    ScratchVector<float> scratch(static_cast<size_t>(M * ld));
    for (int64_t s0 = b0; s0 < b1; s0 += step) {
      const int64_t s1 = std::min(b1, s0 + step);
      quant_dot(format, x, M, packed, groups, s0, s1, scratch.data(), ld);
      const int64_t n0 = s0 * kRows;
      const int64_t n1 = std::min(N, s1 * kRows);
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(out + m * ldo + n0, scratch.data() + m * ld, (n1 - n0) * sizeof(float));
      }
    }
  });
}

int quant_format_of(int64_t group_bytes) {
  for (const int format : {kFormatInt8, kFormatInt4, kFormatK8, kFormatK4}) {
    if (group_bytes == quant_group_bytes(format)) {
      return format;
    }
  }
  return 0;
}

void quant_dot(int format, const QuantRows& x, int64_t M, const uint8_t* packed, int64_t groups,
               int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int bits = format_bits(format);
  if (is_kquant(format)) {
    if (use_avx2()) {
      avx2::kquant_dot_avx2(bits, x, M, packed, groups, block_begin, block_end, out, ldo);
    } else {
      kquant_dot_portable(bits, x, M, packed, groups, block_begin, block_end, out, ldo);
    }
  } else if (M >= amx_min_rows(bits) && use_amx_int8()) {
    avx512::quant_dot_amx(bits, x, M, packed, groups, block_begin, block_end, out, ldo);
  } else if (use_avx512_vnni()) {
    avx512::quant_dot_vnni(bits, x, M, packed, groups, block_begin, block_end, out, ldo);
  } else if (use_avx2()) {
    avx2::quant_dot_avx2(bits, x, M, packed, groups, block_begin, block_end, out, ldo);
  } else if (bits == 8) {
    quant_dot_portable<8>(x, M, packed, groups, block_begin, block_end, out, ldo);
  } else {
    quant_dot_portable<4>(x, M, packed, groups, block_begin, block_end, out, ldo);
  }
}

}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  // Which kernel the quantized ops take in this process: "avx512_vnni", "avx2" or "portable".
  m.def("quant_cpu_isa() -> str", [] {
    if (mlafx::use_avx512_vnni()) {
      return std::string("avx512_vnni");
    }
    return std::string(mlafx::use_avx2() ? "avx2" : "portable");
  });
}

// Portable kernel of quant_dot (quant.h) on the K formats k8 / k4: GGUF's K-quants (Q4_K,
// Q5_K, Q6_K) repacked into super-blocks of 256 columns (mlafx/kernels/kquant_format.py has
// the layout and the semantics). Per block, super-block and group of 32 it unpacks the 16 x 32
// small integers v once, then for every row of x takes per weight row the two exact int32
// half-group dots isum_0, isum_1 and adds
//
//   (d * (float)(a_0 * isum_0 + a_1 * isum_1) - dmin * (float)(m * qsum_x)) * d_x
//
// into that row's fp32 lane, each operation rounded to fp32, in group order. The AVX2 kernel
// (quant_kdot_avx2.cpp) does the same operations 8 lanes at a time, so the two are bit-identical.
#include <algorithm>
#include <cstring>
#include <vector>

#include <c10/util/Half.h>

#include "quant.h"

namespace mlafx {
namespace {

constexpr int kGroup = static_cast<int>(kQuantGroup);
constexpr int kRows = static_cast<int>(kQuantBlockRows);

inline float half_at(const uint8_t* bytes, int i) {
  uint16_t bits;
  std::memcpy(&bits, bytes + 2 * i, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <int kBits>
void kdot(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t supers,
          int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  constexpr int64_t S = quant_group_bytes(kBits | 0x100);
  constexpr int64_t R = kquant_region_bytes(kBits);
  std::vector<float> acc(static_cast<size_t>(M * kRows));
  int16_t v[kRows][kGroup];
  float d[kRows], dmin[kRows];
  for (int64_t b = block_begin; b < block_end; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t g = 0; g < supers; ++g) {
      const uint8_t* super = packed + (b * supers + g) * S;
      const uint8_t* header = super + kSuperGroups * R;
      for (int i = 0; i < kRows; ++i) {
        d[i] = half_at(header, i);
        dmin[i] = half_at(header + 2 * kRows, i);
      }
      for (int64_t t = 0; t < kSuperGroups; ++t) {
        const uint8_t* region = super + t * R;
        unpack_quants<kBits>(region, kBits == 8 ? 128 : 0, v);  // k4: no offset
        const auto* a0 = reinterpret_cast<const int8_t*>(region + quant_bytes(kBits));
        const int8_t* a1 = a0 + kRows;
        const uint8_t* mins = region + quant_bytes(kBits) + 2 * kRows;
        const int64_t group = g * kSuperGroups + t;  // of x's groups of 32
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* xq = x.q + m * x.ldq + group * kGroup;
          const float dx = x.d[m * x.ldd + group];
          const int32_t qsum = x.qsum[m * x.ldd + group];
          float* lanes = acc.data() + m * kRows;
          for (int i = 0; i < kRows; ++i) {
            int32_t isum0 = 0, isum1 = 0;
            for (int k = 0; k < 16; ++k) {
              isum0 += static_cast<int32_t>(v[i][k]) * xq[k];
              isum1 += static_cast<int32_t>(v[i][16 + k]) * xq[16 + k];
            }
            const int32_t I = a0[i] * isum0 + a1[i] * isum1;
            const int32_t J = static_cast<int32_t>(mins[i]) * qsum;
            const float term = d[i] * static_cast<float>(I) - dmin[i] * static_cast<float>(J);
            lanes[i] += term * dx;
          }
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

void kquant_dot_portable(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                         int64_t supers, int64_t block_begin, int64_t block_end, float* out,
                         int64_t ldo) {
  if (bits == 8) {
    kdot<8>(x, M, packed, supers, block_begin, block_end, out, ldo);
  } else {
    kdot<4>(x, M, packed, supers, block_begin, block_end, out, ldo);
  }
}

}  // namespace mlafx

// Vector helpers the quantized AVX2 kernels share (quant_dot_avx2.cpp, quant_kdot_avx2.cpp).
// Include only from *_avx2.cpp sources (compiled with -mavx2 -mfma -mf16c): internal linkage,
// so no AVX2 copy of these can stand in for code a portable object needs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant.h"

namespace mlafx::avx2 {
namespace {

// 4 bytes of a row of q_x (one 32-bit lane's worth of columns) in every lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // unaligned-safe
  return _mm256_set1_epi32(v);
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// A tile's fp32 results (MB blocks x MR rows of x, two 8-lane halves of 16 weight rows each)
// into out rows m0.., columns 16 * (b + bb - out_block0)...
template <int MB, int MR>
inline void store_tile(const __m256 (&acc)[MB][MR][2], int64_t m0, int64_t b, int64_t out_block0,
                       float* out, int64_t ldo) {
  for (int bb = 0; bb < MB; ++bb) {
    for (int r = 0; r < MR; ++r) {
      float* o = out + (m0 + r) * ldo + (b + bb - out_block0) * kQuantBlockRows;
      _mm256_storeu_ps(o, acc[bb][r][0]);
      _mm256_storeu_ps(o + 8, acc[bb][r][1]);
    }
  }
}

}  // namespace
}  // namespace mlafx::avx2

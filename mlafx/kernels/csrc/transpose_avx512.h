// In-register transposes on AVX-512, for the *_avx512.cpp sources only (compiled with the
// AVX-512 flags from setup.py and called after the run-time check).
#pragma once

#include <immintrin.h>

#if !defined(__AVX512F__)
#error "transpose_avx512.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {

// r[i] holds row i of a 16 x 16 matrix of 32-bit elements; afterwards r[j] holds column j:
// in-lane unpacks of 32- and 64-bit elements, then two rounds of 128-bit lane shuffles.
inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved per 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4g + j], lane L: column 4L + j of rows 4g..4g+3
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes per j
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

}  // namespace mlafx::avx512

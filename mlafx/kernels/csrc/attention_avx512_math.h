// Vector math shared by the *_avx512.cpp attention, DSA indexer and batched_matmul sources.
// Include it from AVX-512 sources only: everything here is inline and compiled with AVX-512
// enabled.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"  // bf16_bits_to_fp32 for scalar tails
#include "workspace_layout.h"

#if !defined(__AVX512F__)
#error "attention_avx512_math.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Widths padded to 16 lanes (the workspace itself: workspace_layout.h).
inline int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// Two adjacent bf16 values as one 32-bit word (a "pair" of the dot-product layouts).
inline uint32_t load_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// 2^x for x <= 0 (and NaN): round-to-nearest split, degree-6 Taylor of 2^f on [-0.5, 0.5]
// (relative error ~1e-7), scalef for the exponent. -inf (and anything below -150) gives 0;
// NaN stays NaN (max_ps returns its second operand when either is NaN).
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Lane m = _mm512_reduce_add_ps(v[m]) for m < 16, bit for bit: the same pairs added in the
// same order (GCC's reduce: 256-bit halves, then 128-bit halves, then lanes j and j + 2, then
// j and j + 1; float addition is commutative), four vectors of keys at a time instead of one,
// ~46 instructions against ~140.
inline __m512 reduce_add_16(const __m512 (&v)[16]) {
  __m512 x[8];  // x[i]: lanes 0..7 key i's 256-bit half sum, lanes 8..15 key i + 8's
  for (int i = 0; i < 8; ++i) {
    const __m512d a = _mm512_castps_pd(v[i]), b = _mm512_castps_pd(v[i + 8]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_shuffle_f64x2(a, b, 0x44)),   // lo, lo
                         _mm512_castpd_ps(_mm512_shuffle_f64x2(a, b, 0xEE)));  // hi, hi
  }
  __m512 z[4];  // z[i]: 128-bit chunks = keys i, i + 8, i + 4, i + 12 (their 128-bit sums)
  for (int i = 0; i < 4; ++i) {
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88),   // chunks 0, 2, 0, 2
                         _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));  // chunks 1, 3, 1, 3
  }
  __m512 p[2];  // p[i]: per chunk [z[i]'s lanes j + (j + 2) for j = 0, 1 | z[i + 2]'s]
  for (int i = 0; i < 2; ++i) {
    p[i] = _mm512_add_ps(_mm512_shuffle_ps(z[i], z[i + 2], 0x44),   // 0, 1, 0, 1
                         _mm512_shuffle_ps(z[i], z[i + 2], 0xEE));  // 2, 3, 2, 3
  }
  // per chunk c: lanes 0 + 1 of p[0], 2 + 3 of p[0], then of p[1]: keys z0, z2, z1, z3 of c
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x88),   // 0, 2, 0, 2
                                 _mm512_shuffle_ps(p[0], p[1], 0xDD));  // 1, 3, 1, 3
  // lanes hold keys 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, r);
}

}  // namespace mlafx::avx512

// Vector math shared by the *_avx512.cpp attention, DSA indexer and batched_matmul sources.
// Include it from AVX-512 sources only: everything here is inline and compiled with AVX-512
// enabled.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "workspace_layout.h"

#if !defined(__AVX512F__)
#error "attention_avx512_math.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Widths padded to 16 lanes (the workspace itself: workspace_layout.h).
inline int64_t round_up16(int64_t n) { return (n + 15) / 16 * 16; }

// One bf16 value (its bits) widened to fp32, exactly.
inline float bf16_to_float(uint16_t bits) {
  const uint32_t x = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

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

}  // namespace mlafx::avx512

// v4_compress_pool's entries on AVX-512 (called only when use_avx512_bf16(), from
// v4_compressor.cpp): 16 channels at a time, each slot's gate + bias and exp computed once
// (the portable loops of v4_compressor.h recompute them per pass); the entry's norm, rope and
// store are v4_compressor.h's.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention_avx512_math.h"
#include "bf16_avx512.h"
#include "bf16_bits.h"
#include "v4_compressor_entry.h"

namespace {
#include "v4_compressor.h"

using mlafx::avx512::bf16_to_fp32;
using mlafx::avx512::exp2_ps;
using mlafx::avx512::kLog2e;
using mlafx::avx512::round_to_bf16;

template <typename T>
__m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    return bf16_to_fp32(_mm256_maskz_loadu_epi16(mask, p));
  }
}

template <typename T>
__m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return round_to_bf16(x);
  }
}

template <typename T>
void compress_entries_avx512(const mlafx::V4Compress& p, int64_t n0, int64_t n1,
                             float* scratch) {
  const int64_t m = p.m, c = p.c, sw = p.sw, width = 2 * sw;
  const SlotPlan plan = slot_plan(p);
  const T* rows = static_cast<const T*>(p.rows);
  float* acc = scratch;              // [c]
  float* e = scratch + 4 * c;        // [slots, 16]: gate + bias, then exp
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t* src = p.sources + n * 2 * m;
    const bool has_previous = p.has_previous[n];
    for (int64_t j0 = 0; j0 < c; j0 += 16) {
      const __mmask16 mask =
          c - j0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (c - j0)) - 1u);
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t s = 0; s < plan.slots; ++s) {
        if (plan.masked(s, has_previous)) continue;
        const int64_t col = plan.series(s) + j0;
        const __m512 g = _mm512_add_ps(
            load16(rows + src[plan.source(s)] * width + sw + col, mask),
            _mm512_maskz_loadu_ps(mask, p.bias + (plan.source(s) % m) * sw + col));
        _mm512_storeu_ps(e + 16 * s, g);
        top = _mm512_max_ps(top, g);
      }
      __m512 denom = _mm512_setzero_ps();
      for (int64_t s = 0; s < plan.slots; ++s) {
        if (plan.masked(s, has_previous)) continue;
        const __m512 x = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(e + 16 * s), top),
                                               _mm512_set1_ps(kLog2e)));
        _mm512_storeu_ps(e + 16 * s, x);
        denom = _mm512_add_ps(denom, x);
      }
      __m512 sum = _mm512_setzero_ps();
      for (int64_t s = 0; s < plan.slots; ++s) {
        if (plan.masked(s, has_previous)) continue;
        const __m512 a = round16<T>(_mm512_div_ps(_mm512_loadu_ps(e + 16 * s), denom));
        const __m512 kv = load16(rows + src[plan.source(s)] * width + plan.series(s) + j0, mask);
        sum = _mm512_add_ps(sum, round16<T>(_mm512_mul_ps(kv, a)));
      }
      _mm512_mask_storeu_ps(acc + j0, mask, sum);
    }
    finish_entry<T>(p, n, acc);
  }
}

}  // namespace

namespace mlafx::avx512 {

void v4_compress_f32(const V4Compress& p, int64_t n0, int64_t n1, float* scratch) {
  compress_entries_avx512<float>(p, n0, n1, scratch);
}

void v4_compress_bf16(const V4Compress& p, int64_t n0, int64_t n1, float* scratch) {
  compress_entries_avx512<Bf16>(p, n0, n1, scratch);
}

}  // namespace mlafx::avx512

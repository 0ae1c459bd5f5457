// AVX2 version of the weight quantizer's per-group step (quant_weight.cpp): 8 groups at a
// time, one per fp32 lane, so every lane runs exactly the portable code's per-element IEEE
// operations in the portable order (true division w / d, clamp, round half to even by the
// 1.5 * 2^23 trick, the int4 error summed ((e_l + e_{l+8}) + e_{l+16}) + e_{l+24} then the 8
// partial sums left to right) and the result is bit-identical. Compiled with -ffp-contract=off
// (setup.py): d * q then the subtraction must round separately. Only called after use_avx2().
//
// Differences that cannot change the result: the fp16 rounding of scales is VCVTPS2PH with
// round-to-nearest-even (c10::Half's rounding); max is exact in any order; the int4 candidate
// loop keeps only the best d per lane and recomputes q from it at the end (q depends on w and
// d alone), and does not skip a candidate whose d equals the previous one's (its error equals
// that one's, so `err < best` cannot pick it). Weights are assumed finite, as in the
// portable code (NaN clamps differently here).
#include <immintrin.h>

#include <cstring>

#include "quant.h"

#if !defined(__AVX2__) || !defined(__F16C__)
#error "quant_weight_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

constexpr int kGroup = static_cast<int>(kQuantGroup);

inline __m256 round_half_even(__m256 v) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23
  return _mm256_sub_ps(_mm256_add_ps(v, magic), magic);
}

inline __m256 clamp(__m256 v, float lo, float hi) {
  return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}

// fp32 -> nearest-even fp16 -> fp32, and the fp16 bits.
inline __m256 to_half_and_back(__m256 v, __m128i* bits) {
  *bits = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtph_ps(*bits);
}

// q = d != 0 ? round(clamp(w / d)) : 0 for the 32 columns (d > 0 for int8, as portable).
template <int kBits>
inline __m256 quantize_column(__m256 w, __m256 d, __m256 use) {
  constexpr float lo = kBits == 8 ? -127.0f : -8.0f;
  constexpr float hi = kBits == 8 ? 127.0f : 7.0f;
  return _mm256_and_ps(round_half_even(clamp(_mm256_div_ps(w, d), lo, hi)), use);
}

inline void store_q(const __m256 (&qv)[kGroup], int offset, int8_t* q) {
  alignas(32) int32_t lanes[kGroup][8];
  for (int k = 0; k < kGroup; ++k) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[k]), _mm256_cvttps_epi32(qv[k]));
  }
  for (int l = 0; l < 8; ++l) {
    for (int k = 0; k < kGroup; ++k) {
      q[l * kGroup + k] = static_cast<int8_t>(lanes[k][l] + offset);
    }
  }
}

}  // namespace

void quantize_groups8(int bits, const float* w_t, int8_t* q, uint16_t* scale_bits) {
  __m256 w[kGroup];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < kGroup; ++k) {
    w[k] = _mm256_loadu_ps(w_t + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, w[k]));
  }
  __m256 qv[kGroup];
  __m128i bits_out;
  if (bits == 8) {
    const __m256 d = to_half_and_back(_mm256_div_ps(amax, _mm256_set1_ps(127.0f)), &bits_out);
    const __m256 use = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ);
    for (int k = 0; k < kGroup; ++k) {
      qv[k] = quantize_column<8>(w[k], d, use);
    }
    store_q(qv, 0, q);
  } else {
    // peak = w[first k with |w[k]| == amax] (w[31] if none, as the portable scan)
    __m256 peak = w[kGroup - 1];
    for (int k = kGroup - 2; k >= 0; --k) {
      const __m256 hit = _mm256_cmp_ps(_mm256_andnot_ps(sign, w[k]), amax, _CMP_EQ_OQ);
      peak = _mm256_blendv_ps(peak, w[k], hit);
    }
    constexpr float kDivisors[11] = {-8.0f, -7.75f, -7.5f, -7.25f, -7.0f, -6.75f,
                                     -6.5f, 7.0f,   6.75f, 6.5f,   6.25f};  // kInt4Divisors
    __m256 best_d = _mm256_setzero_ps();
    __m256 best_err = _mm256_setzero_ps();
    for (int c = 0; c < 11; ++c) {
      __m128i unused;
      const __m256 ratio = _mm256_div_ps(peak, _mm256_set1_ps(kDivisors[c]));
      const __m256 d = to_half_and_back(ratio, &unused);
      const __m256 use = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ);
      __m256 lanes[8];
      for (int k = 0; k < kGroup; ++k) {
        const __m256 dq = _mm256_mul_ps(d, quantize_column<4>(w[k], d, use));  // exact
        const __m256 diff = _mm256_sub_ps(w[k], dq);
        const __m256 e = _mm256_mul_ps(diff, diff);
        lanes[k % 8] = k < 8 ? e : _mm256_add_ps(lanes[k % 8], e);
      }
      __m256 err = lanes[0];
      for (int l = 1; l < 8; ++l) {
        err = _mm256_add_ps(err, lanes[l]);
      }
      if (c == 0) {
        best_d = d;
        best_err = err;
      } else {
        const __m256 better = _mm256_cmp_ps(err, best_err, _CMP_LT_OQ);
        best_d = _mm256_blendv_ps(best_d, d, better);
        best_err = _mm256_blendv_ps(best_err, err, better);
      }
    }
    const __m256 use = _mm256_cmp_ps(best_d, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    for (int k = 0; k < kGroup; ++k) {
      qv[k] = quantize_column<4>(w[k], best_d, use);
    }
    store_q(qv, 8, q);
    bits_out = _mm256_cvtps_ph(best_d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scale_bits), bits_out);
}

}  // namespace mlafx::avx2

// AVX-512 specialisation of the activation quantizer (quant.h: quantize_rows_avx512): rows of
// x to int8 per group of 32, bit-identical to the portable quantize_group (quant_dot.cpp),
// which it replaces after use_avx512_vnni(). A group is two vectors of 16 fp32 (masked loads
// zero the columns past K); amax is a vector max (NaN handled by its own mask, as the
// portable loop's flag), d = amax / 127 and 1 / d are the same IEEE divisions, v * (1 / d) is
// clamped to +-127 and rounded half to even by an explicitly rounding conversion (the
// portable magic-number rounding is exact for |v| <= 2^22), and zeros stay 0 when 1 / d
// overflows. The scalar loop cost ~3 ns per value (50 us for 8 x 2048, a tenth of an int4
// q_proj at 8 rows); this one is ~20x faster.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "quant.h"

#if !defined(__AVX512BW__) || !defined(__F16C__)
#error "quant_activations_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

// 16 values of a row from column k (at most `width` of them; zero past it) as fp32.
template <ActivationType kType>
inline __m512 load16(const void* row, int64_t k, int64_t width) {
  const __mmask16 mask = width >= 16 ? __mmask16{0xFFFF}
                                     : static_cast<__mmask16>((1u << std::max<int64_t>(width, 0)) - 1);
  if constexpr (kType == ActivationType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + k);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + k);
    if constexpr (kType == ActivationType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else {
      return _mm512_cvtph_ps(bits);
    }
  }
}

// 16 values -> int8 quants (returned as int32 lanes): clamp(v * inv) rounded half to even,
// 0 where v is 0.
inline __m512i quantize16(__m512 v, __m512 inv) {
  const __m512 scaled = _mm512_min_ps(_mm512_set1_ps(127.0f),
                                      _mm512_max_ps(_mm512_set1_ps(-127.0f), _mm512_mul_ps(v, inv)));
  const __mmask16 nonzero = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  return _mm512_maskz_cvt_roundps_epi32(nonzero, scaled,
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <ActivationType kType>
void quantize_rows_typed(const void* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1,
                         int64_t groups, int8_t* q, int64_t ldq, float* d, int32_t* qsum) {
  const int64_t element = kType == ActivationType::kFloat32 ? 4 : 2;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(x) + m * ldx * element;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * kQuantGroup;
      const __m512 v0 = load16<kType>(row, k0, K - k0);
      const __m512 v1 = load16<kType>(row, k0 + 16, K - k0 - 16);
      const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) |
                        _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
      const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
      int8_t* group_q = q + m * ldq + k0;
      d[m * groups + g] = scale;
      if (!std::isfinite(scale)) {
        std::memset(group_q, 0, kQuantGroup);
        qsum[m * groups + g] = 0;
        continue;
      }
      const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
      const __m512i q0 = quantize16(v0, inv);
      const __m512i q1 = quantize16(v1, inv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(group_q), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(group_q + 16), _mm512_cvtepi32_epi8(q1));
      qsum[m * groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  }
}

}  // namespace

void quantize_rows_avx512(ActivationType type, const void* x, int64_t ldx, int64_t K, int64_t m0,
                          int64_t m1, int64_t groups, int8_t* q, int64_t ldq, float* d,
                          int32_t* qsum) {
  switch (type) {
    case ActivationType::kFloat32:
      quantize_rows_typed<ActivationType::kFloat32>(x, ldx, K, m0, m1, groups, q, ldq, d, qsum);
      break;
    case ActivationType::kBFloat16:
      quantize_rows_typed<ActivationType::kBFloat16>(x, ldx, K, m0, m1, groups, q, ldq, d, qsum);
      break;
    case ActivationType::kFloat16:
      quantize_rows_typed<ActivationType::kFloat16>(x, ldx, K, m0, m1, groups, q, ldq, d, qsum);
      break;
  }
}

}  // namespace mlafx::avx512

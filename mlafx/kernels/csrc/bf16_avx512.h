// fp32 <-> bf16 on AVX-512 registers, for the *_avx512.cpp sources only (compiled with the
// AVX-512 BF16 flags from setup.py and called after use_avx512_bf16()).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512BF16__)
#error "bf16_avx512.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {

// The first min(n, 32) of a vector's 32 16-bit lanes (n >= 0): masked loads and stores of
// rows' last, partial 32 bf16 / fp16 elements.
inline __mmask32 first_lanes32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << n) - 1u);
}

// 16 floats -> 16 bf16 (as 16-bit ints). VCVTNEPS2BF16 rounds to nearest even and quiets
// NaNs keeping sign and top payload bits, but it flushes fp32 subnormals to +-0 (DAZ), which
// torch's .to(torch.bfloat16) does not (bf16 has fp32's exponent range, so they stay
// representable). Subnormal lanes are rare: redo only those with the integer RNE formula.
inline __m256i fp32_to_bf16_rne(__m512 x) {
  const __m256i fast = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 subnormal =
      _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
      _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
  if (__builtin_expect(subnormal == 0, 1)) {
    return fast;
  }
  // bits + 0x7fff + lsb(bits >> 16), then keep the high half: round to nearest, ties to even.
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __m256i slow = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  return _mm256_mask_blend_epi16(subnormal, fast, slow);
}

// 16 bf16 (as 16-bit ints) -> 16 floats, exact.
inline __m512 bf16_to_fp32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x rounded to bf16 (to nearest even), as floats: float(bf16(x)).
inline __m512 round_to_bf16(__m512 x) { return bf16_to_fp32(fp32_to_bf16_rne(x)); }

}  // namespace mlafx::avx512

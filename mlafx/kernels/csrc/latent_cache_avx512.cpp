// AVX-512 specialisations for write_latent_cache (compiled with -mavx512f/bw/vl/dq/bf16).
// Only called after the run-time check in cpu_features.h; the scalar reference for every
// function here is in latent_cache.cpp.
#include <immintrin.h>

#include <ATen/cpu/vec/vec.h>

#include "latent_cache.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "latent_cache_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif
// Guards the build configuration for every *_avx512.cpp: ATen's vector type is 16 floats wide.
static_assert(at::vec::Vectorized<float>::size() == 16, "CPU_CAPABILITY_AVX512 not in effect");

namespace mlafx::avx512 {
namespace {

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

}  // namespace

void convert_fp32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        fp32_to_bf16_rne(_mm512_loadu_ps(src + i)));
  }
  if (i < n) {
    // Masked tail: widths like 512+13 need no scalar loop, and nothing past n is touched.
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(dst + i, tail, fp32_to_bf16_rne(_mm512_maskz_loadu_ps(tail, src + i)));
  }
}

}  // namespace mlafx::avx512

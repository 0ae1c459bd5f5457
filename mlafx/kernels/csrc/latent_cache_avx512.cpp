// AVX-512 specialisations for write_latent_cache (compiled with -mavx512f/bw/vl/dq/bf16).
// Only called after the run-time check in cpu_features.h; the scalar reference for every
// function here is in latent_cache.cpp.
#include <immintrin.h>

#include <ATen/cpu/vec/vec.h>

#include "bf16_avx512.h"
#include "latent_cache.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "latent_cache_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif
// Guards the build configuration for every *_avx512.cpp: ATen's vector type is 16 floats wide.
static_assert(at::vec::Vectorized<float>::size() == 16, "CPU_CAPABILITY_AVX512 not in effect");

namespace mlafx::avx512 {

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

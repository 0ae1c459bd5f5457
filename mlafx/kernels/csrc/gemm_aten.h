// ATen-facing helpers of the weight-streaming kernels, shared by gemm.cpp and moe.cpp.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "cpu_features.h"
#include "gemm.h"
#include "latent_cache.h"  // avx512::convert_fp32_to_bf16 (RNE, bit-exact with c10)

namespace mlafx {

// bfloat16 / float16 / float32 -> FloatKind; anything else raises a TypeError.
FloatKind float_kind(at::ScalarType dtype);

bool is_supported_float(at::ScalarType dtype);

// dst[0, n) = src[0, n) rounded to scalar_t as c10 rounds (to nearest even); bf16 through the
// AVX-512 converter where the CPU has it (the scalar loop cost ~2 ns a value: 17% of a
// 1024-row quantized product, ~10% of kv_b_proj's).
template <typename scalar_t>
void round_row(const float* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (use_avx512_bf16()) {
      avx512::convert_fp32_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<scalar_t>(src[i]);
  }
}

}  // namespace mlafx

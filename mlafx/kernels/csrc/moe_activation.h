// The SwiGLU activation of the quantized and FP8 MoE kernels (quant_moe.cpp, fp8_moe.cpp):
// h = silu(g) * u in x's dtype, silu in fp32 of the rounded g, rounded, times the rounded u.
// Portable sources only (includes c10).
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_features.h"
#include "silu_avx512.h"

namespace mlafx {

template <typename scalar_t>
scalar_t silu_times_up(float gate, float up) {
  const float g = static_cast<float>(static_cast<scalar_t>(gate));
  const float u = static_cast<float>(static_cast<scalar_t>(up));
  const float s = static_cast<float>(static_cast<scalar_t>(g / (1.0f + std::exp(-g))));
  return static_cast<scalar_t>(s * u);
}

// h[i] = silu_times_up(gate[i], up[i]) for i < n; bf16 rows on AVX-512 (bit-identical).
template <typename scalar_t>
void silu_times_up_row(const float* gate, const float* up, scalar_t* h, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (use_avx512_bf16()) {
      avx512::silu_times_up_bf16(gate, up, reinterpret_cast<uint16_t*>(h), n);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    h[i] = silu_times_up<scalar_t>(gate[i], up[i]);
  }
}

}  // namespace mlafx

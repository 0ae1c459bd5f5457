// The SwiGLU activation of the MoE kernels on AVX-512 (silu_avx512.cpp); std-only, shared
// between portable and AVX-512 objects.
#pragma once

#include <cstdint>

namespace mlafx::avx512 {

// h[i] = bf16(bf16(g / (1 + exp(-g))) * bf16(up[i])) with g = bf16(gate[i]), for i < n:
// moe_activation.h's silu_times_up<c10::BFloat16>, bit for bit (exp is the C library's expf,
// called per element; the roundings and arithmetic are 16 lanes at a time), NaN bytes aside.
// Call only when mlafx::use_avx512_bf16().
void silu_times_up_bf16(const float* gate, const float* up, uint16_t* h, int64_t n);

}  // namespace mlafx::avx512

// Row conversions used by write_latent_cache, one declaration per ISA specialisation.
//
// Deliberately free of ATen/c10 includes: this header is shared between portable and
// AVX-512 objects, and anything inline in it would be compiled under both flag sets.
#pragma once

#include <cstdint>

namespace mlafx::avx512 {

// fp32 -> bf16 bits, round to nearest even; bit-exact with the portable scalar conversion in
// latent_cache.cpp for every input, NaNs included. Defined in latent_cache_avx512.cpp;
// call only when mlafx::use_avx512_bf16().
void convert_fp32_to_bf16(const float* src, uint16_t* dst, int64_t n);

}  // namespace mlafx::avx512

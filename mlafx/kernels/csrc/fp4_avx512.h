// The e2m1 decoding shared by the FP4 kernels on AVX-512 (fp4_dot_avx512.cpp) and on AMX tiles
// (fp4_dot_amx_avx512.cpp), for the *_avx512.cpp sources only.
//
// A chunk is 128 weights of a row: 64 bytes read as 32 words of 4 nibbles. VPERMW looks a
// word's low 5 bits up in a 32-entry table (the 16 bf16 e2m1 values twice: bit 4 is the next
// nibble's lowest), so the word itself decodes nibble 0 and the word shifted by 4, 8 and 12
// nibbles 1-3: vector j holds the chunk's elements 4i + j (i = 0..31), the order x's rows are
// staged in (fp4_stage_rows).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512BW__)
#error "fp4_avx512.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
// internal linkage: each including source keeps its own copy (they differ in target flags)
namespace {

constexpr int64_t kFp4Chunk = 128;  // weights a 64-byte load decodes

// The bf16 bits of the 16 e2m1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, ..., -6), twice.
inline __m512i e2m1_table32() {
  alignas(64) static const uint16_t table[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  //
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,  //
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  //
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  return _mm512_load_si512(table);
}

// A chunk's 64 bytes at src, zeros past `bytes` (>= 0).
inline __m512i load_chunk(const uint8_t* src, int64_t bytes) {
  const __mmask64 mask = bytes >= 64 ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1;
  return _mm512_maskz_loadu_epi8(mask, src);
}

// The chunk's elements 4i + j as 32 bf16 (J = 0..3).
template <int J>
inline __m512i chunk_values(__m512i packed, __m512i table) {
  if constexpr (J == 0) {
    return _mm512_permutexvar_epi16(packed, table);
  } else {
    return _mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 4 * J), table);
  }
}

}  // namespace
}  // namespace mlafx::avx512

// e4m3fn -> bf16 in registers, 32 at a time, for the *_avx512.cpp sources of the block FP8
// products (fp8_dot_avx512.cpp, fp8_pairs_avx512.cpp). No VBMI needed (fp8_vbmi_avx512.h has the
// byte-table decoder, 64 at a time, for CPUs with it).
//
// e4m3fn -> bf16 (both exact): a normal byte s.eeee.mmm is bf16 s.(e + 120).mmm0000, i.e.
// ((b & 0x7F) << 4) + 0x3C00 with the sign moved from bit 7 to bit 15; the 7 subnormals
// (e = 0: m * 2^-9) and zero come from an 8-entry permute table; 0x7F / 0xFF are NaN.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16_avx512.h"

#if !defined(__AVX512BW__)
#error "fp8_bf16_avx512.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
// internal linkage: each including source keeps its own copy
namespace {

// 32 e4m3 bytes -> 32 bf16 (16-bit lanes).
inline __m512i e4m3_to_bf16(__m256i bytes) {
  const __m512i subnormals = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
      0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0x0000);
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                    subnormals);
  v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)),
                            _mm512_set1_epi16(0x7FC0));
  // v | (w << 8 & 0x8000): the sign from bit 7 to bit 15
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(-32768), 0xF8);
}

// bf16 elements per widened weight row of K columns: whole 64-byte lines (even, so a last odd
// column has a zero partner), not a multiple of 4 KB apart (split loads and L1 set conflicts
// measured 2-4x slower).
inline int64_t widened_ld(int64_t K) {
  int64_t ld = (K + 31) / 32 * 32;
  if ((ld * 2) % 4096 == 0) ld += 32;
  return ld;
}

// One row of K e4m3 bytes as bf16 into dst (64-byte aligned, widened_ld(K) elements), zero
// past K.
inline void widen_row(const uint8_t* src, int64_t K, uint16_t* dst) {
  const int64_t ld = widened_ld(K);
  for (int64_t k = 0; k < ld; k += 32) {
    const __mmask32 mask = k < K ? first_lanes32(K - k) : 0;
    _mm512_store_si512(dst + k, e4m3_to_bf16(_mm256_maskz_loadu_epi8(mask, src + k)));
  }
}

}  // namespace
}  // namespace mlafx::avx512

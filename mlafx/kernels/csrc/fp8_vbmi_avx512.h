// The VBMI decoding of e4m3 bytes to bf16, 64 at a time, shared by the block FP8 products on
// AVX-512 (fp8_dot_avx512.cpp) and on AMX tiles (fp8_dot_amx_avx512.cpp). For the
// *_avx512.cpp sources only; call after mlafx::use_avx512_vbmi().
//
// VPERMT2B looks up 64 bytes at once in a 128-byte table (index bits 0..6: the magnitude),
// so the high and the low byte of each bf16 are one lookup each, the sign one VPTERNLOG, and
// two byte unpacks interleave them into 2 x 32 bf16: 5 instructions per 64 weights against 20
// for the arithmetic decoding (e4m3_to_bf16 in fp8_bf16_avx512.h). The unpacks work within
// 128-bit lanes, so the 64 columns come out as A = [0..7, 16..23, 32..39, 48..55] and
// B = [8..15, 24..31, 40..47, 56..63]; the rows of x are permuted the same way once per call
// (chunked_rows, fp8_stage_tiles), and dot products do not care about the order of their
// terms. Needs block_k % 64 == 0 (a 64-column chunk never straddles two blocks).

#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512BW__)
#error "fp8_vbmi_avx512.h is for sources compiled with the AVX-512 flags from setup.py"
#endif

#define MLAFX_VBMI __attribute__((target("avx512vbmi")))

namespace mlafx::avx512 {
// internal linkage: each including source keeps its own copy (they differ in target flags)
namespace {

struct ByteTables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};

uint16_t bf16_bits_of_magnitude(int mag) {
  constexpr uint16_t kSubnormals[8] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                       0x3C00, 0x3C20, 0x3C40, 0x3C60};
  if (mag == 0x7F) return 0x7FC0;
  if (mag < 8) return kSubnormals[mag];
  return static_cast<uint16_t>((mag << 4) + 0x3C00);
}

const ByteTables& byte_tables() {
  static const ByteTables tables = [] {
    ByteTables t{};
    for (int i = 0; i < 128; ++i) {
      const uint16_t bits = bf16_bits_of_magnitude(i);
      t.hi[i] = static_cast<uint8_t>(bits >> 8);
      t.lo[i] = static_cast<uint8_t>(bits & 0xFF);
    }
    return t;
  }();
  return tables;
}

struct Decoder {
  __m512i hi0, hi1, lo0, lo1, sign;

  MLAFX_VBMI explicit Decoder(const ByteTables& t)
      : hi0(_mm512_load_si512(t.hi)),
        hi1(_mm512_load_si512(t.hi + 64)),
        lo0(_mm512_load_si512(t.lo)),
        lo1(_mm512_load_si512(t.lo + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}

  // 64 e4m3 bytes -> bf16 columns A (a) and B (b).
  MLAFX_VBMI inline void decode(__m512i bytes, __m512i* a, __m512i* b) const {
    __m512i hi = _mm512_permutex2var_epi8(hi0, bytes, hi1);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, bytes, lo1);
    hi = _mm512_ternarylogic_epi32(hi, bytes, sign, 0xF8);  // hi | (bytes & 0x80)
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
  }
};

inline __mmask64 tail_mask64(int64_t remaining) {
  return remaining >= 64 ? ~__mmask64{0} : (__mmask64{1} << remaining) - 1;
}

}  // namespace
}  // namespace mlafx::avx512

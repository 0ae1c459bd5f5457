// AVX2 kernel of quant_dot (quant.h) on the K formats k8 / k4 (kquant_format.py): compiled
// with -mavx2 -mfma -mf16c -ffp-contract=off (setup.py), called only after use_avx2(), on
// AVX-512 hosts too. The integer part is the int formats' AVX2 kernel (quant_dot_avx2.cpp):
// per sub-step the 64 weight bytes of a group are two 32-byte loads (rows 0-7, rows 8-15; 4
// consecutive columns of one row per 32-bit lane) against 4 bytes of a row of q_x broadcast.
// What differs is that each group's two halves of 16 columns keep their own int32 sums:
// - k8: sub-steps 0-3 are columns 0-15, 4-7 columns 16-31; stored ^ 0x80 is v, multiplied
//   exactly with VPMADDUBSW(|v|, sign(q_x, v)) and widened by VPMADDWD(., 1) every sub-step;
// - k4: low nibbles are columns 0-15, high nibbles 16-31 (v in [0, 15], no offset): each half
//   sums its 4 sub-steps in int16 (4 * 2 * 15 * 127 < 2^15) and is widened once.
// Then per lane (a weight row), exactly as the portable kernel (quant_kdot.cpp):
//   I = a_0 * isum_0 + a_1 * isum_1, J = m * qsum (VPMULLD, exact),
//   acc += (d * (float)I - dmin * (float)J) * d_x, each operation rounded to fp32.
//
// Tiles: MR rows of x x MB blocks (two 8-lane halves of rows per block), blocks walked in
// chunks of ~256 KB of weights as in the int kernel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_kdot_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

constexpr int64_t kChunkBytes = int64_t{256} << 10;

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

// The two half-group int32 sums isum[h][c] (h: rows 0-7 / 8-15, c: columns 0-15 / 16-31) of
// one region against MR rows of x.
template <int kBits, int MR>
inline void region_sums(const uint8_t* quants, const int8_t* const* xq, __m256i (*isum)[2][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < 2; ++h) {
      isum[r][h][0] = _mm256_setzero_si256();
      isum[r][h][1] = _mm256_setzero_si256();
    }
  }
  if constexpr (kBits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int s = 0; s < 8; ++s) {
      const int c = s / 4;
      __m256i xb[MR];
      for (int r = 0; r < MR; ++r) {
        xb[r] = broadcast4(xq[r] + 4 * s);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_xor_si256(load32(quants + 64 * s + 32 * h), flip);
        const __m256i w_abs = _mm256_abs_epi8(w);
        for (int r = 0; r < MR; ++r) {
          const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb[r], w));
          isum[r][h][c] = _mm256_add_epi32(isum[r][h][c], _mm256_madd_epi16(p, ones));
        }
      }
    }
  } else {
    __m256i sacc[MR][2][2];
    for (int r = 0; r < MR; ++r) {
      for (int h = 0; h < 2; ++h) {
        sacc[r][h][0] = _mm256_setzero_si256();
        sacc[r][h][1] = _mm256_setzero_si256();
      }
    }
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      __m256i x_low[MR], x_high[MR];
      for (int r = 0; r < MR; ++r) {
        x_low[r] = broadcast4(xq[r] + 4 * s);
        x_high[r] = broadcast4(xq[r] + 16 + 4 * s);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load32(quants + 64 * s + 32 * h);
        const __m256i w_low = _mm256_and_si256(v, low_nibbles);
        const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        for (int r = 0; r < MR; ++r) {
          sacc[r][h][0] = _mm256_add_epi16(sacc[r][h][0], _mm256_maddubs_epi16(w_low, x_low[r]));
          sacc[r][h][1] =
              _mm256_add_epi16(sacc[r][h][1], _mm256_maddubs_epi16(w_high, x_high[r]));
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int h = 0; h < 2; ++h) {
        isum[r][h][0] = _mm256_madd_epi16(sacc[r][h][0], ones);
        isum[r][h][1] = _mm256_madd_epi16(sacc[r][h][1], ones);
      }
    }
  }
}

// out rows m0..m0+MR-1, block b (out column 16 * (b - out_block0)).
template <int kBits, int MR>
void tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t supers, int64_t b,
          int64_t out_block0, float* out, int64_t ldo) {
  constexpr int64_t S = quant_group_bytes(kBits | 0x100);
  constexpr int64_t R = kquant_region_bytes(kBits);
  __m256 facc[MR][2];
  for (int r = 0; r < MR; ++r) {
    facc[r][0] = _mm256_setzero_ps();
    facc[r][1] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < supers; ++g) {
    const uint8_t* super = packed + (b * supers + g) * S;
    const uint8_t* header = super + kSuperGroups * R;
    __m256 d[2], dmin[2];
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16 * h)));
      dmin[h] = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + 16 * h)));
    }
    for (int64_t t = 0; t < kSuperGroups; ++t) {
      const uint8_t* region = super + t * R;
      const int64_t group = g * kSuperGroups + t;
      const int8_t* xq[MR];
      for (int r = 0; r < MR; ++r) {
        xq[r] = x.q + (m0 + r) * x.ldq + group * kQuantGroup;
      }
      __m256i isum[MR][2][2];
      region_sums<kBits, MR>(region, xq, isum);
      const uint8_t* trailer = region + quant_bytes(kBits);
      for (int h = 0; h < 2; ++h) {
        const __m256i a0 = _mm256_cvtepi8_epi32(load8(trailer + 8 * h));
        const __m256i a1 = _mm256_cvtepi8_epi32(load8(trailer + 16 + 8 * h));
        const __m256i mins = _mm256_cvtepu8_epi32(load8(trailer + 32 + 8 * h));
        for (int r = 0; r < MR; ++r) {
          const __m256i I = _mm256_add_epi32(_mm256_mullo_epi32(a0, isum[r][h][0]),
                                             _mm256_mullo_epi32(a1, isum[r][h][1]));
          const __m256i J =
              _mm256_mullo_epi32(mins, _mm256_set1_epi32(x.qsum[(m0 + r) * x.ldd + group]));
          const __m256 term = _mm256_sub_ps(_mm256_mul_ps(d[h], _mm256_cvtepi32_ps(I)),
                                            _mm256_mul_ps(dmin[h], _mm256_cvtepi32_ps(J)));
          const __m256 dx = _mm256_set1_ps(x.d[(m0 + r) * x.ldd + group]);
          facc[r][h] = _mm256_add_ps(facc[r][h], _mm256_mul_ps(term, dx));
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = out + (m0 + r) * ldo + (b - out_block0) * kQuantBlockRows;
    _mm256_storeu_ps(o, facc[r][0]);
    _mm256_storeu_ps(o + 8, facc[r][1]);
  }
}

template <int kBits, int MR>
void row_tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t supers,
              int64_t b0, int64_t b1, int64_t out_block0, float* out, int64_t ldo) {
  for (int64_t b = b0; b < b1; ++b) {
    tile<kBits, MR>(x, m0, packed, supers, b, out_block0, out, ldo);
  }
}

template <int kBits>
void kdot(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t supers,
          int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t block_bytes = std::max<int64_t>(supers, 1) * quant_group_bytes(kBits | 0x100);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  for (int64_t c0 = block_begin; c0 < block_end; c0 += chunk) {
    const int64_t c1 = std::min(block_end, c0 + chunk);
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) {
      row_tile<kBits, 4>(x, m0, packed, supers, c0, c1, block_begin, out, ldo);
    }
    switch (M - m0) {
      case 3:
        row_tile<kBits, 3>(x, m0, packed, supers, c0, c1, block_begin, out, ldo);
        break;
      case 2:
        row_tile<kBits, 2>(x, m0, packed, supers, c0, c1, block_begin, out, ldo);
        break;
      case 1:
        row_tile<kBits, 1>(x, m0, packed, supers, c0, c1, block_begin, out, ldo);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void kquant_dot_avx2(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                     int64_t supers, int64_t block_begin, int64_t block_end, float* out,
                     int64_t ldo) {
  if (bits == 8) {
    kdot<8>(x, M, packed, supers, block_begin, block_end, out, ldo);
  } else {
    kdot<4>(x, M, packed, supers, block_begin, block_end, out, ldo);
  }
}

}  // namespace mlafx::avx2

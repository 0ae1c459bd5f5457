// AVX2 kernel of quant_dot (quant.h) on the K formats k8 / k4 (kquant_format.py): compiled
// with -mavx2 -mfma -mf16c -ffp-contract=off (setup.py), called only after use_avx2(), on
// AVX-512 hosts too. The integer part is the int formats' AVX2 kernel (quant_dot_avx2.cpp):
// per sub-step the 64 weight bytes of a group are two 32-byte loads (rows 0-7, rows 8-15; 4
// consecutive columns of one row per 32-bit lane) against 4 bytes of a row of q_x broadcast.
// What differs is that each group's two halves of 16 columns have their own scale a_h, which
// the widening VPMADDWD applies (multiplier (a_h, a_h) per row lane instead of (1, 1)), so
// I = a_0 * isum_0 + a_1 * isum_1 accumulates directly:
// - k8: sub-steps 0-3 are columns 0-15, 4-7 columns 16-31; stored ^ 0x80 is v, multiplied
//   exactly with VPMADDUBSW(|v|, sign(q_x, v)) and widened every sub-step;
// - k4: low nibbles are columns 0-15, high nibbles 16-31 (v in [0, 15], no offset): each half
//   sums its 4 sub-steps in int16 (4 * 2 * 15 * 127 < 2^15) and is widened once.
// Then per lane (a weight row), exactly as the portable kernel (quant_kdot.cpp):
//   acc += (d * (float)I - dmin * (float)(m * qsum)) * d_x, each operation rounded to fp32.
//
// Tiles: MR rows of x x MB blocks (two 8-lane halves of rows per block), walked as
// quant_tiles.h says.
#include <immintrin.h>

#include <algorithm>

#include "quant.h"
#include "quant_avx2.h"
#include "quant_tiles.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_kdot_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

inline __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

// Per row i of a group (one 32-bit lane per row, as the int kernel), the two half scales as
// int16 pairs: lane i holds (a_h[i], a_h[i]), VPMADDWD's multiplier.
inline __m256i half_scale_pairs(const uint8_t* a) {
  const __m256i wide = _mm256_cvtepi8_epi32(load8(a));
  return _mm256_or_si256(_mm256_and_si256(wide, _mm256_set1_epi32(0xFFFF)),
                         _mm256_slli_epi32(wide, 16));
}

// I[bb][r][h] = a_0 * isum_0 + a_1 * isum_1 of MB blocks' regions against MR rows of x (h:
// rows 0-7 / 8-15 of a block): the widening VPMADDWD multiplies by the half's scale instead of
// 1, so the half-group sums are never formed apart (exact: |a * pair sum| < 2^22).
template <int kBits, int MB, int MR>
inline void region_dots(const uint8_t* const* quants, const int8_t* const* xq,
                        __m256i (*I)[MR][2]) {
  __m256i scale[MB][2][2];  // [bb][h][column half c]
  for (int bb = 0; bb < MB; ++bb) {
    const uint8_t* trailer = quants[bb] + quant_bytes(kBits);
    for (int h = 0; h < 2; ++h) {
      scale[bb][h][0] = half_scale_pairs(trailer + 8 * h);
      scale[bb][h][1] = half_scale_pairs(trailer + 16 + 8 * h);
      for (int r = 0; r < MR; ++r) {
        I[bb][r][h] = _mm256_setzero_si256();
      }
    }
  }
  if constexpr (kBits == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int s = 0; s < 8; ++s) {
      const int c = s / 4;  // sub-steps 0-3: columns 0-15
      __m256i xb[MR];
      for (int r = 0; r < MR; ++r) {
        xb[r] = broadcast4(xq[r] + 4 * s);
      }
      for (int bb = 0; bb < MB; ++bb) {
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_xor_si256(load32(quants[bb] + 64 * s + 32 * h), flip);
          const __m256i w_abs = _mm256_abs_epi8(w);
          for (int r = 0; r < MR; ++r) {
            const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb[r], w));
            I[bb][r][h] = _mm256_add_epi32(I[bb][r][h], _mm256_madd_epi16(p, scale[bb][h][c]));
          }
        }
      }
    }
  } else {
    // low nibbles are columns 0-15, high ones 16-31: each half's 4 sub-steps summed in int16
    // (4 * 2 * 15 * 127 < 2^15), then scaled and widened once
    __m256i low[MB][MR][2], high[MB][MR][2];
    for (int bb = 0; bb < MB; ++bb) {
      for (int r = 0; r < MR; ++r) {
        for (int h = 0; h < 2; ++h) {
          low[bb][r][h] = _mm256_setzero_si256();
          high[bb][r][h] = _mm256_setzero_si256();
        }
      }
    }
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      __m256i x_low[MR], x_high[MR];
      for (int r = 0; r < MR; ++r) {
        x_low[r] = broadcast4(xq[r] + 4 * s);
        x_high[r] = broadcast4(xq[r] + 16 + 4 * s);
      }
      for (int bb = 0; bb < MB; ++bb) {
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load32(quants[bb] + 64 * s + 32 * h);
          const __m256i w_low = _mm256_and_si256(v, low_nibbles);
          const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
          for (int r = 0; r < MR; ++r) {
            low[bb][r][h] = _mm256_add_epi16(low[bb][r][h], _mm256_maddubs_epi16(w_low, x_low[r]));
            high[bb][r][h] =
                _mm256_add_epi16(high[bb][r][h], _mm256_maddubs_epi16(w_high, x_high[r]));
          }
        }
      }
    }
    for (int bb = 0; bb < MB; ++bb) {
      for (int r = 0; r < MR; ++r) {
        for (int h = 0; h < 2; ++h) {
          I[bb][r][h] = _mm256_add_epi32(_mm256_madd_epi16(low[bb][r][h], scale[bb][h][0]),
                                         _mm256_madd_epi16(high[bb][r][h], scale[bb][h][1]));
        }
      }
    }
  }
}

// out rows m0..m0+MR-1, blocks b..b+MB-1 (out column 16 * (b - out_block0)).
template <int kBits, int MB, int MR>
void tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t supers, int64_t b,
          int64_t out_block0, float* out, int64_t ldo) {
  constexpr int64_t S = quant_group_bytes(kBits | 0x100);
  constexpr int64_t R = kquant_region_bytes(kBits);
  __m256 facc[MB][MR][2];
  for (int bb = 0; bb < MB; ++bb) {
    for (int r = 0; r < MR; ++r) {
      facc[bb][r][0] = _mm256_setzero_ps();
      facc[bb][r][1] = _mm256_setzero_ps();
    }
  }
  for (int64_t g = 0; g < supers; ++g) {
    const uint8_t* super[MB];
    __m256 d[MB][2], dmin[MB][2];
    for (int bb = 0; bb < MB; ++bb) {
      super[bb] = packed + ((b + bb) * supers + g) * S;
      const uint8_t* header = super[bb] + kSuperGroups * R;
      for (int h = 0; h < 2; ++h) {
        d[bb][h] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16 * h)));
        dmin[bb][h] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + 16 * h)));
      }
    }
    for (int64_t t = 0; t < kSuperGroups; ++t) {
      const int64_t group = g * kSuperGroups + t;
      const uint8_t* region[MB];
      for (int bb = 0; bb < MB; ++bb) {
        region[bb] = super[bb] + t * R;
      }
      const int8_t* xq[MR];
      __m256 dx[MR], qsum[MR];
      for (int r = 0; r < MR; ++r) {
        xq[r] = x.q + (m0 + r) * x.ldq + group * kQuantGroup;
        dx[r] = _mm256_set1_ps(x.d[(m0 + r) * x.ldd + group]);
        qsum[r] = _mm256_set1_ps(static_cast<float>(x.qsum[(m0 + r) * x.ldd + group]));
      }
      __m256i I[MB][MR][2];
      region_dots<kBits, MB, MR>(region, xq, I);
      for (int bb = 0; bb < MB; ++bb) {
        const uint8_t* mins = region[bb] + quant_bytes(kBits) + 2 * kQuantBlockRows;
        for (int h = 0; h < 2; ++h) {
          const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(mins + 8 * h)));
          for (int r = 0; r < MR; ++r) {
            // (float)(m * qsum) is m * (float)qsum exactly: both below 2^24
            const __m256 J = _mm256_mul_ps(m, qsum[r]);
            const __m256 term = _mm256_sub_ps(_mm256_mul_ps(d[bb][h], _mm256_cvtepi32_ps(I[bb][r][h])),
                                              _mm256_mul_ps(dmin[bb][h], J));
            facc[bb][r][h] = _mm256_add_ps(facc[bb][r][h], _mm256_mul_ps(term, dx[r]));
          }
        }
      }
    }
  }
  store_tile<MB, MR>(facc, m0, b, out_block0, out, ldo);
}

template <int kBits>
void kdot(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t supers,
          int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t block_bytes = std::max<int64_t>(supers, 1) * quant_group_bytes(kBits | 0x100);
  const auto tile_at = [&]<int MB, int MR>(int64_t m0, int64_t b, int64_t out_block0) {
    tile<kBits, MB, MR>(x, m0, packed, supers, b, out_block0, out, ldo);
  };
  quant_walk_tiles<2>(tile_at, M, block_begin, block_end, block_bytes);
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

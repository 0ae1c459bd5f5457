// AVX2 specialisation of quant_dot (quant.h): compiled with -mavx2 -mfma -mf16c and
// -ffp-contract=off (setup.py); only called after use_avx2(). Same structure as the VNNI
// kernel (quant_dot_avx512.cpp) with 256-bit vectors and no VPDPBUSD (llama.cpp's AVX2
// Q8_0 / Q4_0 dot): per sub-step of a group the 64 weight bytes are two 32-byte loads
// (rows 0-7, rows 8-15; 4 consecutive columns of one row per 32-bit lane) and 4 bytes of a
// row of q_x broadcast to every lane.
//
// int4: VPMADDUBSW(nibbles u8 0..15, q_x s8) gives int16 pair sums of at most 2*15*127; all
// 8 of a group's (4 sub-steps x low/high nibbles) fit one int16 lane (8*3810 < 2^15), so they
// are added in int16 and widened once per group by VPMADDWD(., 1). The stored offset z = 8 is
// removed with 8 * sum(q_x) (precomputed with the activations).
// int8: stored ^ 0x80 is the signed q_w; VPMADDUBSW(|q_w|, sign(q_x, q_w)) multiplies exactly
// (|q_w| <= 128 as u8; pairs at most 2*128*127 < 2^15), so the int32 sums are the signed dot
// with no offset correction. Widened by VPMADDWD(., 1) every sub-step (two pairs would not
// fit int16).
//
// Per group: (float)isum * d_x * d_w added into fp32 accumulators, two roundings per term and
// one per add, exactly as the portable kernel; -ffp-contract=off keeps GCC from fusing the
// multiply and the add into an FMA, so results are bit-identical to the portable path
// (tests/test_kernel_quant.py checks in child processes).
//
// Tiles: MR rows of x x MB blocks, two 8-lane halves per block, walked as quant_tiles.h says:
// chunks of ~256 KB of weights, every row tile of x over a chunk before the next, so the
// weights come from memory once and are re-read from L2 per MR rows of x.
#include <immintrin.h>

#include <algorithm>

#include "quant.h"
#include "quant_avx2.h"
#include "quant_tiles.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_dot_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

// out rows m0..m0+MR-1, blocks b..b+MB-1 (out column 16 * (b - out_block0)).
// Kept as one function (~90 lines): a register-blocked micro-kernel whose MB x MR accumulators
// must stay in registers across the group loop; split into calls, the compiler spills them.
template <int kBits, int MB, int MR>
void tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t groups, int64_t b,
          int64_t out_block0, float* out, int64_t ldo) {
  constexpr int64_t S = quant_group_bytes(kBits);
  __m256 facc[MB][MR][2];
  for (int bb = 0; bb < MB; ++bb) {
    for (int r = 0; r < MR; ++r) {
      facc[bb][r][0] = _mm256_setzero_ps();
      facc[bb][r][1] = _mm256_setzero_ps();
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[MB];
    for (int bb = 0; bb < MB; ++bb) {
      group[bb] = packed + ((b + bb) * groups + g) * S;
    }
    const int8_t* xq[MR];
    for (int r = 0; r < MR; ++r) {
      xq[r] = x.q + (m0 + r) * x.ldq + g * kQuantGroup;
    }
    __m256i iacc[MB][MR][2];
    if constexpr (kBits == 8) {
      for (int bb = 0; bb < MB; ++bb) {
        for (int r = 0; r < MR; ++r) {
          iacc[bb][r][0] = _mm256_setzero_si256();
          iacc[bb][r][1] = _mm256_setzero_si256();
        }
      }
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int s = 0; s < 8; ++s) {
        __m256i xb[MR];
        for (int r = 0; r < MR; ++r) {
          xb[r] = broadcast4(xq[r] + 4 * s);
        }
        for (int bb = 0; bb < MB; ++bb) {
          for (int h = 0; h < 2; ++h) {
            const __m256i w = _mm256_xor_si256(load32(group[bb] + 64 * s + 32 * h), flip);
            const __m256i w_abs = _mm256_abs_epi8(w);
            for (int r = 0; r < MR; ++r) {
              const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb[r], w));
              iacc[bb][r][h] = _mm256_add_epi32(iacc[bb][r][h], _mm256_madd_epi16(p, ones));
            }
          }
        }
      }
    } else {
      __m256i sacc[MB][MR][2];  // int16 pair sums, see the header comment
      for (int bb = 0; bb < MB; ++bb) {
        for (int r = 0; r < MR; ++r) {
          sacc[bb][r][0] = _mm256_setzero_si256();
          sacc[bb][r][1] = _mm256_setzero_si256();
        }
      }
      const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
      for (int s = 0; s < 4; ++s) {
        __m256i x_low[MR], x_high[MR];
        for (int r = 0; r < MR; ++r) {
          x_low[r] = broadcast4(xq[r] + 4 * s);        // columns 4s..4s+3
          x_high[r] = broadcast4(xq[r] + 16 + 4 * s);  // columns 16+4s..
        }
        for (int bb = 0; bb < MB; ++bb) {
          for (int h = 0; h < 2; ++h) {
            const __m256i v = load32(group[bb] + 64 * s + 32 * h);
            const __m256i w_low = _mm256_and_si256(v, low_nibbles);
            const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
            for (int r = 0; r < MR; ++r) {
              const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w_low, x_low[r]),
                                                 _mm256_maddubs_epi16(w_high, x_high[r]));
              sacc[bb][r][h] = _mm256_add_epi16(sacc[bb][r][h], p);
            }
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i correction = _mm256_set1_epi32(8 * x.qsum[(m0 + r) * x.ldd + g]);
        for (int bb = 0; bb < MB; ++bb) {
          for (int h = 0; h < 2; ++h) {
            iacc[bb][r][h] = _mm256_sub_epi32(_mm256_madd_epi16(sacc[bb][r][h], ones), correction);
          }
        }
      }
    }
    __m256 dx[MR];
    for (int r = 0; r < MR; ++r) {
      dx[r] = _mm256_set1_ps(x.d[(m0 + r) * x.ldd + g]);
    }
    for (int bb = 0; bb < MB; ++bb) {
      const uint8_t* scale_bits = group[bb] + quant_bytes(kBits);
      for (int h = 0; h < 2; ++h) {
        const __m256 scales = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_bits + 16 * h)));
        for (int r = 0; r < MR; ++r) {
          const __m256 isum = _mm256_cvtepi32_ps(iacc[bb][r][h]);
          const __m256 term = _mm256_mul_ps(_mm256_mul_ps(isum, dx[r]), scales);
          facc[bb][r][h] = _mm256_add_ps(facc[bb][r][h], term);
        }
      }
    }
  }
  store_tile<MB, MR>(facc, m0, b, out_block0, out, ldo);
}

template <int kBits>
void quant_dot_bits(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t groups,
                    int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t block_bytes = std::max<int64_t>(groups, 1) * quant_group_bytes(kBits);
  const auto tile_at = [&]<int MB, int MR>(int64_t m0, int64_t b, int64_t out_block0) {
    tile<kBits, MB, MR>(x, m0, packed, groups, b, out_block0, out, ldo);
  };
  quant_walk_tiles<4>(tile_at, M, block_begin, block_end, block_bytes);
}

}  // namespace

void quant_dot_avx2(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                    int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                    int64_t ldo) {
  if (bits == 8) {
    quant_dot_bits<8>(x, M, packed, groups, block_begin, block_end, out, ldo);
  } else {
    quant_dot_bits<4>(x, M, packed, groups, block_begin, block_end, out, ldo);
  }
}

}  // namespace mlafx::avx2

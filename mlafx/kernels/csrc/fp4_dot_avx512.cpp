// The AVX-512 kernels of fp4_dot (fp4.h): e2m1 nibbles widened to bf16 in registers, 32 at a
// time, then VDPBF16PS against bf16 activations (exact products, fp32 sums) or two fp32 FMAs
// against fp32 activations, in the register tiles of block_dot_avx512.h with blocks of 32
// columns (one ue8m0 scale each, applied once per group by one FMA).
//
// e2m1 -> bf16 (exact): 16 bytes zero-extended to 16 dwords d; (d | d << 12) & 0x000F000F puts
// byte j's low nibble (element 2j) in word 2j and its high nibble in word 2j + 1; one VPERMW
// looks the 16 values up as bf16 bits: 4 instructions per 32 weights.
//
// Few rows of x (decode) take several weight rows at once for independent accumulator chains;
// many rows (prefill) widen a tile of weight rows to a bf16 scratch once and reuse it for every
// group of 8 rows of x.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_avx512.h"
#include "block_dot_avx512.h"
#include "fp4.h"

namespace mlafx::avx512 {
namespace {

// 32 e2m1 nibbles (16 bytes, low nibble first) -> 32 bf16 (16-bit lanes), in order.
inline __m512i e2m1_to_bf16(__m128i bytes) {
  // bf16 bits of 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (indices 0..15)
  const __m512i table = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
      static_cast<int16_t>(0xC0C0), static_cast<int16_t>(0xC080), static_cast<int16_t>(0xC040),
      static_cast<int16_t>(0xC000), static_cast<int16_t>(0xBFC0), static_cast<int16_t>(0xBF80),
      static_cast<int16_t>(0xBF00), static_cast<int16_t>(0x8000), 0x40C0, 0x4080, 0x4040, 0x4000,
      0x3FC0, 0x3F80, 0x3F00, 0x0000);
  const __m512i d = _mm512_cvtepu8_epi32(bytes);
  // (d | d << 12) & 0x000F000F
  const __m512i idx =
      _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  return _mm512_permutexvar_epi16(idx, table);
}

// The bytes holding the valid ones of 32 elements (K is even, so whole bytes).
inline __mmask16 byte_lanes(__mmask32 elements) {
  if (elements == ~__mmask32{0}) {
    return static_cast<__mmask16>(0xFFFF);
  }
  const int bytes = __builtin_popcount(elements) / 2;
  return static_cast<__mmask16>((1u << bytes) - 1u);
}

// The weight rows of one tile: packed nibbles, or bf16 already widened (kConverted, unscaled).
template <int NR, bool kConverted>
struct WeightRows {
  const uint8_t* fp4[NR];
  const uint16_t* bf16[NR];
  const uint8_t* scales[NR];
  const float* ue8m0;

  float scale(int r, int64_t g) const { return ue8m0[scales[r][g]]; }
  __m512i load(int r, int64_t k, __mmask32 mask) const {
    if constexpr (kConverted) {
      return _mm512_maskz_loadu_epi16(mask, bf16[r] + k);
    } else {
      return e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), fp4[r] + k / 2));
    }
  }
};

template <int NR, bool kConverted>
WeightRows<NR, kConverted> rows_at(const Fp4Weight& W, int64_t n, const uint16_t* converted) {
  WeightRows<NR, kConverted> rows{};
  for (int r = 0; r < NR; ++r) {
    rows.fp4[r] = W.w + (n + r) * W.ldw;
    rows.bf16[r] = converted;
    rows.scales[r] = W.scale + (n + r) * W.lds;
  }
  rows.ue8m0 = ue8m0_table();
  return rows;
}

// Rows [0, MR) of x against weight rows [n0, n1), NR at a time, then one at a time.
template <int MR, int NR>
void rows_direct_bf16(const Fp4Weight& W, const uint16_t* x, int64_t ldx, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    tile_bf16<MR, NR>(rows_at<NR, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
  for (; n < n1; ++n) {
    tile_bf16<MR, 1>(rows_at<1, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
}

template <int MR, int NR>
void rows_direct_f32(const Fp4Weight& W, const float* x, int64_t ldx, int64_t n0, int64_t n1,
                     float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    tile_f32<MR, NR>(rows_at<NR, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
  for (; n < n1; ++n) {
    tile_f32<MR, 1>(rows_at<1, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
}

// M <= 8 rows of x, the tile shape chosen at run time.
void rows_bf16_few(int64_t mr, const Fp4Weight& W, const uint16_t* x, int64_t ldx, int64_t n0,
                   int64_t n1, float* out, int64_t ldo) {
  switch (mr) {
    case 1: return rows_direct_bf16<1, 4>(W, x, ldx, n0, n1, out, ldo);
    case 2: return rows_direct_bf16<2, 4>(W, x, ldx, n0, n1, out, ldo);
    case 3: return rows_direct_bf16<3, 2>(W, x, ldx, n0, n1, out, ldo);
    case 4: return rows_direct_bf16<4, 2>(W, x, ldx, n0, n1, out, ldo);
    case 5: return rows_direct_bf16<5, 1>(W, x, ldx, n0, n1, out, ldo);
    case 6: return rows_direct_bf16<6, 1>(W, x, ldx, n0, n1, out, ldo);
    case 7: return rows_direct_bf16<7, 1>(W, x, ldx, n0, n1, out, ldo);
    default: return rows_direct_bf16<8, 1>(W, x, ldx, n0, n1, out, ldo);
  }
}

// Row n's K nibbles widened to bf16 (unscaled) at dst.
void widen_row(const Fp4Weight& W, int64_t n, uint16_t* dst) {
  const uint8_t* src = W.w + n * W.ldw;
  for (int64_t k = 0; k < W.K; k += 32) {
    const __mmask32 mask = first_lanes32(W.K - k);
    _mm512_mask_storeu_epi16(dst + k, mask,
                             e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), src + k / 2)));
  }
}

constexpr int64_t kTileRows = 16;  // weight rows widened to bf16 at once (M > 8)

}  // namespace

void fp4_dot_bf16(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                  float* out, int64_t ldo) {
  if (M <= 8) {
    rows_bf16_few(M, W, x.bf16, x.ld, n0, n1, out, ldo);
    return;
  }
  // rows a whole number of lines apart but not 4 KB apart (L1 set conflicts)
  int64_t kpad = (W.K + 31) / 32 * 32;
  if ((kpad * 2) % 4096 == 0) {
    kpad += 32;
  }
  std::vector<uint16_t> widened(static_cast<size_t>(kTileRows * kpad));
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
    const int64_t t1 = std::min(n1, t0 + kTileRows);
    for (int64_t n = t0; n < t1; ++n) widen_row(W, n, widened.data() + (n - t0) * kpad);
    for (int64_t n = t0; n < t1; ++n) {
      const WeightRows<1, true> rows = rows_at<1, true>(W, n, widened.data() + (n - t0) * kpad);
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        tile_bf16<8, 1>(rows, W.K, kFp4Group, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
      for (; m < M; ++m) {
        tile_bf16<1, 1>(rows, W.K, kFp4Group, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
    }
  }
}

void fp4_dot_f32(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    rows_direct_f32<4, 1>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
  for (; m < M; ++m) {
    rows_direct_f32<1, 4>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
}

void fp4_dequantize(const Fp4Weight& W, int64_t n0, int64_t n1, float* out) {
  const float* ue8m0 = ue8m0_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const uint8_t* scale = W.scale + n * W.lds;
    float* dst = out + (n - n0) * W.K;
    for (int64_t k = 0, g = 0; k < W.K; k += 32, ++g) {
      const __mmask32 mask = first_lanes32(W.K - k);
      const __m512i v = e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), row + k / 2));
      const __m512 s = _mm512_set1_ps(ue8m0[scale[g]]);
      _mm512_mask_storeu_ps(dst + k, static_cast<__mmask16>(mask), _mm512_mul_ps(bf16_low_to_f32(v), s));
      _mm512_mask_storeu_ps(dst + k + 16, static_cast<__mmask16>(mask >> 16),
                            _mm512_mul_ps(bf16_high_to_f32(v), s));
    }
  }
}

}  // namespace mlafx::avx512

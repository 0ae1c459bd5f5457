// The register tiles of the AVX-512 block-scaled products, shared by the e4m3 (fp8_dot_avx512.cpp)
// and e2m1 (fp4_dot_avx512.cpp) kernels. For the *_avx512.cpp sources only.
//
// MR rows of x by NR weight rows share each widened weight vector and each loaded activation
// vector. A weight-rows type `Rows` widens its rows to bf16 (exact) 32 columns at a time and
// knows each k block's scale:
//   __m512i load(int r, int64_t k, __mmask32 mask) const;  // columns k.. of row r (mask: valid)
//   float scale(int r, int64_t kb) const;                   // row r's scale of k block kb
// Each block's 16-lane partial sums are scaled once (one FMA per block) and reduced across lanes
// once per output: out = sum_kb scale * (fp32 sum of the block's exact products).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_avx512.h"

namespace mlafx::avx512 {

inline __m512 bf16_low_to_f32(__m512i v) {  // lanes 0..15 of 32 bf16 -> fp32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
inline __m512 bf16_high_to_f32(__m512i v) {  // lanes 16..31
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

// out[m * ldo + r] for m < MR, r < NR: bf16 rows of x (row stride ldx), VDPBF16PS; K columns in
// k blocks of block_k (a multiple of 32).
template <int MR, int NR, typename Rows>
void tile_bf16(const Rows& rows, int64_t K, int64_t block_k, const uint16_t* x, int64_t ldx,
               float* out, int64_t ldo) {
  __m512 total[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) total[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += block_k, ++kb) {
    const int64_t k1 = std::min(K, k0 + block_k);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    }
    for (int64_t k = k0; k < k1; k += 32) {
      const __mmask32 mask = first_lanes32(k1 - k);
      __m512i wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = rows.load(r, k, mask);
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
        for (int r = 0; r < NR; ++r) {
          acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(rows.scale(r, kb));
      for (int m = 0; m < MR; ++m) total[m][r] = _mm512_fmadd_ps(acc[m][r], s, total[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = _mm512_reduce_add_ps(total[m][r]);
  }
}

// The same over fp32 rows of x: each 32 widened weights as two fp32 vectors, two FMAs.
template <int MR, int NR, typename Rows>
void tile_f32(const Rows& rows, int64_t K, int64_t block_k, const float* x, int64_t ldx,
              float* out, int64_t ldo) {
  __m512 total[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) total[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += block_k, ++kb) {
    const int64_t k1 = std::min(K, k0 + block_k);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    }
    for (int64_t k = k0; k < k1; k += 32) {
      const __mmask32 mask = first_lanes32(k1 - k);
      __m512 lo[NR], hi[NR];
      for (int r = 0; r < NR; ++r) {
        const __m512i v = rows.load(r, k, mask);
        lo[r] = bf16_low_to_f32(v);
        hi[r] = bf16_high_to_f32(v);
      }
      for (int m = 0; m < MR; ++m) {
        const float* xm = x + m * ldx + k;
        const __m512 x_lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), xm);
        const __m512 x_hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), xm + 16);
        for (int r = 0; r < NR; ++r) {
          acc[m][r] = _mm512_fmadd_ps(x_lo, lo[r], acc[m][r]);
          acc[m][r] = _mm512_fmadd_ps(x_hi, hi[r], acc[m][r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(rows.scale(r, kb));
      for (int m = 0; m < MR; ++m) total[m][r] = _mm512_fmadd_ps(acc[m][r], s, total[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = _mm512_reduce_add_ps(total[m][r]);
  }
}

}  // namespace mlafx::avx512

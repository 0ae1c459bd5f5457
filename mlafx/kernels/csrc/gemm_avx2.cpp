// The AVX2 kernels of rows_dot and packed_dot (gemm.h) for bf16, on CPUs without AVX-512 BF16:
// the weights widened to fp32 in registers (a bf16 is the high half of an fp32), the rows of x
// widened once per call into an fp32 copy, fp32 FMAs, fp32 sums.
//
// packed_dot: lanes are a block's weight rows. Each 32-bit lane of the packed layout holds one
// row's pair of columns (2p in the low half, 2p + 1 in the high half), so a shift and a mask
// give the even and the odd column of 8 rows as fp32; tiles of up to 4 rows of x by one block
// of 16 weight rows, no horizontal sums.
// rows_dot: lanes run along K, 4 weight rows by 2 rows of x per tile, one horizontal sum per
// output; the tile's weight rows stay in L1 while the rows of x pass over them.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "gemm_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

inline __m256 bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Rows of bf16 x -> fp32 [M, ld], ld = K rounded up to 8, zero past K.
std::vector<float> widened_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t ld) {
  std::vector<float> out(static_cast<size_t>(M * ld), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = x + m * ldx;
    float* dst = out.data() + m * ld;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, bf16x8(src + k));
    for (; k < K; ++k) {
      const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
      std::memcpy(dst + k, &bits, sizeof(bits));
    }
  }
  return out;
}

// ---- packed_dot ---------------------------------------------------------------------------

template <int MR>
void packed_tile(const uint16_t* block, int64_t K2, const float* xf, int64_t ldxf, float* out,
                 int64_t ldo) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    const uint16_t* pairs = block + p * 2 * kPackedBlockRows;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
    for (int m = 0; m < MR; ++m) {
      const __m256 xe = _mm256_broadcast_ss(xf + m * ldxf + 2 * p);
      const __m256 xo = _mm256_broadcast_ss(xf + m * ldxf + 2 * p + 1);
      acc[m][0] = _mm256_fmadd_ps(even0, xe, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(even1, xe, acc[m][1]);
      acc[m][0] = _mm256_fmadd_ps(odd0, xo, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(odd1, xo, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ldo, acc[m][0]);
    _mm256_storeu_ps(out + m * ldo + 8, acc[m][1]);
  }
}

// ---- rows_dot -----------------------------------------------------------------------------

template <int MR, int NR>
void rows_tile(const float* xf, int64_t ldxf, const uint16_t* const* w, int64_t K, float* out,
               int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = bf16x8(w[r] + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * ldxf + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {  // x is zero past K in its copy; the weights' last columns via a zeroed copy
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) {
      uint16_t tail[8] = {};
      std::memcpy(tail, w[r] + k, sizeof(uint16_t) * static_cast<size_t>(K - k));
      wv[r] = bf16x8(tail);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * ldxf + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(acc[m][r]);
  }
}

template <int NR>
void rows_group(const float* xf, int64_t ldxf, int64_t M, const uint16_t* const* w, int64_t K,
                float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) rows_tile<2, NR>(xf + m * ldxf, ldxf, w, K, out + m * ldo, ldo);
  if (m < M) rows_tile<1, NR>(xf + m * ldxf, ldxf, w, K, out + m * ldo, ldo);
}

}  // namespace

void packed_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t K2 = (K + 1) / 2;
  const int64_t ld = (2 * K2 + 7) / 8 * 8;  // the odd column's partner reads x's zero padding
  const std::vector<float> xf = widened_rows(x, ldx, M, K, ld);
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint16_t* block = wp + b * K2 * 2 * kPackedBlockRows;
    float* dst = out + (b - block_begin) * kPackedBlockRows;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) packed_tile<4>(block, K2, xf.data() + m * ld, ld, dst + m * ldo, ldo);
    switch (M - m) {
      case 3: packed_tile<3>(block, K2, xf.data() + m * ld, ld, dst + m * ldo, ldo); break;
      case 2: packed_tile<2>(block, K2, xf.data() + m * ld, ld, dst + m * ldo, ldo); break;
      case 1: packed_tile<1>(block, K2, xf.data() + m * ld, ld, dst + m * ldo, ldo); break;
      default: break;
    }
  }
}

void rows_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw,
                   int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo) {
  const int64_t ld = (K + 7) / 8 * 8;
  const std::vector<float> xf = widened_rows(x, ldx, M, K, ld);
  constexpr int NR = 4;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) {
    const uint16_t* rows[NR];
    for (int r = 0; r < NR; ++r) rows[r] = w + (n + r) * ldw;
    rows_group<NR>(xf.data(), ld, M, rows, K, out + (n - n_begin), ldo);
  }
  for (; n < n_end; ++n) {
    const uint16_t* row[1] = {w + n * ldw};
    rows_group<1>(xf.data(), ld, M, row, K, out + (n - n_begin), ldo);
  }
}

}  // namespace mlafx::avx2

// AVX2 few-row batched_matmul (batched_matmul.h; compiled with -mavx2 -mfma -mf16c, called
// only after use_avx2() on CPUs without AVX-512 BF16). The streaming kernel of
// batched_matmul_avx512.cpp on 8 lanes: without it, decode's absorbed products widened each
// head's whole w to an fp32 copy per call for ATen's fp32 bmm (ATen's 16-bit bmm is emulated
// there), reading and writing three times w's bytes.
//
// Work items are (head b, 64 output columns), as on AVX-512; an item runs as two halves of
// 32 columns, each streaming its [K, 32] slice of w (one cache line of bf16/fp16 per row)
// once per 2 rows of x, widening 8 elements at a time to fp32 (bf16: a shift; fp16: F16C) and
// adding x[m, k] * w[k, :] into 4 x 2 fp32 accumulators; one rounding to bf16 / fp16 at the
// end. The slice's rows are a whole w row apart, too far for the hardware prefetcher: it
// prefetches kAhead rows ahead. Rows never share arithmetic, so a row's result does not
// depend on the call's other rows.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "batched_matmul.h"
#include "bf16_bits.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "batched_matmul_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

constexpr int kVecs = 4;         // 8-lane vectors per half item: 32 columns
constexpr int kMaxTileRows = 2;  // rows of x per pass over a half
constexpr int64_t kAhead = 12;   // w rows prefetched ahead

inline float to_float(BmmElem e, uint16_t v) {
  return e == BmmElem::kFp16 ? _cvtsh_ss(v) : bf16_bits_to_fp32(v);
}

inline __m256 widen8(BmmElem e, __m128i raw) {
  if (e == BmmElem::kFp16) {
    return _mm256_cvtph_ps(raw);
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 elements from p, of which the first `left` (< 8: the rest read as 0) exist.
inline __m256 load8(BmmElem e, const uint16_t* p, int64_t left) {
  if (left >= 8) {
    return widen8(e, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  uint16_t part[8] = {};
  std::memcpy(part, p, static_cast<size_t>(std::max<int64_t>(left, 0)) * sizeof(uint16_t));
  return widen8(e, _mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
}

inline uint16_t round_to(BmmElem e, float v) {
  return e == BmmElem::kFp16 ? _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT) : fp32_to_bf16_bits(v);
}

// Rows xf[0..MR) (fp32, K each) against w's columns [n0, n0 + 32) into out rows (columns
// past N are neither read nor written).
template <int MR>
void half_tile(const BmmArgs& a, const float* xf, const uint16_t* w, int64_t n0, uint16_t* out) {
  const int64_t left = a.N - n0;  // columns of the slice that exist
  __m256 acc[MR][kVecs];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < a.K; ++k) {
    const uint16_t* row = w + k * a.ws_k + n0;
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * a.ws_k), _MM_HINT_T0);
    __m256 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load8(a.elem, row + 8 * v, left - 8 * v);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xf + r * a.K + k);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float sums[kVecs * 8];
    for (int v = 0; v < kVecs; ++v) _mm256_store_ps(sums + 8 * v, acc[r][v]);
    const int64_t n = std::min<int64_t>(left, kVecs * 8);
    for (int64_t j = 0; j < n; ++j) out[r * a.N + n0 + j] = round_to(a.elem, sums[j]);
  }
}

// x[b] widened to fp32 rows of K in xf.
void widen_rows(const BmmArgs& a, int64_t b, float* xf) {
  const uint16_t* x = a.x + b * a.xs_b;
  for (int64_t m = 0; m < a.M; ++m) {
    const uint16_t* row = x + m * a.xs_m;
    float* dst = xf + m * a.K;
    if (a.xs_k == 1) {
      int64_t k = 0;
      for (; k + 8 <= a.K; k += 8) _mm256_storeu_ps(dst + k, load8(a.elem, row + k, 8));
      for (; k < a.K; ++k) dst[k] = to_float(a.elem, row[k]);
    } else {
      for (int64_t k = 0; k < a.K; ++k) dst[k] = to_float(a.elem, row[k * a.xs_k]);
    }
  }
}

void run_item(const BmmArgs& a, int64_t b, int64_t n0, const float* xf) {
  const uint16_t* w = a.w + b * a.ws_b;
  uint16_t* out = a.out + b * a.M * a.N;
  for (int64_t half = n0; half < std::min(a.N, n0 + kBatchedMatmulCols); half += kVecs * 8) {
    for (int64_t m = 0; m < a.M; m += kMaxTileRows) {
      if (a.M - m >= 2) {
        half_tile<2>(a, xf + m * a.K, w, half, out + m * a.N);
      } else {
        half_tile<1>(a, xf + m * a.K, w, half, out + m * a.N);
      }
    }
  }
}

}  // namespace

void batched_matmul_items(const BmmArgs& a, int64_t begin, int64_t end, float* xf) {
  batched_matmul_walk_items(
      a, begin, end, [&](int64_t b) { widen_rows(a, b, xf); },
      [&](int64_t b, int64_t n0) { run_item(a, b, n0, xf); });
}

}  // namespace mlafx::avx2

// The pairs kernel of batched_matmul (batched_matmul.h): bf16, kBatchedMatmulPairsMinRows to
// kBatchedMatmulPairsMaxRows rows per head, on AVX-512 BF16 CPUs without AMX (called only after
// use_avx512_bf16()).
//
// Work items are the streaming kernel's (head b, 64 output columns). Each item runs in passes
// of 32 columns (one 64-byte line of every w row) and of at most 8 rows of x: two w rows k,
// k + 1 are interleaved into column pairs (VPERMT2W), and x's pair (x[m, k], x[m, k + 1]),
// broadcast, meets them in VDPBF16PS: 2 exact products added into each of 16 columns' fp32
// sums per instruction, against one per FMA in the streaming kernel, whose arithmetic outran
// ATen's bmm from 5 rows on. One rounding at the end. A row's sums do not depend on the call's
// other rows. The w rows are prefetched kAhead pairs ahead (a whole w row apart each).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "batched_matmul.h"
#include "bf16_avx512.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "batched_matmul_pairs_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kPassCols = 32;
constexpr int kPassRows = 8;
constexpr int64_t kAhead = 8;  // k pairs prefetched ahead

// Rows xs[0..MR) (bf16, ldx elements each, zero past K) against w's columns [n0, n0 + 32)
// (fewer under mask) into out rows (row stride N).
template <int MR>
void pass(const BmmArgs& a, const uint16_t* xs, int64_t ldx, const uint16_t* w, int64_t n0,
          __mmask32 mask, uint16_t* out) {
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                    37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                    53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                    27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t pairs = (a.K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* row = w + 2 * p * a.ws_k + n0;
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * kAhead * a.ws_k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + (2 * kAhead + 1) * a.ws_k), _MM_HINT_T0);
    const __m512i r0 = _mm512_maskz_loadu_epi16(mask, row);
    const __m512i r1 = 2 * p + 1 < a.K ? _mm512_maskz_loadu_epi16(mask, row + a.ws_k)
                                       : _mm512_setzero_si512();
    const __m512i w0 = _mm512_permutex2var_epi16(r0, lo, r1);  // columns 0..15, k and k + 1
    const __m512i w1 = _mm512_permutex2var_epi16(r0, hi, r1);  // columns 16..31
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, xs + m * ldx + 2 * p, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)xv);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, (__m512bh)xv);
    }
  }
  for (int m = 0; m < MR; ++m) {
    uint16_t* dst = out + m * a.N + n0;
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>(mask), fp32_to_bf16_rne(acc[m][0]));
    _mm256_mask_storeu_epi16(dst + 16, static_cast<__mmask16>(mask >> 16),
                             fp32_to_bf16_rne(acc[m][1]));
  }
}

void rows_pass(int rows, const BmmArgs& a, const uint16_t* xs, int64_t ldx, const uint16_t* w,
               int64_t n0, __mmask32 mask, uint16_t* out) {
  switch (rows) {
    case 1: return pass<1>(a, xs, ldx, w, n0, mask, out);
    case 2: return pass<2>(a, xs, ldx, w, n0, mask, out);
    case 3: return pass<3>(a, xs, ldx, w, n0, mask, out);
    case 4: return pass<4>(a, xs, ldx, w, n0, mask, out);
    case 5: return pass<5>(a, xs, ldx, w, n0, mask, out);
    case 6: return pass<6>(a, xs, ldx, w, n0, mask, out);
    case 7: return pass<7>(a, xs, ldx, w, n0, mask, out);
    default: return pass<8>(a, xs, ldx, w, n0, mask, out);
  }
}

// x[b]'s rows as contiguous bf16 rows of ldx elements, zero past K.
void stage_rows(const BmmArgs& a, int64_t b, int64_t ldx, uint16_t* xs) {
  const uint16_t* x = a.x + b * a.xs_b;
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t k = 0; k < ldx; ++k) {
      xs[m * ldx + k] = k < a.K ? x[m * a.xs_m + k * a.xs_k] : 0;
    }
  }
}

}  // namespace

int64_t batched_matmul_pairs_scratch(const BmmArgs& a) { return a.M * ((a.K + 1) / 2 * 2); }

void batched_matmul_items_pairs(const BmmArgs& a, int64_t begin, int64_t end, uint16_t* xs) {
  const int64_t col_items = batched_matmul_col_items(a.N), ldx = (a.K + 1) / 2 * 2;
  int64_t staged = -1;  // the head whose rows xs holds
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / col_items;
    if (b != staged) {
      stage_rows(a, b, ldx, xs);
      staged = b;
    }
    const uint16_t* w = a.w + b * a.ws_b;
    uint16_t* out = a.out + b * a.M * a.N;
    const int64_t c0 = item % col_items * kBatchedMatmulCols;
    for (int64_t n0 = c0; n0 < std::min(a.N, c0 + kBatchedMatmulCols); n0 += kPassCols) {
      const __mmask32 mask = first_lanes32(a.N - n0);
      for (int64_t m0 = 0; m0 < a.M; m0 += kPassRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPassRows, a.M - m0));
        rows_pass(rows, a, xs + m0 * ldx, ldx, w, n0, mask, out + m0 * a.N);
      }
    }
  }
}

}  // namespace mlafx::avx512

// AVX-512 few-row batched_matmul (batched_matmul.h; compiled with -mavx512f/bw/vl/dq/bf16,
// called only after use_avx512_bf16()). The reference is torch.bmm in float64 (tests).
//
// Work items are (head b, 64 output columns): each streams its [K, 64] slice of w once for all
// its rows of x (at most 4: 16 accumulators), widening 16 elements at a time to fp32 and adding
// x[m, k] * w[k, :] into 4 x M fp32 accumulators; one rounding to bf16 / fp16 at the end. The
// slice's rows are a whole w row apart, too far for the hardware prefetcher: it prefetches 48
// rows ahead into L2 (Zen 4, 7 Dec 2026, 2 threads, 300 distinct 2 MB weights: 1 and 2 rows
// 80-106 against 119-172 us a call with 12 rows ahead into L1; 4 rows level). Rows never
// share arithmetic, so a row's result does not depend on the call's other rows. Items go to
// the threads from a shared counter (parallel_chunks.h, in batched_matmul.cpp).
//
// Measured (Xeon with AMX, 2 threads, 5 Dec 2026, 300 distinct 2 MB weights so that each call
// reads from memory, ms for [16, M, 128] x [16, 128, 512] / [16, M, 512] x [16, 512, 128]):
// M = 1 0.112 / 0.105 against ATen's 0.197 / 0.153 (without the prefetch 0.130 / 0.128);
// M = 2 0.125 / 0.116 against 0.158 / 0.164; M = 4 0.139 / 0.129 against 0.152 / 0.153;
// M = 5 (two passes) 0.167 / 0.152 against 0.144 / 0.151, M = 8 0.19 against 0.15: from 5
// rows the FMAs (one per element and row) outrun ATen's, hence kBatchedMatmulStreamRows = 4.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attention_avx512_math.h"
#include "batched_matmul.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "batched_matmul_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int kVecs = 4;
constexpr int64_t kAhead = 48;  // w rows prefetched ahead, into L2

inline float to_float(BmmElem e, uint16_t v) {
  return e == BmmElem::kFp16 ? _cvtsh_ss(v) : bf16_bits_to_fp32(v);
}

// 16 elements (fewer under `mask`, the rest 0) widened to fp32.
inline __m512 load16(BmmElem e, const uint16_t* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  if (e == BmmElem::kFp16) {
    return _mm512_cvtph_ps(raw);
  }
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(BmmElem e, uint16_t* p, __m512 v, __mmask16 mask) {
  const __m256i bits = e == BmmElem::kFp16
                           ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                           : (__m256i)_mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, mask, bits);
}

// Rows xf[0..MR) (fp32, K each) against w's columns [n0, n0 + 64) into out rows.
template <int MR>
void row_tile(const BmmArgs& a, const float* xf, const uint16_t* w, int64_t n0,
              const __mmask16 (&masks)[kVecs], uint16_t* out) {
  __m512 acc[MR][kVecs];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < a.K; ++k) {
    const uint16_t* row = w + k * a.ws_k + n0;
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * a.ws_k), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * a.ws_k + 32), _MM_HINT_T1);
    __m512 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      wv[v] = load16(a.elem, row + 16 * v, masks[v]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(xf[r * a.K + k]);
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      store16(a.elem, out + r * a.N + n0 + 16 * v, acc[r][v], masks[v]);
    }
  }
}

// x[b] widened to fp32 rows of K in xf.
void widen_rows(const BmmArgs& a, int64_t b, float* xf) {
  const uint16_t* x = a.x + b * a.xs_b;
  for (int64_t m = 0; m < a.M; ++m) {
    const uint16_t* row = x + m * a.xs_m;
    float* dst = xf + m * a.K;
    if (a.xs_k == 1) {
      for (int64_t k = 0; k < a.K; k += 16) {
        const int64_t left = std::min<int64_t>(16, a.K - k);
        const __mmask16 mask = static_cast<__mmask16>((uint32_t{1} << left) - 1);
        _mm512_mask_storeu_ps(dst + k, mask, load16(a.elem, row + k, mask));
      }
    } else {
      for (int64_t k = 0; k < a.K; ++k) {
        dst[k] = to_float(a.elem, row[k * a.xs_k]);
      }
    }
  }
}

void run_item(const BmmArgs& a, int64_t b, int64_t n0, const float* xf) {
  __mmask16 masks[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const int64_t left = std::clamp<int64_t>(a.N - n0 - 16 * v, 0, 16);
    masks[v] = static_cast<__mmask16>((uint32_t{1} << left) - 1);
  }
  const uint16_t* w = a.w + b * a.ws_b;
  uint16_t* out = a.out + b * a.M * a.N;
  switch (a.M) {  // M <= kBatchedMatmulStreamRows = 4: one pass over the slice
    case 4:
      row_tile<4>(a, xf, w, n0, masks, out);
      break;
    case 3:
      row_tile<3>(a, xf, w, n0, masks, out);
      break;
    case 2:
      row_tile<2>(a, xf, w, n0, masks, out);
      break;
    default:
      row_tile<1>(a, xf, w, n0, masks, out);
      break;
  }
}

}  // namespace

void batched_matmul_items(const BmmArgs& a, int64_t begin, int64_t end, float* xf) {
  batched_matmul_walk_items(
      a, begin, end, [&](int64_t b) { widen_rows(a, b, xf); },
      [&](int64_t b, int64_t n0) { run_item(a, b, n0, xf); });
}

}  // namespace mlafx::avx512

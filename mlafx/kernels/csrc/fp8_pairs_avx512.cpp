// The block FP8 product for many rows of bf16 x on CPUs with AVX-512 BF16 but no AMX (fp8.h,
// "pairs"): a VDPBF16PS GEMM with the rows of x along the vector lanes.
//
// x is staged once per call (fp8_stage_pairs): panels of kFp8PanelRows rows, each [pairs of K]
// x [48 rows] x [2 columns], so one 64-byte load holds a column pair of 16 rows. A weight row's
// column pair (two bf16 after the exact e4m3 widening) is the other operand, broadcast from
// memory: each VDPBF16PS adds 2 products into 16 rows' fp32 sums, no lane is wasted and nothing
// is summed across lanes. The weight is widened a chunk of kChunkRows rows at a time into a
// bf16 scratch that stays in L2, then every panel of x runs over it, NR weight rows by MV
// vectors of x rows per register tile (MV * NR >= 16 independent chains: VDPBF16PS has a
// latency of several cycles and issues up to twice a cycle). After each k block the tile's sums
// are scaled by each row's block scale once and added into fp32 totals. Every output's sums run
// in the same order for any M >= kFp8PairsMinRows (a row's lane never meets another row); up to
// 8 rows the VBMI kernel sums in another order.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_avx512.h"
#include "fp8.h"
#include "fp8_bf16_avx512.h"
#include "scratch_buffer.h"

namespace mlafx::avx512 {
namespace {

constexpr int64_t kChunkRows = 64;  // weight rows widened at once (64 x 2 KB x 2 at K = 2048)

int64_t pair_count(int64_t K) { return (K + 1) / 2; }

// Rows [n0, n1) of W as bf16 into dst (row stride widened_ld(K)), zero past K; rows up to
// `rows` zeroed.
void widen_rows(const Fp8Weight& W, int64_t n0, int64_t n1, int64_t rows, uint16_t* dst) {
  const int64_t ld = widened_ld(W.K);
  for (int64_t n = n0; n < n1; ++n) widen_row(W.w + n * W.ldw, W.K, dst + (n - n0) * ld);
  std::memset(dst + (n1 - n0) * ld, 0, static_cast<size_t>((rows - (n1 - n0)) * ld) * 2);
}

// The next chunk's weight bytes, prefetched into L2 one line per pair of a tile while the
// current chunk computes (widening it later then reads from L2, not from memory).
struct NextChunk {
  const char* at;
  const char* end;
};

// NR widened weight rows (stride ldw) x MV vectors of one panel of x: fp32 totals
// tot[r][v][16] (64-byte aligned), each k block's sums scaled by scale[r][kb] once.
template <int NR, int MV>
void pairs_tile(const uint16_t* w, int64_t ldw, const float* const* scale, int64_t P,
                int64_t block_pairs, const uint16_t* panel, float* tot, NextChunk& next) {
  const char* ahead = next.at;  // a local: tot's stores may alias a char pointer in memory
  for (int i = 0; i < NR * MV; ++i) _mm512_store_ps(tot + 16 * i, _mm512_setzero_ps());
  for (int64_t p0 = 0, kb = 0; p0 < P; p0 += block_pairs, ++kb) {
    const int64_t p1 = std::min(P, p0 + block_pairs);
    __m512 acc[NR][MV];
    for (int r = 0; r < NR; ++r) {
      for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t p = p0; p < p1; ++p) {
      if (ahead < next.end) {
        _mm_prefetch(ahead, _MM_HINT_T1);
        ahead += 64;
      }
      __m512i xv[MV];
      for (int v = 0; v < MV; ++v) {
        xv[v] = _mm512_load_si512(panel + (p * kFp8PanelRows + v * 16) * 2);
      }
      for (int r = 0; r < NR; ++r) {
        int32_t pair;
        std::memcpy(&pair, w + r * ldw + 2 * p, 4);
        const __m512i wb = _mm512_set1_epi32(pair);
        for (int v = 0; v < MV; ++v) {
          acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)xv[v], (__m512bh)wb);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(scale[r][kb]);
      for (int v = 0; v < MV; ++v) {
        float* t = tot + (r * MV + v) * 16;
        _mm512_store_ps(t, _mm512_fmadd_ps(acc[r][v], s, _mm512_load_ps(t)));
      }
    }
  }
  next.at = ahead;
}

// Weight rows [c0, c1) (widened at w) against one panel of `rows` rows of x (panel row 0 is
// x row m0), NR rows at a time; outputs out[(m0 + i) * ldo + n - n0].
template <int NR, int MV>
void panel_rows(const Fp8Weight& W, const uint16_t* w, int64_t ldw, int64_t c0, int64_t c1,
                const uint16_t* panel, int64_t m0, int64_t rows, int64_t n0, float* out,
                int64_t ldo, NextChunk& next) {
  alignas(64) float tot[NR * MV * 16];
  const int64_t P = pair_count(W.K), block_pairs = W.block_k / 2;
  for (int64_t t0 = c0; t0 < c1; t0 += NR) {
    const float* scale[NR];
    for (int r = 0; r < NR; ++r) {  // rows past c1 are zero: any valid scale row will do
      scale[r] = W.scale + (std::min(t0 + r, c1 - 1) / W.block_n) * W.lds;
    }
    pairs_tile<NR, MV>(w + (t0 - c0) * ldw, ldw, scale, P, block_pairs, panel, tot, next);
    const int64_t nr = std::min<int64_t>(NR, c1 - t0);
    for (int64_t i = 0; i < rows; ++i) {
      float* dst = out + (m0 + i) * ldo + t0 - n0;
      for (int64_t r = 0; r < nr; ++r) dst[r] = tot[(r * MV + i / 16) * 16 + i % 16];
    }
  }
}

}  // namespace

int64_t fp8_pair_elements(int64_t M, int64_t K) {
  const int64_t panels = (M + kFp8PanelRows - 1) / kFp8PanelRows;
  return panels * pair_count(K) * kFp8PanelRows * 2;
}

void fp8_stage_pairs(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, int64_t q0,
                     int64_t q1, uint16_t* pairs) {
  const int64_t P = pair_count(K);
  for (int64_t q = q0; q < q1; ++q) {
    uint16_t* panel = pairs + q * P * kFp8PanelRows * 2;
    for (int64_t l = 0; l < kFp8PanelRows; ++l) {
      const int64_t m = q * kFp8PanelRows + l;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t k = 2 * p;
        uint16_t* dst = panel + (p * kFp8PanelRows + l) * 2;
        dst[0] = m < M ? x[m * ldx + k] : 0;
        dst[1] = m < M && k + 1 < K ? x[m * ldx + k + 1] : 0;
      }
    }
  }
}

void fp8_dot_pairs(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                   float* out, int64_t ldo) {
  const int64_t ldw = widened_ld(W.K), P = pair_count(W.K);
  thread_local ScratchVector<uint16_t> widened;
  widened.resize(static_cast<size_t>(kChunkRows * ldw));
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(n1, c0 + kChunkRows);
    const int64_t rows16 = (c1 - c0 + 15) / 16 * 16;
    widen_rows(W, c0, c1, rows16, widened.data());
    const int64_t n2 = std::min(n1, c1 + kChunkRows);
    NextChunk next{reinterpret_cast<const char*>(W.w + c1 * W.ldw),
                   reinterpret_cast<const char*>(W.w + (n2 - 1) * W.ldw + W.K)};
    for (int64_t m0 = 0; m0 < M; m0 += kFp8PanelRows) {
      const int64_t rows = std::min(kFp8PanelRows, M - m0);
      const uint16_t* panel = x.tiles + (m0 / kFp8PanelRows) * P * kFp8PanelRows * 2;
      const uint16_t* w = widened.data();
      if (rows > 32) {
        panel_rows<8, 3>(W, w, ldw, c0, c1, panel, m0, rows, n0, out, ldo, next);
      } else if (rows > 16) {
        panel_rows<8, 2>(W, w, ldw, c0, c1, panel, m0, rows, n0, out, ldo, next);
      } else {
        panel_rows<16, 1>(W, w, ldw, c0, c1, panel, m0, rows, n0, out, ldo, next);
      }
    }
  }
}

}  // namespace mlafx::avx512

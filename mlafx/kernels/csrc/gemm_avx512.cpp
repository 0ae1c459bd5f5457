// AVX-512 specialisations of the weight-streaming dot products (compiled with
// -mavx512f/bw/vl/dq/bf16). Only called after the run-time check in cpu_features.h; the
// scalar references are in gemm.cpp, the contracts and the packed layout in gemm.h.
//
// Both layouts feed VDPBF16PS (32 exact bf16 products summed into 16 fp32 lanes) with the bf16
// values as they lie: nothing is widened or repacked per call. On Zen 4 VDPBF16PS issues once
// per cycle, like a 512-bit VFMADD231PS that does half the products, so the widen-and-FMA
// kernels this replaced used twice the arithmetic and ran at 64-73% of the memory bandwidth at 8
// rows of x (2 threads, cold weights); these stream at ~90-100% of it (bench/kernel_cases/
// moe_gemm.py). Sums are fp32 in a different order than the scalar reference's; the
// instruction treats bf16 subnormal inputs as zero.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "attention_avx512_math.h"  // load_pair
#include "bf16_avx512.h"
#include "gemm.h"
#include "transpose_avx512.h"

#if !defined(__AVX512BF16__)
#error "gemm_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int kMaxTileRows = 8;  // rows of x per tile (MR)
constexpr int kMaxRowsTileWeights = 8;
constexpr int kMaxPackedTileBlocks = 4;

// Weight rows are streamed a few at a time, each one 2..6 KB: the hardware prefetchers stop at
// every 4 KB page and restart late, so a tile asks for the same columns of the next group
// of rows (the rows after its own, which the next tile reads) while it computes. Measured
// (moe_experts, one expert, 8 tokens, one thread): 2.6 ms without, 1.7 ms with. Prefetches
// never fault, so running past the last row is harmless.
inline void prefetch_next_group(const uint16_t* address) {
  _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0);
}

// Packed blocks are contiguous (K bf16 pairs x 16 rows: 64 KB for K = 2048); ask for the
// line 4 KB ahead in each block being streamed, across page boundaries (2 KB measured
// 5-30% slower at 8 rows of x, single thread).
constexpr int64_t kPackedPrefetchLines = 64;

// ---- row-major weights: lanes along K ---------------------------------------------------
//
// A 64-byte chunk of a weight row (32 columns) and the same chunk of a row of x are both 16
// bf16 pairs: one VDPBF16PS adds their 32 products into 16 partial sums, reduced once per
// output at the end. Lanes past K load as zeros in both (masked loads: nothing past the end of
// a row is read), so odd and ragged widths need no special case.

// Weight rows per tile for MR rows of x: MR * NR accumulators + NR weight chunks + one chunk of
// x within 32 registers, and several accumulation chains when MR is 1.
constexpr std::array<int, kMaxTileRows + 1> kRowsTileWeights = {0, 8, 8, 6, 6, 4, 4, 3, 3};

template <int MR, int NR>
void rows_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
               float* out, int64_t ldo) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc[m][r] = _mm512_setzero_ps();
    }
  }
  const auto step = [&](int64_t k, __mmask32 mask) {
    __m512i wk[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      prefetch_next_group(w + (r + NR) * ldw + k);
      wk[r] = _mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512i xk = _mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)wk[r], (__m512bh)xk);
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    step(k, ~__mmask32{0});
  }
  if (k < K) {
    step(k, first_lanes32(K - k));
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      out[m * ldo + r] = _mm512_reduce_add_ps(acc[m][r]);
    }
  }
}

using RowsTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*,
                            int64_t);

template <int MR, std::size_t... I>
constexpr std::array<RowsTileFn, kMaxRowsTileWeights> rows_tiles_for(std::index_sequence<I...>) {
  return {&rows_tile<MR, static_cast<int>(I) + 1>...};
}

template <std::size_t... I>
constexpr std::array<std::array<RowsTileFn, kMaxRowsTileWeights>, kMaxTileRows> all_rows_tiles(
    std::index_sequence<I...>) {
  return {rows_tiles_for<static_cast<int>(I) + 1>(
      std::make_index_sequence<kMaxRowsTileWeights>{})...};
}

// kRowsTiles[MR - 1][NR - 1] = rows_tile<MR, NR>.
constexpr auto kRowsTiles = all_rows_tiles(std::make_index_sequence<kMaxTileRows>{});

// ---- packed weights: lanes along N ------------------------------------------------------
//
// The packed layout is VDPBF16PS's operand layout as it lies: one 64-byte vector holds columns
// (2p, 2p + 1) of a block's 16 rows, and a row of x contributes the 32-bit broadcast of its
// pair (2p, 2p + 1). So neither operand is widened or repacked, and one instruction does the 32
// products.

// Rows of x as bf16 pairs: x itself when K is even, else a copy with a zero column appended
// (the packed weight's padding column is zero too), [M][2 * K2] in a per-thread scratch.
const uint16_t* rows_as_pairs(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t K2,
                              int64_t* ld_pairs) {
  if (K % 2 == 0) {
    *ld_pairs = ldx;
    return x;
  }
  thread_local std::vector<uint16_t> scratch;
  const int64_t width = 2 * K2;
  if (static_cast<int64_t>(scratch.size()) < M * width) {
    scratch.resize(static_cast<size_t>(M * width));
  }
  for (int64_t m = 0; m < M; ++m) {
    std::copy(x + m * ldx, x + m * ldx + K, scratch.data() + m * width);
    scratch[m * width + K] = 0;
  }
  *ld_pairs = width;
  return scratch.data();
}

// Blocks of 16 weight rows per tile for MR rows of x: MR * NB accumulators + NB weight vectors
// + one broadcast within 32 registers.
constexpr std::array<int, kMaxTileRows + 1> kPackedTileBlocks = {0, 4, 4, 4, 4, 4, 4, 3, 3};

template <int MR, int NB>
void packed_tile(const uint16_t* xp, int64_t ldxp, int64_t K2, const uint16_t* wp, float* out,
                 int64_t ldo) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      acc[m][b] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < K2; ++p) {
    __m512i w[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (b * K2 + p + kPackedPrefetchLines) * 32),
                   _MM_HINT_T0);
      w[b] = _mm512_loadu_si512(wp + (b * K2 + p) * 32);  // columns 2p, 2p + 1 of 16 rows
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512i x_pair =
          _mm512_set1_epi32(static_cast<int>(load_pair(xp + m * ldxp + 2 * p)));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)w[b], (__m512bh)x_pair);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      _mm512_storeu_ps(out + m * ldo + 16 * b, acc[m][b]);
    }
  }
}

using PackedTileFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, float*, int64_t);

template <int MR, std::size_t... I>
constexpr std::array<PackedTileFn, kMaxPackedTileBlocks> packed_tiles_for(
    std::index_sequence<I...>) {
  return {&packed_tile<MR, static_cast<int>(I) + 1>...};
}

template <std::size_t... I>
constexpr std::array<std::array<PackedTileFn, kMaxPackedTileBlocks>, kMaxTileRows>
all_packed_tiles(std::index_sequence<I...>) {
  return {packed_tiles_for<static_cast<int>(I) + 1>(
      std::make_index_sequence<kMaxPackedTileBlocks>{})...};
}

// kPackedTiles[MR - 1][NB - 1] = packed_tile<MR, NB>.
constexpr auto kPackedTiles = all_packed_tiles(std::make_index_sequence<kMaxTileRows>{});

// Split M rows into equal tiles of at most kMaxTileRows (12 -> 6 + 6, not 8 + 4), so every
// tile over a group of weight rows can use the same, largest group.
inline int tile_rows_for(int64_t M) {
  const int64_t num_tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
  return static_cast<int>((M + num_tiles - 1) / num_tiles);
}

}  // namespace

void rows_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw,
                   int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo) {
  if (M <= 0 || n_end <= n_begin) {
    return;
  }
  const int tile_rows = tile_rows_for(M);
  const int group = kRowsTileWeights[tile_rows];
  for (int64_t n = n_begin; n < n_end; n += group) {
    const int nr = static_cast<int>(std::min<int64_t>(group, n_end - n));
    for (int64_t m = 0; m < M; m += tile_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
      kRowsTiles[mr - 1][nr - 1](x + m * ldx, ldx, w + n * ldw, ldw, K,
                                 out + m * ldo + (n - n_begin), ldo);
    }
  }
}

namespace {

// fp32 packed_dot: rows i of MB blocks as lanes, MR rows of x. A column pair of a block is 32
// floats, the 16 rows' (even, odd) values side by side; two permutes split them into the
// even and the odd column's 16 rows. Every output is one chain, the even then the odd
// product of each pair added in pair order, each multiply and add rounded on its own
// (*_round_ps: GCC would contract mul + add into an FMA): bit for bit the portable kernel's
// `acc += w_even * x_even; acc += w_odd * x_odd`. The router's fp32 gate of a MoE layer
// takes it (64 x 2048 at one row: 60 us on the scalar loop, 512 KB).
template <int MB, int MR>
void packed_f32_tile(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t b,
                     float* out, int64_t ldo) {
  constexpr int64_t kLine = 2 * kPackedBlockRows;
  const int64_t K2 = (K + 1) / 2;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                        31);
  const float* block[MB];
  __m512 acc[MB][MR];
  for (int j = 0; j < MB; ++j) {
    block[j] = wp + (b + j) * K2 * kLine;
    for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < K2; ++p) {
    __m512 we[MB], wo[MB];
    for (int j = 0; j < MB; ++j) {
      const __m512 lo = _mm512_loadu_ps(block[j] + p * kLine);
      const __m512 hi = _mm512_loadu_ps(block[j] + p * kLine + kPackedBlockRows);
      we[j] = _mm512_permutex2var_ps(lo, even, hi);
      wo[j] = _mm512_permutex2var_ps(lo, odd, hi);
    }
    const bool has_odd = 2 * p + 1 < K;
    for (int m = 0; m < MR; ++m) {
      const __m512 xe = _mm512_set1_ps(x[m * ldx + 2 * p]);
      const __m512 xo = has_odd ? _mm512_set1_ps(x[m * ldx + 2 * p + 1]) : _mm512_setzero_ps();
      for (int j = 0; j < MB; ++j) {
        acc[j][m] = _mm512_add_round_ps(
            acc[j][m], _mm512_mul_round_ps(we[j], xe, _MM_FROUND_CUR_DIRECTION),
            _MM_FROUND_CUR_DIRECTION);
        acc[j][m] = _mm512_add_round_ps(
            acc[j][m], _mm512_mul_round_ps(wo[j], xo, _MM_FROUND_CUR_DIRECTION),
            _MM_FROUND_CUR_DIRECTION);
      }
    }
  }
  for (int j = 0; j < MB; ++j) {
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(out + m * ldo + j * kPackedBlockRows, acc[j][m]);
    }
  }
}

template <int MR>
void packed_f32_rows(const float* x, int64_t ldx, const float* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  int64_t b = block_begin;
  for (; b + 2 <= block_end; b += 2) {
    packed_f32_tile<2, MR>(x, ldx, wp, K, b, out + (b - block_begin) * kPackedBlockRows, ldo);
  }
  if (b < block_end) {
    packed_f32_tile<1, MR>(x, ldx, wp, K, b, out + (b - block_begin) * kPackedBlockRows, ldo);
  }
}

}  // namespace

void packed_dot_f32(const float* x, int64_t ldx, int64_t M, const float* wp, int64_t K,
                    int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: packed_f32_rows<1>(xm, ldx, wp, K, block_begin, block_end, om, ldo); break;
      case 2: packed_f32_rows<2>(xm, ldx, wp, K, block_begin, block_end, om, ldo); break;
      case 3: packed_f32_rows<3>(xm, ldx, wp, K, block_begin, block_end, om, ldo); break;
      default: packed_f32_rows<4>(xm, ldx, wp, K, block_begin, block_end, om, ldo); break;
    }
  }
}

void packed_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  if (M <= 0 || block_end <= block_begin) {
    return;
  }
  const int64_t K2 = (K + 1) / 2;
  int64_t ldxp = 0;
  const uint16_t* xp = rows_as_pairs(x, ldx, M, K, K2, &ldxp);
  const int tile_rows = tile_rows_for(M);
  const int group = kPackedTileBlocks[tile_rows];
  for (int64_t b = block_begin; b < block_end; b += group) {
    const int nb = static_cast<int>(std::min<int64_t>(group, block_end - b));
    for (int64_t m = 0; m < M; m += tile_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
      kPackedTiles[mr - 1][nb - 1](xp + m * ldxp, ldxp, K2, wp + b * K2 * 32,
                                   out + m * ldo + 16 * (b - block_begin), ldo);
    }
  }
}

// For 16-bit elements a column pair is 32 bits, so 16 consecutive pairs of a block (16 rows at
// one pair each, one 64-byte line) are a row of a 16 x 16 matrix of 32-bit values whose
// transpose holds 16 consecutive pairs of each row (transpose_16x16_epi32), instead of the
// scalar loop's 256 scattered 4-byte copies.
void unpack_rows_16bit(const uint16_t* packed, int64_t K, int64_t n_begin, int64_t n_end,
                       uint16_t* dst, int64_t ldd) {
  const int64_t K2 = (K + 1) / 2;
  const int64_t full_pairs = K / 2;
  for (int64_t n = n_begin; n < n_end;) {
    const int64_t b = n / 16;
    const int64_t row0 = b * 16;
    const int i_begin = static_cast<int>(n - row0);
    const int i_end = static_cast<int>(std::min<int64_t>(16, n_end - row0));
    const uint16_t* block = packed + b * K2 * 32;
    uint16_t* rows = dst + (row0 - n_begin) * ldd;
    for (int64_t p0 = 0; p0 < full_pairs; p0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, full_pairs - p0));
      const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
      __m512i r[16];
      for (int q = 0; q < 16; ++q) {
        r[q] = q < count ? _mm512_loadu_si512(block + (p0 + q) * 32) : _mm512_setzero_si512();
      }
      transpose_16x16_epi32(r);
      for (int i = i_begin; i < i_end; ++i) {  // rows need not be 4-byte aligned (odd ldd)
        _mm512_mask_storeu_epi32(rows + i * ldd + 2 * p0, lanes, r[i]);
      }
    }
    if (K % 2 != 0) {  // the last column, whose pair partner is padding
      for (int i = i_begin; i < i_end; ++i) {
        rows[i * ldd + K - 1] = block[full_pairs * 32 + 2 * i];
      }
    }
    n = row0 + i_end;
  }
}

}  // namespace mlafx::avx512

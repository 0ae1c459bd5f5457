// AVX-512 specialisations of the weight-streaming dot products (compiled with
// -mavx512f/bw/vl/dq/bf16). Only called after the run-time check in cpu_features.h; the
// scalar references are in gemm.cpp, the contracts and the packed layout in gemm.h.
//
// Why FMA and not VDPBF16PS: measured on this CPU, VDPBF16PS (32 MACs) issues once every
// two cycles while VFMADD231PS (16 MACs) issues twice per cycle, so widening bf16 to fp32
// costs one shift or one AND per 16 values and still doubles the arithmetic rate. At 8 rows
// of x, dpbf16 would top out near the memory bandwidth of one core; FMA leaves headroom.
// The widening is exact (a bf16 is the top half of an fp32), so products and sums are the
// same fp32 arithmetic as the scalar reference, in a different summation order.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "gemm.h"

#if !defined(__AVX512BF16__)
#error "gemm_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int kMaxTileRows = 8;  // rows of x per tile (MR)
constexpr int kMaxRowsTileWeights = 8;
constexpr int kMaxPackedTileBlocks = 4;

// 32 bf16 as 16 pairs (one pair per 32-bit lane) -> the fp32 values of the even and of the
// odd elements: a bf16 is the top half of the fp32 with the same value.
inline __m512 widen_even(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 widen_odd(__m512i pairs) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
}

inline __mmask32 first_lanes16(int64_t n) {
  return static_cast<__mmask32>((uint64_t{1} << n) - 1u);  // n < 32
}

// Row stride of the widened rows of x, in floats: a multiple of 4 KB would put the same
// column of every row (and of the weight rows streaming past) in one L1 set, and 8 rows of x
// plus the weight rows overflow its 12 ways: an extra 64 B per row spreads them over sets.
inline int64_t padded_stride(int64_t floats) { return floats + 16; }

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

// Per-thread fp32 scratch for the widened rows of x (grown, never shrunk).
float* scratch_floats(int64_t n) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) {
    scratch.resize(static_cast<size_t>(n));
  }
  return scratch.data();
}

// ---- row-major weights: lanes along K ---------------------------------------------------

// x rows -> fp32 in chunks of 32 columns, each chunk stored as [16 even | 16 odd] columns
// (the order widen_even / widen_odd produce for the weights); the last chunk zero-padded.
// Layout [M][num_chunks][32], rows padded_stride(num_chunks * 32) apart.
const float* widen_rows_split(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t chunks = (K + 31) / 32;
  const int64_t stride = padded_stride(chunks * 32);
  float* out = scratch_floats(M * stride);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = c * 32;
      const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : first_lanes16(K - k);
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
      float* dst = out + m * stride + c * 32;
      _mm512_storeu_ps(dst, widen_even(pairs));
      _mm512_storeu_ps(dst + 16, widen_odd(pairs));
    }
  }
  return out;
}

// Weight rows per tile for MR rows of x: MR * NR accumulators + 2 * NR widened weight
// vectors + 2 x vectors within 32 registers, and several accumulation chains when MR is 1.
constexpr std::array<int, kMaxTileRows + 1> kRowsTileWeights = {0, 8, 6, 4, 4, 3, 3, 2, 2};

template <int MR, int NR>
void rows_tile(const float* xs, int64_t ldxs, const uint16_t* w, int64_t ldw, int64_t K,
               float* out, int64_t ldo) {
  const int64_t chunks = (K + 31) / 32;
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      acc[m][r] = _mm512_setzero_ps();
    }
  }
  const auto step = [&](int64_t c, __mmask32 mask) {
    __m512 w_even[NR], w_odd[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      prefetch_next_group(w + (r + NR) * ldw + c * 32);
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, w + r * ldw + c * 32);
      w_even[r] = widen_even(pairs);
      w_odd[r] = widen_odd(pairs);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float* x_chunk = xs + m * ldxs + c * 32;
      const __m512 x_even = _mm512_loadu_ps(x_chunk);
      const __m512 x_odd = _mm512_loadu_ps(x_chunk + 16);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        acc[m][r] = _mm512_fmadd_ps(w_even[r], x_even, acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(w_odd[r], x_odd, acc[m][r]);
      }
    }
  };
  const int64_t full_chunks = K / 32;
  for (int64_t c = 0; c < full_chunks; ++c) {
    step(c, ~__mmask32{0});
  }
  if (full_chunks < chunks) {
    // Widths like 64+13: lanes past K load as zeros (so do x's padding lanes); nothing past
    // the end of a weight row is read.
    step(full_chunks, first_lanes16(K - full_chunks * 32));
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      out[m * ldo + r] = _mm512_reduce_add_ps(acc[m][r]);
    }
  }
}

using RowsTileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*,
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

// Tiles of 5..8 rows of x: widened x would be 8 KB per row (K = 2048) and, re-read for every
// group of 2..3 weight rows, would stream from L2 at several times the weights' rate; bf16 x
// (4 KB a row) stays in L1, and widening it again per group costs less than those L2 reads.
constexpr int kMinRawTileRows = 5;
constexpr std::array<int, kMaxTileRows + 1> kRawTileWeights = {0, 0, 0, 0, 0, 3, 3, 2, 2};

template <int MR, int NR>
void rows_tile_raw_x(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
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
    __m512 w_even[NR], w_odd[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      prefetch_next_group(w + (r + NR) * ldw + k);
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
      w_even[r] = widen_even(pairs);
      w_odd[r] = widen_odd(pairs);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
      const __m512 x_even = widen_even(pairs);
      const __m512 x_odd = widen_odd(pairs);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        acc[m][r] = _mm512_fmadd_ps(w_even[r], x_even, acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(w_odd[r], x_odd, acc[m][r]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    step(k, ~__mmask32{0});
  }
  if (k < K) {
    step(k, first_lanes16(K - k));
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      out[m * ldo + r] = _mm512_reduce_add_ps(acc[m][r]);
    }
  }
}

using RawTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*,
                           int64_t);

template <int MR>
constexpr std::array<RawTileFn, 3> raw_tiles_for() {
  return {&rows_tile_raw_x<MR, 1>, &rows_tile_raw_x<MR, 2>, &rows_tile_raw_x<MR, 3>};
}

// kRawTiles[MR - 1][NR - 1] = rows_tile_raw_x<MR, NR> (MR < 5 for the last, short tile).
constexpr std::array<std::array<RawTileFn, 3>, kMaxTileRows> kRawTiles = {
    raw_tiles_for<1>(), raw_tiles_for<2>(), raw_tiles_for<3>(), raw_tiles_for<4>(),
    raw_tiles_for<5>(), raw_tiles_for<6>(), raw_tiles_for<7>(), raw_tiles_for<8>()};

// ---- packed weights: lanes along N ------------------------------------------------------

// x rows -> fp32, [M][2 * K2] (K2 = ceil(K / 2)), the padding column zero; rows
// padded_stride(2 * K2) apart.
const float* widen_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t K2) {
  const int64_t width = 2 * K2;
  const int64_t stride = padded_stride(width);
  float* out = scratch_floats(M * stride);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < width; k += 16) {
      const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, K - k));
      const __mmask16 load = static_cast<__mmask16>((1u << valid) - 1u);
      const __mmask16 store = static_cast<__mmask16>((1u << std::min<int64_t>(16, width - k)) - 1u);
      const __m256i bf16 = _mm256_maskz_loadu_epi16(load, x + m * ldx + k);
      const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16);
      _mm512_mask_storeu_ps(out + m * stride + k, store, _mm512_castsi512_ps(bits));
    }
  }
  return out;
}

// Blocks of 16 weight rows per tile for MR rows of x: MR * NB accumulators + 2 * NB widened
// weight vectors + 2 broadcasts within 32 registers. At MR = 8, NB = 3 needs 32 and GCC keeps
// one accumulator on the stack, yet it measured 10-30% faster than NB = 2 (2 threads, cold
// weights, 8 x 2048 -> 2048..3072): fewer tiles re-broadcast x per weight byte.
constexpr std::array<int, kMaxTileRows + 1> kPackedTileBlocks = {0, 4, 4, 4, 4, 3, 3, 3, 3};

template <int MR, int NB>
void packed_tile(const float* xf, int64_t ldxf, int64_t K2, const uint16_t* wp, float* out,
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
    __m512 w_even[NB], w_odd[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (b * K2 + p + kPackedPrefetchLines) * 32),
                   _MM_HINT_T0);
      const __m512i pairs = _mm512_loadu_si512(wp + (b * K2 + p) * 32);
      w_even[b] = widen_even(pairs);  // column 2p of the block's 16 rows
      w_odd[b] = widen_odd(pairs);    // column 2p + 1
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 x_even = _mm512_set1_ps(xf[m * ldxf + 2 * p]);
      const __m512 x_odd = _mm512_set1_ps(xf[m * ldxf + 2 * p + 1]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        acc[m][b] = _mm512_fmadd_ps(w_even[b], x_even, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(w_odd[b], x_odd, acc[m][b]);
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

using PackedTileFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, float*, int64_t);

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
  if (tile_rows >= kMinRawTileRows) {
    const int group = kRawTileWeights[tile_rows];
    for (int64_t n = n_begin; n < n_end; n += group) {
      const int nr = static_cast<int>(std::min<int64_t>(group, n_end - n));
      for (int64_t m = 0; m < M; m += tile_rows) {
        const int mr = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
        kRawTiles[mr - 1][nr - 1](x + m * ldx, ldx, w + n * ldw, ldw, K,
                                                out + m * ldo + (n - n_begin), ldo);
      }
    }
    return;
  }
  const int64_t ldxs = padded_stride((K + 31) / 32 * 32);
  const float* xs = widen_rows_split(x, ldx, M, K);
  const int group = kRowsTileWeights[tile_rows];
  for (int64_t n = n_begin; n < n_end; n += group) {
    const int nr = static_cast<int>(std::min<int64_t>(group, n_end - n));
    for (int64_t m = 0; m < M; m += tile_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
      kRowsTiles[mr - 1][nr - 1](xs + m * ldxs, ldxs, w + n * ldw, ldw, K,
                                 out + m * ldo + (n - n_begin), ldo);
    }
  }
}

void packed_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  if (M <= 0 || block_end <= block_begin) {
    return;
  }
  const int64_t K2 = (K + 1) / 2;
  const int64_t ldxf = padded_stride(2 * K2);
  const float* xf = widen_rows(x, ldx, M, K, K2);
  const int tile_rows = tile_rows_for(M);
  const int group = kPackedTileBlocks[tile_rows];
  for (int64_t b = block_begin; b < block_end; b += group) {
    const int nb = static_cast<int>(std::min<int64_t>(group, block_end - b));
    for (int64_t m = 0; m < M; m += tile_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(tile_rows, M - m));
      kPackedTiles[mr - 1][nb - 1](xf + m * ldxf, ldxf, K2, wp + b * K2 * 32,
                                   out + m * ldo + 16 * (b - block_begin), ldo);
    }
  }
}

}  // namespace mlafx::avx512

// packed_dot on the AMX tile unit (compiled with the AVX-512 and AMX flags from setup.py; called
// only when mlafx::use_amx_bf16() and packed_dot_amx_supports()).
//
// The packed weight layout [blocks, K/2, 16, 2] (gemm.h) is already the tile unit's B layout:
// 16 consecutive column pairs of one block are one contiguous 1 KB tile (16 rows of 64 bytes:
// the 16 outputs' two values side by side). x rows are A tiles as they lie (32 columns of up
// to 16 rows, the row stride as the tile stride), so nothing is widened or copied: each
// weight byte is loaded once by a tile load and used by one (M <= 16) or two tile dot
// products. The fp32 FMA kernel in gemm_avx512.cpp spends a widening and M FMAs per 32
// weights and falls below memory bandwidth from about 8 rows; on tiles the product is
// bandwidth-bound at every M up to 32.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "gemm.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "gemm_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kChunk = 32;                       // columns of x per tile
constexpr int64_t kTileElems = kTileRows * kChunk;   // bf16 elements in one B tile

// K a multiple of 32: two blocks at a time. Tiles: 0/1 accumulators of row tile 0 against
// blocks b and b + 1, 2/3 of row tile 1; 4/5 the row tiles' x chunks; 6/7 the two blocks'
// weight chunks. Each weight and x tile load feeds two products.
void configure_pairs(int64_t rows0, int64_t rows1) {
  TileConfig cfg;
  cfg.set(0, rows0, 64);
  cfg.set(1, rows0, 64);
  cfg.set(4, rows0, 64);
  if (rows1 > 0) {
    cfg.set(2, rows1, 64);
    cfg.set(3, rows1, 64);
    cfg.set(5, rows1, 64);
  }
  cfg.set(6, kTileRows, 64);
  cfg.set(7, kTileRows, 64);
  cfg.load();
}

// Up to 32 rows of x against blocks [block_begin, block_end), K = 32 * chunks: a row's sums
// are rows_against_blocks' (zero, then the chunks in order), two blocks sharing x's loads.
template <bool kTwoRowTiles>
void rows_against_block_pairs(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t K2,
                              int64_t chunks, int64_t block_begin, int64_t block_end,
                              float* out, int64_t ldo) {
  const int64_t xstride = 2 * ldx;
  const int64_t ostride = 4 * ldo;
  const uint16_t* x1 = x + kTileRows * ldx;
  const int64_t block_elems = K2 * 2 * kTileRows;
  int64_t b = block_begin;
  for (; b + 2 <= block_end; b += 2) {
    const uint16_t* w = wp + b * block_elems;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, x + c * kChunk, xstride);
      _tile_loadd(6, w + c * kTileElems, 64);
      _tile_loadd(7, w + block_elems + c * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (kTwoRowTiles) {
        _tile_loadd(5, x1 + c * kChunk, xstride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* o = out + kTileRows * (b - block_begin);
    _tile_stored(0, o, ostride);
    _tile_stored(1, o + kTileRows, ostride);
    if constexpr (kTwoRowTiles) {
      _tile_stored(2, o + kTileRows * ldo, ostride);
      _tile_stored(3, o + kTileRows * ldo + kTileRows, ostride);
    }
  }
  if (b < block_end) {  // an odd last block
    const uint16_t* w = wp + b * block_elems;
    _tile_zero(0);
    if constexpr (kTwoRowTiles) _tile_zero(2);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, x + c * kChunk, xstride);
      _tile_loadd(6, w + c * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kTwoRowTiles) {
        _tile_loadd(5, x1 + c * kChunk, xstride);
        _tile_dpbf16ps(2, 5, 6);
      }
    }
    float* o = out + kTileRows * (b - block_begin);
    _tile_stored(0, o, ostride);
    if constexpr (kTwoRowTiles) _tile_stored(2, o + kTileRows * ldo, ostride);
  }
}

// Tiles: 0/1 accumulators of row tiles 0/1 (rows 0..15, 16..31 of x); 2/3 their full x chunks;
// 4 a full weight chunk; 5/6 the x tails and 7 the weight tail (the last K mod 32 columns).
void configure(int64_t rows0, int64_t rows1, int64_t tail_pairs) {
  TileConfig cfg;
  cfg.set(0, rows0, 64);
  cfg.set(2, rows0, 64);
  cfg.set(4, kTileRows, 64);
  if (rows1 > 0) {
    cfg.set(1, rows1, 64);
    cfg.set(3, rows1, 64);
  }
  if (tail_pairs > 0) {
    cfg.set(5, rows0, 4 * tail_pairs);
    cfg.set(7, tail_pairs, 64);
    if (rows1 > 0) {
      cfg.set(6, rows1, 4 * tail_pairs);
    }
  }
  cfg.load();
}

// Up to 32 rows of x against blocks [block_begin, block_end).
template <bool kTwoRowTiles>
void rows_against_blocks(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t K2,
                         int64_t full_chunks, bool tail, int64_t block_begin,
                         int64_t block_end, float* out, int64_t ldo) {
  const int64_t xstride = 2 * ldx;
  const int64_t ostride = 4 * ldo;
  const uint16_t* x1 = x + kTileRows * ldx;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint16_t* w = wp + b * K2 * 2 * kTileRows;
    _tile_zero(0);
    if constexpr (kTwoRowTiles) _tile_zero(1);
    for (int64_t c = 0; c < full_chunks; ++c) {
      _tile_loadd(4, w + c * kTileElems, 64);
      _tile_loadd(2, x + c * kChunk, xstride);
      _tile_dpbf16ps(0, 2, 4);
      if constexpr (kTwoRowTiles) {
        _tile_loadd(3, x1 + c * kChunk, xstride);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    if (tail) {
      _tile_loadd(7, w + full_chunks * kTileElems, 64);
      _tile_loadd(5, x + full_chunks * kChunk, xstride);
      _tile_dpbf16ps(0, 5, 7);
      if constexpr (kTwoRowTiles) {
        _tile_loadd(6, x1 + full_chunks * kChunk, xstride);
        _tile_dpbf16ps(1, 6, 7);
      }
    }
    float* o = out + kTileRows * (b - block_begin);
    _tile_stored(0, o, ostride);
    if constexpr (kTwoRowTiles) _tile_stored(1, o + kTileRows * ldo, ostride);
  }
}

// ---- row-major weights (rows_dot): C^T = W x^T -------------------------------------------------
//
// The weight rows are A tiles as they lie (16 rows x 32 columns), x is the B operand, packed
// once per call by pack_rows_for_tiles; the accumulator is C^T [16 weight rows x 16 rows of x],
// transposed on its way out. Tiles: 0..3 accumulators of four weight-row tiles, 4 weight
// chunks, 5 the x chunk, 6/7 accumulator and weight chunk of a last, partial row tile.

void configure_rows_dot(int64_t tail_rows) {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.set(t, kTileRows, 64);
  }
  if (tail_rows > 0) {
    cfg.set(6, tail_rows, 64);
    cfg.set(7, tail_rows, 64);
  }
  cfg.load();
}

// C^T tile [16 weight rows][16] in `tile` -> out[m * ldo + n] for n < rows, m < M.
inline void store_transposed(const float* tile, int64_t rows, int64_t M, float* out,
                             int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < rows; ++n) {
      out[m * ldo + n] = tile[n * kTileRows + m];
    }
  }
}

}  // namespace

void pack_rows_for_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp) {
  const int64_t K2 = K / 2;
  auto* dst = reinterpret_cast<uint32_t*>(xp);
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      uint32_t pair = 0;
      if (m < M) {
        std::memcpy(&pair, x + m * ldx + 2 * k2, sizeof(pair));
      }
      dst[k2 * kTileRows + m] = pair;
    }
  }
}

bool rows_dot_amx_supports(int64_t M, int64_t K) {
  return M >= 1 && M <= kTileRows && K >= kChunk && K % kChunk == 0;
}

void rows_dot_bf16_amx(const uint16_t* xp, int64_t M, const uint16_t* w, int64_t ldw, int64_t K,
                       int64_t n_begin, int64_t n_end, float* out, int64_t ldo) {
  if (n_end <= n_begin) {
    return;
  }
  const int64_t chunks = K / kChunk;
  const int64_t wstride = 2 * ldw;
  const int64_t full = (n_end - n_begin) / kTileRows * kTileRows;
  const int64_t tail = n_end - n_begin - full;
  alignas(64) float tile[4][kTileRows * kTileRows];
  configure_rows_dot(tail);
  int64_t n = n_begin;
  for (; n + 4 * kTileRows <= n_begin + full; n += 4 * kTileRows) {
    const uint16_t* w0 = w + n * ldw;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(5, xp + c * kTileElems, 64);
      _tile_loadd(4, w0 + c * kChunk, wstride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(4, w0 + kTileRows * ldw + c * kChunk, wstride);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(4, w0 + 2 * kTileRows * ldw + c * kChunk, wstride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(4, w0 + 3 * kTileRows * ldw + c * kChunk, wstride);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, tile[0], 64);
    _tile_stored(1, tile[1], 64);
    _tile_stored(2, tile[2], 64);
    _tile_stored(3, tile[3], 64);
    for (int t = 0; t < 4; ++t) {
      store_transposed(tile[t], kTileRows, M, out + (n - n_begin) + t * kTileRows, ldo);
    }
  }
  for (; n < n_begin + full; n += kTileRows) {
    const uint16_t* w0 = w + n * ldw;
    _tile_zero(0);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(5, xp + c * kTileElems, 64);
      _tile_loadd(4, w0 + c * kChunk, wstride);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, tile[0], 64);
    store_transposed(tile[0], kTileRows, M, out + (n - n_begin), ldo);
  }
  if (tail > 0) {
    const uint16_t* w0 = w + n * ldw;
    _tile_zero(6);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(5, xp + c * kTileElems, 64);
      _tile_loadd(7, w0 + c * kChunk, wstride);
      _tile_dpbf16ps(6, 7, 5);
    }
    _tile_stored(6, tile[0], 64);
    store_transposed(tile[0], tail, M, out + (n - n_begin), ldo);
  }
  _tile_release();
}

bool packed_dot_amx_supports(int64_t K) { return K >= 2 && K % 2 == 0; }

void packed_dot_bf16_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                         int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  if (M <= 0 || block_end <= block_begin) {
    return;
  }
  const int64_t K2 = K / 2;
  const int64_t full_chunks = K / kChunk;
  const int64_t tail_pairs = K2 - full_chunks * kTileRows;
  for (int64_t m = 0; m < M; m += 2 * kTileRows) {
    const int64_t rows = std::min<int64_t>(2 * kTileRows, M - m);
    const int64_t rows0 = std::min<int64_t>(kTileRows, rows);
    const int64_t rows1 = rows - rows0;
    if (tail_pairs == 0) {
      configure_pairs(rows0, rows1);
      if (rows1 > 0) {
        rows_against_block_pairs<true>(x + m * ldx, ldx, wp, K2, full_chunks, block_begin,
                                       block_end, out + m * ldo, ldo);
      } else {
        rows_against_block_pairs<false>(x + m * ldx, ldx, wp, K2, full_chunks, block_begin,
                                        block_end, out + m * ldo, ldo);
      }
      continue;
    }
    configure(rows0, rows1, tail_pairs);
    if (rows1 > 0) {
      rows_against_blocks<true>(x + m * ldx, ldx, wp, K2, full_chunks, tail_pairs > 0,
                                block_begin, block_end, out + m * ldo, ldo);
    } else {
      rows_against_blocks<false>(x + m * ldx, ldx, wp, K2, full_chunks, tail_pairs > 0,
                                 block_begin, block_end, out + m * ldo, ldo);
    }
  }
  _tile_release();
}

}  // namespace mlafx::avx512

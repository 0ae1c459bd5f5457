// batched_matmul (batched_matmul.h) on the AMX-BF16 tile unit for a few rows per head
// (compiled with the AVX-512 and AMX flags from setup.py; called only when
// mlafx::use_amx_bf16(), for bf16 with kBatchedMatmulAmxMinRows..16 rows per head).
//
// A work item is a head. Its w is read 32 rows at a time, row after row (one forward stream,
// the next chunk's rows prefetched while this one is staged): each chunk of rows becomes
// N / 16 B tiles in the tile unit's pair layout (row p = the 16 columns' values at k = 2p and
// 2p + 1 side by side: one VPERMT2W of the two w rows per tile row), and x's rows of the
// chunk (the head's rows copied to K_pad = K rounded up to 32 with zeros, once per head) are
// the A tile. Each pair of 16-column accumulator tiles (M x 16 fp32) is loaded from and
// stored back to an fp32 [M, N] buffer around its products, so every column's sums carry
// over from chunk to chunk. Columns past N and rows past K load as zeros. The products are
// exact in fp32 and summed in fp32 (TDPBF16PS; bf16 inputs that are subnormal count as zero),
// with one rounding to bf16 at the end, as the streaming kernel and ATen do; a row's sums
// never involve another row, so a row's result does not depend on the others in the call.
//
// Why: from 5 rows the streaming kernel's FMAs (one per weight and row) outrun the memory, and
// ATen's bmm is no faster. In the engine's batch-8 int4 decode step (full V2-Lite, Xeon with
// AMX, 6 Dec 2026, the two products of 27 layers, A/B in one process over 4 rounds) a step
// took 231.8 ms with this kernel against 238.5 with ATen's bmm. In isolation (600 distinct
// 2 MB weights, 2 threads) it is level with ATen (0.13-0.16 ms at 5-16 rows), and with the
// streaming kernel at 2-4 rows (one row: 0.115-0.131 against 0.105 ms), hence the 5.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "batched_matmul.h"
#include "bf16_avx512.h"
#include "workspace_layout.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "batched_matmul_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kChunk = 32;    // k per tile product (16 pairs)
constexpr int64_t kCols = 32;     // output columns per staged pair of B tiles
constexpr int64_t kRowBlock = 32;  // rows of x per block in the many-rows kernel

// Tiles: 0/1 the accumulators (M rows x 16 fp32), 2 x's chunk (M rows x 32 bf16), 3/4 the
// two staged weight tiles (16 pairs x 16 columns).
void configure(int64_t rows) {
  TileConfig cfg;
  cfg.set(0, rows, 64);
  cfg.set(1, rows, 64);
  cfg.set(2, rows, 64);
  cfg.set(3, 16, 64);
  cfg.set(4, 16, 64);
  cfg.load();
}

// Rows k0..k0+31 of w (those below K; the rest zero), all N columns (zeros up to n_pad), as
// n_pad / 16 B tiles of 16 pairs x 16 columns, 512 elements each: row after row, so that the
// reads are two forward streams the hardware prefetcher follows.
void stage_chunk(const BmmArgs& a, const uint16_t* w, int64_t k0, int64_t n_pad,
                 uint16_t* staging) {
  // pair p of a tile: out[32p + 2i + j] = row (2p + j)'s column i of the tile
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const int64_t rows = std::min<int64_t>(kChunk, a.K - k0);
  for (int64_t p = 0; p < kChunk / 2; ++p) {
    const uint16_t* r0 = w + (k0 + 2 * p) * a.ws_k;
    const bool has0 = 2 * p < rows, has1 = 2 * p + 1 < rows;
    for (int64_t n0 = 0; n0 < n_pad; n0 += kCols) {
      const __mmask32 col_mask = first_lanes32(std::max<int64_t>(a.N - n0, 0));
      const __m512i even = _mm512_maskz_loadu_epi16(has0 ? col_mask : 0, r0 + n0);
      const __m512i odd = _mm512_maskz_loadu_epi16(has1 ? col_mask : 0, r0 + a.ws_k + n0);
      // the next chunk's same two rows (past the end of w is harmless: prefetches do not fault)
      _mm_prefetch(reinterpret_cast<const char*>(r0 + kChunk * a.ws_k + n0), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r0 + (kChunk + 1) * a.ws_k + n0), _MM_HINT_T0);
      uint16_t* tiles = staging + n0 / 16 * 512;
      _mm512_store_si512(tiles + 32 * p, _mm512_permutex2var_epi16(even, low, odd));
      _mm512_store_si512(tiles + 512 + 32 * p, _mm512_permutex2var_epi16(even, high, odd));
    }
  }
  compiler_barrier();
}

// One row of x (K elements xs_k apart; null: a row of zeros) as k_pad bf16 at dst (64-byte
// aligned), zeros past K.
void stage_row(const BmmArgs& a, const uint16_t* row, int64_t k_pad, uint16_t* dst) {
  if (row == nullptr) {
    for (int64_t k = 0; k < k_pad; k += 32) {
      _mm512_store_si512(dst + k, _mm512_setzero_si512());
    }
  } else if (a.xs_k == 1) {
    for (int64_t k = 0; k < k_pad; k += 32) {
      const __mmask32 mask = first_lanes32(std::max<int64_t>(a.K - k, 0));
      _mm512_store_si512(dst + k, _mm512_maskz_loadu_epi16(mask, row + k));
    }
  } else {
    for (int64_t k = 0; k < k_pad; ++k) {
      dst[k] = k < a.K ? row[k * a.xs_k] : uint16_t{0};
    }
  }
}

// Head b's rows of x as bf16 rows of k_pad (zeros past K), 64 bytes aligned.
void stage_rows(const BmmArgs& a, int64_t b, int64_t k_pad, uint16_t* xs) {
  const uint16_t* x = a.x + b * a.xs_b;
  for (int64_t m = 0; m < a.M; ++m) {
    stage_row(a, x + m * a.xs_m, k_pad, xs + m * k_pad);
  }
  compiler_barrier();
}

// Head b: w[b] read chunk after chunk of 32 rows (stage_chunk), the fp32 sums of all columns
// kept in `sums` (M x n_pad) between chunks.
void run_head(const BmmArgs& a, int64_t b, const uint16_t* xs, int64_t k_pad, int64_t n_pad,
              uint16_t* staging, float* sums) {
  const int64_t sum_stride = n_pad * 4;  // bytes
  const uint16_t* w = a.w + b * a.ws_b;
  for (int64_t k0 = 0; k0 < k_pad; k0 += kChunk) {
    stage_chunk(a, w, k0, n_pad, staging);
    _tile_loadd(2, xs + k0, k_pad * 2);
    for (int64_t n0 = 0; n0 < n_pad; n0 += kCols) {
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
      } else {
        _tile_loadd(0, sums + n0, sum_stride);
        _tile_loadd(1, sums + n0 + 16, sum_stride);
      }
      _tile_loadd(3, staging + n0 / 16 * 512, 64);
      _tile_loadd(4, staging + n0 / 16 * 512 + 512, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
      _tile_stored(0, sums + n0, sum_stride);
      _tile_stored(1, sums + n0 + 16, sum_stride);
    }
  }
  compiler_barrier();
  uint16_t* out = a.out + b * a.M * a.N;
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t n0 = 0; n0 < a.N; n0 += kCols) {
      const __mmask32 col_mask = first_lanes32(a.N - n0);
      const float* row = sums + m * n_pad + n0;
      const __m512i rounded = _mm512_inserti64x4(
          _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row))),
          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + 16)), 1);
      _mm512_mask_storeu_epi16(out + m * a.N + n0, col_mask, rounded);
    }
  }
}

// ---- many rows (batch-invariant prefill) -------------------------------------------------------
//
// Tiles: 0..3 the accumulators of a 32-row x 32-column block (rows 0-15 / 16-31 x columns
// 0-15 / 16-31), 4/5 x's two 16-row tiles of a chunk, 6/7 the chunk's two staged B tiles.
void configure_blocks() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.set(t, 16, 64);
  }
  cfg.load();
}

// Rows m0..m0+31 of head b's x (zeros past M and past K) as bf16 rows of k_pad.
void stage_row_block(const BmmArgs& a, int64_t b, int64_t m0, int64_t k_pad, uint16_t* xs) {
  const uint16_t* x = a.x + b * a.xs_b;
  for (int64_t r = 0; r < kRowBlock; ++r) {
    const int64_t m = m0 + r;
    stage_row(a, m < a.M ? x + m * a.xs_m : nullptr, k_pad, xs + r * k_pad);
  }
  compiler_barrier();
}

// Head b with many rows: all of w[b] staged once (chunk c's B tiles at c * 32 * n_pad), then
// every 32 x 32 block of the output summed in four accumulator tiles over the chunks in order.
// A row's sums are those of run_head (zero, then one product per chunk, k ascending; the
// fp32 round trip through `sums` there is exact), so either kernel gives a row the same bits.
void run_head_blocks(const BmmArgs& a, int64_t b, int64_t k_pad, int64_t n_pad,
                     uint16_t* wstage, uint16_t* xs, float* block) {
  const uint16_t* w = a.w + b * a.ws_b;
  for (int64_t k0 = 0; k0 < k_pad; k0 += kChunk) {
    stage_chunk(a, w, k0, n_pad, wstage + k0 * n_pad);
  }
  uint16_t* out = a.out + b * a.M * a.N;
  constexpr int64_t kBlockStride = kCols * 4;  // bytes per row of `block`
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowBlock) {
    stage_row_block(a, b, m0, k_pad, xs);
    const int64_t rows = std::min(kRowBlock, a.M - m0);
    for (int64_t n0 = 0; n0 < n_pad; n0 += kCols) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k0 = 0; k0 < k_pad; k0 += kChunk) {
        const uint16_t* tiles = wstage + k0 * n_pad + n0 / 16 * 512;
        _tile_loadd(4, xs + k0, k_pad * 2);
        _tile_loadd(5, xs + 16 * k_pad + k0, k_pad * 2);
        _tile_loadd(6, tiles, 64);
        _tile_loadd(7, tiles + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, block, kBlockStride);
      _tile_stored(1, block + 16, kBlockStride);
      _tile_stored(2, block + 16 * kCols, kBlockStride);
      _tile_stored(3, block + 16 * kCols + 16, kBlockStride);
      compiler_barrier();
      const __mmask32 col_mask = first_lanes32(std::max<int64_t>(a.N - n0, 0));
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = block + r * kCols;
        const __m512i rounded = _mm512_inserti64x4(
            _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row))),
            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + 16)), 1);
        _mm512_mask_storeu_epi16(out + (m0 + r) * a.N + n0, col_mask, rounded);
      }
    }
  }
}

// A thread's scratch, each region from a 64-byte boundary. The few-row kernel: a chunk's B
// tiles (32 x n_pad bf16), the head's rows of x (M x k_pad bf16) and the fp32 sums (M x
// n_pad). The many-rows kernel (`blocks`): all of a head's w in B tiles (k_pad x n_pad), a
// block of x's rows (32 x k_pad) and a block of sums (32 x 32).
struct ScratchLayout {
  int64_t k_pad = 0;
  int64_t n_pad = 0;
  size_t staging = 0, rows = 0, sums = 0, bytes = 0;
};

ScratchLayout scratch_layout(const BmmArgs& a, bool blocks) {
  ScratchLayout L;
  L.k_pad = (a.K + kChunk - 1) / kChunk * kChunk;
  L.n_pad = (a.N + kCols - 1) / kCols * kCols;
  const int64_t staged_k = blocks ? L.k_pad : kChunk;
  const int64_t rows = blocks ? kRowBlock : a.M;
  WorkspaceCarver carve;
  L.staging = carve.take(static_cast<size_t>(staged_k * L.n_pad) * sizeof(uint16_t));
  L.rows = carve.take(static_cast<size_t>(rows * L.k_pad) * sizeof(uint16_t));
  L.sums = carve.take(static_cast<size_t>(rows * (blocks ? kCols : L.n_pad)) * sizeof(float));
  L.bytes = carve.total();
  return L;
}

}  // namespace

int64_t batched_matmul_amx_blocks_scratch(const BmmArgs& a) {
  return static_cast<int64_t>(scratch_layout(a, /*blocks=*/true).bytes / sizeof(uint16_t));
}

void batched_matmul_heads_amx_blocks(const BmmArgs& a, int64_t begin, int64_t end,
                                     uint16_t* scratch) {
  const ScratchLayout L = scratch_layout(a, /*blocks=*/true);
  uint16_t* wstage = at_offset<uint16_t>(scratch, L.staging);
  uint16_t* xs = at_offset<uint16_t>(scratch, L.rows);
  float* block = at_offset<float>(scratch, L.sums);
  configure_blocks();
  for (int64_t b = begin; b < end; ++b) {
    run_head_blocks(a, b, L.k_pad, L.n_pad, wstage, xs, block);
  }
  _tile_release();
}

int64_t batched_matmul_amx_scratch(const BmmArgs& a) {
  return static_cast<int64_t>(scratch_layout(a, /*blocks=*/false).bytes / sizeof(uint16_t));
}

void batched_matmul_heads_amx(const BmmArgs& a, int64_t begin, int64_t end, uint16_t* scratch) {
  const ScratchLayout L = scratch_layout(a, /*blocks=*/false);
  uint16_t* staging = at_offset<uint16_t>(scratch, L.staging);
  uint16_t* xs = at_offset<uint16_t>(scratch, L.rows);
  float* sums = at_offset<float>(scratch, L.sums);
  configure(a.M);
  for (int64_t b = begin; b < end; ++b) {
    stage_rows(a, b, L.k_pad, xs);
    run_head(a, b, xs, L.k_pad, L.n_pad, staging, sums);
  }
  _tile_release();  // the tile state back to its init state: no 8 KB to save on a switch
}

}  // namespace mlafx::avx512

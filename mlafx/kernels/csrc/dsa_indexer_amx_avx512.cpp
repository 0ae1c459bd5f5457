// AMX indexer core (compiled with the AVX-512 and AMX flags; called only after use_amx_bf16(),
// for bf16 and Di a multiple of 32: DeepSeek-V3.2's and GLM-5's 128). The scalar reference is
// PortableIndexer in dsa_indexer.cpp.
//
// It takes the AVX-512 BF16 core's packed queries as they lie (its `begin`,
// dsa_indexer_packed_q.h): [pair][16 rows][2] is the AMX B tile layout. A tiles read 16 keys x
// 32 features straight from the cache where the 16 keys are consecutive rows of one block, else
// from a copy (zero rows pad the last tile of a chunk). Up to 4 groups of 16 rows (query x
// head) multiply at once into 4 C tiles [16 keys][16 rows] (TDPBF16PS, fp32); then relu, times
// the head weight, summed lane-wise over the query's rows in a fixed order and once
// horizontally, as the AVX-512 core does (its _mm512_reduce_add_ps, for 16 keys at once:
// reduce_add_16). A key's score depends on its query and itself alone.
//
// Measured (Xeon with AMX, 2 threads, 5 Dec 2026, `bench/kernels.py --only dsa`: batch 8, 64
// heads x 128, block 64, 23-24 GB/s of read bandwidth): the indexer at 16k context took
// 11.8 ms on the AVX-512 core (182 GFLOP/s: VDPBF16PS-bound, 12% of the bandwidth), on this one
// 3.8 ms with every key copied, 3.7 ms reading them in place, 3.0-3.4 ms with the next tile's
// keys prefetched (13.0-13.6 ms at 64k: 41-46% of the bandwidth). Under perf most of the time
// then waits on memory (the prefetches stall on fill buffers: ~5 GB/s per core of 256-byte
// rows in 16 KB blocks scattered by the block table); prefetching two tiles ahead into L2 was
// slower (16.0 ms at 64k), and one C tile per row group instead of four changed nothing.
// Chunks of 256 keys instead of 64 (kIndexerChunk: the prefetches above reach no further than
// the chunk) and the L2 kick two tiles ahead (prefetch_page_start) then gave 10.8-11.2 ms at
// 64k and 2.5-3.0 ms at 16k (6 Dec, same host; 48-52% of 23.3 GB/s). Spreading the next
// tile's prefetches over its four products, T1/T2/NTA hints instead of T0, or issuing them
// after the products were each slower than one burst before them (16-18 ms at 64k), as was
// no prefetch at all (16.5 ms).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "dsa_indexer.h"
#include "dsa_indexer_packed_q.h"

#if !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "dsa_indexer_amx_avx512.cpp must be compiled with the AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::dsa::IndexerDims;
using mlafx::dsa::IndexerOps;
using mlafx::dsa::kIndexerChunk;

constexpr int64_t kKeyTile = 16;  // keys per A / C tile

// The AVX-512 core's packed queries, then 16 gathered keys and 4 C tiles.
struct AmxLayout {
  size_t keys, c, total;
  explicit AmxLayout(const IndexerDims& d) {
    WorkspaceCarver carve;
    carve.take(PackedQueries(d).total);
    keys = carve.take(2 * static_cast<size_t>(kKeyTile * d.dim));
    c = carve.take(4 * 4 * kKeyTile * 16);  // 4 C tiles
    total = carve.total();
  }
};

size_t workspace_bytes(const IndexerDims& d) { return AmxLayout(d).total; }

// The next tile's keys into L1 while this one multiplies: tile loads straight from memory
// kept the AMX scorer at ~40% of the read bandwidth (below).
inline void prefetch_keys(const uint16_t* const* key, int64_t count, size_t row_bytes) {
  for (int64_t m = 0; m < count; ++m) {
    const char* row = reinterpret_cast<const char*>(key[m]);
    for (size_t off = 0; off < row_bytes; off += 64) {
      _mm_prefetch(row + off, _MM_HINT_T0);
    }
  }
}

// The first keys of the tile after next into L2: the hardware's L2 streamer follows a stream
// only within a 4 KB page, and a tile of 16 keys of 256 bytes is one page of a block, so
// touching its first lines early starts the streamer on it while this tile multiplies
// (10.8-11.2 against 11.5-12.3 ms at 64k, below).
inline void prefetch_page_start(const uint16_t* const* key, int64_t count, size_t row_bytes) {
  constexpr size_t kLines = 8;
  for (size_t line = 0; line < kLines && static_cast<int64_t>(line * 64 / row_bytes) < count;
       ++line) {
    const size_t byte = line * 64;
    _mm_prefetch(reinterpret_cast<const char*>(key[byte / row_bytes]) + byte % row_bytes,
                 _MM_HINT_T1);
  }
}

// The first of 16 keys that lie one after another in the cache (one block): an A tile reads
// them in place. nullptr when fewer than 16 are left or they are not consecutive.
inline const uint16_t* contiguous_tile(const uint16_t* const* key, int64_t left, int64_t dim) {
  if (left < kKeyTile) {
    return nullptr;
  }
  for (int64_t m = 1; m < kKeyTile; ++m) {
    if (key[m] != key[0] + m * dim) {
      return nullptr;
    }
  }
  return key[0];
}

// Tiles: 0..3 = C, 4 = A, 5..7 = B (multiply_groups); all 16 x 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.set(t, kKeyTile, 64);
  }
  cfg.load();
}

// C tiles 0..NG-1 = 16 keys (kb) x 16 rows each of NG consecutive row groups from row r0: per
// 32 features one A tile (4) and NG B tiles (5, 6, 7, then 5 again), so NG independent
// TDPBF16PS chains overlap (one C tile's chain alone waits out every product's latency).
// Stored to cbuf[g * 256 + key * 16 + lane].
template <int NG>
void multiply_groups(const uint32_t* qp, int64_t rows, int64_t r0, int64_t q_stride,
                     const uint16_t* kb, size_t row_bytes, int64_t steps, float* cbuf) {
  _tile_zero(0);
  if constexpr (NG > 1) _tile_zero(1);
  if constexpr (NG > 2) _tile_zero(2);
  if constexpr (NG > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, kb + 32 * s, row_bytes);
    const uint32_t* q = qp + (16 * s) * rows + r0;
    _tile_loadd(5, q, q_stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NG > 1) {
      _tile_loadd(6, q + 16, q_stride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NG > 2) {
      _tile_loadd(7, q + 32, q_stride);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NG > 3) {
      _tile_loadd(5, q + 48, q_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (NG > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (NG > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (NG > 3) _tile_stored(3, cbuf + 768, 64);
}

void score(void* ws, const IndexerDims& d, int64_t n, const void* const* keys, float* scores) {
  const PackedQueries L(d);
  const AmxLayout A(d);
  const int64_t nq = *at_offset<int64_t>(ws, L.hdr);
  const int64_t lanes = query_lanes(d);
  const int64_t rows = nq * lanes;
  const int64_t steps = d.dim / 32;
  const uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  const float* w = at_offset<float>(ws, L.w);
  uint16_t* kbuf = at_offset<uint16_t>(ws, A.keys);
  float* cbuf = at_offset<float>(ws, A.c);
  const size_t row_bytes = 2 * static_cast<size_t>(d.dim);
  configure_tiles();
  const int64_t q_stride = 4 * rows;
  const __m512 zero = _mm512_setzero_ps();
  const uint16_t* const* key = reinterpret_cast<const uint16_t* const*>(keys);
  for (int64_t k0 = 0; k0 < n; k0 += kKeyTile) {
    prefetch_keys(key + k0 + kKeyTile, std::min(kKeyTile, n - k0 - kKeyTile), row_bytes);
    prefetch_page_start(key + k0 + 2 * kKeyTile, n - k0 - 2 * kKeyTile, row_bytes);
    const uint16_t* kb = contiguous_tile(key + k0, n - k0, d.dim);
    if (kb == nullptr) {  // keys from several blocks, or fewer than 16: gather them
      const int64_t count = std::min(kKeyTile, n - k0);
      for (int64_t k = 0; k < count; ++k) {
        std::memcpy(kbuf + k * d.dim, key[k0 + k], row_bytes);
      }
      std::memset(kbuf + count * d.dim, 0, (kKeyTile - count) * row_bytes);
      compiler_barrier();
      kb = kbuf;
    }
    for (int64_t i = 0; i < nq; ++i) {
      __m512 sum[kKeyTile];
      for (auto& s : sum) {
        s = zero;
      }
      for (int64_t r = i * lanes; r < (i + 1) * lanes; r += 64) {
        const int64_t groups = std::min<int64_t>(4, ((i + 1) * lanes - r) / 16);
        switch (groups) {
          case 4: multiply_groups<4>(qp, rows, r, q_stride, kb, row_bytes, steps, cbuf); break;
          case 3: multiply_groups<3>(qp, rows, r, q_stride, kb, row_bytes, steps, cbuf); break;
          case 2: multiply_groups<2>(qp, rows, r, q_stride, kb, row_bytes, steps, cbuf); break;
          default: multiply_groups<1>(qp, rows, r, q_stride, kb, row_bytes, steps, cbuf); break;
        }
        compiler_barrier();
        for (int64_t g = 0; g < groups; ++g) {  // the heads in order, as the AVX-512 core
          const __m512 wv = _mm512_loadu_ps(w + r + 16 * g);
          for (int64_t m = 0; m < kKeyTile; ++m) {
            // relu (max_ps returns its second operand for NaN: keep NaN as the reference does)
            const __m512 relu = _mm512_max_ps(zero, _mm512_loadu_ps(cbuf + 256 * g + 16 * m));
            sum[m] = _mm512_fmadd_ps(wv, relu, sum[m]);
          }
        }
      }
      const int64_t valid = std::min(kKeyTile, n - k0);
      const __mmask16 kept = valid >= kKeyTile ? 0xFFFF : (1u << valid) - 1;
      _mm512_mask_storeu_ps(scores + i * kIndexerChunk + k0, kept, reduce_add_16(sum));
    }
  }
}

}  // namespace

bool dsa_indexer_amx_fits(const IndexerDims& d) { return d.dim >= 32 && d.dim % 32 == 0; }

const IndexerOps& dsa_indexer_core_amx() {
  // The packing of q is the AVX-512 core's (dsa_indexer_packed_q.h).
  static const IndexerOps table{&workspace_bytes, dsa_indexer_core_bf16().begin, &score};
  return table;
}

}  // namespace mlafx::avx512

// AMX indexer core (compiled with the AVX-512 and AMX flags; called only after use_amx_bf16(),
// for bf16 and Di a multiple of 32 up to 128, DeepSeek-V3.2's and GLM-5's 128). The scalar
// reference is PortableIndexer in dsa_indexer.cpp.
//
// It takes the AVX-512 BF16 core's packed queries as they lie (its `begin`,
// dsa_indexer_packed_q.h): [pair][16 rows][2] is the AMX B tile layout. A tiles read 16 keys x
// 32 features straight from the cache where the 16 keys are consecutive rows of one block, else
// from a copy (zero rows pad the last tile of a chunk). Per 16 keys the Di / 32 A tiles stay loaded while every 16 rows (query x
// head) of the group multiply into one C tile [16 keys][16 rows] (TDPBF16PS, fp32); then relu,
// times the head weight, summed lane-wise over the query's rows in a fixed order and once
// horizontally, as the AVX-512 core does. A key's score depends on its query and itself alone.
//
// Measured (Xeon with AMX, 2 threads, 5 Dec 2026, `bench/kernels.py --only dsa`: batch 8, 64
// heads x 128, block 64): the indexer at 16k context took 11.8 ms on the AVX-512 core (182
// GFLOP/s: VDPBF16PS-bound, 12% of the read bandwidth), 3.8 ms on this one with the keys
// copied, 3.7 ms reading them in place (38% of the bandwidth: the running top-k takes about a
// third of it); 14.0 ms at 64k.
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
constexpr int64_t kMaxSteps = 4;  // A tiles of 32 features held at once: Di <= 128

// Tile loads are asm statements that do not tell the compiler they read memory: order them
// after the plain stores that filled their source (and the C tile's store before its reads).
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// The AVX-512 core's packed queries, then 16 gathered keys and one C tile.
struct AmxLayout {
  size_t keys, c, total;
  explicit AmxLayout(const IndexerDims& d) {
    WorkspaceCarver carve;
    carve.take(PackedQueries(d).total);
    keys = carve.take(2 * static_cast<size_t>(kKeyTile * d.dim));
    c = carve.take(4 * kKeyTile * 16);
    total = carve.total();
  }
};

size_t workspace_bytes(const IndexerDims& d) { return AmxLayout(d).total; }

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

// Tiles: 0 = C, 1..4 = A (one per 32 features), 5 = B; all 16 x 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t <= 5; ++t) {
    cfg.set(t, kKeyTile, 64);
  }
  // LDTILECFG's builtin does not tell GCC it reads the block: inlined here, the row and
  // width stores were dropped as dead (measured: only the palette byte was written).
  compiler_barrier();
  cfg.load();
}

// C += A(s) x B(s): features [32 s, 32 s + 32) of 16 keys against 16 rows' q pairs.
#define MLAFX_DSA_STEP(A, s)                                                      \
  do {                                                                            \
    _tile_loadd(5, qp + (16 * (s)) * rows + r, q_stride);                         \
    _tile_dpbf16ps(0, A, 5);                                                      \
  } while (0)

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
    _tile_loadd(1, kb, row_bytes);
    if (steps > 1) _tile_loadd(2, kb + 32, row_bytes);
    if (steps > 2) _tile_loadd(3, kb + 64, row_bytes);
    if (steps > 3) _tile_loadd(4, kb + 96, row_bytes);
    for (int64_t i = 0; i < nq; ++i) {
      __m512 sum[kKeyTile];
      for (auto& s : sum) {
        s = zero;
      }
      for (int64_t r = i * lanes; r < (i + 1) * lanes; r += 16) {
        _tile_zero(0);
        MLAFX_DSA_STEP(1, 0);
        if (steps > 1) MLAFX_DSA_STEP(2, 1);
        if (steps > 2) MLAFX_DSA_STEP(3, 2);
        if (steps > 3) MLAFX_DSA_STEP(4, 3);
        _tile_stored(0, cbuf, 64);
        compiler_barrier();
        const __m512 wv = _mm512_loadu_ps(w + r);
        for (int64_t m = 0; m < kKeyTile; ++m) {
          // relu (max_ps returns its second operand for NaN: keep NaN as the reference does)
          const __m512 relu = _mm512_max_ps(zero, _mm512_loadu_ps(cbuf + 16 * m));
          sum[m] = _mm512_fmadd_ps(wv, relu, sum[m]);
        }
      }
      const int64_t valid = std::min(kKeyTile, n - k0);
      for (int64_t m = 0; m < valid; ++m) {
        scores[i * kIndexerChunk + k0 + m] = _mm512_reduce_add_ps(sum[m]);
      }
    }
  }
}

#undef MLAFX_DSA_STEP

}  // namespace

bool dsa_indexer_amx_fits(const IndexerDims& d) {
  return d.dim % 32 == 0 && d.dim / 32 >= 1 && d.dim / 32 <= kMaxSteps;
}

const IndexerOps& dsa_indexer_core_amx() {
  // The packing of q is the AVX-512 core's (dsa_indexer_packed_q.h).
  static const IndexerOps table{&workspace_bytes, dsa_indexer_core_bf16().begin, &score};
  return table;
}

}  // namespace mlafx::avx512

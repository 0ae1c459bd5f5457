// AMX BF16 attention core (compiled with the AVX-512 and AMX flags from setup.py). Called only
// when mlafx::use_amx_bf16() and attention_core_amx_supports(dims); otherwise the AVX-512 core
// (attention_avx512.cpp) or the scalar reference (PortableCore in attention.cpp) runs.
//
// Both products run on the tile unit; every tile is 16 rows x 64 bytes (16 x 32 bf16 inputs or
// 16 x 16 fp32 accumulators), so one tile configuration serves the whole core.
//   - q.k: S^T[key, row] += K[key, 32 features] . Qp[16 feature pairs, row]. The A tile is 16
//     cached rows loaded straight from the cache (one row per key, the row stride as the tile
//     stride): keys are never copied or packed. Q is packed once per group into pairs
//     ([pair][row], the tile unit's "VNNI" B layout).
//   - softmax: vertical over keys with the rows in fp32 lanes, as in the AVX-512 core, with a
//     lazy running max (the max used for exp moves only when a score exceeds it by more than
//     2^8, so the output is rescaled a few times per group instead of once per block; the
//     result is the same up to rounding, since sum and output share whichever max was used).
//   - P.V: O[row, 2n] += P[row, key] . V[key, 2n] and O[row, 2n+1] likewise, with V read
//     straight from the cache as the B tile (16 keys x 32 features, pairs of adjacent
//     features). The B layout pairs adjacent *features*, not keys, so P enters as two A tiles:
//     P in the low half of each 32-bit pair and zero in the high half (even features), and
//     the reverse (odd features). That wastes half the tile unit's multiplies but needs no
//     repacking of V: the kernel is memory-bound by a wide margin, so reading the cache once
//     and never writing a copy of it is what counts. The output accumulator holds each 32
//     features as [16 even | 16 odd] and is put back in order once, at the end.
//   P is kept to fp32 accuracy: a high and a low bf16 part (p = hi + lo to 2^-17 relative)
//     enter as their own A tiles, so P.V uses the fp32 weights the softmax sum adds up.
// Batch-invariant mode has its own twin of this core (attention_core_bf16_amx_pairs, the
// kPairs instantiations): each block's values are staged once in key pairs (the B layout with
// keys paired: 16 pairs x 16 features a tile), so P enters as plain [row, key] A tiles (hi and
// lo) and P.V takes half the tile products, with the accumulators loaded and stored once per
// block and 16 features. The staging costs decode ~11% (memory-bound, every block staged for
// one row tile) and saves prefill ~13% (compute-bound, several row tiles per block); a row's
// arithmetic depends on its own values alone in both cores.
// The next block's rows are prefetched into L2 while this one computes, a slice per q.k chunk
// (see CoreOps::prefetch): tile loads of cold rows keep few cache misses in flight, which
// left decode at a third of the memory bandwidth when the cache was not already in L3.
// Partial key sub-tiles (fewer than 16 keys, or keys whose rows are not evenly spaced, e.g. a
// block size below 16) are copied into a zero-padded staging tile first.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amx_tiles.h"
#include "attention.h"
#include "attention_avx512_math.h"
#include "attention_prefetch.h"
#include "transpose_avx512.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "attention_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::CoreOps;
using mlafx::attn::kBlockKeys;
using mlafx::attn::kMaxRows;

constexpr int64_t kTileRows = 16;                       // keys (or rows) per tile
constexpr int64_t kSubTiles = kBlockKeys / kTileRows;   // key sub-tiles per block
constexpr int64_t kRowTiles = kMaxRows / kTileRows;     // query-row tiles per group
constexpr int64_t kTileBytes = 1024;
// The lazy max: exp2(score - max) may reach 2^kMaxGrowth before the max is moved.
constexpr float kMaxGrowth = 8.f;

static_assert(kBlockKeys % kTileRows == 0 && kMaxRows % kTileRows == 0);

// 8 tiles of 16 rows x 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.set(t, kTileRows, 64);
  }
  cfg.load();
}

struct Layout {
  int64_t pa, pb;  // feature pairs in segments a and b
  int64_t ca, cb;  // 32-feature chunks in segments a and b
  int64_t dv, wk;  // value width; key width wa + wb
  size_t hdr, qp, lim, s, pe, po, pel, pol, o, m, l, alpha, stage_k, stage_v, vp, pf, total;
  explicit Layout(const CoreDims& d)
      : pa(d.wa / 2), pb(d.wb / 2), ca(d.wa / 32), cb(d.wb / 32), dv(d.dv), wk(d.wa + d.wb) {
    WorkspaceCarver carve;
    hdr = carve.take(64);
    qp = carve.take(4 * static_cast<size_t>(pa + pb) * kMaxRows);
    lim = carve.take(4 * kMaxRows);
    s = carve.take(4 * kBlockKeys * kMaxRows);
    pe = carve.take(kTileBytes * kRowTiles * kSubTiles);
    po = carve.take(kTileBytes * kRowTiles * kSubTiles);
    pel = carve.take(kTileBytes * kRowTiles * kSubTiles);
    pol = carve.take(kTileBytes * kRowTiles * kSubTiles);
    o = carve.take(4 * kMaxRows * static_cast<size_t>(dv));
    m = carve.take(4 * kMaxRows);
    l = carve.take(4 * kMaxRows);
    alpha = carve.take(4 * kMaxRows);
    stage_k = carve.take(2 * kBlockKeys * static_cast<size_t>(wk));
    stage_v = carve.take(2 * kBlockKeys * static_cast<size_t>(dv));
    vp = carve.take(2 * kBlockKeys * static_cast<size_t>(dv));
    pf = carve.take(sizeof(PrefetchList));
    total = carve.total();
  }
};

struct Header {
  int64_t rows;  // G
  int64_t gp;    // G rounded up to 16
  int64_t rt;    // row tiles, gp / 16
};

// Where the tile loads of one key sub-tile read: segment a, segment b and the value rows,
// each as a base address and a row stride in bytes.
struct TileSource {
  const char* a;
  int64_t sa;
  const char* b;
  int64_t sb;
  const char* v;
  int64_t sv;
};

// True iff the 16 rows are evenly spaced at a positive stride (*stride, bytes).
inline bool evenly_spaced(const void* const* rows, int64_t* stride) {
  const char* first = static_cast<const char*>(rows[0]);
  const int64_t step = static_cast<const char*>(rows[1]) - first;
  if (step <= 0) {
    return false;
  }
  for (int64_t r = 2; r < kTileRows; ++r) {
    if (static_cast<const char*>(rows[r]) - first != r * step) {
      return false;
    }
  }
  *stride = step;
  return true;
}

TileSource tile_source(void* ws, const Layout& L, int64_t sub, int64_t count,
                       const void* const* ka, const void* const* kb, const void* const* v) {
  TileSource src{};
  if (count == kTileRows && evenly_spaced(ka, &src.sa) &&
      (L.pb == 0 || evenly_spaced(kb, &src.sb)) && evenly_spaced(v, &src.sv)) {
    src.a = static_cast<const char*>(ka[0]);
    src.b = L.pb == 0 ? nullptr : static_cast<const char*>(kb[0]);
    src.v = static_cast<const char*>(v[0]);
    return src;
  }
  // Staging: the rows this sub-tile has, then zeros (zero keys and values contribute nothing;
  // their scores are masked anyway).
  char* k_rows = at_offset<char>(ws, L.stage_k) + sub * kTileRows * 2 * L.wk;
  char* v_rows = at_offset<char>(ws, L.stage_v) + sub * kTileRows * 2 * L.dv;
  const size_t a_bytes = 2 * static_cast<size_t>(L.pa) * 2;
  const size_t b_bytes = 2 * static_cast<size_t>(L.pb) * 2;
  const size_t v_bytes = 2 * static_cast<size_t>(L.dv);
  for (int64_t r = 0; r < kTileRows; ++r) {
    char* k_row = k_rows + r * 2 * L.wk;
    char* v_row = v_rows + r * 2 * L.dv;
    if (r < count) {
      std::memcpy(k_row, ka[r], a_bytes);
      if (b_bytes > 0) {
        std::memcpy(k_row + a_bytes, kb[r], b_bytes);
      }
      std::memcpy(v_row, v[r], v_bytes);
    } else {
      std::memset(k_row, 0, a_bytes + b_bytes);
      std::memset(v_row, 0, v_bytes);
    }
  }
  src.a = k_rows;
  src.sa = 2 * L.wk;
  src.b = k_rows + a_bytes;
  src.sb = 2 * L.wk;
  src.v = v_rows;
  src.sv = 2 * L.dv;
  compiler_barrier();
  return src;
}

// ---- q.k on tiles: S^T for NSUB key sub-tiles, every row tile --------------------------------
//
// Tiles: 0..3 accumulators (one per key sub-tile), 4 the packed Q chunk, 5..7 key chunks.

#define MLAFX_QK_SUB(C, A, SRC, OFF, STRIDE) \
  do {                                       \
    _tile_loadd(A, (SRC) + (OFF), STRIDE);   \
    _tile_dpbf16ps(C, A, 4);                 \
  } while (0)

template <int NSUB>
void qk_tiles(const Layout& L, const Header& h, const uint32_t* qp, float* s,
              const TileSource* src, PrefetchList* pf) {
  const int64_t gp = h.gp;
  const int64_t qstride = 4 * gp;
  // The next block's prefetches, spread evenly over this block's q.k chunks.
  const int64_t chunks = h.rt * (L.ca + L.cb);
  const int64_t per_chunk = (pf->total + chunks - 1) / chunks;
  for (int64_t r = 0; r < h.rt; ++r) {
    _tile_zero(0);
    if constexpr (NSUB > 1) _tile_zero(1);
    if constexpr (NSUB > 2) _tile_zero(2);
    if constexpr (NSUB > 3) _tile_zero(3);
    for (int64_t c = 0; c < L.ca; ++c) {
      pf->issue(per_chunk);
      _tile_loadd(4, qp + (16 * c) * gp + 16 * r, qstride);
      const int64_t off = 64 * c;
      MLAFX_QK_SUB(0, 5, src[0].a, off, src[0].sa);
      if constexpr (NSUB > 1) MLAFX_QK_SUB(1, 6, src[1].a, off, src[1].sa);
      if constexpr (NSUB > 2) MLAFX_QK_SUB(2, 7, src[2].a, off, src[2].sa);
      if constexpr (NSUB > 3) MLAFX_QK_SUB(3, 5, src[3].a, off, src[3].sa);
    }
    for (int64_t c = 0; c < L.cb; ++c) {
      pf->issue(per_chunk);
      _tile_loadd(4, qp + (L.pa + 16 * c) * gp + 16 * r, qstride);
      const int64_t off = 64 * c;
      MLAFX_QK_SUB(0, 5, src[0].b, off, src[0].sb);
      if constexpr (NSUB > 1) MLAFX_QK_SUB(1, 6, src[1].b, off, src[1].sb);
      if constexpr (NSUB > 2) MLAFX_QK_SUB(2, 7, src[2].b, off, src[2].sb);
      if constexpr (NSUB > 3) MLAFX_QK_SUB(3, 5, src[3].b, off, src[3].sb);
    }
    float* sr = s + 16 * r;
    _tile_stored(0, sr, qstride);
    if constexpr (NSUB > 1) _tile_stored(1, sr + 16 * gp, qstride);
    if constexpr (NSUB > 2) _tile_stored(2, sr + 32 * gp, qstride);
    if constexpr (NSUB > 3) _tile_stored(3, sr + 48 * gp, qstride);
  }
}

#undef MLAFX_QK_SUB

// ---- softmax: vertical over keys; P written as the two zero-interleaved A tiles ---------------

// Scores of keys 0..n-1 (raw q.k in s) -> scaled, masked, exponentiated against the running
// max; returns true if some row's max moved (alpha != 1 somewhere).
// bf16 bits of p (16 rows' values of one key) and of its remainder p - hi, each in the low
// half of a 32-bit lane.
inline void split_hi_lo(__m512 p, __m512i* hi_bits, __m512i* lo_bits) {
  const __m256bh hi = _mm512_cvtneps_pbh(p);
  const __m512 lo = _mm512_sub_ps(p, _mm512_cvtpbh_ps(hi));
  *hi_bits = _mm512_cvtepu16_epi32((__m256i)hi);
  *lo_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
}

template <bool kPairs>
bool softmax_block(void* ws, const Layout& L, const Header& h, int64_t j0, int64_t n,
                   float scale_log2) {
  const int64_t gp = h.gp;
  float* s = at_offset<float>(ws, L.s);
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  float* m = at_offset<float>(ws, L.m);
  float* l = at_offset<float>(ws, L.l);
  float* alpha = at_offset<float>(ws, L.alpha);
  uint32_t* pe = at_offset<uint32_t>(ws, L.pe);
  uint32_t* po = at_offset<uint32_t>(ws, L.po);
  uint32_t* pel = at_offset<uint32_t>(ws, L.pel);
  uint32_t* pol = at_offset<uint32_t>(ws, L.pol);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(scale_log2);
  const int64_t nsub = (n + kTileRows - 1) / kTileRows;
  bool moved = false;
  for (int64_t r = 0; r < h.rt; ++r) {
    const int64_t v = 16 * r;
    const __m512i limit = _mm512_loadu_si512(lim + v);
    // Scale and mask in place; block max per row.
    __m512 mx = neg_inf;
    for (int64_t k = 0; k < n; ++k) {
      const __mmask16 visible =
          _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(static_cast<int>(j0 + k)));
      const __m512 x = _mm512_mask_mul_ps(neg_inf, visible, _mm512_loadu_ps(s + k * gp + v), scale);
      _mm512_storeu_ps(s + k * gp + v, x);
      mx = _mm512_max_ps(x, mx);  // a NaN score propagates via p
    }
    const __m512 m_old = _mm512_loadu_ps(m + v);
    const __mmask16 grow =
        _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(kMaxGrowth)), _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_blend_ps(grow, m_old, mx);
    // Rows with no visible key yet keep max -inf: subtract 0 so p = 2^-inf = 0, not NaN.
    const __m512 shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                                              m_new, _mm512_setzero_ps());
    const __m512 a = _mm512_mask_blend_ps(grow, _mm512_set1_ps(1.f),
                                          exp2_ps(_mm512_sub_ps(m_old, shift)));
    moved = moved || grow != 0;
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l + v), a);
    if constexpr (kPairs) {
      // A tiles of P over 32 keys (16 pairs): lane g of pair i = keys 2i (low) and 2i + 1.
      for (int64_t half = 0; half < (n + 31) / 32; ++half) {
        __m512i cols[16];
        __m512i lows[16];
        for (int64_t i = 0; i < 16; ++i) {
          __m512i hi2[2], lo2[2];
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t key = 32 * half + 2 * i + j;
            __m512 p = _mm512_setzero_ps();
            if (key < n) {
              p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + key * gp + v), shift));
              sum = _mm512_add_ps(sum, p);
            }
            split_hi_lo(p, &hi2[j], &lo2[j]);
          }
          cols[i] = _mm512_or_si512(hi2[0], _mm512_slli_epi32(hi2[1], 16));
          lows[i] = _mm512_or_si512(lo2[0], _mm512_slli_epi32(lo2[1], 16));
        }
        transpose_16x16_epi32(cols);  // cols[g] = row g: its 16 pairs of keys
        transpose_16x16_epi32(lows);
        const int64_t at = (r * kSubTiles + half) * (kTileBytes / 4);
        for (int g = 0; g < 16; ++g) {
          _mm512_storeu_si512(pe + at + 16 * g, cols[g]);
          _mm512_storeu_si512(pel + at + 16 * g, lows[g]);
        }
      }
      _mm512_storeu_ps(l + v, sum);
      _mm512_storeu_ps(m + v, m_new);
      _mm512_storeu_ps(alpha + v, a);
      continue;
    }
    for (int64_t sub = 0; sub < nsub; ++sub) {
      __m512i cols[16];
      __m512i lows[16];
      for (int64_t k = 0; k < kTileRows; ++k) {
        const int64_t key = sub * kTileRows + k;
        __m512 p = _mm512_setzero_ps();
        if (key < n) {
          p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + key * gp + v), shift));
          sum = _mm512_add_ps(sum, p);
        }
        split_hi_lo(p, &cols[k], &lows[k]);
      }
      transpose_16x16_epi32(cols);  // cols[g] = row g: its 16 keys
      transpose_16x16_epi32(lows);
      const int64_t at = (r * kSubTiles + sub) * (kTileBytes / 4);
      for (int g = 0; g < 16; ++g) {
        _mm512_storeu_si512(pe + at + 16 * g, cols[g]);
        _mm512_storeu_si512(po + at + 16 * g, _mm512_slli_epi32(cols[g], 16));
        _mm512_storeu_si512(pel + at + 16 * g, lows[g]);
        _mm512_storeu_si512(pol + at + 16 * g, _mm512_slli_epi32(lows[g], 16));
      }
    }
    _mm512_storeu_ps(l + v, sum);
    _mm512_storeu_ps(m + v, m_new);
    _mm512_storeu_ps(alpha + v, a);
  }
  return moved;
}

// O[row, :] *= alpha[row] for rows whose max moved.
void rescale_output(void* ws, const Layout& L, const Header& h) {
  const float* alpha = at_offset<float>(ws, L.alpha);
  float* o = at_offset<float>(ws, L.o);
  for (int64_t g = 0; g < h.gp; ++g) {
    if (alpha[g] == 1.f) {
      continue;
    }
    const __m512 a = _mm512_set1_ps(alpha[g]);
    float* row = o + g * L.dv;
    for (int64_t d = 0; d < L.dv; d += 16) {
      _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), a));
    }
  }
}

// ---- P.V on tiles ------------------------------------------------------------------------------
//
// Per key sub-tile: tiles 2/3 hold the even/odd A tiles of P's high part, 4/5 those of its low
// part, 6 the value chunk, 0/1 the even/odd accumulators of one 32-feature chunk.

void pv_sub_tile(const uint32_t* pe, const uint32_t* po, const uint32_t* pel,
                 const uint32_t* pol, float* o, int64_t dv, const TileSource& a) {
  const int64_t ostride = 4 * dv;
  _tile_loadd(2, pe, 64);
  _tile_loadd(3, po, 64);
  _tile_loadd(4, pel, 64);
  _tile_loadd(5, pol, 64);
  for (int64_t c = 0; c < dv / 32; ++c) {
    _tile_loadd(0, o + 32 * c, ostride);
    _tile_loadd(1, o + 32 * c + 16, ostride);
    _tile_loadd(6, a.v + 64 * c, a.sv);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_stored(0, o + 32 * c, ostride);
    _tile_stored(1, o + 32 * c + 16, ostride);
  }
}

void pv_tiles(void* ws, const Layout& L, const Header& h, int64_t nsub, const TileSource* src) {
  constexpr int64_t kTileWords = kTileBytes / 4;
  compiler_barrier();
  for (int64_t r = 0; r < h.rt; ++r) {
    const int64_t base = r * kSubTiles * kTileWords;
    const uint32_t* pe = at_offset<uint32_t>(ws, L.pe) + base;
    const uint32_t* po = at_offset<uint32_t>(ws, L.po) + base;
    const uint32_t* pel = at_offset<uint32_t>(ws, L.pel) + base;
    const uint32_t* pol = at_offset<uint32_t>(ws, L.pol) + base;
    float* o = at_offset<float>(ws, L.o) + 16 * r * L.dv;
    for (int64_t sub = 0; sub < nsub; ++sub) {
      const int64_t off = sub * kTileWords;
      pv_sub_tile(pe + off, po + off, pel + off, pol + off, o, L.dv, src[sub]);
    }
  }
}

// ---- P.V on tiles, V in key pairs (the batch-invariant core) ---------------------------------
//
// The block's values staged once in the B layout: half h (keys 32h..32h+31), feature tile t
// (16 features) at (h * dv / 16 + t) * 512 elements, pair p's row = the 16 features of keys
// 32h + 2p and 32h + 2p + 1 side by side; keys past n are zeros.
void stage_value_pairs(void* ws, const Layout& L, int64_t n, const void* const* v) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  uint16_t* vp = at_offset<uint16_t>(ws, L.vp);
  const int64_t tiles = L.dv / 16;
  for (int64_t key = 0; key < (n + 31) / 32 * 32; key += 2) {
    const int64_t half = key / 32, p = key % 32 / 2;
    const uint16_t* r0 = key < n ? static_cast<const uint16_t*>(v[key]) : nullptr;
    const uint16_t* r1 = key + 1 < n ? static_cast<const uint16_t*>(v[key + 1]) : nullptr;
    uint16_t* dst = vp + half * tiles * 512 + 32 * p;
    for (int64_t f = 0; f < L.dv; f += 32) {
      const __m512i even = r0 != nullptr ? _mm512_loadu_si512(r0 + f) : _mm512_setzero_si512();
      const __m512i odd = r1 != nullptr ? _mm512_loadu_si512(r1 + f) : _mm512_setzero_si512();
      _mm512_store_si512(dst + f / 16 * 512, _mm512_permutex2var_epi16(even, low, odd));
      _mm512_store_si512(dst + f / 16 * 512 + 512, _mm512_permutex2var_epi16(even, high, odd));
    }
  }
  compiler_barrier();
}

// O[rows of tile r, :] += P_hi . V + P_lo . V over the block's halves, two 16-feature tiles
// at a time. Tiles: 0/1 accumulators, 2/3 P's high/low part of half 0, 4/5 of half 1, 6/7
// value tiles.
void pv_pairs(void* ws, const Layout& L, const Header& h, int64_t n) {
  constexpr int64_t kTileWords = kTileBytes / 4;
  const int64_t halves = (n + 31) / 32;
  const int64_t tiles = L.dv / 16;
  const uint16_t* vp = at_offset<uint16_t>(ws, L.vp);
  const int64_t ostride = 4 * L.dv;
  for (int64_t r = 0; r < h.rt; ++r) {
    const uint32_t* pe = at_offset<uint32_t>(ws, L.pe) + r * kSubTiles * kTileWords;
    const uint32_t* pel = at_offset<uint32_t>(ws, L.pel) + r * kSubTiles * kTileWords;
    float* o = at_offset<float>(ws, L.o) + 16 * r * L.dv;
    _tile_loadd(2, pe, 64);
    _tile_loadd(3, pel, 64);
    if (halves > 1) {
      _tile_loadd(4, pe + kTileWords, 64);
      _tile_loadd(5, pel + kTileWords, 64);
    }
    for (int64_t t = 0; t < tiles; t += 2) {
      _tile_loadd(0, o + 16 * t, ostride);
      _tile_loadd(1, o + 16 * t + 16, ostride);
      _tile_loadd(6, vp + t * 512, 64);
      _tile_loadd(7, vp + (t + 1) * 512, 64);
      _tile_dpbf16ps(0, 2, 6);
      _tile_dpbf16ps(0, 3, 6);
      _tile_dpbf16ps(1, 2, 7);
      _tile_dpbf16ps(1, 3, 7);
      if (halves > 1) {
        _tile_loadd(6, vp + (tiles + t) * 512, 64);
        _tile_loadd(7, vp + (tiles + t + 1) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(1, 5, 7);
      }
      _tile_stored(0, o + 16 * t, ostride);
      _tile_stored(1, o + 16 * t + 16, ostride);
    }
  }
}

// ---- the CoreOps entry points ---------------------------------------------------------------

size_t workspace_bytes(const CoreDims& d) { return Layout(d).total; }

void begin(void* ws, const CoreDims& d, int64_t num_rows, const void* const* q_rows,
           const int64_t* limits) {
  // Per thread and per group: anything else on this thread (oneDNN) may have reconfigured.
  configure_tiles();
  const Layout L(d);
  Header* h = at_offset<Header>(ws, L.hdr);
  h->rows = num_rows;
  h->gp = round_up16(num_rows);
  h->rt = h->gp / 16;
  const int64_t gp = h->gp;
  uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  int32_t* lim = at_offset<int32_t>(ws, L.lim);
  // Pack Q as [pair][row]: 16 x 16 transposes of 32-bit pairs, once per group (the pair
  // count is a multiple of 16: both segments' widths are multiples of 32).
  for (int64_t r0 = 0; r0 < gp; r0 += 16) {
    for (int64_t kp0 = 0; kp0 < L.pa + L.pb; kp0 += 16) {
      __m512i cols[16];
      for (int64_t i = 0; i < 16; ++i) {
        cols[i] = r0 + i < num_rows
                      ? _mm512_loadu_si512(static_cast<const uint16_t*>(q_rows[r0 + i]) + 2 * kp0)
                      : _mm512_setzero_si512();
      }
      transpose_16x16_epi32(cols);  // cols[i] = pair kp0 + i of the 16 rows
      for (int64_t i = 0; i < 16; ++i) {
        _mm512_storeu_si512(qp + (kp0 + i) * gp + r0, cols[i]);
      }
    }
  }
  for (int64_t g = 0; g < gp; ++g) {
    // Limits beyond int32 are clamped: no key list is that long.
    lim[g] = g >= num_rows ? 0
                           : static_cast<int32_t>(limits[g] < INT32_MAX ? limits[g] : INT32_MAX);
  }
  std::memset(at_offset<float>(ws, L.o), 0, sizeof(float) * gp * L.dv);
  PrefetchList* pf = at_offset<PrefetchList>(ws, L.pf);
  pf->clear();
  float* m = at_offset<float>(ws, L.m);
  float* l = at_offset<float>(ws, L.l);
  for (int64_t g = 0; g < gp; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  compiler_barrier();
}

template <bool kPairs>
void block(void* ws, const CoreDims& d, int64_t j0, int64_t n, const void* const* ka,
           const void* const* kb, const void* const* v) {
  const Layout L(d);
  const Header& h = *at_offset<Header>(ws, L.hdr);
  const int64_t nsub = (n + kTileRows - 1) / kTileRows;
  TileSource src[kSubTiles];
  for (int64_t sub = 0; sub < nsub; ++sub) {
    const int64_t k0 = sub * kTileRows;
    src[sub] = tile_source(ws, L, sub, std::min(kTileRows, n - k0), ka + k0,
                           kb != nullptr ? kb + k0 : nullptr, v + k0);
  }
  const uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  float* s = at_offset<float>(ws, L.s);
  PrefetchList* pf = at_offset<PrefetchList>(ws, L.pf);
  switch (nsub) {
    case 1: qk_tiles<1>(L, h, qp, s, src, pf); break;
    case 2: qk_tiles<2>(L, h, qp, s, src, pf); break;
    case 3: qk_tiles<3>(L, h, qp, s, src, pf); break;
    default: qk_tiles<4>(L, h, qp, s, src, pf); break;
  }
  pf->issue(pf->total);  // whatever the chunks left
  pf->clear();
  if (softmax_block<kPairs>(ws, L, h, j0, n, d.scale * kLog2e)) {
    rescale_output(ws, L, h);
  }
  if constexpr (kPairs) {
    stage_value_pairs(ws, L, n, v);
    pv_pairs(ws, L, h, n);
  } else {
    pv_tiles(ws, L, h, nsub, src);
  }
}

void prefetch(void* ws, const CoreDims& d, int64_t n, const void* const* ka,
              const void* const* kb, const void* const* v) {
  at_offset<PrefetchList>(ws, Layout(d).pf)->set_block(d, n, ka, kb, v);
}

template <bool kPairs>
void end(void* ws, const CoreDims& d, void* const* out_rows, float* const* out_f32_rows,
         float* const* lse_ptrs) {
  _tile_release();
  const Layout L(d);
  const Header* h = at_offset<Header>(ws, L.hdr);
  const float* o = at_offset<float>(ws, L.o);
  const float* m = at_offset<float>(ws, L.m);
  const float* l = at_offset<float>(ws, L.l);
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  // [16 even | 16 odd] -> features in order.
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t g = 0; g < h->rows; ++g) {
    const bool empty = lim[g] <= 0;
    *lse_ptrs[g] = empty ? -std::numeric_limits<float>::infinity()
                         : (m[g] + std::log2(l[g])) * kLn2;
    // An empty row is written as exact zeros: its O may hold 0 * NaN from another row's keys.
    const __m512 inv = _mm512_set1_ps(empty ? 0.f : 1.f / l[g]);
    const float* row = o + g * L.dv;
    for (int64_t c = 0; c < L.dv / 32; ++c) {
      const __m512 even = _mm512_loadu_ps(row + 32 * c);
      const __m512 odd = _mm512_loadu_ps(row + 32 * c + 16);
      // (the key-pair core keeps features in order)
      __m512 x0 = _mm512_mul_ps(kPairs ? even : _mm512_permutex2var_ps(even, lo, odd), inv);
      __m512 x1 = _mm512_mul_ps(kPairs ? odd : _mm512_permutex2var_ps(even, hi, odd), inv);
      if (empty) {
        x0 = _mm512_setzero_ps();
        x1 = _mm512_setzero_ps();
      }
      if (out_rows != nullptr) {
        uint16_t* dst = static_cast<uint16_t*>(out_rows[g]) + 32 * c;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                            (__m256i)_mm512_cvtneps_pbh(x1));
      } else {
        float* dst = out_f32_rows[g] + 32 * c;
        _mm512_storeu_ps(dst, x0);
        _mm512_storeu_ps(dst + 16, x1);
      }
    }
  }
}

}  // namespace

bool attention_core_amx_supports(const CoreDims& dims) {
  return dims.wa > 0 && dims.wa % 32 == 0 && dims.wb % 32 == 0 && dims.dv > 0 &&
         dims.dv % 32 == 0;
}

const mlafx::attn::CoreOps& attention_core_bf16_amx() {
  static const CoreOps table{&workspace_bytes, &begin, &block<false>, &end<false>, &prefetch};
  return table;
}

const mlafx::attn::CoreOps& attention_core_bf16_amx_pairs() {
  static const CoreOps table{&workspace_bytes, &begin, &block<true>, &end<true>, &prefetch};
  return table;
}

}  // namespace mlafx::avx512

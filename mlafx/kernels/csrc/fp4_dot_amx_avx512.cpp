// fp4_dot (fp4.h) for bf16 rows of x on the AMX-BF16 tile unit (compiled with the AVX-512 and
// AMX flags from setup.py; called only when fp4_uses_amx(M), for rows staged by
// fp4_stage_tiles).
//
// As the block FP8 tile kernel (fp8_dot_amx_avx512.cpp): the weight's rows are the A tiles (16
// weight rows x 32 k) and x's rows, staged once per op call, the B tiles (16 k pairs x 16 rows of
// x), C = 16 weight rows x 16 rows of x in fp32. Each tile of 16 weight rows is decoded a panel
// of columns at a time into a bf16 staging area that stays in L1, 128 weights (64 bytes) a
// load as fp4_avx512.h decodes them (vector j holding elements 4i + j; x's tiles are staged in
// the same column order); each group's scale is folded into its bf16 weights (e2m1 *
// 2^(s - 127) is exact in bf16: 2 significant bits, fp32's exponent range; for 2 <= s <= 252
// an add to the exponent field of the nonzero values), so a panel's products need no scaling:
// C tiles per panel and 16 rows of x, added into fp32 totals. The result differs from the
// other kernels only in the fp32 summation order.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "bf16_avx512.h"
#include "block_dot_avx512.h"
#include "fp4.h"
#include "fp4_avx512.h"
#include "scratch_buffer.h"
#include "transpose_avx512.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "fp4_dot_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kTileK = 32;              // k per tile product (16 pairs): one FP4 group
constexpr int64_t kTileRows = 16;           // weight rows per A tile, rows of x per B tile
constexpr int64_t kTileElements = 16 * 32;  // bf16 elements of one staged tile (1 KB)
constexpr int64_t kPanelColumns = 512;      // weight columns decoded at a time
constexpr int64_t kRowsPerPass = 256;       // rows of x per pass over the weights

// 32-column tiles of K padded to whole 128-weight chunks
int64_t chunks_of(int64_t K) { return (K + kFp4Chunk - 1) / kFp4Chunk * (kFp4Chunk / kTileK); }

// Tiles: 0-3 accumulators (16 weight rows x 16 rows of x, fp32: two rows-of-x blocks, each
// summing even and odd chunks apart so that consecutive products do not wait on each other),
// 4 the weight rows (16 x 32 bf16), 5-6 x's rows (16 pairs x 16 rows).
void configure() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.set(t, kTileRows, 64);
  cfg.load();
}

// 128 weights (64 bytes, zeros past `bytes`) of one row, scaled by its 4 groups' ue8m0 bytes
// (`scale`, `groups` of them left in the row; missing ones 1.0) into out[32 j + i] = weight
// 4 i + j, exact bf16.
inline void decode_chunk(const __m512i table, const uint8_t* src, int64_t bytes,
                         const uint8_t* scale, int64_t groups, uint16_t* out) {
  const __m512i packed = load_chunk(src, bytes);
  uint8_t s[4] = {127, 127, 127, 127};
  for (int64_t g = 0; g < std::min<int64_t>(groups, 4); ++g) s[g] = scale[g];
  const bool normal = s[0] - 2u <= 250u && s[1] - 2u <= 250u && s[2] - 2u <= 250u &&
                      s[3] - 2u <= 250u;
  __m512i shift = _mm512_setzero_si512();
  if (__builtin_expect(normal, 1)) {  // lane i of each vector is in group i / 8
    uint64_t packed_shifts = 0;
    for (int g = 0; g < 4; ++g) {
      packed_shifts |= uint64_t{static_cast<uint16_t>((s[g] - 127) * 128)} << (16 * g);
    }
    const __m512i spread = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1,
                                            1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i shifts = _mm512_set1_epi64(static_cast<int64_t>(packed_shifts));
    shift = _mm512_permutexvar_epi16(spread, shifts);
  }
  const __m512i values[4] = {chunk_values<0>(packed, table), chunk_values<1>(packed, table),
                             chunk_values<2>(packed, table), chunk_values<3>(packed, table)};
  for (int j = 0; j < 4; ++j) {
    __m512i v = values[j];
    if (__builtin_expect(normal, 1)) {
      v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), v, shift);
    } else {  // through fp32: subnormal, overflowing or NaN scales
      const float* f = ue8m0_table();
      const __m512 lo_scale = _mm512_set_ps(f[s[1]], f[s[1]], f[s[1]], f[s[1]], f[s[1]], f[s[1]],
                                            f[s[1]], f[s[1]], f[s[0]], f[s[0]], f[s[0]], f[s[0]],
                                            f[s[0]], f[s[0]], f[s[0]], f[s[0]]);
      const __m512 hi_scale = _mm512_set_ps(
          f[s[3]], f[s[3]], f[s[3]], f[s[3]], f[s[3]], f[s[3]], f[s[3]], f[s[3]], f[s[2]], f[s[2]],
          f[s[2]], f[s[2]], f[s[2]], f[s[2]], f[s[2]], f[s[2]]);
      const __m256i lo = fp32_to_bf16_rne(_mm512_mul_ps(bf16_low_to_f32(v), lo_scale));
      const __m256i hi = fp32_to_bf16_rne(_mm512_mul_ps(bf16_high_to_f32(v), hi_scale));
      v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    _mm512_store_si512(out + 32 * j, v);
  }
}

// Columns [k0, k1) (multiples of 128) of weight rows n..n+rows-1 decoded and scaled into
// `staging` (16 rows of `ld` bf16, zeros past K), each row's next panel (or, at the last, the
// next tile's first) prefetched to L2 as it goes.
void decode_panel(const Fp4Weight& W, int64_t n, int64_t rows, int64_t k0, int64_t k1,
                  uint16_t* staging, int64_t ld) {
  const __m512i table = e2m1_table32();
  const int64_t groups = (W.K + kTileK - 1) / kTileK;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = W.w + (n + r) * W.ldw;
    const uint8_t* scale = W.scale + (n + r) * W.lds;
    uint16_t* dst = staging + r * ld - k0;
    const uint8_t* next = k1 < W.K ? src + k1 / 2 : src + kTileRows * W.ldw;
    for (int64_t k = k0; k < k1; k += kFp4Chunk) {
      _mm_prefetch(reinterpret_cast<const char*>(next + (k - k0) / 2), _MM_HINT_T1);
      decode_chunk(table, src + k / 2, std::max<int64_t>(0, (W.K - k) / 2), scale + k / kTileK,
                   std::max<int64_t>(0, groups - k / kTileK), dst + k);
    }
  }
}

// totals[mb][r][j] += the panel's products of weight row r and row 16 mb + j of x, for every
// 16 rows of x (mb), two blocks of rows of x a pass; the staging holds columns [k0, k1).
void multiply_panel(int64_t K, int64_t k0, int64_t k1, const uint16_t* staging, int64_t ld,
                    const uint16_t* tiles, int64_t M, int64_t rows, float* totals) {
  const int64_t chunks = chunks_of(K);
  const int64_t m_blocks = (M + kTileRows - 1) / kTileRows;
  alignas(64) float sums[4][kTileRows * kTileRows];
  for (int64_t mb = 0; mb < m_blocks; mb += 2) {
    const bool pair = mb + 1 < m_blocks;
    const uint16_t* x0 = tiles + mb * chunks * kTileElements;
    const uint16_t* x1 = x0 + chunks * kTileElements;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = k0; k < k1; k += kTileK) {
      const int64_t c = k / kTileK;
      _tile_loadd(4, staging + (k - k0), ld * 2);
      _tile_loadd(5, x0 + c * kTileElements, 64);
      if (c % 2 == 0) {
        _tile_dpbf16ps(0, 4, 5);
      } else {
        _tile_dpbf16ps(1, 4, 5);
      }
      if (pair) {
        _tile_loadd(6, x1 + c * kTileElements, 64);
        if (c % 2 == 0) {
          _tile_dpbf16ps(2, 4, 6);
        } else {
          _tile_dpbf16ps(3, 4, 6);
        }
      }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (pair) {
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
    }
    compiler_barrier();
    for (int64_t b = 0; b < (pair ? 2 : 1); ++b) {
      float* total = totals + (mb + b) * kTileRows * kTileRows;
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums[2 * b] + r * kTileRows),
                                         _mm512_load_ps(sums[2 * b + 1] + r * kTileRows));
        _mm512_store_ps(total + r * kTileRows,
                        _mm512_add_ps(_mm512_load_ps(total + r * kTileRows), sum));
      }
    }
  }
}

void dot_tiles(const Fp4Weight& W, const uint16_t* tiles, int64_t M, int64_t n0, int64_t n1,
               float* out, int64_t ldo) {
  const int64_t k_end = chunks_of(W.K) * kTileK;
  const int64_t panel = std::min(kPanelColumns, k_end);
  const int64_t ld = (panel * 2) % 4096 == 0 ? panel + 32 : panel;  // rows not 4 KB apart
  const int64_t m_blocks = (M + kTileRows - 1) / kTileRows;
  ScratchVector<uint16_t> staging(static_cast<size_t>(kTileRows * ld));
  ScratchVector<float> totals(static_cast<size_t>(m_blocks * kTileRows * kTileRows));
  configure();
  for (int64_t n = n0; n < n1; n += kTileRows) {
    const int64_t rows = std::min(kTileRows, n1 - n);
    std::fill(staging.begin() + rows * ld, staging.end(), uint16_t{0});  // rows past N
    std::fill(totals.begin(), totals.end(), 0.0f);
    for (int64_t k0 = 0; k0 < k_end; k0 += panel) {
      const int64_t k1 = std::min(k0 + panel, k_end);
      decode_panel(W, n, rows, k0, k1, staging.data(), ld);
      compiler_barrier();  // the staging's stores before the tile loads
      multiply_panel(W.K, k0, k1, staging.data(), ld, tiles, M, rows, totals.data());
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* total = totals.data() + (m / kTileRows) * kTileRows * kTileRows + m % kTileRows;
      for (int64_t r = 0; r < rows; ++r) out[m * ldo + n - n0 + r] = total[r * kTileRows];
    }
  }
  _tile_release();
}

}  // namespace

int64_t fp4_tile_elements(int64_t M, int64_t K) {
  return (M + kTileRows - 1) / kTileRows * chunks_of(K) * kTileElements;
}

void fp4_stage_tiles(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, uint16_t* tiles) {
  const int64_t chunks = chunks_of(K);
  const int64_t ldp = fp4_staged_ld(K);  // >= chunks * 32, the few-rows kernel's order
  ScratchVector<uint16_t> permuted(static_cast<size_t>(kTileRows * ldp));
  for (int64_t mb = 0; mb * kTileRows < M; ++mb) {
    const int64_t rows = std::min(kTileRows, M - mb * kTileRows);
    fp4_stage_rows(x + mb * kTileRows * ldx, ldx, K, rows, permuted.data());
    uint16_t* block = tiles + mb * chunks * kTileElements;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i pairs[16];  // row j's 16 column pairs of the tile, then transposed: pair p's rows
      for (int64_t j = 0; j < kTileRows; ++j) {
        pairs[j] = j < rows ? _mm512_load_si512(permuted.data() + j * ldp + c * kTileK)
                            : _mm512_setzero_si512();
      }
      transpose_16x16_epi32(pairs);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(block + c * kTileElements + p * 32, pairs[p]);
    }
  }
}

void fp4_dot_amx(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  // a pass over the weight rows per kRowsPerPass rows of x, whose staged tiles then stay in L2
  const int64_t chunks = chunks_of(W.K);
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    dot_tiles(W, x.tiles + (m0 / kTileRows) * chunks * kTileElements,
              std::min(kRowsPerPass, M - m0), n0, n1, out + m0 * ldo, ldo);
  }
}

}  // namespace mlafx::avx512

// fp8_dot (fp8.h) for bf16 rows of x on the AMX-BF16 tile unit (compiled with the AVX-512 and
// AMX flags from setup.py; called only when mlafx::use_amx_bf16() and use_avx512_vbmi(), for
// rows staged by fp8_stage_tiles and block_k a multiple of 64).
//
// The roles are those of a GEMM of W by x^T: the weight's rows are the A tiles (16 weight rows x
// 32 k, row-major as stored once the bytes are decoded) and x's rows, staged once per op call,
// the B tiles (16 k pairs x 16 rows of x), so C = 16 weight rows x 16 rows of x in fp32 and the
// weight needs no transposing. Each tile of 16 weight rows is decoded (the VBMI byte tables,
// fp8_vbmi_avx512.h) a panel of columns at a time into a bf16 staging area that stays in L1, in
// the decoder's column order, which the staged x follows. Per k block and 16 rows of x, the block's
// products are summed in one C tile (TDPBF16PS: exact products, fp32 sums; bf16 subnormals of x
// count as zero, as in VDPBF16PS), stored, and added into fp32 totals times each weight row's
// block scale: one scaling per block, as the other kernels do, so the result differs from them
// only in the fp32 summation order.
//
// Why: from a few rows of x the VDPBF16PS kernels are bound by the products (one instruction
// per 32 weights and row): 8 rows read the weight at 8.9 GB/s, 32 rows at 1.8; from 64 rows the
// weight went to fp32 for at::mm (~300 GFLOP/s). On tiles (Xeon, 2 threads, 6 Dec 2026,
// bench.kernels --only fp8_gemm): q_proj 2048 -> 3072 at 8 rows 0.418 against 0.710 ms, 32 rows
// 0.559 against 3.59, 1024 rows 13.9 against 42.9 ms (925 GFLOP/s).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "bf16_avx512.h"
#include "fp8.h"
#include "fp8_vbmi_avx512.h"
#include "scratch_buffer.h"
#include "transpose_avx512.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "fp8_dot_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kTileK = 32;               // k per tile product (16 pairs)
constexpr int64_t kTileRows = 16;            // weight rows per A tile, rows of x per B tile
constexpr int64_t kTileElements = 16 * 32;   // bf16 elements of one staged tile (1 KB)
constexpr int64_t kPanelColumns = 256;       // weight columns decoded at a time (whole blocks)
constexpr int64_t kRowsPerPass = 256;        // rows of x per pass over the weights (16 x n)

int64_t padded_k(int64_t K) { return (K + 63) / 64 * 64; }

// Tiles: 0 the accumulator (16 weight rows x 16 rows of x, fp32), 1 the weight rows (16 x 32
// bf16), 2 x's rows (16 pairs x 16 rows).
void configure() {
  TileConfig cfg;
  cfg.set(0, kTileRows, 64);
  cfg.set(1, kTileRows, 64);
  cfg.set(2, kTileRows, 64);
  cfg.load();
}

// A tile of weight rows n..n+rows-1 decoded a panel of columns at a time into a staging area of
// 16 rows of `ld` bf16 (the panel's columns in the decoder's order, zeros past K).
struct WeightTile {
  int64_t n = 0;
  int64_t rows = 0;
  uint16_t* staging = nullptr;
  int64_t ld = 0;
  const float* scale[kTileRows] = {};  // each row's block scales
};

// Columns [k0, k1) of the tile's rows decoded (k0 a multiple of 64), each row's next panel
// (or, at the last, the next tile's first) prefetched to L2 as it goes: one prefetch per line,
// a panel ahead, so the 16 short streams keep enough lines in flight.
MLAFX_VBMI void decode_panel(const Fp8Weight& W, const Decoder& dec, const WeightTile& t,
                             int64_t k0, int64_t k1, int64_t panel) {
  const int64_t k_end = (W.K + panel - 1) / panel * panel;
  for (int64_t r = 0; r < t.rows; ++r) {
    const uint8_t* src = W.w + (t.n + r) * W.ldw;
    uint16_t* dst = t.staging + r * t.ld - k0;
    for (int64_t k = k0; k < k1; k += 64) {
      const int64_t ahead = k + panel;
      const uint8_t* next = ahead < W.K ? src + ahead : src + kTileRows * W.ldw + (ahead - k_end);
      _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
      __m512i a, b;
      dec.decode(_mm512_maskz_loadu_epi8(tail_mask64(W.K - k), src + k), &a, &b);
      _mm512_store_si512(dst + k, a);
      _mm512_store_si512(dst + k + 32, b);
    }
  }
}

// totals[mb][r][j] += scale of row r's block kb * (the block's products of weight row r and
// row 16 mb + j of x), for every 16 rows of x (mb); the staging holds columns from k0 on.
void multiply_block(const Fp8Weight& W, int64_t kb, int64_t k0, const WeightTile& t,
                    const uint16_t* tiles, int64_t M, float* totals) {
  const int64_t chunks = padded_k(W.K) / kTileK;
  const int64_t c0 = kb * (W.block_k / kTileK);
  const int64_t c1 = std::min(chunks, c0 + W.block_k / kTileK);
  const uint16_t* staging = t.staging - k0;
  alignas(64) float sums[kTileRows * kTileRows];
  for (int64_t mb = 0; mb * kTileRows < M; ++mb) {
    const uint16_t* x_tiles = tiles + mb * chunks * kTileElements;
    _tile_zero(0);
    for (int64_t c = c0; c < c1; ++c) {
      _tile_loadd(1, staging + c * kTileK, t.ld * 2);
      _tile_loadd(2, x_tiles + c * kTileElements, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, sums, 64);
    compiler_barrier();
    float* total = totals + mb * kTileRows * kTileRows;
    for (int64_t r = 0; r < t.rows; ++r) {
      const __m512 sum = _mm512_load_ps(total + r * kTileRows);
      _mm512_store_ps(total + r * kTileRows,
                      _mm512_fmadd_ps(_mm512_load_ps(sums + r * kTileRows),
                                      _mm512_set1_ps(t.scale[r][kb]), sum));
    }
  }
}

// Tile after tile of 16 weight rows, each a panel of columns at a time: the panel's 16 rows
// decoded (16 x panel bf16 stay in L1), then its k blocks multiplied. Decoding a whole tile
// first (one forward stream, 64 KB of bf16 at K = 2048) and then multiplying it ran at 10
// against the 17 GB/s of one row of x: the memory idled during the products, and the tile
// loads came from L2.
MLAFX_VBMI void dot_tiles(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0,
                          int64_t n1, float* out, int64_t ldo) {
  const int64_t panel = std::max<int64_t>(1, kPanelColumns / W.block_k) * W.block_k;
  const int64_t ld = (panel * 2) % 4096 == 0 ? panel + 32 : panel;  // rows not 4 KB apart
  const int64_t m_blocks = (M + kTileRows - 1) / kTileRows;
  ScratchVector<uint16_t> staging(static_cast<size_t>(kTileRows * ld));
  ScratchVector<float> totals(static_cast<size_t>(m_blocks * kTileRows * kTileRows));
  const Decoder dec(byte_tables());
  configure();
  WeightTile t;
  t.staging = staging.data();
  t.ld = ld;
  for (t.n = n0; t.n < n1; t.n += kTileRows) {
    t.rows = std::min(kTileRows, n1 - t.n);
    for (int64_t r = 0; r < t.rows; ++r) t.scale[r] = W.scale + ((t.n + r) / W.block_n) * W.lds;
    std::fill(staging.begin() + t.rows * ld, staging.end(), uint16_t{0});  // rows past N
    std::fill(totals.begin(), totals.end(), 0.0f);
    for (int64_t k0 = 0; k0 < W.K; k0 += panel) {
      decode_panel(W, dec, t, k0, std::min(k0 + panel, padded_k(W.K)), panel);
      compiler_barrier();  // the staging's stores before the tile loads
      for (int64_t kb = k0 / W.block_k; kb * W.block_k < std::min(W.K, k0 + panel); ++kb) {
        multiply_block(W, kb, k0, t, x.tiles, M, totals.data());
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* total = totals.data() + (m / kTileRows) * kTileRows * kTileRows + m % kTileRows;
      for (int64_t r = 0; r < t.rows; ++r) out[m * ldo + t.n - n0 + r] = total[r * kTileRows];
    }
  }
  _tile_release();
}

}  // namespace

int64_t fp8_tile_elements(int64_t M, int64_t K) {
  return (M + kTileRows - 1) / kTileRows * (padded_k(K) / kTileK) * kTileElements;
}

void fp8_stage_tiles(const uint16_t* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1,
                     uint16_t* tiles) {
  const int64_t chunks = padded_k(K) / kTileK;
  // the 16 pairs of a 64-column chunk's A half (columns 0..7, 16..23, ...: pair p at column
  // (p / 4) * 16 + (p % 4) * 2) as 32-bit lanes of [x0 | x1]; the B half is 4 lanes on
  const __m512i half_a = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i half_b = _mm512_add_epi32(half_a, _mm512_set1_epi32(4));
  for (int64_t mb = m0 / kTileRows; mb * kTileRows < m1; ++mb) {
    const int64_t rows = std::min(kTileRows, m1 - mb * kTileRows);
    uint16_t* block = tiles + mb * chunks * kTileElements;
    for (int64_t k = 0; k < chunks * kTileK; k += 64) {
      __m512i a[16], b[16];
      for (int64_t j = 0; j < kTileRows; ++j) {
        if (j >= rows) {
          a[j] = b[j] = _mm512_setzero_si512();
          continue;
        }
        const uint16_t* row = x + (mb * kTileRows + j) * ldx + k;
        const __mmask32 low = first_lanes32(std::max<int64_t>(K - k, 0));
        const __mmask32 high = first_lanes32(std::max<int64_t>(K - k - 32, 0));
        const __m512i x0 = _mm512_maskz_loadu_epi16(low, row);
        const __m512i x1 = _mm512_maskz_loadu_epi16(high, row + 32);
        a[j] = _mm512_permutex2var_epi32(x0, half_a, x1);
        b[j] = _mm512_permutex2var_epi32(x0, half_b, x1);
      }
      transpose_16x16_epi32(a);
      transpose_16x16_epi32(b);
      uint16_t* tile_a = block + (k / kTileK) * kTileElements;
      for (int p = 0; p < 16; ++p) {
        _mm512_store_si512(tile_a + p * 32, a[p]);
        _mm512_store_si512(tile_a + kTileElements + p * 32, b[p]);
      }
    }
  }
}

void fp8_dot_amx(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  // Many rows of x: a pass over the weight rows per kRowsPerPass of them, so that their staged
  // tiles (1 MB at K = 2048) stay in L2 while every weight tile is multiplied by them; the
  // weight is decoded once per pass. At 1024 rows one pass took 17.2 ms for q_proj (2048 ->
  // 3072, 2 threads, Xeon, 6 Dec 2026), four 12.3 ms (1044 GFLOP/s).
  const int64_t chunks = padded_k(W.K) / kTileK;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    Fp8Rows rows = x;
    rows.tiles = x.tiles + (m0 / kTileRows) * chunks * kTileElements;
    dot_tiles(W, rows, std::min(kRowsPerPass, M - m0), n0, n1, out + m0 * ldo, ldo);
  }
}

}  // namespace mlafx::avx512

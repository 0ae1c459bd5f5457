// The AVX-512 kernels of fp8_dot (fp8.h): e4m3 bytes widened to bf16 in registers, 32 at a
// time, then VDPBF16PS against bf16 activations (exact products, fp32 sums) or two fp32 FMAs
// against fp32 activations. Each k block's 16-lane partial sums are scaled by the block's
// scale once (one FMA per block) and reduced across lanes once per output.
//
// Register tiles: MR rows of x by NR rows of W share each converted weight vector and each
// loaded activation vector. Few rows of x (decode) take several weight rows at once for
// independent accumulator chains. Staged rows go to the AMX tiles or the pairs GEMM
// (fp8_pairs_avx512.cpp); more than 8 unstaged rows (batch-invariant mode without VBMI's
// kernel) convert a tile of weight rows to a bf16 scratch once and reuse it for every group of
// 8 rows of x.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "bf16_avx512.h"
#include "block_dot_avx512.h"
#include "cpu_features.h"
#include "fp8.h"
#include "fp8_bf16_avx512.h"
#include "fp8_vbmi_avx512.h"

namespace mlafx::avx512 {
namespace {

// The weight rows of one tile: e4m3 bytes, or bf16 already converted (kConverted).
template <int NR, bool kConverted>
struct WeightRows {
  const uint8_t* fp8[NR];
  const uint16_t* bf16[NR];
  const float* scales[NR];

  float scale(int r, int64_t kb) const { return scales[r][kb]; }
  __m512i load(int r, int64_t k, __mmask32 mask) const {
    if constexpr (kConverted) {
      return _mm512_maskz_loadu_epi16(mask, bf16[r] + k);
    } else {
      return e4m3_to_bf16(_mm256_maskz_loadu_epi8(mask, fp8[r] + k));
    }
  }
};

template <int NR, bool kConverted>
WeightRows<NR, kConverted> rows_at(const Fp8Weight& W, int64_t n, const uint16_t* converted,
                                   int64_t ldc) {
  WeightRows<NR, kConverted> rows{};
  for (int r = 0; r < NR; ++r) {
    rows.fp8[r] = W.w + (n + r) * W.ldw;
    rows.bf16[r] = converted == nullptr ? nullptr : converted + r * ldc;
    rows.scales[r] = W.scale + ((n + r) / W.block_n) * W.lds;
  }
  return rows;
}

// Rows [m0, m0 + MR) of x against weight rows [n0, n1), NR at a time, then one at a time.
template <int MR, int NR>
void rows_direct_bf16(const Fp8Weight& W, const uint16_t* x, int64_t ldx, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    tile_bf16<MR, NR>(rows_at<NR, false>(W, n, nullptr, 0), W.K, W.block_k, x, ldx,
                      out + n - n0, ldo);
  }
  for (; n < n1; ++n) {
    tile_bf16<MR, 1>(rows_at<1, false>(W, n, nullptr, 0), W.K, W.block_k, x, ldx,
                     out + n - n0, ldo);
  }
}

template <int MR, int NR>
void rows_direct_f32(const Fp8Weight& W, const float* x, int64_t ldx, int64_t n0, int64_t n1,
                     float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    tile_f32<MR, NR>(rows_at<NR, false>(W, n, nullptr, 0), W.K, W.block_k, x, ldx,
                     out + n - n0, ldo);
  }
  for (; n < n1; ++n) {
    tile_f32<MR, 1>(rows_at<1, false>(W, n, nullptr, 0), W.K, W.block_k, x, ldx,
                    out + n - n0, ldo);
  }
}

// M <= 8 rows of x, the tile shape chosen at run time.
void rows_bf16_few(int64_t mr, const Fp8Weight& W, const uint16_t* x, int64_t ldx, int64_t n0,
                     int64_t n1, float* out, int64_t ldo) {
  switch (mr) {
    case 1: return rows_direct_bf16<1, 4>(W, x, ldx, n0, n1, out, ldo);
    case 2: return rows_direct_bf16<2, 4>(W, x, ldx, n0, n1, out, ldo);
    case 3: return rows_direct_bf16<3, 2>(W, x, ldx, n0, n1, out, ldo);
    case 4: return rows_direct_bf16<4, 2>(W, x, ldx, n0, n1, out, ldo);
    case 5: return rows_direct_bf16<5, 1>(W, x, ldx, n0, n1, out, ldo);
    case 6: return rows_direct_bf16<6, 1>(W, x, ldx, n0, n1, out, ldo);
    case 7: return rows_direct_bf16<7, 1>(W, x, ldx, n0, n1, out, ldo);
    default: return rows_direct_bf16<8, 1>(W, x, ldx, n0, n1, out, ldo);
  }
}

template <int MR>
void converted_tile(const Fp8Weight& W, const WeightRows<1, true>& rows, const uint16_t* x,
                    int64_t ldx, float* out, int64_t ldo) {
  tile_bf16<MR, 1>(rows, W.K, W.block_k, x, ldx, out, ldo);
}

constexpr int64_t kTileRows = 16;  // weight rows converted to bf16 at once (M > 8)

struct AlignedBuffer {
  explicit AlignedBuffer(size_t count)
      : ptr(static_cast<uint16_t*>(std::aligned_alloc(64, (count * 2 + 63) / 64 * 64))) {}
  ~AlignedBuffer() { std::free(ptr); }
  AlignedBuffer(AlignedBuffer&& other) noexcept : ptr(other.ptr) { other.ptr = nullptr; }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint16_t* data() const { return ptr; }
  uint16_t* ptr;
};

// x rows [M, K] -> bf16 chunk by chunk: the M rows' 64 columns of chunk c at
// (c * M + m) * 64, each as A then B, zero past K. One pointer and constant offsets reach every
// row of a chunk (8 row pointers spilled general registers in the 8-row tile).
MLAFX_VBMI AlignedBuffer chunked_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t chunks = (K + 63) / 64;
  AlignedBuffer out(static_cast<size_t>(chunks * M * 64));
  // A: 0..7 | 16..23 | 32..39 | 48..55, B: 8..15 | ... (indices into [x0 | x1], 64 columns)
  alignas(64) uint16_t ia[32], ib[32];
  for (int j = 0; j < 32; ++j) {
    ia[j] = static_cast<uint16_t>((j / 8) * 16 + j % 8);
    ib[j] = static_cast<uint16_t>(ia[j] + 8);
  }
  const __m512i idx_a = _mm512_load_si512(ia), idx_b = _mm512_load_si512(ib);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k = c * 64;
    const __mmask32 m0 = first_lanes32(K - k);
    const __mmask32 m1 = k + 32 < K ? first_lanes32(K - k - 32) : 0;
    for (int64_t m = 0; m < M; ++m) {
      const __m512i x0 = _mm512_maskz_loadu_epi16(m0, x + m * ldx + k);
      const __m512i x1 = _mm512_maskz_loadu_epi16(m1, x + m * ldx + k + 32);
      uint16_t* dst = out.data() + (c * M + m) * 64;
      _mm512_store_si512(dst, _mm512_permutex2var_epi16(x0, idx_a, x1));
      _mm512_store_si512(dst + 32, _mm512_permutex2var_epi16(x0, idx_b, x1));
    }
  }
  return out;
}

// Prefetch distance of the VBMI tiles, in weight rows ahead of the tile: at least the next
// tile's rows and at least kPrefetchBytes ahead, so a tile of one or two 2 KB rows still asks
// for its lines a memory latency before it needs them.
constexpr int64_t kPrefetchBytes = 8192;

template <int NR>
int64_t prefetch_rows(int64_t ldw) {
  return std::max<int64_t>(NR, (kPrefetchBytes + ldw - 1) / std::max<int64_t>(ldw, 1));
}

// One 64-column chunk of a VBMI tile: NR weight rows decoded once, then each row of x loaded
// once for all NR of them (the A columns, then the B columns, into the same accumulator).
// Zen 4 (7 Dec 2026; C loops from L1, TSC ticks per 64 weights) runs these products about
// twice as fast when each 64-byte x load feeds two or more VDPBF16PS: 8 rows of x took 24-30
// ticks with one weight row and the A and B columns summed apart, 14 with two weight rows
// sharing each x load.
template <int MR, int NR, bool kMasked>
MLAFX_VBMI inline void chunk_vbmi(const Decoder& dec, const uint8_t* const* w, int64_t pf,
                                  int64_t k, __mmask64 mask, const uint16_t* xp,
                                  __m512 (&acc)[MR][NR]) {
  __m512i wa[NR], wb[NR];
  for (int r = 0; r < NR; ++r) {
    // Into L2, the line `pf` bytes on: the hardware prefetchers stop at every 4 KB page (as
    // gemm_avx512.cpp's prefetch_next_group). A prefetch into L1 holds one of the core's few
    // fill buffers for the whole memory latency, and those capped one row of x (8 tokens'
    // experts, 2 threads, Xeon, 6 Dec 2026) at 15 against 17.7 GB/s.
    _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T1);
    const __m512i bytes = kMasked ? _mm512_maskz_loadu_epi8(mask, w[r] + k)
                                  : _mm512_loadu_si512(w[r] + k);
    dec.decode(bytes, &wa[r], &wb[r]);
  }
  const uint16_t* xc = xp + k * MR;  // chunk k / 64 of chunked_rows
  for (int m = 0; m < MR; ++m) {
    const __m512bh xa = (__m512bh)_mm512_load_si512(xc + m * 64);
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)wa[r], xa);
    const __m512bh xb = (__m512bh)_mm512_load_si512(xc + m * 64 + 32);
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)wb[r], xb);
  }
}

// total[m][r] = MR rows of x times weight rows n + r, r < NR: per k block the 16-lane sums,
// scaled once into totals kept in registers. Each lane takes its chunks' A and B products in
// one order whatever MR and NR, so a row's result does not depend on the other rows of x
// (batch-invariant mode relies on it). kBlock: DeepSeek's block_k of 128 known at compile time
// (two chunks a block, unrolled), else 0 (W.block_k).
template <int MR, int NR, int kBlock>
MLAFX_VBMI __attribute__((always_inline)) inline void tile_sums(const Fp8Weight& W,
                                                                const Decoder& dec, int64_t n,
                                                                int64_t pf, const uint16_t* xp,
                                                                __m512 (&total)[MR][NR]) {
  const int64_t block_k = kBlock != 0 ? kBlock : W.block_k;
  const uint8_t* w[NR];
  const float* scale[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = W.w + (n + r) * W.ldw;
    scale[r] = W.scale + ((n + r) / W.block_n) * W.lds;
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) total[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += block_k, ++kb) {
    const int64_t k1 = std::min(W.K, k0 + block_k);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    }
    if (k1 - k0 == block_k) {  // a whole block: whole chunks
      for (int64_t k = k0; k < k0 + block_k; k += 64) {
        chunk_vbmi<MR, NR, false>(dec, w, pf, k, 0, xp, acc);
      }
    } else {  // the last block, cut short by K
      for (int64_t k = k0; k < k1; k += 64) {
        chunk_vbmi<MR, NR, true>(dec, w, pf, k, tail_mask64(k1 - k), xp, acc);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_set1_ps(scale[r][kb]);
      for (int m = 0; m < MR; ++m) total[m][r] = _mm512_fmadd_ps(acc[m][r], s, total[m][r]);
    }
  }
}

// The tile's sums reduced across lanes into out[m * ldo + r].
template <int MR, int NR, int kBlock>
MLAFX_VBMI void tile_vbmi(const Fp8Weight& W, const Decoder& dec, int64_t n, int64_t pf,
                          const uint16_t* xp, float* out, int64_t ldo) {
  __m512 total[MR][NR];
  tile_sums<MR, NR, kBlock>(W, dec, n, pf, xp, total);
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = _mm512_reduce_add_ps(total[m][r]);
  }
}

// The tile's 16-lane sums into held[r][m], reduced later.
template <int MR, int NR, int kBlock>
MLAFX_VBMI void tile_vbmi_held(const Fp8Weight& W, const Decoder& dec, int64_t n, int64_t pf,
                               const uint16_t* xp, __m512 (*held)[MR]) {
  __m512 total[MR][NR];
  tile_sums<MR, NR, kBlock>(W, dec, n, pf, xp, total);
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) held[r][m] = total[m][r];
  }
}

// Weight rows per pass of the 5-8 row tiles: their 16-lane sums are held in a buffer and
// reduced across lanes after the pass. Reduced at the end of each tile, as the 1-4 row tiles
// are, GCC 12 spilled the 8-row tile's registers (39 against 31 cycles per 64 weights on Zen
// 4, 7 Dec 2026); held for the 1-4 row tiles, one row of x over 6 experts ran 1.3x slower.
constexpr int64_t kPassRows = 16;

template <int MR, int NR, int kBlock>
MLAFX_VBMI void rows_vbmi_block(const Fp8Weight& W, const Decoder& dec, const uint16_t* xp,
                                int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t pf = prefetch_rows<NR>(W.ldw) * W.ldw;
  if constexpr (MR <= 4) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
      tile_vbmi<MR, NR, kBlock>(W, dec, n, pf, xp, out + n - n0, ldo);
    }
    for (; n < n1; ++n) tile_vbmi<MR, 1, kBlock>(W, dec, n, pf, xp, out + n - n0, ldo);
  } else {
    for (int64_t c0 = n0; c0 < n1; c0 += kPassRows) {
      const int64_t c1 = std::min(n1, c0 + kPassRows);
      __m512 held[kPassRows][MR];
      int64_t n = c0;
      for (; n + NR <= c1; n += NR) {
        tile_vbmi_held<MR, NR, kBlock>(W, dec, n, pf, xp, held + (n - c0));
      }
      for (; n < c1; ++n) tile_vbmi_held<MR, 1, kBlock>(W, dec, n, pf, xp, held + (n - c0));
      for (n = c0; n < c1; ++n) {
        for (int m = 0; m < MR; ++m) out[m * ldo + n - n0] = _mm512_reduce_add_ps(held[n - c0][m]);
      }
    }
  }
}

template <int MR, int NR>
MLAFX_VBMI void rows_vbmi(const Fp8Weight& W, const Decoder& dec, const uint16_t* xp, int64_t n0,
                          int64_t n1, float* out, int64_t ldo) {
  if (W.block_k == 128) {
    rows_vbmi_block<MR, NR, 128>(W, dec, xp, n0, n1, out, ldo);
  } else {
    rows_vbmi_block<MR, NR, 0>(W, dec, xp, n0, n1, out, ldo);
  }
}

// M <= 8 rows of x.
MLAFX_VBMI void fp8_dot_vbmi(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0,
                             int64_t n1, float* out, int64_t ldo) {
  const AlignedBuffer xp = chunked_rows(x.bf16, x.ld, M, W.K);
  const Decoder dec(byte_tables());
  const uint16_t* p = xp.data();
  switch (M) {
    case 1: return rows_vbmi<1, 4>(W, dec, p, n0, n1, out, ldo);
    case 2: return rows_vbmi<2, 4>(W, dec, p, n0, n1, out, ldo);
    case 3: return rows_vbmi<3, 4>(W, dec, p, n0, n1, out, ldo);
    case 4: return rows_vbmi<4, 2>(W, dec, p, n0, n1, out, ldo);
    case 5: return rows_vbmi<5, 2>(W, dec, p, n0, n1, out, ldo);
    case 6: return rows_vbmi<6, 2>(W, dec, p, n0, n1, out, ldo);
    case 7: return rows_vbmi<7, 2>(W, dec, p, n0, n1, out, ldo);
    default: return rows_vbmi<8, 2>(W, dec, p, n0, n1, out, ldo);
  }
}

}  // namespace

void fp8_dot_bf16(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                  float* out, int64_t ldo) {
  if (x.tiles != nullptr) {
    if (fp8_tiles_are_amx(W.block_k)) {
      fp8_dot_amx(W, x, M, n0, n1, out, ldo);
    } else {
      fp8_dot_pairs(W, x, M, n0, n1, out, ldo);
    }
    return;
  }
  if (M <= 8 && W.block_k % 64 == 0 && use_avx512_vbmi()) {
    fp8_dot_vbmi(W, x, M, n0, n1, out, ldo);
    return;
  }
  if (M <= 8) {
    rows_bf16_few(M, W, x.bf16, x.ld, n0, n1, out, ldo);
    return;
  }
  // 64-byte aligned rows, a whole number of lines apart but not 4 KB apart
  const int64_t kpad = widened_ld(W.K);
  AlignedBuffer converted(static_cast<size_t>(kTileRows * kpad));
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
    const int64_t t1 = std::min(n1, t0 + kTileRows);
    for (int64_t n = t0; n < t1; ++n) {
      widen_row(W.w + n * W.ldw, W.K, converted.data() + (n - t0) * kpad);
    }
    for (int64_t n = t0; n < t1; ++n) {
      const WeightRows<1, true> rows = rows_at<1, true>(W, n, converted.data() + (n - t0) * kpad, 0);
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        converted_tile<8>(W, rows, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
      for (; m < M; ++m) {
        converted_tile<1>(W, rows, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
    }
  }
}

void fp8_dequantize(const Fp8Weight& W, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const float* scale = W.scale + (n / W.block_n) * W.lds;
    float* dst = out + (n - n0) * W.K;
    for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += W.block_k, ++kb) {
      const int64_t k1 = std::min(W.K, k0 + W.block_k);
      const __m512 s = _mm512_set1_ps(scale[kb]);
      for (int64_t k = k0; k < k1; k += 32) {
        const __mmask32 mask = first_lanes32(k1 - k);
        const __m512i v = e4m3_to_bf16(_mm256_maskz_loadu_epi8(mask, row + k));
        _mm512_mask_storeu_ps(dst + k, static_cast<__mmask16>(mask),
                              _mm512_mul_ps(bf16_low_to_f32(v), s));
        _mm512_mask_storeu_ps(dst + k + 16, static_cast<__mmask16>(mask >> 16),
                              _mm512_mul_ps(bf16_high_to_f32(v), s));
      }
    }
  }
}

void fp8_dot_f32(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    rows_direct_f32<4, 1>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
  for (; m < M; ++m) {
    rows_direct_f32<1, 4>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
}

}  // namespace mlafx::avx512

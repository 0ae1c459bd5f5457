// The AVX-512 kernels of fp4_dot (fp4.h): e2m1 nibbles widened to bf16 in registers, 32 at a
// time, then VDPBF16PS against bf16 activations (exact products, fp32 sums) or two fp32 FMAs
// against fp32 activations, in the register tiles of block_dot_avx512.h with blocks of 32
// columns (one ue8m0 scale each, applied once per group by one FMA).
//
// Few rows of x (decode, M <= 8; the bytes are the limit): 128 weights (64 bytes) at a time, as
// fp4_avx512.h decodes them: 4 VPERMW lookups and 3 shifts, vector j holding elements 4i + j
// of the chunk (i = 0..31). The rows of x are staged in that order once (fp4_stage_rows). VDPBF16PS
// sums lane pairs i = 2l, 2l + 1, both in group l / 4 of the chunk's 4, so one FMA per chunk
// scales the 4 vectors' fp32 sums by [s0 x4, s1 x4, s2 x4, s3 x4] (the 4 scale bytes as fp32
// 2^(s - 127): a broadcast from memory, a byte shuffle and a shift).
//
// More rows go to AMX tiles where the CPU has them (fp4_dot_amx_avx512.cpp); else (and for
// rows whose scales make subnormal weights, which the tiles flush) a tile of weight rows is
// widened to a bf16 scratch once (16 bytes zero-extended to 16 dwords d, (d | d << 12) &
// 0x000F000F puts element 2j in word 2j and 2j + 1 in word 2j + 1, one VPERMW) and reused for
// every group of 8 rows of x in the register tiles of block_dot_avx512.h (from 16 rows of an
// expert the product dequantizes to bf16 for oneDNN's GEMM instead: fp8_linear.cpp). fp32 x
// takes those register tiles too (two FMAs per 32 widened weights).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_avx512.h"
#include "block_dot_avx512.h"
#include "fp4.h"
#include "fp4_avx512.h"
#include "scratch_buffer.h"

namespace mlafx::avx512 {
namespace {

// 32 e2m1 nibbles (16 bytes, low nibble first) -> 32 bf16 (16-bit lanes), in order.
inline __m512i e2m1_to_bf16(__m128i bytes) {
  const __m512i d = _mm512_cvtepu8_epi32(bytes);
  // (d | d << 12) & 0x000F000F
  const __m512i idx =
      _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  return _mm512_permutexvar_epi16(idx, e2m1_table32());  // idx < 16
}

// The bytes holding the valid ones of 32 elements (K is even, so whole bytes).
inline __mmask16 byte_lanes(__mmask32 elements) {
  if (elements == ~__mmask32{0}) {
    return static_cast<__mmask16>(0xFFFF);
  }
  const int bytes = __builtin_popcount(elements) / 2;
  return static_cast<__mmask16>((1u << bytes) - 1u);
}

// The weight rows of one tile: packed nibbles, or bf16 already widened (kConverted, unscaled).
template <int NR, bool kConverted>
struct WeightRows {
  const uint8_t* fp4[NR];
  const uint16_t* bf16[NR];
  const uint8_t* scales[NR];
  const float* ue8m0;

  float scale(int r, int64_t g) const { return ue8m0[scales[r][g]]; }
  __m512i load(int r, int64_t k, __mmask32 mask) const {
    if constexpr (kConverted) {
      return _mm512_maskz_loadu_epi16(mask, bf16[r] + k);
    } else {
      return e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), fp4[r] + k / 2));
    }
  }
};

template <int NR, bool kConverted>
WeightRows<NR, kConverted> rows_at(const Fp4Weight& W, int64_t n, const uint16_t* converted) {
  WeightRows<NR, kConverted> rows{};
  for (int r = 0; r < NR; ++r) {
    rows.fp4[r] = W.w + (n + r) * W.ldw;
    rows.bf16[r] = converted;
    rows.scales[r] = W.scale + (n + r) * W.lds;
  }
  rows.ue8m0 = ue8m0_table();
  return rows;
}

template <int MR, int NR>
void rows_direct_f32(const Fp4Weight& W, const float* x, int64_t ldx, int64_t n0, int64_t n1,
                     float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    tile_f32<MR, NR>(rows_at<NR, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
  for (; n < n1; ++n) {
    tile_f32<MR, 1>(rows_at<1, false>(W, n, nullptr), W.K, kFp4Group, x, ldx, out + n - n0, ldo);
  }
}

inline bool has_zero_byte(uint32_t v) { return ((v - 0x01010101u) & ~v & 0x80808080u) != 0; }

// The fp32 scales of a chunk's 4 groups, lane l holding group l / 4's: 2^(s - 127) is s << 23
// as float bits but for s = 0 (2^-127, subnormal) and 255 (NaN). `groups` left in the row;
// missing ones get 1.0 (their products are zero).
inline __m512 chunk_scales(const uint8_t* scale, int64_t groups) {
  uint32_t bytes = 0x7F7F7F7Fu;
  if (__builtin_expect(groups >= 4, 1)) {
    std::memcpy(&bytes, scale, 4);  // one load (a byte-wise copy stalls the dword read)
  } else {
    std::memcpy(&bytes, scale, static_cast<size_t>(groups));
  }
  // byte L of the dword into every dword of 128-bit lane L
  constexpr int kLane0 = static_cast<int>(0xFFFFFF00u), kLane1 = kLane0 | 1,
                kLane2 = kLane0 | 2, kLane3 = kLane0 | 3;  // byte L, then three zeroing indices
  const __m512i spread =
      _mm512_set_epi32(kLane3, kLane3, kLane3, kLane3, kLane2, kLane2, kLane2, kLane2, kLane1,
                       kLane1, kLane1, kLane1, kLane0, kLane0, kLane0, kLane0);
  const __m512i s = _mm512_shuffle_epi8(_mm512_set1_epi32(static_cast<int>(bytes)), spread);
  __m512i bits = _mm512_slli_epi32(s, 23);
  if (__builtin_expect(has_zero_byte(bytes) || has_zero_byte(~bytes), 0)) {
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                                 _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7FC00000));
  }
  return _mm512_castsi512_ps(bits);
}

// out[m * ldo + r] for m < MR, r < NR: weight rows n.. against MR staged rows of x (xp, row
// stride ldp; fp4_stage_rows' order).
template <int MR, int NR>
void chunk_tile(const Fp4Weight& W, int64_t n, const uint16_t* xp, int64_t ldp, float* out,
                int64_t ldo) {
  const __m512i table = e2m1_table32();
  const uint8_t* w[NR];
  const uint8_t* scale[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = W.w + (n + r) * W.ldw;
    scale[r] = W.scale + (n + r) * W.lds;
  }
  const int64_t groups = (W.K + kFp4Group - 1) / kFp4Group;
  __m512 total[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) total[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < W.K; k += kFp4Chunk) {
    for (int r = 0; r < NR; ++r) {
      // the same line of the rows the next tile reads, into L2 (as fp8_dot_avx512.cpp's VBMI
      // tiles): a row is half a 4 KB page or less, and the hardware prefetchers restart at
      // every page
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + NR * W.ldw + k / 2), _MM_HINT_T1);
      const __m512i packed = load_chunk(w[r] + k / 2, (W.K - k) / 2);
      const __m512i v0 = chunk_values<0>(packed, table);
      const __m512i v1 = chunk_values<1>(packed, table);
      const __m512i v2 = chunk_values<2>(packed, table);
      const __m512i v3 = chunk_values<3>(packed, table);
      const __m512 s = chunk_scales(scale[r] + k / kFp4Group, groups - k / kFp4Group);
      for (int m = 0; m < MR; ++m) {
        const uint16_t* xm = xp + m * ldp + k;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_load_si512(xm),
                                    (__m512bh)v0);
        __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_load_si512(xm + 64),
                                    (__m512bh)v2);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_load_si512(xm + 32), (__m512bh)v1);
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_load_si512(xm + 96), (__m512bh)v3);
        total[m][r] = _mm512_fmadd_ps(_mm512_add_ps(a, b), s, total[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = _mm512_reduce_add_ps(total[m][r]);
  }
}

template <int MR, int NR>
void rows_chunked(const Fp4Weight& W, const uint16_t* xp, int64_t ldp, int64_t n0, int64_t n1,
                  float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) chunk_tile<MR, NR>(W, n, xp, ldp, out + n - n0, ldo);
  for (; n < n1; ++n) chunk_tile<MR, 1>(W, n, xp, ldp, out + n - n0, ldo);
}

// M <= 8 staged rows of x, the tile shape chosen at run time.
void rows_few(int64_t M, const Fp4Weight& W, const uint16_t* xp, int64_t ldp, int64_t n0,
              int64_t n1, float* out, int64_t ldo) {
  switch (M) {
    case 1: return rows_chunked<1, 4>(W, xp, ldp, n0, n1, out, ldo);
    case 2: return rows_chunked<2, 4>(W, xp, ldp, n0, n1, out, ldo);
    case 3: return rows_chunked<3, 2>(W, xp, ldp, n0, n1, out, ldo);
    case 4: return rows_chunked<4, 2>(W, xp, ldp, n0, n1, out, ldo);
    case 5: return rows_chunked<5, 1>(W, xp, ldp, n0, n1, out, ldo);
    case 6: return rows_chunked<6, 1>(W, xp, ldp, n0, n1, out, ldo);
    case 7: return rows_chunked<7, 1>(W, xp, ldp, n0, n1, out, ldo);
    default: return rows_chunked<8, 1>(W, xp, ldp, n0, n1, out, ldo);
  }
}

// Row n's K nibbles widened to bf16 (unscaled) at dst.
void widen_row(const Fp4Weight& W, int64_t n, uint16_t* dst) {
  const uint8_t* src = W.w + n * W.ldw;
  for (int64_t k = 0; k < W.K; k += 32) {
    const __mmask32 mask = first_lanes32(W.K - k);
    _mm512_mask_storeu_epi16(dst + k, mask,
                             e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), src + k / 2)));
  }
}

constexpr int64_t kTileRows = 16;  // weight rows widened to bf16 at once (M > 8)

// Whether a scale byte of rows [n0, n1) is 0 or 1 (2^-127, 2^-126: the scaled weights are
// subnormal in bf16). 1/16 of the weight's bytes, read once per call of the tile kernel.
bool has_subnormal_scales(const Fp4Weight& W, int64_t n0, int64_t n1) {
  const int64_t groups = (W.K + kFp4Group - 1) / kFp4Group;
  const __m512i two = _mm512_set1_epi8(2);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* scale = W.scale + n * W.lds;
    for (int64_t g = 0; g < groups; g += 64) {
      const int64_t left = groups - g;
      const __mmask64 mask = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      if (_mm512_mask_cmplt_epu8_mask(mask, _mm512_maskz_loadu_epi8(mask, scale + g), two) != 0) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace

int64_t fp4_staged_ld(int64_t K) {
  int64_t ld = (K + kFp4Chunk - 1) / kFp4Chunk * kFp4Chunk;
  return (ld * 2) % 4096 == 0 ? ld + 64 : ld;  // rows 4 KB apart share L1 sets
}

void fp4_stage_rows(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, uint16_t* out) {
  const int64_t ld = fp4_staged_ld(K);
  alignas(64) uint16_t index[4][32] = {};
  for (int j = 0; j < 4; ++j) {
    for (int i = 0; i < 16; ++i) index[j][i] = static_cast<uint16_t>(4 * i + j);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += kFp4Chunk) {
      const uint16_t* src = x + m * ldx + k;
      __m512i part[4];
      for (int p = 0; p < 4; ++p) {
        const int64_t at = k + 32 * p;
        part[p] = _mm512_maskz_loadu_epi16(at < K ? first_lanes32(K - at) : 0, src + 32 * p);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i idx = _mm512_load_si512(index[j]);
        const __m512i low = _mm512_permutex2var_epi16(part[0], idx, part[1]);   // i = 0..15
        const __m512i high = _mm512_permutex2var_epi16(part[2], idx, part[3]);  // i = 16..31
        _mm512_store_si512(out + m * ld + k + 32 * j,
                           _mm512_inserti64x4(low, _mm512_castsi512_si256(high), 1));
      }
    }
  }
}

void fp4_dot_bf16(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                  float* out, int64_t ldo) {
  if (x.tiles != nullptr && fp4_uses_amx(M)) {
    if (!has_subnormal_scales(W, n0, n1)) {
      fp4_dot_amx(W, x, M, n0, n1, out, ldo);
      return;
    }
    // scale bytes 0 and 1 make subnormal bf16 weights, which the tile unit counts as zero: the
    // rows as they lie (x.bf16) through the widened tiles, which scale in fp32
  }
  if (M <= 8) {
    const int64_t ldp = fp4_staged_ld(W.K);
    if (x.tiles != nullptr) {  // staged by fp4_stage_rows
      rows_few(M, W, x.tiles, ldp, n0, n1, out, ldo);
      return;
    }
    ScratchVector<uint16_t> staged(static_cast<size_t>(M * ldp));  // 64-byte aligned
    fp4_stage_rows(x.bf16, x.ld, W.K, M, staged.data());
    rows_few(M, W, staged.data(), ldp, n0, n1, out, ldo);
    return;
  }
  // rows a whole number of lines apart but not 4 KB apart (L1 set conflicts)
  int64_t kpad = (W.K + 31) / 32 * 32;
  if ((kpad * 2) % 4096 == 0) {
    kpad += 32;
  }
  ScratchVector<uint16_t> widened(static_cast<size_t>(kTileRows * kpad));  // read only below K
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
    const int64_t t1 = std::min(n1, t0 + kTileRows);
    for (int64_t n = t0; n < t1; ++n) widen_row(W, n, widened.data() + (n - t0) * kpad);
    for (int64_t n = t0; n < t1; ++n) {
      const WeightRows<1, true> rows = rows_at<1, true>(W, n, widened.data() + (n - t0) * kpad);
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) {
        tile_bf16<8, 1>(rows, W.K, kFp4Group, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
      for (; m < M; ++m) {
        tile_bf16<1, 1>(rows, W.K, kFp4Group, x.bf16 + m * x.ld, x.ld, out + m * ldo + n - n0, ldo);
      }
    }
  }
}

void fp4_dot_f32(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    rows_direct_f32<4, 1>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
  for (; m < M; ++m) {
    rows_direct_f32<1, 4>(W, x.f32 + m * x.ld, x.ld, n0, n1, out + m * ldo, ldo);
  }
}

namespace {

// Rows [n0, n1) dequantized 32 weights at a time: store(dst row, k, mask, lo, hi) takes the
// group's exact fp32 values, elements k..k+15 in lo and k+16..k+31 in hi.
template <typename T, typename Store>
void dequantize_rows(const Fp4Weight& W, int64_t n0, int64_t n1, T* out, Store store) {
  const float* ue8m0 = ue8m0_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const uint8_t* scale = W.scale + n * W.lds;
    T* dst = out + (n - n0) * W.K;
    for (int64_t k = 0, g = 0; k < W.K; k += 32, ++g) {
      const __mmask32 mask = first_lanes32(W.K - k);
      const __m512i v = e2m1_to_bf16(_mm_maskz_loadu_epi8(byte_lanes(mask), row + k / 2));
      const __m512 s = _mm512_set1_ps(ue8m0[scale[g]]);
      store(dst + k, mask, _mm512_mul_ps(bf16_low_to_f32(v), s),
            _mm512_mul_ps(bf16_high_to_f32(v), s));
    }
  }
}

}  // namespace

void fp4_dequantize(const Fp4Weight& W, int64_t n0, int64_t n1, float* out) {
  dequantize_rows(W, n0, n1, out, [](float* dst, __mmask32 mask, __m512 lo, __m512 hi) {
    _mm512_mask_storeu_ps(dst, static_cast<__mmask16>(mask), lo);
    _mm512_mask_storeu_ps(dst + 16, static_cast<__mmask16>(mask >> 16), hi);
  });
}

void fp4_dequantize_bf16(const Fp4Weight& W, int64_t n0, int64_t n1, uint16_t* out) {
  // exact values; the RNE conversion keeps subnormals (VCVTNEPS2BF16 would flush them)
  dequantize_rows(W, n0, n1, out, [](uint16_t* dst, __mmask32 mask, __m512 lo, __m512 hi) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(fp32_to_bf16_rne(lo)),
                                            fp32_to_bf16_rne(hi), 1);
    _mm512_mask_storeu_epi16(dst, mask, both);
  });
}

}  // namespace mlafx::avx512

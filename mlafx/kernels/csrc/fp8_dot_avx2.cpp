// The AVX2 kernels of fp8_dot and fp8_dequantize (fp8.h), for CPUs without AVX-512 BF16: e4m3
// bytes widened to fp32 in registers, 32 at a time, and fp32 FMAs against fp32 activations.
// Each k block's 8-lane partial sums are scaled by the block's scale once (one FMA per block)
// and reduced across lanes once per output.
//
// e4m3fn -> fp16 -> fp32 (exact): a byte s.eeee.mmm placed in a 16-bit lane as
// s.0eeee.mmm0000000 is the fp16 number 2^-8 * e4m3 (fp16's exponent bias is 15, e4m3's 7, and
// the e4m3 subnormals m * 2^-9 land on the fp16 subnormals m * 2^-17), which F16C's VCVTPH2PS
// widens to fp32 exactly, 8 at a time. The 2^8 goes into the block scale (exact while the
// scale is below 2^120). 32 bytes take two unpacks against zero (each byte into the high half
// of a 16-bit lane), a shift right by 1 (arithmetic: the sign stays) and an AND clearing bit 14
// (the sign's copy) per 16, two 128-bit extracts and four VCVTPH2PS. The lanes come out as
// columns [0, 8), [16, 24), [8, 16), [24, 32) (the unpacks work within 128-bit halves); x is
// read at those offsets. NaN (0x7F / 0xFF) would come out as the finite 1.875 (480 once the
// scale's 2^8 applies): each 32 bytes are compared against it (an AND, a compare and an OR
// into a flag), and a k block whose flag is set runs again with its bytes decoded by the
// table (e4m3_to_float), so NaN stays NaN.
//
// Measured on a 2-core AMD EPYC (Zen 3, AVX2 only, ~2.1 GHz), 7 Dec 2026, weights quantized
// from Gaussian values: one row of x 8.9-10.5 GB/s of weight bytes per core against 6.2 with
// the previous decoding (sign-extend, shift, mask, multiply by 2^120, NaN per lane), 11 GB/s
// from L2; VCVTPH2PS issues once a cycle there, so the decoding, not memory, bounds it.
//
// Tiles: MR rows of x by NR weight rows; each decoded weight vector serves the MR rows of x
// (x's vectors are loaded again per weight row, from L1). M <= 8 rows of x run in one tile
// per weight row group, so every weight byte is decoded (and read) once; more rows run 8 at a
// time over a chunk of weight rows small enough to stay in L2 between the groups. A row's sums
// run in the same order whatever the tile, so its result does not depend on M.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fp8.h"

namespace mlafx::avx2 {
namespace {

// Columns of a step and the offset in x of each decoded vector's 8 columns.
constexpr int64_t kStep = 32;
constexpr int64_t kColumn[4] = {0, 16, 8, 24};
constexpr float kFp16Bias = 256.0f;  // e4m3 = 2^8 * the decoded fp16 image

struct E4m3Decoder {
  __m256i magnitude = _mm256_set1_epi8(0x7F);
  __m256i clear_bit14 = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));

  // All-ones bytes where a byte is NaN.
  inline __m256i nan_bytes(__m256i bytes) const {
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, magnitude), magnitude);
  }

  // 32 e4m3 bytes without NaN -> 2^-8 times their values, columns kColumn[i] + [0, 8) in v[i].
  inline void operator()(__m256i bytes, __m256 v[4]) const {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i lo =
        _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, bytes), 1), clear_bit14);
    const __m256i hi =
        _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, bytes), 1), clear_bit14);
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    v[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
  }
};

// The decoder's contract for any 32 bytes, NaN included, by the table (the rare path).
void decode_by_table(const uint8_t* bytes, __m256 v[4]) {
  alignas(32) float values[kStep];
  for (int64_t i = 0; i < kStep; ++i) values[i] = e4m3_to_float(bytes[i]) / kFp16Bias;
  for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(values + kColumn[i]);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Lanes [0, n) set (none when n <= 0).
inline __m256i lane_mask(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            index);
}

// Weight rows per chunk: their bytes (16 x K) stay in L2 while the segments pass over them.
constexpr int64_t kChunkRows = 16;
// x bytes per segment of K: the MR rows' fp32 columns of one segment stay in L1 while the
// chunk's weight rows pass over them (8 rows of a 2048-wide x are 64 KB, twice L1).
constexpr int64_t kSegmentBytes = 16 << 10;

// Columns of K per segment for MR rows of x: whole k blocks, all of K when it fits.
int64_t segment_columns(const Fp8Weight& W, int64_t MR) {
  const int64_t blocks = kSegmentBytes / (MR * int64_t{sizeof(float)} * W.block_k);
  return std::max<int64_t>(1, blocks) * W.block_k;
}

// total[r][m] += the sums of k blocks [s0, s1) (block-aligned) of x rows m < MR (row stride
// ldx) against weight rows n + r, r < NR: per block the 8-lane sums, scaled once. The bytes
// `ahead` past each step's are prefetched into L2 (the same row's next segment, or the next
// chunk's row; 0: the step's own, which costs nothing).
template <int MR, int NR>
void tile(const Fp8Weight& W, const E4m3Decoder& decode, int64_t n, int64_t s0, int64_t s1,
          const float* x, int64_t ldx, int64_t ahead, float (*total)[MR][8]) {
  const uint8_t* w[NR];
  const float* scale[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = W.w + (n + r) * W.ldw;
    scale[r] = W.scale + ((n + r) / W.block_n) * W.lds;
  }
  // acc[m][r] += x[m, k + kColumn[i] ..] * wv[i] for the 4 vectors of one step of row r
  const auto accumulate = [&](__m256 acc[MR][NR], int r, const __m256 wv[4], int64_t k) {
    for (int i = 0; i < 4; ++i) {
      for (int m = 0; m < MR; ++m) {
        acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + kColumn[i]), wv[i],
                                    acc[m][r]);
      }
    }
  };
  for (int64_t k0 = s0; k0 < s1; k0 += W.block_k) {
    const int64_t k1 = std::min(s1, k0 + W.block_k);
    const int64_t whole = k0 + (k1 - k0) / kStep * kStep;  // the block's whole steps end here
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    }
    // Row by row within a step (each row's bytes decoded just before its FMAs: the registers
    // hold one row's vectors, not NR rows'); NaN bytes are looked for across the block.
    __m256i nan = _mm256_setzero_si256();
    for (int64_t k = k0; k < whole; k += kStep) {
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + ahead), _MM_HINT_T1);
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
        nan = _mm256_or_si256(nan, decode.nan_bytes(bytes));
        __m256 wv[4];
        decode(bytes, wv);
        accumulate(acc, r, wv, k);
      }
    }
    if (__builtin_expect(!_mm256_testz_si256(nan, nan), 0)) {
      // a NaN byte in the block, decoded as a finite value: the block again, by the table
      for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
      }
      for (int64_t k = k0; k < whole; k += kStep) {
        for (int r = 0; r < NR; ++r) {
          __m256 wv[4];
          decode_by_table(w[r] + k, wv);
          accumulate(acc, r, wv, k);
        }
      }
    }
    const int64_t k = whole;
    if (k < k1) {  // the matrix's last columns: bytes past K read as 0, x masked to 0
      const int64_t n_left = k1 - k;
      for (int r = 0; r < NR; ++r) {
        uint8_t tail[kStep] = {};
        std::memcpy(tail, w[r] + k, static_cast<size_t>(n_left));
        __m256 wv[4];
        decode_by_table(tail, wv);
        for (int i = 0; i < 4; ++i) {
          const __m256i mask = lane_mask(n_left - kColumn[i]);
          for (int m = 0; m < MR; ++m) {
            const __m256 xv = _mm256_maskload_ps(x + m * ldx + k + kColumn[i], mask);
            acc[m][r] = _mm256_fmadd_ps(xv, wv[i], acc[m][r]);
          }
        }
      }
    }
    const int64_t kb = k0 / W.block_k;
    for (int r = 0; r < NR; ++r) {
      const __m256 s = _mm256_set1_ps(scale[r][kb] * kFp16Bias);
      for (int m = 0; m < MR; ++m) {
        _mm256_store_ps(total[r][m],
                        _mm256_fmadd_ps(acc[m][r], s, _mm256_load_ps(total[r][m])));
      }
    }
  }
}

// Rows [0, MR) of x against weight rows [n0, n1): per chunk of kChunkRows weight rows, per
// segment of K, NR weight rows at a time, then one at a time.
template <int MR, int NR>
void rows(const Fp8Weight& W, const E4m3Decoder& decode, const float* x, int64_t ldx, int64_t n0,
          int64_t n1, float* out, int64_t ldo) {
  const int64_t segment = segment_columns(W, MR);
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(n1, c0 + kChunkRows);
    alignas(32) float total[kChunkRows][MR][8] = {};
    for (int64_t s0 = 0; s0 < W.K; s0 += segment) {
      const int64_t s1 = std::min(W.K, s0 + segment);
      const int64_t ahead = s1 < W.K ? segment : (c1 < n1 ? kChunkRows * W.ldw - s0 : 0);
      int64_t n = c0;
      for (; n + NR <= c1; n += NR) {
        tile<MR, NR>(W, decode, n, s0, s1, x, ldx, ahead, total + (n - c0));
      }
      for (; n < c1; ++n) tile<MR, 1>(W, decode, n, s0, s1, x, ldx, ahead, total + (n - c0));
    }
    for (int64_t n = c0; n < c1; ++n) {
      for (int m = 0; m < MR; ++m) {
        out[m * ldo + n - n0] = hsum(_mm256_load_ps(total[n - c0][m]));
      }
    }
  }
}

// 1 <= M <= 8 rows of x in one tile per weight row group.
void rows_few(int64_t M, const Fp8Weight& W, const E4m3Decoder& decode, const float* x,
              int64_t ldx, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  switch (M) {
    case 1: return rows<1, 4>(W, decode, x, ldx, n0, n1, out, ldo);
    case 2: return rows<2, 4>(W, decode, x, ldx, n0, n1, out, ldo);
    case 3: return rows<3, 2>(W, decode, x, ldx, n0, n1, out, ldo);
    case 4: return rows<4, 2>(W, decode, x, ldx, n0, n1, out, ldo);
    case 5: return rows<5, 1>(W, decode, x, ldx, n0, n1, out, ldo);
    case 6: return rows<6, 1>(W, decode, x, ldx, n0, n1, out, ldo);
    case 7: return rows<7, 1>(W, decode, x, ldx, n0, n1, out, ldo);
    default: return rows<8, 1>(W, decode, x, ldx, n0, n1, out, ldo);
  }
}

// Weight rows per chunk when more than 8 rows of x pass over it: ~128 KB of bytes, which the
// groups of 8 rows after the first read from L2.
int64_t chunk_rows(int64_t K) { return std::max<int64_t>(1, (int64_t{128} << 10) / K); }

}  // namespace

void fp8_dot_f32(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  const E4m3Decoder decode;
  if (M <= 8) {
    rows_few(M, W, decode, x.f32, x.ld, n0, n1, out, ldo);
    return;
  }
  const int64_t step = chunk_rows(W.K);
  for (int64_t c0 = n0; c0 < n1; c0 += step) {
    const int64_t c1 = std::min(n1, c0 + step);
    for (int64_t m = 0; m < M; m += 8) {
      rows_few(std::min<int64_t>(8, M - m), W, decode, x.f32 + m * x.ld, x.ld, c0, c1,
               out + m * ldo + c0 - n0, ldo);
    }
  }
}

// Each value (v * 2^-8) * 2^8 (exact), then times the scale: the portable rounding.
void fp8_dequantize(const Fp8Weight& W, int64_t n0, int64_t n1, float* out) {
  const E4m3Decoder decode;
  const __m256 bias = _mm256_set1_ps(kFp16Bias);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const float* scale = W.scale + (n / W.block_n) * W.lds;
    float* dst = out + (n - n0) * W.K;
    for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += W.block_k, ++kb) {
      const int64_t k1 = std::min(W.K, k0 + W.block_k);
      const __m256 s = _mm256_set1_ps(scale[kb]);
      for (int64_t k = k0; k < k1; k += kStep) {
        const int64_t n_left = std::min(kStep, k1 - k);
        __m256 v[4];
        if (n_left == kStep) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
          const __m256i nan = decode.nan_bytes(bytes);
          if (__builtin_expect(_mm256_testz_si256(nan, nan), 1)) {
            decode(bytes, v);
          } else {
            decode_by_table(row + k, v);
          }
        } else {
          uint8_t tail[kStep] = {};
          std::memcpy(tail, row + k, static_cast<size_t>(n_left));
          decode_by_table(tail, v);
        }
        for (int i = 0; i < 4; ++i) {
          const __m256 value = _mm256_mul_ps(_mm256_mul_ps(v[i], bias), s);
          if (n_left == kStep) {
            _mm256_storeu_ps(dst + k + kColumn[i], value);
          } else {
            _mm256_maskstore_ps(dst + k + kColumn[i], lane_mask(n_left - kColumn[i]), value);
          }
        }
      }
    }
  }
}

}  // namespace mlafx::avx2

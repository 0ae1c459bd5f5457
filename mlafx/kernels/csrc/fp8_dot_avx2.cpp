// The AVX2 kernels of fp8_dot and fp8_dequantize (fp8.h), for CPUs without AVX-512 BF16: e4m3
// bytes widened to fp32 in registers, 8 at a time, and fp32 FMAs against fp32 activations.
// Each k block's 8-lane partial sums are scaled by the block's scale once (one FMA per block)
// and reduced across lanes once per output.
//
// e4m3fn -> fp32 (exact): sign-extend each byte to 32 bits and shift it left by 20, so the sign
// lands in bit 31 and the 4 exponent and 3 mantissa bits in bits 26..20: the fp32 number
// 2^-120 * e4m3 (a normal e4m3 s.eeee.mmm is 2^(e-7) * 1.mmm, its fp32 image 2^(e-127) *
// 1.mmm; the 7 subnormals m * 2^-9 become fp32 subnormals m * 2^-129). One multiply by 2^120
// is then exact for every byte; 0x7F / 0xFF (NaN) are set to all-ones. 5 vector instructions
// per 8 weights. Exact as long as the FPU keeps subnormal inputs (MXCSR.DAZ clear, the
// default; torch.set_flush_denormal(True) would zero the e4m3 subnormals).
//
// Tiles: MR rows of x by NR weight rows share each decoded weight vector and each loaded
// activation vector. M <= 8 rows of x run in one tile per weight row group, so every weight
// byte is decoded (and read) once; more rows run 8 at a time over a chunk of weight rows
// small enough to stay in L2 between the groups.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "fp8.h"

namespace mlafx::avx2 {
namespace {

struct E4m3Decoder {
  __m256i field = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
  __m256i magnitude = _mm256_set1_epi32(0x7F);
  __m256 two_120 = _mm256_set1_ps(0x1p120f);

  // 8 e4m3 bytes (the low 64 bits of `bytes`) -> 8 floats.
  inline __m256 operator()(__m128i bytes) const {
    const __m256i b = _mm256_cvtepi8_epi32(bytes);
    const __m256i image = _mm256_and_si256(_mm256_slli_epi32(b, 20), field);
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(image), two_120);
    const __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(b, magnitude), magnitude);
    return _mm256_or_ps(v, _mm256_castsi256_ps(nan));
  }
};

inline __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Lanes [0, n) set, for the last (partial) 8 columns of a k block.
inline __m256i lane_mask(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), index);
}

// out[m * ldo + r] for m < MR, r < NR: x rows [MR, K] (row stride ldx) against weight rows
// n .. n + NR - 1.
template <int MR, int NR>
void tile(const Fp8Weight& W, const E4m3Decoder& decode, int64_t n, const float* x, int64_t ldx,
          float* out, int64_t ldo) {
  const uint8_t* w[NR];
  const float* scale[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = W.w + (n + r) * W.ldw;
    scale[r] = W.scale + ((n + r) / W.block_n) * W.lds;
  }
  __m256 total[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) total[m][r] = _mm256_setzero_ps();
  }
  for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += W.block_k, ++kb) {
    const int64_t k1 = std::min(W.K, k0 + W.block_k);
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m) {
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    }
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) {
      __m256 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = decode(load8(w[r] + k));
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
    if (k < k1) {  // the matrix's last columns: bytes past K read as 0, x masked to 0
      const __m256i mask = lane_mask(k1 - k);
      __m256 wv[NR];
      for (int r = 0; r < NR; ++r) {
        uint8_t tail[16] = {};
        std::memcpy(tail, w[r] + k, static_cast<size_t>(k1 - k));
        wv[r] = decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail)));
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_maskload_ps(x + m * ldx + k, mask);
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 s = _mm256_set1_ps(scale[r][kb]);
      for (int m = 0; m < MR; ++m) total[m][r] = _mm256_fmadd_ps(acc[m][r], s, total[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) out[m * ldo + r] = hsum(total[m][r]);
  }
}

// Rows [0, MR) of x against weight rows [n0, n1), NR at a time, then one at a time.
template <int MR, int NR>
void rows(const Fp8Weight& W, const E4m3Decoder& decode, const float* x, int64_t ldx, int64_t n0,
          int64_t n1, float* out, int64_t ldo) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(W, decode, n, x, ldx, out + n - n0, ldo);
  for (; n < n1; ++n) tile<MR, 1>(W, decode, n, x, ldx, out + n - n0, ldo);
}

// 1 <= M <= 8 rows of x in one tile per weight row group.
void rows_few(int64_t M, const Fp8Weight& W, const E4m3Decoder& decode, const float* x,
              int64_t ldx, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  switch (M) {
    case 1: return rows<1, 4>(W, decode, x, ldx, n0, n1, out, ldo);
    case 2: return rows<2, 2>(W, decode, x, ldx, n0, n1, out, ldo);
    case 3: return rows<3, 1>(W, decode, x, ldx, n0, n1, out, ldo);
    case 4: return rows<4, 1>(W, decode, x, ldx, n0, n1, out, ldo);
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

void fp8_dequantize(const Fp8Weight& W, int64_t n0, int64_t n1, float* out) {
  const E4m3Decoder decode;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const float* scale = W.scale + (n / W.block_n) * W.lds;
    float* dst = out + (n - n0) * W.K;
    for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += W.block_k, ++kb) {
      const int64_t k1 = std::min(W.K, k0 + W.block_k);
      const __m256 s = _mm256_set1_ps(scale[kb]);
      int64_t k = k0;
      for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(dst + k, _mm256_mul_ps(decode(load8(row + k)), s));
      if (k < k1) {
        uint8_t tail[16] = {};
        std::memcpy(tail, row + k, static_cast<size_t>(k1 - k));
        const __m256 v = decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail)));
        _mm256_maskstore_ps(dst + k, lane_mask(k1 - k), _mm256_mul_ps(v, s));
      }
    }
  }
}

}  // namespace mlafx::avx2

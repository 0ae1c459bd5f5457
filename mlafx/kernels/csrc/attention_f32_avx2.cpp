// AVX2 attention core for bf16, fp16 and fp32 inputs on CPUs without AVX-512 BF16 (compiled
// with -mavx2 -mfma -mf16c): the AVX-512 fp32-FMA core (attention_f32_avx512.cpp) on 8-lane
// vectors, with the same workspace (attention_f32_layout.h) and arithmetic: inputs widened to
// fp32 once per block (bf16 by a shift, fp16 by F16C), q.k with lanes as query rows (keys
// broadcast one element at a time against Q stored [dim][row]), an fp32 online softmax (P is
// never rounded), P.V with lanes as value dims. Called only when mlafx::use_avx2() and AVX-512
// BF16 is off; the scalar reference is PortableCore in attention.cpp.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "attention_f32_layout.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "attention_f32_avx2.cpp must be compiled with the AVX2 flags from setup.py"
#endif

namespace mlafx::avx2 {
namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::CoreOps;
using Layout = mlafx::attn::F32Layout;
using Header = mlafx::attn::F32Header;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^k for integer-valued k in [-126, 127] (as floats): the exponent field.
inline __m256 pow2i(__m256 k) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

// 2^x for x <= 0 (and NaN): the AVX-512 cores' exp2_ps (round-to-nearest split, the same
// degree-6 Taylor of 2^f on [-0.5, 0.5]), the exponent applied as two exact halves so that a
// result below 2^-126 is rounded once, as scalef rounds it. -inf (and below -150) gives 0;
// NaN stays NaN (max_ps returns its second operand when either is NaN).
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-150.f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // n in [-150, 0]: 2^n = 2^h * 2^(n - h), h = floor(n / 2), both factors normal
  const __m256 h = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i(h)), pow2i(_mm256_sub_ps(n, h)));
}

// ---- element types: fp32 (float), fp16 (c10::Half bits), bf16 (c10::BFloat16 bits) ----------

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// 8 elements -> fp32.
template <typename E>
inline __m256 load8(const E* p) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<E, F16>) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// fp32 -> 8 elements (round to nearest even; bf16 as c10::BFloat16 rounds: NaN -> 0x7FC0).
template <typename E>
inline void store8(E* p, __m256 x) {
  if constexpr (std::is_same_v<E, float>) {
    _mm256_storeu_ps(p, x);
  } else if constexpr (std::is_same_v<E, F16>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
}

// n elements of type E -> fp32, zero-padded up to `padded` (a multiple of 8 >= n, or n).
template <typename E>
inline void widen(const E* src, float* dst, int64_t n, int64_t padded) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, load8(src + i));
  }
  if (i < n) {
    E tail[8] = {};
    std::memcpy(tail, src + i, sizeof(E) * static_cast<size_t>(n - i));
    const __m256 x = load8(tail);
    if (padded >= i + 8) {
      _mm256_storeu_ps(dst + i, x);
    } else {
      alignas(32) float out[8];
      _mm256_store_ps(out, x);
      std::memcpy(dst + i, out, sizeof(float) * static_cast<size_t>(n - i));
    }
    i += 8;
  }
  for (; i < padded; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_setzero_ps());
  }
}

// fp32 row -> n elements of type E, scaled by `inv`.
template <typename E>
inline void narrow(const float* src, E* dst, int64_t n, __m256 inv) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    store8(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), inv));
  }
  if (i < n) {
    E tail[8];
    store8(tail, _mm256_mul_ps(_mm256_loadu_ps(src + i), inv));  // src is padded to 16
    std::memcpy(dst + i, tail, sizeof(E) * static_cast<size_t>(n - i));
  }
}

// ---- q.k ------------------------------------------------------------------------------------

template <int M, int NV>
inline void qk_keys(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0,
                    int64_t n0) {
  const float* qf = at_offset<float>(ws, L.qf);
  const float* kf = at_offset<float>(ws, L.kf) + n0 * L.wq;
  __m256 acc[M][NV];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < L.wq; ++i) {
    for (int m = 0; m < M; ++m) {
      const __m256 kk = _mm256_broadcast_ss(kf + m * L.wq + i);
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + i * gp + 8 * v), kk, acc[m][v]);
      }
    }
  }
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  float* s = at_offset<float>(ws, L.s);
  const __m256 scale = _mm256_set1_ps(d.scale * kLog2e);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < M; ++m) {
    const __m256i j = _mm256_set1_epi32(static_cast<int>(j0 + n0 + m));
    for (int v = 0; v < NV; ++v) {
      const __m256i limits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lim + 8 * v));
      const __m256 visible = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limits, j));
      _mm256_storeu_ps(s + (n0 + m) * gp + 8 * v,
                       _mm256_blendv_ps(neg_inf, _mm256_mul_ps(acc[m][v], scale), visible));
    }
  }
}

template <int NV>
void qk_block(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0, int64_t n) {
  constexpr int M = NV <= 2 ? 4 : NV <= 4 ? 2 : 1;  // M * NV accumulators <= 8
  int64_t n0 = 0;
  for (; n0 + M <= n; n0 += M) qk_keys<M, NV>(ws, L, d, gp, j0, n0);
  for (; n0 < n; ++n0) qk_keys<1, NV>(ws, L, d, gp, j0, n0);
}

// ---- online softmax (P stays fp32, in place of the scores) ----------------------------------

void softmax_block(void* ws, const Layout& L, int64_t gp, int64_t n) {
  float* s = at_offset<float>(ws, L.s);
  float* m = at_offset<float>(ws, L.m);
  float* l = at_offset<float>(ws, L.l);
  float* alpha = at_offset<float>(ws, L.alpha);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < gp; v += 8) {
    const __m256 m_old = _mm256_loadu_ps(m + v);
    __m256 mx = m_old;
    for (int64_t k = 0; k < n; ++k) {
      mx = _mm256_max_ps(_mm256_loadu_ps(s + k * gp + v), mx);  // a NaN score propagates via p
    }
    const __m256 none = _mm256_cmp_ps(mx, neg_inf, _CMP_EQ_OQ);  // no visible key yet
    const __m256 shift = _mm256_blendv_ps(mx, _mm256_setzero_ps(), none);
    const __m256 a = exp2_ps(_mm256_sub_ps(m_old, shift));
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(l + v), a);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + k * gp + v), shift));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(s + k * gp + v, p);
    }
    _mm256_storeu_ps(l + v, sum);
    _mm256_storeu_ps(m + v, mx);
    _mm256_storeu_ps(alpha + v, a);
  }
}

// ---- P.V ------------------------------------------------------------------------------------

template <int MR, int ND>
inline void pv_tile(const float* p, const float* vf, float* o, const float* alpha, int64_t gp,
                    int64_t dvp, int64_t n, int64_t g0, int64_t d0) {
  __m256 acc[MR][ND];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < n; ++k) {
    __m256 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = _mm256_loadu_ps(vf + k * dvp + d0 + 8 * c);
    for (int r = 0; r < MR; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + k * gp + g0 + r);
      for (int c = 0; c < ND; ++c) acc[r][c] = _mm256_fmadd_ps(vv[c], pr, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_broadcast_ss(alpha + g0 + r);
    float* row = o + (g0 + r) * dvp + d0;
    for (int c = 0; c < ND; ++c) {
      _mm256_storeu_ps(row + 8 * c, _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * c), a, acc[r][c]));
    }
  }
}

void pv_block(void* ws, const Layout& L, int64_t gp, int64_t n) {
  constexpr int MR = 4;
  const float* p = at_offset<float>(ws, L.s);
  const float* vf = at_offset<float>(ws, L.vf);
  float* o = at_offset<float>(ws, L.o);
  const float* alpha = at_offset<float>(ws, L.alpha);
  for (int64_t g0 = 0; g0 < gp; g0 += MR) {
    for (int64_t d0 = 0; d0 < L.dvp; d0 += 16) {  // dvp is a multiple of 16
      pv_tile<MR, 2>(p, vf, o, alpha, gp, L.dvp, n, g0, d0);
    }
  }
}

// ---- CoreOps entry points, per element type -------------------------------------------------

template <typename E>
struct Core {
  static size_t workspace_bytes(const CoreDims& d) { return Layout(d).total; }

  static void begin(void* ws, const CoreDims& d, int64_t num_rows, const void* const* q_rows,
                    const int64_t* limits) {
    const Layout L(d);
    Header* h = at_offset<Header>(ws, L.hdr);
    h->rows = num_rows;
    h->gp = (num_rows + 15) / 16 * 16;
    const int64_t gp = h->gp;
    float* qf = at_offset<float>(ws, L.qf);
    int32_t* lim = at_offset<int32_t>(ws, L.lim);
    // Q as [dim][row]: widen each row into the key buffer (free here), then transpose.
    float* row = at_offset<float>(ws, L.kf);
    for (int64_t g = 0; g < gp; ++g) {
      if (g < num_rows) {
        widen(static_cast<const E*>(q_rows[g]), row, L.wq, L.wq);
        lim[g] = static_cast<int32_t>(limits[g] < INT32_MAX ? limits[g] : INT32_MAX);
      } else {
        std::memset(row, 0, sizeof(float) * L.wq);
        lim[g] = 0;
      }
      for (int64_t i = 0; i < L.wq; ++i) qf[i * gp + g] = row[i];
    }
    std::memset(at_offset<float>(ws, L.o), 0, sizeof(float) * gp * L.dvp);
    float* m = at_offset<float>(ws, L.m);
    float* l = at_offset<float>(ws, L.l);
    for (int64_t g = 0; g < gp; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
  }

  static void block(void* ws, const CoreDims& d, int64_t j0, int64_t n, const void* const* ka,
                    const void* const* kb, const void* const* v) {
    const Layout L(d);
    const int64_t gp = at_offset<Header>(ws, L.hdr)->gp;
    float* kf = at_offset<float>(ws, L.kf);
    float* vf = at_offset<float>(ws, L.vf);
    for (int64_t k = 0; k < n; ++k) {
      widen(static_cast<const E*>(ka[k]), kf + k * L.wq, d.wa, d.wa);
      if (d.wb > 0) {
        widen(static_cast<const E*>(kb[k]), kf + k * L.wq + d.wa, d.wb, d.wb);
      }
      widen(static_cast<const E*>(v[k]), vf + k * L.dvp, d.dv, L.dvp);
    }
    switch (gp / 8) {
      case 2: qk_block<2>(ws, L, d, gp, j0, n); break;
      case 4: qk_block<4>(ws, L, d, gp, j0, n); break;
      case 6: qk_block<6>(ws, L, d, gp, j0, n); break;
      default: qk_block<8>(ws, L, d, gp, j0, n); break;
    }
    softmax_block(ws, L, gp, n);
    pv_block(ws, L, gp, n);
  }

  static void end(void* ws, const CoreDims& d, void* const* out_rows, float* const* out_f32_rows,
                  float* const* lse_ptrs) {
    const Layout L(d);
    const Header* h = at_offset<Header>(ws, L.hdr);
    const float* o = at_offset<float>(ws, L.o);
    const float* m = at_offset<float>(ws, L.m);
    const float* l = at_offset<float>(ws, L.l);
    const int32_t* lim = at_offset<int32_t>(ws, L.lim);
    float* zeros = at_offset<float>(ws, L.vf);  // a cleared row for empty rows
    std::memset(zeros, 0, sizeof(float) * L.dvp);
    for (int64_t g = 0; g < h->rows; ++g) {
      const bool empty = lim[g] <= 0;
      *lse_ptrs[g] = empty ? -std::numeric_limits<float>::infinity()
                           : (m[g] + std::log2(l[g])) * kLn2;
      const __m256 inv = _mm256_set1_ps(empty ? 0.f : 1.f / l[g]);
      const float* src = empty ? zeros : o + g * L.dvp;
      if (out_rows != nullptr) {
        narrow(src, static_cast<E*>(out_rows[g]), d.dv, inv);
      } else {
        narrow(src, out_f32_rows[g], d.dv, inv);
      }
    }
  }

  static const CoreOps& ops() {
    static const CoreOps table{&workspace_bytes, &begin, &block, &end};
    return table;
  }
};

}  // namespace

const mlafx::attn::CoreOps& attention_core_f32() { return Core<float>::ops(); }
const mlafx::attn::CoreOps& attention_core_f16() { return Core<F16>::ops(); }
const mlafx::attn::CoreOps& attention_core_bf16() { return Core<Bf16>::ops(); }

}  // namespace mlafx::avx2

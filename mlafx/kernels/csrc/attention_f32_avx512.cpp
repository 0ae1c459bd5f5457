// AVX-512 attention core for fp32 and fp16 inputs (compiled with -mavx512f/...): fp32 FMAs
// throughout, so fp32 and fp16 keep their precision (no bf16 rounding anywhere). Called only
// after the run-time check in cpu_features.h; the scalar reference is PortableCore in
// attention.cpp. Same layout as the bf16 core (attention_avx512.cpp): fp32 lanes are query
// rows for q.k (keys broadcast one element at a time against Q stored [dim][row]) and value
// dims for P.V (P broadcast per row). Each key block is widened to fp32 once for all rows.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "attention_avx512_math.h"
#include "attention_f32_layout.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "attention_f32_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::CoreOps;
using mlafx::attn::kBlockKeys;
using mlafx::attn::kMaxRows;

using Layout = mlafx::attn::F32Layout;
using Header = mlafx::attn::F32Header;

// Element types: fp32 (float) or fp16 (uint16_t bits).
template <typename E>
inline __m512 load16(const E* p, __mmask16 mask) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

template <typename E>
inline void store16(E* p, __m512 x, __mmask16 mask) {
  if constexpr (std::is_same_v<E, float>) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else {
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
}

// n elements of type E -> fp32, zero-padded up to `padded`.
template <typename E>
inline void widen(const E* src, float* dst, int64_t n, int64_t padded) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, load16(src + i, 0xffff));
  }
  if (i < n) {
    // Masked load; the store covers the padding too when there is room, else only n.
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 x = load16(src + i, tail);
    if (padded >= i + 16) {
      _mm512_storeu_ps(dst + i, x);
    } else {
      _mm512_mask_storeu_ps(dst + i, tail, x);
    }
    i += 16;
  }
  for (; i < padded; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_setzero_ps());
  }
}

// ---- q.k --------------------------------------------------------------------------------------

template <int M, int NV>
inline void qk_keys(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0,
                    int64_t n0) {
  const float* qf = at_offset<float>(ws, L.qf);
  const float* kf = at_offset<float>(ws, L.kf) + n0 * L.wq;
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t i = 0; i < L.wq; ++i) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) {
      qv[v] = _mm512_loadu_ps(qf + i * gp + 16 * v);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 kk = _mm512_set1_ps(kf[m * L.wq + i]);
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_fmadd_ps(qv[v], kk, acc[m][v]);
      }
    }
  }
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  float* s = at_offset<float>(ws, L.s);
  const __m512 scale = _mm512_set1_ps(d.scale * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < M; ++m) {
    const __m512i j = _mm512_set1_epi32(static_cast<int>(j0 + n0 + m));
    for (int v = 0; v < NV; ++v) {
      const __mmask16 visible = _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(lim + 16 * v), j);
      _mm512_storeu_ps(s + (n0 + m) * gp + 16 * v,
                       _mm512_mask_mul_ps(neg_inf, visible, acc[m][v], scale));
    }
  }
}

template <int NV>
void qk_block(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0, int64_t n) {
  constexpr int M = NV <= 2 ? 8 : 4;
  int64_t n0 = 0;
  for (; n0 + M <= n; n0 += M) {
    qk_keys<M, NV>(ws, L, d, gp, j0, n0);
  }
  for (; n0 < n; ++n0) {
    qk_keys<1, NV>(ws, L, d, gp, j0, n0);
  }
}

// ---- online softmax (P stays fp32, in place of the scores) --------------------------------------

void softmax_block(void* ws, const Layout& L, int64_t gp, int64_t n) {
  float* s = at_offset<float>(ws, L.s);
  float* m = at_offset<float>(ws, L.m);
  float* l = at_offset<float>(ws, L.l);
  float* alpha = at_offset<float>(ws, L.alpha);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < gp; v += 16) {
    const __m512 m_old = _mm512_loadu_ps(m + v);
    __m512 mx = m_old;
    for (int64_t k = 0; k < n; ++k) {
      mx = _mm512_max_ps(_mm512_loadu_ps(s + k * gp + v), mx);  // a NaN score propagates via p
    }
    const __m512 shift =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), mx, _mm512_setzero_ps());
    const __m512 a = exp2_ps(_mm512_sub_ps(m_old, shift));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l + v), a);
    for (int64_t k = 0; k < n; ++k) {
      const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + k * gp + v), shift));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(s + k * gp + v, p);
    }
    _mm512_storeu_ps(l + v, sum);
    _mm512_storeu_ps(m + v, mx);
    _mm512_storeu_ps(alpha + v, a);
  }
}

// ---- P.V ----------------------------------------------------------------------------------------

template <int MR, int ND>
inline void pv_tile(const float* p, const float* vf, float* o, const float* alpha, int64_t gp,
                    int64_t dvp, int64_t n, int64_t g0, int64_t d0) {
  __m512 acc[MR][ND];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < ND; ++c) {
      acc[r][c] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) {
      vv[c] = _mm512_loadu_ps(vf + k * dvp + d0 + 16 * c);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 pr = _mm512_set1_ps(p[k * gp + g0 + r]);
      for (int c = 0; c < ND; ++c) {
        acc[r][c] = _mm512_fmadd_ps(vv[c], pr, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[g0 + r]);
    float* row = o + (g0 + r) * dvp + d0;
    for (int c = 0; c < ND; ++c) {
      _mm512_storeu_ps(row + 16 * c,
                       _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * c), a, acc[r][c]));
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
    int64_t d0 = 0;
    for (; d0 + 64 <= L.dvp; d0 += 64) {
      pv_tile<MR, 4>(p, vf, o, alpha, gp, L.dvp, n, g0, d0);
    }
    for (; d0 < L.dvp; d0 += 16) {
      pv_tile<MR, 1>(p, vf, o, alpha, gp, L.dvp, n, g0, d0);
    }
  }
}

// ---- CoreOps entry points, per element type -----------------------------------------------------

template <typename E>
struct Core {
  static size_t workspace_bytes(const CoreDims& d) { return Layout(d).total; }

  static void begin(void* ws, const CoreDims& d, int64_t num_rows, const void* const* q_rows,
                    const int64_t* limits) {
    const Layout L(d);
    Header* h = at_offset<Header>(ws, L.hdr);
    h->rows = num_rows;
    h->gp = round_up16(num_rows);
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
      for (int64_t i = 0; i < L.wq; ++i) {
        qf[i * gp + g] = row[i];
      }
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
    switch (gp / 16) {
      case 1: qk_block<1>(ws, L, d, gp, j0, n); break;
      case 2: qk_block<2>(ws, L, d, gp, j0, n); break;
      case 3: qk_block<3>(ws, L, d, gp, j0, n); break;
      default: qk_block<4>(ws, L, d, gp, j0, n); break;
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
    const int64_t full = d.dv / 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (d.dv % 16)) - 1u);
    float* zeros = at_offset<float>(ws, L.vf);  // a cleared row for empty rows
    std::memset(zeros, 0, sizeof(float) * L.dvp);
    for (int64_t g = 0; g < h->rows; ++g) {
      const bool empty = lim[g] <= 0;
      *lse_ptrs[g] = empty ? -std::numeric_limits<float>::infinity()
                           : (m[g] + std::log2(l[g])) * kLn2;
      const __m512 inv = _mm512_set1_ps(empty ? 0.f : 1.f / l[g]);
      const float* src = empty ? zeros : o + g * L.dvp;
      if (out_rows != nullptr) {
        E* dst = static_cast<E*>(out_rows[g]);
        for (int64_t i = 0; i < full; ++i) {
          store16(dst + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(src + 16 * i), inv), 0xffff);
        }
        if (tail != 0) {
          store16(dst + 16 * full, _mm512_mul_ps(_mm512_loadu_ps(src + 16 * full), inv), tail);
        }
      } else {
        float* dst = out_f32_rows[g];
        for (int64_t i = 0; i < full; ++i) {
          _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(src + 16 * i), inv));
        }
        if (tail != 0) {
          _mm512_mask_storeu_ps(dst + 16 * full, tail,
                                _mm512_mul_ps(_mm512_loadu_ps(src + 16 * full), inv));
        }
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
const mlafx::attn::CoreOps& attention_core_f16() { return Core<uint16_t>::ops(); }

}  // namespace mlafx::avx512

// AVX-512 BF16 attention core (compiled with -mavx512f/bw/vl/dq/bf16). Called only after the
// run-time check in cpu_features.h; the scalar reference is PortableCore in attention.cpp.
//
// Layout trick: the fp32 lanes are *query rows* (16 per vector, up to 4 vectors), not the
// head dimension. Then
//   - q.k is a GEMM S[key, row] = sum_pair K[key, pair] . Qp[pair, row]: Q is packed once per
//     group as bf16 pairs ("VNNI" layout [pair][row][2]), and each key contributes a 32-bit
//     broadcast of two adjacent elements straight from the cache row -- keys need no packing,
//     and every cached row is read once for all rows of the group;
//   - the softmax is vertical (max/exp/sum across keys, lane-wise per row): no horizontal
//     reductions;
//   - P.V is a GEMM O[row, d] += sum_pair Pp[pair, row] . Vp[pair, d] with lanes over d: P is
//     written as bf16 pairs by the softmax, V is repacked per key block into pairs of adjacent
//     keys ([pair][d][2]), once for all rows of the group.
// Both GEMMs use _mm512_dpbf16_ps (32 bf16 products into 16 fp32 accumulators, exact products,
// fp32 sums). P is kept to fp32 accuracy for the second one: it is split into a high and a low
// bf16 part (p = hi + lo to 2^-17 relative) and P.V runs both, so the weights the product uses
// are the fp32 ones the softmax sum adds up. (Rounding P to one bf16 made the output error up
// to ~3x that of a correctly rounded bf16 result; the split costs one more dpbf16 per pair.)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "attention_avx512_math.h"
#include "attention_prefetch.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "attention_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::CoreOps;
using mlafx::attn::kBlockKeys;
using mlafx::attn::kMaxRows;

// The next key block (CoreOps::prefetch) is fetched one line every other pair of q.k.
// Measured on Zen 4 (one thread, 16 rows, 65536 keys of 576 in permuted blocks of 16, beyond
// L3): 19.4 -> 15.2 ms (117 -> 150 GFLOP/s; 180 when the keys are in L3); T0 or a line every
// pair: no better.

struct Layout {
  int64_t pa, pb, dvp;  // pairs in segment a / b, value width padded to 16
  size_t hdr, qp, qtail, lim, s, pp, pl, vp, o, m, l, alpha, pf, total;
  explicit Layout(const CoreDims& d) : pa(d.wa / 2), pb(d.wb / 2), dvp(round_up16(d.dv)) {
    WorkspaceCarver carve;
    hdr = carve.take(64);
    qp = carve.take(4 * static_cast<size_t>(pa + pb) * kMaxRows);
    qtail = carve.take(4 * 2 * kMaxRows);
    lim = carve.take(4 * kMaxRows);
    s = carve.take(4 * kBlockKeys * kMaxRows);
    pp = carve.take(4 * (kBlockKeys / 2) * kMaxRows);
    pl = carve.take(4 * (kBlockKeys / 2) * kMaxRows);
    vp = carve.take(4 * (kBlockKeys / 2) * static_cast<size_t>(dvp));
    o = carve.take(4 * kMaxRows * static_cast<size_t>(dvp));
    m = carve.take(4 * kMaxRows);
    l = carve.take(4 * kMaxRows);
    alpha = carve.take(4 * kMaxRows);
    pf = carve.take(sizeof(PrefetchList));
    total = carve.total();
  }
};

struct Header {
  int64_t rows;  // G
  int64_t gp;    // G rounded up to 16 (lanes in use)
};

// [a0..a15 | b0..b15] (bf16) -> [a0 b0 a1 b1 ... a15 b15]: pairs for dpbf16.
inline __m512i interleave_pairs(__m512i ab) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, ab);
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// ---- q.k: S[key, row] for M keys x NV row vectors ------------------------------------------

template <int M, int NV>
inline void qk_tile(const uint32_t* qp, int64_t gp, int64_t pa, int64_t pb,
                    const uint16_t* const* ka, const uint16_t* const* kb, const float* qtail,
                    bool tail_a, bool tail_b, int64_t wa, int64_t wb, PrefetchList* pf,
                    __m512 acc[M][NV]) {
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t kp = 0; kp < pa; ++kp) {
    if ((kp & 1) == 0) {
      pf->issue(1);
    }
    __m512i qv[NV];
    for (int v = 0; v < NV; ++v) {
      qv[v] = _mm512_loadu_si512(qp + kp * gp + 16 * v);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i kk = _mm512_set1_epi32(static_cast<int>(load_pair(ka[m] + 2 * kp)));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = dp(acc[m][v], qv[v], kk);
      }
    }
  }
  const uint32_t* qpb = qp + pa * gp;
  for (int64_t kp = 0; kp < pb; ++kp) {
    if ((kp & 1) == 0) {
      pf->issue(1);
    }
    __m512i qv[NV];
    for (int v = 0; v < NV; ++v) {
      qv[v] = _mm512_loadu_si512(qpb + kp * gp + 16 * v);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i kk = _mm512_set1_epi32(static_cast<int>(load_pair(kb[m] + 2 * kp)));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = dp(acc[m][v], qv[v], kk);
      }
    }
  }
  // Odd widths: the last element of a segment has no partner; fp32 FMA for it.
  if (tail_a) {
    for (int m = 0; m < M; ++m) {
      const __m512 kk = _mm512_set1_ps(bf16_bits_to_fp32(ka[m][wa - 1]));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_fmadd_ps(_mm512_loadu_ps(qtail + 16 * v), kk, acc[m][v]);
      }
    }
  }
  if (tail_b) {
    for (int m = 0; m < M; ++m) {
      const __m512 kk = _mm512_set1_ps(bf16_bits_to_fp32(kb[m][wb - 1]));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_fmadd_ps(_mm512_loadu_ps(qtail + kMaxRows + 16 * v), kk, acc[m][v]);
      }
    }
  }
}

// Scores for keys n0..n0+M-1 of the block, scaled to log2 units, masked to -inf where the
// key is at or past the row's limit.
template <int M, int NV>
inline void qk_keys(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0,
                    int64_t n0, const uint16_t* const* ka, const uint16_t* const* kb) {
  __m512 acc[M][NV];
  const uint16_t* const* kb_m = kb != nullptr ? kb + n0 : nullptr;
  qk_tile<M, NV>(at_offset<uint32_t>(ws, L.qp), gp, L.pa, L.pb, ka + n0, kb_m,
                 at_offset<float>(ws, L.qtail), (d.wa & 1) != 0, (d.wb & 1) != 0, d.wa, d.wb,
                 at_offset<PrefetchList>(ws, L.pf), acc);
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  float* s = at_offset<float>(ws, L.s);
  const __m512 scale = _mm512_set1_ps(d.scale * kLog2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int m = 0; m < M; ++m) {
    const __m512i j = _mm512_set1_epi32(static_cast<int>(j0 + n0 + m));
    for (int v = 0; v < NV; ++v) {
      const __mmask16 visible =
          _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(lim + 16 * v), j);
      _mm512_storeu_ps(s + (n0 + m) * gp + 16 * v,
                       _mm512_mask_mul_ps(neg_inf, visible, acc[m][v], scale));
    }
  }
}

template <int NV>
void qk_block(void* ws, const Layout& L, const CoreDims& d, int64_t gp, int64_t j0, int64_t n,
              const uint16_t* const* ka, const uint16_t* const* kb) {
  constexpr int M = NV <= 2 ? 8 : 4;
  int64_t n0 = 0;
  for (; n0 + M <= n; n0 += M) {
    qk_keys<M, NV>(ws, L, d, gp, j0, n0, ka, kb);
  }
  switch (n - n0) {
    case 7: if constexpr (M > 7) qk_keys<7, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 6: if constexpr (M > 6) qk_keys<6, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 5: if constexpr (M > 5) qk_keys<5, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 4: if constexpr (M > 4) qk_keys<4, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 3: qk_keys<3, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 2: qk_keys<2, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    case 1: qk_keys<1, NV>(ws, L, d, gp, j0, n0, ka, kb); break;
    default: break;
  }
}

// ---- online softmax: vertical over the block's keys, P written as bf16 pairs (hi and lo) -----

void softmax_block(void* ws, const Layout& L, int64_t gp, int64_t n) {
  float* s = at_offset<float>(ws, L.s);
  uint32_t* pp = at_offset<uint32_t>(ws, L.pp);
  uint32_t* pl = at_offset<uint32_t>(ws, L.pl);
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
    // Rows with no visible key yet keep max -inf: subtract 0 so p = 2^-inf = 0, not NaN.
    const __m512 shift =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ), mx, _mm512_setzero_ps());
    const __m512 a = exp2_ps(_mm512_sub_ps(m_old, shift));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l + v), a);
    for (int64_t k = 0; k < n; k += 2) {
      const __m512 p0 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + k * gp + v), shift));
      const __m512 p1 = k + 1 < n
                            ? exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(s + (k + 1) * gp + v), shift))
                            : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512bh hi = _mm512_cvtne2ps_pbh(p1, p0);  // [p0 | p1]
      const __m512i hi_bits = (__m512i)hi;
      const __m512 hi0 = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(hi_bits));
      const __m512 hi1 = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(hi_bits, 1));
      // p - hi is exact in fp32; its bf16 rounding leaves p - hi - lo within 2^-17 p
      const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, hi1), _mm512_sub_ps(p0, hi0));
      _mm512_storeu_si512(pp + (k / 2) * gp + v, interleave_pairs(hi_bits));
      _mm512_storeu_si512(pl + (k / 2) * gp + v, interleave_pairs(lo));
    }
    _mm512_storeu_ps(l + v, sum);
    _mm512_storeu_ps(m + v, mx);
    _mm512_storeu_ps(alpha + v, a);
  }
}

// ---- V packing: pairs of adjacent keys, [pair][d][2], zero-padded to dvp and to even n ------

void pack_v(void* ws, const Layout& L, int64_t dv, int64_t n, const uint16_t* const* v) {
  uint32_t* vp = at_offset<uint32_t>(ws, L.vp);
  const int64_t full = dv / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (dv % 16)) - 1u);
  for (int64_t k = 0; k < n; k += 2) {
    const uint16_t* v0 = v[k];
    const uint16_t* v1 = k + 1 < n ? v[k + 1] : nullptr;
    uint32_t* dst = vp + (k / 2) * L.dvp;
    for (int64_t i = 0; i < full; ++i) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * i));
      const __m256i x1 = v1 != nullptr
                             ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * i))
                             : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
      _mm512_storeu_si512(dst + 16 * i, interleave_pairs(both));
    }
    if (tail != 0) {
      // Masked loads: nothing past the row's end is touched.
      const __m256i x0 = _mm256_maskz_loadu_epi16(tail, v0 + 16 * full);
      const __m256i x1 =
          v1 != nullptr ? _mm256_maskz_loadu_epi16(tail, v1 + 16 * full) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
      _mm512_storeu_si512(dst + 16 * full, interleave_pairs(both));
    }
  }
}

// ---- P.V: O[row, d] = alpha[row] * O[row, d] + sum_pair Pp[pair, row] . Vp[pair, d] ----------

template <int MR, int ND>
inline void pv_tile(const uint32_t* pp, const uint32_t* pl, const uint32_t* vp, float* o,
                    const float* alpha, int64_t gp, int64_t dvp, int64_t pairs, int64_t g0,
                    int64_t d0) {
  __m512 acc[MR][ND];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < ND; ++c) {
      acc[r][c] = _mm512_setzero_ps();
    }
  }
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512i vv[ND];
    for (int c = 0; c < ND; ++c) {
      vv[c] = _mm512_loadu_si512(vp + kp * dvp + d0 + 16 * c);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i hi = _mm512_set1_epi32(static_cast<int>(pp[kp * gp + g0 + r]));
      const __m512i lo = _mm512_set1_epi32(static_cast<int>(pl[kp * gp + g0 + r]));
      for (int c = 0; c < ND; ++c) {
        acc[r][c] = dp(dp(acc[r][c], vv[c], hi), vv[c], lo);
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
  constexpr int MR = 8;
  const uint32_t* pp = at_offset<uint32_t>(ws, L.pp);
  const uint32_t* pl = at_offset<uint32_t>(ws, L.pl);
  const uint32_t* vp = at_offset<uint32_t>(ws, L.vp);
  float* o = at_offset<float>(ws, L.o);
  const float* alpha = at_offset<float>(ws, L.alpha);
  const int64_t pairs = (n + 1) / 2;
  for (int64_t g0 = 0; g0 < gp; g0 += MR) {  // gp is a multiple of 16
    int64_t d0 = 0;
    for (; d0 + 32 <= L.dvp; d0 += 32) {
      pv_tile<MR, 2>(pp, pl, vp, o, alpha, gp, L.dvp, pairs, g0, d0);
    }
    if (d0 < L.dvp) {
      pv_tile<MR, 1>(pp, pl, vp, o, alpha, gp, L.dvp, pairs, g0, d0);
    }
  }
}

// ---- the CoreOps entry points ---------------------------------------------------------------

size_t workspace_bytes(const CoreDims& d) { return Layout(d).total; }

void begin(void* ws, const CoreDims& d, int64_t num_rows, const void* const* q_rows,
           const int64_t* limits) {
  const Layout L(d);
  Header* h = at_offset<Header>(ws, L.hdr);
  h->rows = num_rows;
  h->gp = round_up16(num_rows);
  const int64_t gp = h->gp;
  uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  float* qtail = at_offset<float>(ws, L.qtail);
  int32_t* lim = at_offset<int32_t>(ws, L.lim);
  // Pack Q as [pair][row]: a 32-bit transpose, once per group.
  for (int64_t g = 0; g < gp; ++g) {
    if (g >= num_rows) {
      for (int64_t kp = 0; kp < L.pa + L.pb; ++kp) {
        qp[kp * gp + g] = 0;
      }
      qtail[g] = 0.f;
      qtail[kMaxRows + g] = 0.f;
      lim[g] = 0;
      continue;
    }
    const uint16_t* row = static_cast<const uint16_t*>(q_rows[g]);
    for (int64_t kp = 0; kp < L.pa; ++kp) {
      qp[kp * gp + g] = load_pair(row + 2 * kp);
    }
    for (int64_t kp = 0; kp < L.pb; ++kp) {
      qp[(L.pa + kp) * gp + g] = load_pair(row + d.wa + 2 * kp);
    }
    qtail[g] = (d.wa & 1) != 0 ? bf16_bits_to_fp32(row[d.wa - 1]) : 0.f;
    qtail[kMaxRows + g] = (d.wb & 1) != 0 ? bf16_bits_to_fp32(row[d.wa + d.wb - 1]) : 0.f;
    // Limits beyond int32 are clamped: no key list is that long.
    lim[g] = static_cast<int32_t>(limits[g] < INT32_MAX ? limits[g] : INT32_MAX);
  }
  std::memset(at_offset<float>(ws, L.o), 0, sizeof(float) * gp * L.dvp);
  at_offset<PrefetchList>(ws, L.pf)->clear();
  float* m = at_offset<float>(ws, L.m);
  float* l = at_offset<float>(ws, L.l);
  for (int64_t g = 0; g < gp; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
}

void block(void* ws, const CoreDims& d, int64_t j0, int64_t n, const void* const* ka,
           const void* const* kb, const void* const* v) {
  const Layout L(d);
  const int64_t gp = at_offset<Header>(ws, L.hdr)->gp;
  const auto* ka16 = reinterpret_cast<const uint16_t* const*>(ka);
  const auto* kb16 = reinterpret_cast<const uint16_t* const*>(kb);
  switch (gp / 16) {
    case 1: qk_block<1>(ws, L, d, gp, j0, n, ka16, kb16); break;
    case 2: qk_block<2>(ws, L, d, gp, j0, n, ka16, kb16); break;
    case 3: qk_block<3>(ws, L, d, gp, j0, n, ka16, kb16); break;
    default: qk_block<4>(ws, L, d, gp, j0, n, ka16, kb16); break;
  }
  softmax_block(ws, L, gp, n);
  pack_v(ws, L, d.dv, n, reinterpret_cast<const uint16_t* const*>(v));
  pv_block(ws, L, gp, n);
  at_offset<PrefetchList>(ws, L.pf)->clear();  // fetched (or not): never announced twice
}

void prefetch(void* ws, const CoreDims& d, int64_t n, const void* const* ka,
              const void* const* kb, const void* const* v) {
  at_offset<PrefetchList>(ws, Layout(d).pf)->set_block(d, n, ka, kb, v);
}

void end(void* ws, const CoreDims& d, void* const* out_rows, float* const* out_f32_rows,
         float* const* lse_ptrs) {
  const Layout L(d);
  const Header* h = at_offset<Header>(ws, L.hdr);
  const float* o = at_offset<float>(ws, L.o);
  const float* m = at_offset<float>(ws, L.m);
  const float* l = at_offset<float>(ws, L.l);
  const int32_t* lim = at_offset<int32_t>(ws, L.lim);
  const int64_t full = d.dv / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (d.dv % 16)) - 1u);
  // A zero row to read instead of O for empty rows: the (unused) V block buffer, cleared.
  float* zeros = at_offset<float>(ws, L.vp);
  std::memset(zeros, 0, sizeof(float) * std::min<int64_t>(L.dvp, kBlockKeys / 2 * L.dvp));
  for (int64_t g = 0; g < h->rows; ++g) {
    const bool empty = lim[g] <= 0;
    *lse_ptrs[g] = empty ? -std::numeric_limits<float>::infinity()
                         : (m[g] + std::log2(l[g])) * kLn2;
    // An empty row is written as exact zeros: its O may hold 0 * NaN from another row's keys.
    const __m512 inv = _mm512_set1_ps(empty ? 0.f : 1.f / l[g]);
    const float* src = empty ? zeros : o + g * L.dvp;
    if (out_rows != nullptr) {
      uint16_t* dst = static_cast<uint16_t*>(out_rows[g]);
      for (int64_t i = 0; i < full; ++i) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * i), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i),
                            (__m256i)_mm512_cvtneps_pbh(x));
      }
      if (tail != 0) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * full), inv);
        _mm256_mask_storeu_epi16(dst + 16 * full, tail, (__m256i)_mm512_cvtneps_pbh(x));
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

}  // namespace

const mlafx::attn::CoreOps& attention_core_bf16() {
  static const CoreOps table{&workspace_bytes, &begin, &block, &end, &prefetch};
  return table;
}

}  // namespace mlafx::avx512

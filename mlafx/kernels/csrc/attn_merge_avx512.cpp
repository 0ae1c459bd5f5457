// AVX-512 merge_attn_states (compiled with -mavx512f/bw/vl/dq/bf16). Called only after the
// run-time check in cpu_features.h; the scalar reference is merge_rows_portable in
// attn_merge.cpp. The weights are computed 16 tokens at a time (vector exp and log), the rows
// with fp32 FMAs.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>

#include "attention_avx512_math.h"
#include "attn_merge.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "attn_merge_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::merge::Elem;
using mlafx::merge::MergeArgs;

// ln(x) for x in [1, 2] (the sum of two weights, one of which is 1): 2 atanh(z),
// z = (x - 1) / (x + 1) <= 1/3, odd series to z^11 (error < 1e-7). NaN stays NaN.
inline __m512 log_1_to_2(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 z = _mm512_div_ps(_mm512_sub_ps(x, one), _mm512_add_ps(x, one));
  const __m512 z2 = _mm512_mul_ps(z, z);
  __m512 p = _mm512_set1_ps(1.f / 11);
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.f / 9));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.f / 7));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.f / 5));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(1.f / 3));
  p = _mm512_fmadd_ps(p, z2, one);
  return _mm512_mul_ps(_mm512_mul_ps(z, p), _mm512_set1_ps(2.f));
}

template <Elem E>
inline __m512 load16(const void* p, __mmask16 mask) {
  if constexpr (E == Elem::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (E == Elem::kFloat16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  } else {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

template <Elem E>
inline void store16(void* p, __m512 x, __mmask16 mask) {
  if constexpr (E == Elem::kFloat32) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else if constexpr (E == Elem::kFloat16) {
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(x));
  }
}

enum Mode : int { kWeighted = 0, kPrefixOnly = 1, kSuffixOnly = 2, kNone = 3 };

// Weights of 16 tokens x up to kHeadBlock heads are computed first (vectorised over the tokens
// of one head, where the LSEs are contiguous), then the rows are merged in memory order
// (token-major, then head): walking one head's rows across tokens would stride by a whole
// token (H * D elements) and defeat the hardware prefetcher.
constexpr int64_t kHeadBlock = 64;

// Kept as one function (~85 lines): the weight pass and the row pass share the block's weight
// and mode arrays on the stack, and the row loop's four modes are one switch in its body.
template <Elem E>
void merge_typed(const MergeArgs& a, int64_t t0, int64_t t1) {
  using elem_t = std::conditional_t<E == Elem::kFloat32, float, uint16_t>;
  const auto* prefix = static_cast<const elem_t*>(a.prefix);
  const auto* suffix = static_cast<const elem_t*>(a.suffix);
  auto* out = static_cast<elem_t*>(a.out);
  const int64_t d = a.head_dim;
  const int64_t full = d / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (d % 16)) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  alignas(64) float lp[16], ls[16];
  alignas(64) float wp[kHeadBlock][16], ws[kHeadBlock][16];
  alignas(64) int32_t mode[kHeadBlock][16];
  for (int64_t c0 = t0; c0 < t1; c0 += 16) {
    const int64_t n = t1 - c0 < 16 ? t1 - c0 : 16;
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t h0 = 0; h0 < a.num_heads; h0 += kHeadBlock) {
      const int64_t hn = a.num_heads - h0 < kHeadBlock ? a.num_heads - h0 : kHeadBlock;
      for (int64_t hb = 0; hb < hn; ++hb) {
        const int64_t h = h0 + hb;
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t t = c0 + (i < n ? i : 0);
          lp[i] = a.prefix_lse[h * a.prefix_lse_sh + t * a.prefix_lse_st];
          ls[i] = a.suffix_lse[h * a.suffix_lse_sh + t * a.suffix_lse_st];
        }
        const __m512 p = _mm512_load_ps(lp), s = _mm512_load_ps(ls);
        const __mmask16 p_empty = _mm512_fpclass_ps_mask(p, 0x18);  // +inf | -inf
        const __mmask16 s_empty = _mm512_fpclass_ps_mask(s, 0x18);
        const __m512 m = _mm512_max_ps(p, s);  // s NaN -> NaN; p NaN -> ep NaN below
        const __m512 ep = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(p, m), log2e));
        const __m512 es = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(s, m), log2e));
        const __m512 sum = _mm512_add_ps(ep, es);
        _mm512_store_ps(wp[hb], _mm512_div_ps(ep, sum));
        _mm512_store_ps(ws[hb], _mm512_div_ps(es, sum));
        __m512 lse = _mm512_add_ps(m, log_1_to_2(sum));
        lse = _mm512_mask_blend_ps(s_empty, lse, p);
        lse = _mm512_mask_blend_ps(p_empty, lse, s);
        lse = _mm512_mask_blend_ps(p_empty & s_empty, lse, neg_inf);
        __m512i md = _mm512_setzero_si512();
        md = _mm512_mask_blend_epi32(s_empty, md, _mm512_set1_epi32(kPrefixOnly));
        md = _mm512_mask_blend_epi32(p_empty, md, _mm512_set1_epi32(kSuffixOnly));
        md = _mm512_mask_blend_epi32(p_empty & s_empty, md, _mm512_set1_epi32(kNone));
        _mm512_store_si512(mode[hb], md);
        _mm512_mask_storeu_ps(a.out_lse + h * a.num_tokens + c0, lanes, lse);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = c0 + i;
        for (int64_t hb = 0; hb < hn; ++hb) {
          const int64_t h = h0 + hb;
          const elem_t* pr = prefix + t * a.prefix_st + h * a.prefix_sh;
          const elem_t* sr = suffix + t * a.suffix_st + h * a.suffix_sh;
          elem_t* o = out + (t * a.num_heads + h) * d;
          switch (mode[hb][i]) {
            case kNone:
              std::memset(o, 0, sizeof(elem_t) * d);
              break;
            case kPrefixOnly:
              std::memcpy(o, pr, sizeof(elem_t) * d);
              break;
            case kSuffixOnly:
              std::memcpy(o, sr, sizeof(elem_t) * d);
              break;
            default: {
              const __m512 vp = _mm512_set1_ps(wp[hb][i]), vs = _mm512_set1_ps(ws[hb][i]);
              for (int64_t k = 0; k < full; ++k) {
                const __m512 x =
                    _mm512_fmadd_ps(load16<E>(pr + 16 * k, 0xffff), vp,
                                    _mm512_mul_ps(load16<E>(sr + 16 * k, 0xffff), vs));
                store16<E>(o + 16 * k, x, 0xffff);
              }
              if (tail != 0) {
                const __m512 x =
                    _mm512_fmadd_ps(load16<E>(pr + 16 * full, tail), vp,
                                    _mm512_mul_ps(load16<E>(sr + 16 * full, tail), vs));
                store16<E>(o + 16 * full, x, tail);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

void merge_attn_states(const MergeArgs& args, int64_t t0, int64_t t1) {
  switch (args.elem) {
    case Elem::kBFloat16:
      return merge_typed<Elem::kBFloat16>(args, t0, t1);
    case Elem::kFloat16:
      return merge_typed<Elem::kFloat16>(args, t0, t1);
    default:
      return merge_typed<Elem::kFloat32>(args, t0, t1);
  }
}

}  // namespace mlafx::avx512

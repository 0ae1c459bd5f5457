// merge_attn_states: combine two attention results over disjoint key sets by their LSEs.
//
//   prefix_out, suffix_out: [T, H, D] bf16/fp16/fp32 (one dtype), last dim contiguous
//   prefix_lse, suffix_lse: [H, T] fp32 (natural log)
//   -> out [T, H, D] (input dtype, contiguous), lse [H, T] fp32
// Per (t, h): an infinite LSE (+inf or -inf) marks an empty half. Both empty: out 0, lse -inf.
// One empty: the other half is copied (its NaNs included). Otherwise m = max(p, s),
// out = (e^(p-m) * prefix + e^(s-m) * suffix) / (e^(p-m) + e^(s-m)), lse = m + log(sum).
// A NaN LSE gives NaN output and LSE; NaN outputs propagate through the weighted sum.
// Python reference: mlafx/kernels/attention_reference.py::merge_attn_states_ref.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "attn_merge.h"
#include "cpu_features.h"
#include "lse_merge.h"
#include "parallel_chunks.h"

namespace {

using mlafx::merge::Elem;
using mlafx::merge::MergeArgs;

// ---- Scalar reference -------------------------------------------------------------------

template <typename T>
void merge_rows_portable(const MergeArgs& a, int64_t t0, int64_t t1) {
  const T* prefix = static_cast<const T*>(a.prefix);
  const T* suffix = static_cast<const T*>(a.suffix);
  T* out = static_cast<T*>(a.out);
  const int64_t d = a.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const float p = a.prefix_lse[h * a.prefix_lse_sh + t * a.prefix_lse_st];
      const float s = a.suffix_lse[h * a.suffix_lse_sh + t * a.suffix_lse_st];
      const T* pr = prefix + t * a.prefix_st + h * a.prefix_sh;
      const T* sr = suffix + t * a.suffix_st + h * a.suffix_sh;
      T* o = out + (t * a.num_heads + h) * d;
      float* lse = a.out_lse + h * a.num_tokens + t;
      const bool p_empty = std::isinf(p), s_empty = std::isinf(s);
      if (p_empty && s_empty) {
        std::fill_n(o, d, T(0.f));
        *lse = -std::numeric_limits<float>::infinity();
      } else if (p_empty) {
        std::copy_n(sr, d, o);
        *lse = s;
      } else if (s_empty) {
        std::copy_n(pr, d, o);
        *lse = p;
      } else {
        const float lses[2] = {p, s};
        float w[2];  // NaN in either LSE: the weights and the LSE become NaN
        *lse = mlafx::lse_merge_weights(lses, 2, w);
        for (int64_t i = 0; i < d; ++i) {
          o[i] = static_cast<T>(w[0] * static_cast<float>(pr[i]) + w[1] * static_cast<float>(sr[i]));
        }
      }
    }
  }
}

void merge_portable(const MergeArgs& a, int64_t t0, int64_t t1) {
  switch (a.elem) {
    case Elem::kBFloat16:
      return merge_rows_portable<c10::BFloat16>(a, t0, t1);
    case Elem::kFloat16:
      return merge_rows_portable<c10::Half>(a, t0, t1);
    default:
      return merge_rows_portable<float>(a, t0, t1);
  }
}

// ---- at::Tensor entry -------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> merge_attn_states(
    const at::Tensor& prefix_out,  // [T, H, D]
    const at::Tensor& prefix_lse,  // [H, T] fp32
    const at::Tensor& suffix_out,  // [T, H, D]
    const at::Tensor& suffix_lse   // [H, T] fp32
) {
  constexpr const char* op = "merge_attn_states";
  for (const at::Tensor* t : {&prefix_out, &prefix_lse, &suffix_out, &suffix_lse}) {
    TORCH_CHECK(t->device().is_cpu(), op, ": all tensors must be on the CPU, got one on ",
                t->device());
  }
  const at::ScalarType dtype = prefix_out.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
                   ": prefix_out must be bfloat16, float16 or float32, got ", dtype);
  TORCH_CHECK_TYPE(suffix_out.scalar_type() == dtype, op, ": suffix_out must have prefix_out's "
                   "dtype ", dtype, ", got ", suffix_out.scalar_type());
  TORCH_CHECK_TYPE(prefix_lse.scalar_type() == at::kFloat &&
                       suffix_lse.scalar_type() == at::kFloat,
                   op, ": prefix_lse and suffix_lse must be float32, got ",
                   prefix_lse.scalar_type(), " and ", suffix_lse.scalar_type());
  TORCH_CHECK_VALUE(prefix_out.dim() == 3, op, ": prefix_out must be [num_tokens, num_heads, "
                    "head_dim], got shape ", prefix_out.sizes());
  TORCH_CHECK_VALUE(suffix_out.sizes() == prefix_out.sizes(), op, ": suffix_out has shape ",
                    suffix_out.sizes(), " but prefix_out has ", prefix_out.sizes());
  const int64_t T = prefix_out.size(0), H = prefix_out.size(1), D = prefix_out.size(2);
  for (const at::Tensor* lse : {&prefix_lse, &suffix_lse}) {
    TORCH_CHECK_VALUE(lse->dim() == 2 && lse->size(0) == H && lse->size(1) == T, op,
                      ": LSEs must be [num_heads, num_tokens] = [", H, ", ", T, "], got shape ",
                      lse->sizes());
  }
  for (const at::Tensor* o : {&prefix_out, &suffix_out}) {
    TORCH_CHECK_VALUE(D <= 1 || o->stride(2) == 1, op,
                      ": outputs' last dim must be contiguous, got strides ", o->strides());
  }
  at::Tensor out = at::empty({T, H, D}, prefix_out.options());
  at::Tensor lse = at::empty({H, T}, prefix_lse.options());
  if (T == 0 || H == 0) {
    return {out, lse};
  }
  MergeArgs a;
  a.prefix = prefix_out.const_data_ptr();
  a.suffix = suffix_out.const_data_ptr();
  a.out = out.data_ptr();
  a.prefix_st = prefix_out.stride(0);
  a.prefix_sh = prefix_out.stride(1);
  a.suffix_st = suffix_out.stride(0);
  a.suffix_sh = suffix_out.stride(1);
  a.prefix_lse = prefix_lse.const_data_ptr<float>();
  a.suffix_lse = suffix_lse.const_data_ptr<float>();
  a.prefix_lse_sh = prefix_lse.stride(0);
  a.prefix_lse_st = prefix_lse.stride(1);
  a.suffix_lse_sh = suffix_lse.stride(0);
  a.suffix_lse_st = suffix_lse.stride(1);
  a.out_lse = lse.data_ptr<float>();
  a.num_tokens = T;
  a.num_heads = H;
  a.head_dim = D;
  a.elem = dtype == at::kBFloat16 ? Elem::kBFloat16
           : dtype == at::kHalf   ? Elem::kFloat16
                                  : Elem::kFloat32;
  const bool vectorised = mlafx::use_avx512_bf16();
  // ~64 KB of output per chunk.
  const int64_t row_bytes = std::max<int64_t>(1, H * D * static_cast<int64_t>(out.element_size()));
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / row_bytes);
  mlafx::parallel_chunks(0, T, grain, [&](int64_t t0, int64_t t1) {
    if (vectorised) {
      mlafx::avx512::merge_attn_states(a, t0, t1);
    } else {
      merge_portable(a, t0, t1);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "merge_attn_states(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, "
      "Tensor suffix_lse) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("merge_attn_states", &merge_attn_states); }

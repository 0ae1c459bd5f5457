// v4_compress_pool: DeepSeek-V4's compressor at a window close. The entries whose window
// closes in the step, each pooled from its window's cached compressor inputs and written into
// the pool cache (the arithmetic: v4_compressor.h; the reference:
// models/deepseek_v4/compressor.py, PoolCompressor.close).
//
//   rows          [NB, BS, 2 * sw]   bf16/fp16/fp32, contiguous: per token kv (sw) | gate (sw);
//                                    sw = c (HCA) or 2c (CSA: series A | series B)
//   sources       [N, 2m] int64      token slots of window w-1 (m), then window w (m)
//   has_previous  [N] bool           False for w = 0 (CSA: series A masked)
//   position_bias [m, sw] float32
//   norm_weight   [c] float32
//   eps           float
//   cos, sin      [N, R/2] float32   the entries' rope (position w * m, times the YaRN scale)
//   overlap       bool               CSA (2m slots) or HCA (window w's m)
//   pool          [NB', P, c]        rows' dtype, contiguous, written in place
//   slots         [N] int64          pool slot of each entry
// Entries are independent: threads split them. AVX-512 (v4_compressor_avx512.cpp: 16 channels
// at a time) when use_avx512_bf16() for fp32 and bf16; fp16 and other CPUs: the portable loops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_bits.h"
#include "cpu_features.h"
#include "op_checks.h"
#include "v4_compressor_entry.h"

namespace {
#include "v4_compressor.h"

template <>
struct Bits<c10::Half> {
  static float load(const c10::Half* p) { return static_cast<float>(*p); }
  static void store(c10::Half* p, float v) { *p = static_cast<c10::Half>(v); }
  static float round(float v) { return static_cast<float>(static_cast<c10::Half>(v)); }
};

constexpr const char* kOp = "v4_compress_pool";

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim && t.is_contiguous(), kOp, ": ", name, " must be a contiguous ",
                    dim, "-D tensor, got shape ", t.sizes(), " strides ", t.strides());
}

void v4_compress_pool(const at::Tensor& rows, const at::Tensor& sources,
                      const at::Tensor& has_previous, const at::Tensor& position_bias,
                      const at::Tensor& norm_weight, double eps, const at::Tensor& cos,
                      const at::Tensor& sin, bool overlap, at::Tensor& pool,
                      const at::Tensor& slots) {
  mlafx::op_checks::check_cpu(kOp, {&rows, &sources, &has_previous, &position_bias, &norm_weight,
                                    &cos, &sin, &pool, &slots});
  TORCH_CHECK_TYPE(mlafx::op_checks::is_supported_float(rows.scalar_type()), kOp,
                   ": rows must be bfloat16, float16 or float32, got ", rows.scalar_type());
  check(rows, "rows", rows.scalar_type(), 3);
  check(pool, "pool", rows.scalar_type(), 3);
  check(sources, "sources", at::kLong, 2);
  check(has_previous, "has_previous", at::kBool, 1);
  check(position_bias, "position_bias", at::kFloat, 2);
  check(norm_weight, "norm_weight", at::kFloat, 1);
  check(cos, "cos", at::kFloat, 2);
  check(sin, "sin", at::kFloat, 2);
  check(slots, "slots", at::kLong, 1);
  const int64_t n = sources.size(0), m = position_bias.size(0), sw = position_bias.size(1);
  const int64_t c = pool.size(2), half = cos.size(1);
  TORCH_CHECK_VALUE(sw == (overlap ? 2 : 1) * c && rows.size(2) == 2 * sw, kOp,
                    ": position_bias [m, sw] and rows [.., .., 2 * sw] must have sw = ",
                    overlap ? "2c" : "c", " (c = ", c, "), got ", position_bias.sizes(), " and ",
                    rows.sizes());
  TORCH_CHECK_VALUE(m > 0 && sources.size(1) == 2 * m, kOp, ": sources must be [N, 2m] = [N, ",
                    2 * m, "], got ", sources.sizes());
  TORCH_CHECK_VALUE(has_previous.size(0) == n && slots.size(0) == n && cos.size(0) == n &&
                        sin.sizes() == cos.sizes(),
                    kOp, ": has_previous, slots, cos and sin must have N = ", n,
                    " rows, got ", has_previous.sizes(), ", ", slots.sizes(), ", ", cos.sizes(),
                    ", ", sin.sizes());
  TORCH_CHECK_VALUE(norm_weight.size(0) == c && 2 * half <= c, kOp, ": norm_weight must be [", c,
                    "] and the rope's 2 * ", half, " dims fit in it, got ", norm_weight.sizes());
  const int64_t row_slots = rows.size(0) * rows.size(1), pool_slots = pool.size(0) * pool.size(1);
  const int64_t* src = sources.const_data_ptr<int64_t>();
  const int64_t* dst = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n * 2 * m; ++i) {
    TORCH_CHECK_INDEX(src[i] >= 0 && src[i] < row_slots, kOp, ": sources[", i / (2 * m), ", ",
                      i % (2 * m), "] = ", src[i], " is out of range for ", row_slots,
                      " token slots; nothing was written");
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(dst[i] >= 0 && dst[i] < pool_slots, kOp, ": slots[", i, "] = ", dst[i],
                      " is out of range for ", pool_slots, " pool slots; nothing was written");
  }
  if (n == 0) {
    return;
  }
  const mlafx::V4Compress p{rows.const_data_ptr(), src, has_previous.const_data_ptr<bool>(),
                            position_bias.const_data_ptr<float>(),
                            norm_weight.const_data_ptr<float>(), cos.const_data_ptr<float>(),
                            sin.const_data_ptr<float>(), pool.data_ptr(), dst, m, c, sw,
                            2 * half, overlap, static_cast<float>(eps)};
  const at::ScalarType dtype = rows.scalar_type();
  const bool avx512 = mlafx::use_avx512_bf16() && dtype != at::kHalf;
  at::parallel_for(0, n, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> buffer(static_cast<size_t>(compress_scratch_floats(c, m)));
    float* scratch = buffer.data();
    if (dtype == at::kFloat) {
      avx512 ? mlafx::avx512::v4_compress_f32(p, n0, n1, scratch)
             : compress_entries<float>(p, n0, n1, scratch);
    } else if (dtype == at::kBFloat16) {
      avx512 ? mlafx::avx512::v4_compress_bf16(p, n0, n1, scratch)
             : compress_entries<Bf16>(p, n0, n1, scratch);
    } else {
      compress_entries<c10::Half>(p, n0, n1, scratch);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "v4_compress_pool(Tensor rows, Tensor sources, Tensor has_previous, Tensor position_bias, "
      "Tensor norm_weight, float eps, Tensor cos, Tensor sin, bool overlap, Tensor(a!) pool, "
      "Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("v4_compress_pool", &v4_compress_pool); }

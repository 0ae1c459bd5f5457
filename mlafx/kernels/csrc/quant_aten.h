// ATen-facing helpers of the quantized products, shared by quant_linear.cpp and quant_moe.cpp.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "quant.h"
#include "scratch_buffer.h"

namespace mlafx {

// Rows of x quantized per group of 32 (quant_format.quantize_activations), owning the
// buffers that QuantRows points into: q [rows, ldq] (groups * 32 used), d and qsum
// [rows, groups].
struct QuantizedActivations {
  int64_t rows = 0;
  int64_t groups = 0;
  int64_t ldq = 0;  // quant_row_stride(groups)
  ScratchVector<int8_t> q;
  ScratchVector<float> d;
  ScratchVector<int32_t> qsum;

  // Rows [row0, rows) as the kernels' view.
  QuantRows view(int64_t row0 = 0) const;
};

// x [M, K] bf16/fp16/fp32, last dim contiguous (rows may be strided); in parallel over rows.
QuantizedActivations quantize_activations(const at::Tensor& x);

// Rows `index` of `src`, in that order (moe: the tokens of each expert, quantized once).
QuantizedActivations gather_rows(const QuantizedActivations& src,
                                 const std::vector<int64_t>& index);

// out[m * ldo + n] = the product of rows x (M of them) with the packed weight [NB, G, S]
// over its rows n in [0, N), fp32, in parallel over blocks (>= ~64 KB of weight per thread).
void quant_product_f32(int format, const QuantRows& x, int64_t M, const uint8_t* packed,
                       int64_t blocks, int64_t groups, int64_t N, float* out, int64_t ldo);

// The format of a packed weight from its last dim (quant.h: 544 -> kFormatInt8, 288 ->
// kFormatInt4, 4544 -> kFormatK8, 2496 -> kFormatK4), else 0.
int quant_format_of(int64_t group_bytes);

// Groups (super-blocks for the K formats) a row of `width` columns takes in `format`.
inline int64_t quant_groups_of(int format, int64_t width) {
  const int64_t columns = quant_group_columns(format);
  return (width + columns - 1) / columns;
}

}  // namespace mlafx

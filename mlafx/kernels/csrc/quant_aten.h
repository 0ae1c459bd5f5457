// ATen-facing helpers of the quantized products, shared by quant_linear.cpp and quant_moe.cpp.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <new>
#include <vector>

#include "quant.h"

namespace mlafx {

// A std::vector allocator on 64-byte boundaries: quantized rows start on a cache line, so the
// AMX kernel's 32-byte tile rows never straddle two.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: rebinding is implicit
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const CacheLineAllocator&) const { return true; }
};

// Rows of x quantized per group of 32 (quant_format.quantize_activations), owning the
// buffers that QuantRows points into: q [rows, ldq] (groups * 32 used), d and qsum
// [rows, groups].
struct QuantizedActivations {
  int64_t rows = 0;
  int64_t groups = 0;
  int64_t ldq = 0;  // quant_row_stride(groups)
  std::vector<int8_t, CacheLineAllocator<int8_t>> q;
  std::vector<float> d;
  std::vector<int32_t> qsum;

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

// Input checks shared by the ops' at::Tensor entries: each names the op and the argument.
// Portable sources only (includes ATen).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

namespace mlafx::op_checks {

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

inline void check_cpu(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu(), op, ": all tensors must be on the CPU, got one on ",
                t->device());
  }
}

inline void check_last_dim_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    "'s last dim must be contiguous, got strides ", t.strides());
}

inline void check_index(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                 int64_t dim) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be ",
                   dtype == at::kInt ? "int32" : "int64", ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got shape ",
                    t.sizes());
}

// cu_seqlens-style offsets: starts at 0, non-decreasing, ends at `total`.
inline void check_offsets(const char* op, const char* name, const int32_t* p, int64_t stride,
                   int64_t count, int64_t total, const char* total_name) {
  TORCH_CHECK_VALUE(p[0] == 0, op, ": ", name, "[0] must be 0, got ", p[0]);
  for (int64_t i = 0; i + 1 < count; ++i) {
    TORCH_CHECK_VALUE(p[(i + 1) * stride] >= p[i * stride], op, ": ", name,
                      " must be non-decreasing, but ", name, "[", i + 1, "] = ",
                      p[(i + 1) * stride], " < ", name, "[", i, "] = ", p[i * stride]);
  }
  TORCH_CHECK_VALUE(p[(count - 1) * stride] == total, op, ": ", name, "[-1] = ",
                    p[(count - 1) * stride], " must equal ", total_name, " = ", total);
}

// A paged cache's index: every kv_lens[b] in 0..M*BS and every block-table entry a sequence
// uses (the first ceil(kv_lens[b] / BS)) a block of the cache; entries past those are never
// read, so they may hold anything.
inline void check_paged_table(const char* op, const at::Tensor& block_table,  // [B, M] int32
                              const at::Tensor& kv_lens,                      // [B] int32
                              int64_t num_blocks, int64_t block_size) {
  const int64_t B = block_table.size(0), M = block_table.size(1);
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b * kv_lens.stride(0)];
    TORCH_CHECK_VALUE(len >= 0 && len <= M * block_size, op, ": kv_lens[", b, "] = ", len,
                      " is out of range 0..", M * block_size, " (block_table width ", M,
                      " x block_size ", block_size, ")");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t block = table[b * block_table.stride(0) + i * block_table.stride(1)];
      TORCH_CHECK_INDEX(block >= 0 && block < num_blocks, op, ": block_table[", b, ", ", i,
                        "] = ", block, " is out of range for a cache of ", num_blocks,
                        " blocks");
    }
  }
}

}  // namespace mlafx::op_checks

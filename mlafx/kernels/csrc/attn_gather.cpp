// gather_latent: copy rows of the paged latent cache at host-built slots.
//
//   kv_cache: [NB, BS, Lkv + R] bf16/fp16/fp32, contiguous
//   slots:    [N] int64          slot = block * BS + offset; every slot must be in range
//                                (-1 is an error here: the host never pads a gather)
//   -> [N, Lkv + R] in the cache dtype, contiguous
// Python reference: mlafx/kernels/attention_reference.py::gather_latent_ref.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_chunks.h"

namespace {

at::Tensor gather_latent(const at::Tensor& kv_cache,  // [NB, BS, Lkv + R]
                         const at::Tensor& slots      // [N] int64
) {
  constexpr const char* op = "gather_latent";
  TORCH_CHECK(kv_cache.device().is_cpu() && slots.device().is_cpu(), op,
              ": all tensors must be on the CPU, got kv_cache on ", kv_cache.device(),
              ", slots on ", slots.device());
  const at::ScalarType dtype = kv_cache.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
                   ": kv_cache must be bfloat16, float16 or float32, got ", dtype);
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, op, ": slots must be int64, got ",
                   slots.scalar_type());
  TORCH_CHECK_VALUE(kv_cache.dim() == 3, op, ": kv_cache must be [num_blocks, block_size, "
                    "kv_lora_rank + rope_dim], got shape ", kv_cache.sizes());
  TORCH_CHECK_VALUE(slots.dim() == 1, op, ": slots must be [num_rows], got shape ",
                    slots.sizes());
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), op, ": kv_cache must be contiguous, got strides ",
                    kv_cache.strides());
  const int64_t n = slots.size(0);
  const int64_t width = kv_cache.size(2);
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t stride = slots.stride(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slot[i * stride];
    TORCH_CHECK_INDEX(s >= 0 && s < num_slots, op, ": slots[", i, "] = ", s,
                      " is out of range for a cache of ", kv_cache.size(0), " blocks x ",
                      kv_cache.size(1), " slots (valid: 0..", num_slots - 1, ")");
  }
  at::Tensor out = at::empty({n, width}, kv_cache.options());
  if (n == 0 || width == 0) {
    return out;
  }
  const size_t row_bytes = static_cast<size_t>(width) * kv_cache.element_size();
  const char* src = static_cast<const char*>(kv_cache.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  // ~32 KB per chunk amortises waking a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / static_cast<int64_t>(row_bytes));
  mlafx::parallel_chunks(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(dst + i * row_bytes, src + slot[i * stride] * row_bytes, row_bytes);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) { m.def("gather_latent(Tensor kv_cache, Tensor slots) -> Tensor"); }

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("gather_latent", &gather_latent); }

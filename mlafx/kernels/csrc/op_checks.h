// Input checks shared by the ops' at::Tensor entries: each names the op and the argument.
// Portable sources only (includes ATen).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
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

// The names the checks give the paged cache's tensors (v4_attention: its window's and
// its pool's).
struct PagedNames {
  const char* cache = "kv_cache";
  const char* table = "block_table";
  const char* lens = "kv_lens";
};

// A paged cache's index: every kv_lens[b] in 0..M*BS and every block-table entry a sequence
// uses (the first ceil(kv_lens[b] / BS)) a block of the cache; entries past those are never
// read, so they may hold anything.
inline void check_paged_table(const char* op, const at::Tensor& block_table,  // [B, M] int32
                              const at::Tensor& kv_lens,                      // [B] int32
                              int64_t num_blocks, int64_t block_size,
                              const PagedNames& names = {}) {
  const char* table_name = names.table;
  const char* lens_name = names.lens;
  const int64_t B = block_table.size(0), M = block_table.size(1);
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b * kv_lens.stride(0)];
    TORCH_CHECK_VALUE(len >= 0 && len <= M * block_size, op, ": ", lens_name, "[", b, "] = ",
                      len, " is out of range 0..", M * block_size, " (", table_name, " width ",
                      M, " x block_size ", block_size, ")");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t block = table[b * block_table.stride(0) + i * block_table.stride(1)];
      TORCH_CHECK_INDEX(block >= 0 && block < num_blocks, op, ": ", table_name, "[", b, ", ",
                        i, "] = ", block, " is out of range for a cache of ", num_blocks,
                        " blocks");
    }
  }
}

// The arguments every absorbed-MLA op over the paged latent cache shares (mla_attention_paged,
// mla_attention_sparse): q [T, H, Lkv + R] and kv_cache [NB, BS, Lkv + R] of one float dtype,
// the sequences' block_table / kv_lens / query_start_loc, scale and kv_lora_rank. The op's
// per-token index tensor (positions, selected) is its own to check.
inline void check_latent_attention(const char* op, const at::Tensor& q,
                                   const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& kv_lens, const at::Tensor& query_start_loc,
                                   double scale, int64_t kv_lora_rank,
                                   const PagedNames& names = {}) {
  TORCH_CHECK_TYPE(is_supported_float(q.scalar_type()), op,
                   ": q must be bfloat16, float16 or float32, got ", q.scalar_type());
  TORCH_CHECK_TYPE(kv_cache.scalar_type() == q.scalar_type(), op,
                   ": ", names.cache, " must have q's dtype ", q.scalar_type(), ", got ",
                   kv_cache.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3, op, ": q must be [num_tokens, num_heads, kv_lora_rank + "
                    "rope_dim], got shape ", q.sizes());
  TORCH_CHECK_VALUE(kv_cache.dim() == 3, op, ": ", names.cache, " must be [num_blocks, "
                    "block_size, kv_lora_rank + rope_dim], got shape ", kv_cache.sizes());
  check_index(op, names.table, block_table, at::kInt, 2);
  check_index(op, names.lens, kv_lens, at::kInt, 1);
  check_index(op, "query_start_loc", query_start_loc, at::kInt, 1);
  const int64_t T = q.size(0), W = q.size(2);
  const int64_t NB = kv_cache.size(0), BS = kv_cache.size(1);
  const int64_t B = block_table.size(0);
  TORCH_CHECK_VALUE(kv_cache.size(2) == W, op, ": ", names.cache, " rows are ",
                    kv_cache.size(2), " wide but q rows are ", W);
  TORCH_CHECK_VALUE(kv_lora_rank >= 1 && kv_lora_rank <= W, op, ": kv_lora_rank = ",
                    kv_lora_rank, " must be in 1..", W, " (the cache row width)");
  TORCH_CHECK_VALUE(BS >= 1, op, ": block_size must be at least 1, got ", BS);
  TORCH_CHECK_VALUE(kv_lens.size(0) == B, op, ": ", names.lens, " has ", kv_lens.size(0),
                    " entries but ", names.table, " has ", B, " rows");
  TORCH_CHECK_VALUE(query_start_loc.size(0) == B + 1, op, ": query_start_loc must have ",
                    B + 1, " entries (num_seqs + 1), got ", query_start_loc.size(0));
  check_last_dim_contiguous(op, "q", q);
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), op, ": ", names.cache,
                    " must be contiguous, got strides ", kv_cache.strides());
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_offsets(op, "query_start_loc", query_start_loc.const_data_ptr<int32_t>(),
                query_start_loc.stride(0), B + 1, T, "num_tokens");
  check_paged_table(op, block_table, kv_lens, NB, BS, names);
}

}  // namespace mlafx::op_checks

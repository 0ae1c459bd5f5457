// write_latent_cache: scatter new latent rows [kv_c | k_pe] into the paged latent cache.
//
//   kv_c:         [T, Lkv]          bf16/fp16/fp32, last dim contiguous
//   k_pe:         [T, R]            bf16/fp16/fp32, last dim contiguous
//   kv_cache:     [NB, BS, Lkv + R] bf16/fp16/fp32, contiguous, written in place
//   slot_mapping: [T] int64         row t goes to slot = block * BS + offset; -1 = skip
//
// Values are cast to the cache dtype with round to nearest even: for every non-NaN input the
// bytes equal torch's `.to(cache.dtype)`; a NaN stays a NaN (bits below). Python reference:
// mlafx/kernels/reference.py::write_latent_cache_ref.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16_bits.h"
#include "cpu_features.h"
#include "latent_cache.h"
#include "parallel_chunks.h"

namespace {

// ---- Scalar reference conversions ------------------------------------------------------

template <typename dst_t>
inline dst_t cast_rne(float value);

template <>
inline float cast_rne<float>(float value) {
  return value;
}

template <>
inline c10::Half cast_rne<c10::Half>(float value) {
  return c10::Half(value);  // IEEE round to nearest even, subnormals and overflow to inf
}

template <>
inline c10::BFloat16 cast_rne<c10::BFloat16>(float value) {
  return c10::BFloat16(mlafx::fp32_to_bf16_bits(value), c10::BFloat16::from_bits());
}

// Every source dtype widens to fp32 exactly, so one rounding step from fp32 gives the same
// result as a direct conversion (and as torch, which also goes through fp32).
template <typename src_t, typename dst_t>
void convert_row(const void* src, void* dst, int64_t n) {
  const auto* in = static_cast<const src_t*>(src);
  auto* out = static_cast<dst_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = cast_rne<dst_t>(static_cast<float>(in[i]));
  }
}

// Same dtype: a byte copy (the common case, model dtype == cache dtype); also keeps NaN bits.
template <typename T>
void copy_row(const void* src, void* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
}

void convert_row_fp32_to_bf16_avx512(const void* src, void* dst, int64_t n) {
  mlafx::avx512::convert_fp32_to_bf16(static_cast<const float*>(src), static_cast<uint16_t*>(dst),
                                      n);
}

using ConvertRowFn = void (*)(const void* src, void* dst, int64_t n);

template <typename dst_t>
ConvertRowFn select_for_dst(at::ScalarType src) {
  switch (src) {
    case at::kFloat:
      return std::is_same_v<dst_t, float> ? copy_row<float> : convert_row<float, dst_t>;
    case at::kHalf:
      return std::is_same_v<dst_t, c10::Half> ? copy_row<c10::Half>
                                               : convert_row<c10::Half, dst_t>;
    case at::kBFloat16:
      return std::is_same_v<dst_t, c10::BFloat16> ? copy_row<c10::BFloat16>
                                                   : convert_row<c10::BFloat16, dst_t>;
    default:
      TORCH_CHECK(false, "write_latent_cache: unsupported dtype ", src);  // checked earlier
  }
}

// The scalar reference for each (src, dst) pair, with SIMD specialisations where they exist.
ConvertRowFn select_convert_row(at::ScalarType src, at::ScalarType dst) {
  if (src == at::kFloat && dst == at::kBFloat16 && mlafx::use_avx512_bf16()) {
    return convert_row_fp32_to_bf16_avx512;
  }
  switch (dst) {
    case at::kFloat:
      return select_for_dst<float>(src);
    case at::kHalf:
      return select_for_dst<c10::Half>(src);
    case at::kBFloat16:
      return select_for_dst<c10::BFloat16>(src);
    default:
      TORCH_CHECK(false, "write_latent_cache: unsupported dtype ", dst);  // checked earlier
  }
}

// ---- Raw-pointer implementation ---------------------------------------------------------

struct RowSource {
  const char* data;
  int64_t row_stride_bytes;
  int64_t width;  // elements
  ConvertRowFn convert;
};

void write_latent_rows(const RowSource& kv_c, const RowSource& k_pe, char* cache,
                       int64_t cache_elem_bytes, const int64_t* slots, int64_t slot_stride,
                       int64_t num_tokens) {
  const int64_t row_bytes = (kv_c.width + k_pe.width) * cache_elem_bytes;
  const int64_t k_pe_offset_bytes = kv_c.width * cache_elem_bytes;
  // One row is ~1 KB (576 bf16); a chunk of ~32 KB amortises waking a thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / std::max<int64_t>(row_bytes, 1));
  mlafx::parallel_chunks(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) {
        continue;  // -1: the caller asked to skip this token (bounds were checked up front)
      }
      char* row = cache + slot * row_bytes;
      kv_c.convert(kv_c.data + t * kv_c.row_stride_bytes, row, kv_c.width);
      k_pe.convert(k_pe.data + t * k_pe.row_stride_bytes, row + k_pe_offset_bytes, k_pe.width);
    }
  });
}

// ---- at::Tensor entry -------------------------------------------------------------------

bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

void write_latent_cache(const at::Tensor& kv_c,         // [T, Lkv]
                        const at::Tensor& k_pe,         // [T, R]
                        at::Tensor& kv_cache,           // [NB, BS, Lkv + R], mutated
                        const at::Tensor& slot_mapping  // [T] int64
) {
  // Every check happens before the first write: a failing call leaves the cache untouched.
  TORCH_CHECK(kv_c.device().is_cpu() && k_pe.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "write_latent_cache: all tensors must be on the CPU, got kv_c on ", kv_c.device(),
              ", k_pe on ", k_pe.device(), ", kv_cache on ", kv_cache.device(),
              ", slot_mapping on ", slot_mapping.device());
  TORCH_CHECK_TYPE(is_supported_float(kv_c.scalar_type()) &&
                       is_supported_float(k_pe.scalar_type()) &&
                       is_supported_float(kv_cache.scalar_type()),
                   "write_latent_cache: kv_c, k_pe and kv_cache must be bfloat16, float16 or "
                   "float32, got ",
                   kv_c.scalar_type(), ", ", k_pe.scalar_type(), ", ", kv_cache.scalar_type());
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong,
                   "write_latent_cache: slot_mapping must be int64, got ",
                   slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(kv_c.dim() == 2, "write_latent_cache: kv_c must be [num_tokens, kv_lora_rank], "
                    "got shape ", kv_c.sizes());
  TORCH_CHECK_VALUE(k_pe.dim() == 2, "write_latent_cache: k_pe must be [num_tokens, rope_dim], "
                    "got shape ", k_pe.sizes());
  TORCH_CHECK_VALUE(kv_cache.dim() == 3,
                    "write_latent_cache: kv_cache must be [num_blocks, block_size, "
                    "kv_lora_rank + rope_dim], got shape ", kv_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1,
                    "write_latent_cache: slot_mapping must be [num_tokens], got shape ",
                    slot_mapping.sizes());
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK_VALUE(kv_c.size(0) == num_tokens && k_pe.size(0) == num_tokens,
                    "write_latent_cache: kv_c, k_pe and slot_mapping must have the same number "
                    "of tokens, got ", kv_c.size(0), ", ", k_pe.size(0), ", ", num_tokens);
  const int64_t kv_lora_rank = kv_c.size(1);
  const int64_t rope_dim = k_pe.size(1);
  TORCH_CHECK_VALUE(kv_cache.size(2) == kv_lora_rank + rope_dim,
                    "write_latent_cache: kv_cache rows are ", kv_cache.size(2),
                    " wide but kv_c (", kv_lora_rank, ") + k_pe (", rope_dim, ") is ",
                    kv_lora_rank + rope_dim);
  // Rows may be strided (e.g. views into the fused kv_a_proj output), elements may not.
  TORCH_CHECK_VALUE(kv_c.size(1) <= 1 || kv_c.stride(1) == 1,
                    "write_latent_cache: kv_c's last dim must be contiguous, got strides ",
                    kv_c.strides());
  TORCH_CHECK_VALUE(k_pe.size(1) <= 1 || k_pe.stride(1) == 1,
                    "write_latent_cache: k_pe's last dim must be contiguous, got strides ",
                    k_pe.strides());
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), "write_latent_cache: kv_cache must be contiguous, "
                    "got strides ", kv_cache.strides());

  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  // Check every slot before writing any: an out-of-range slot is a runtime bug, and a
  // half-written cache would hide where it came from.
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t * slot_stride];
    TORCH_CHECK_INDEX(slot == -1 || (slot >= 0 && slot < num_slots),
                      "write_latent_cache: slot_mapping[", t, "] = ", slot,
                      " is out of range for a cache of ", kv_cache.size(0), " blocks x ",
                      kv_cache.size(1), " slots (valid: 0..", num_slots - 1,
                      ", or -1 to skip); nothing was written");
  }
  if (num_tokens == 0) {
    return;
  }

  const RowSource kv_c_rows{static_cast<const char*>(kv_c.const_data_ptr()),
                            kv_c.stride(0) * static_cast<int64_t>(kv_c.element_size()),
                            kv_lora_rank,
                            select_convert_row(kv_c.scalar_type(), kv_cache.scalar_type())};
  const RowSource k_pe_rows{static_cast<const char*>(k_pe.const_data_ptr()),
                            k_pe.stride(0) * static_cast<int64_t>(k_pe.element_size()),
                            rope_dim,
                            select_convert_row(k_pe.scalar_type(), kv_cache.scalar_type())};
  write_latent_rows(kv_c_rows, k_pe_rows, static_cast<char*>(kv_cache.data_ptr()),
                    static_cast<int64_t>(kv_cache.element_size()), slots, slot_stride,
                    num_tokens);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "write_latent_cache(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("write_latent_cache", &write_latent_cache); }

// v4_compress_pool's problem (plain data) and its AVX-512 entries (v4_compressor_avx512.cpp).
#pragma once

#include <cstdint>

namespace mlafx {

struct V4Compress {
  const void* rows;          // token rows [*, 2 * sw]: kv (sw) | gate (sw), contiguous
  const int64_t* sources;    // [N, 2m] token slots: window w-1's m, then window w's m
  const bool* has_previous;  // [N]
  const float* bias;         // [m, sw]
  const float* norm_weight;  // [c]
  const float* cos;          // [N, R/2]
  const float* sin;          // [N, R/2]
  void* pool;                // pool rows [*, c]
  const int64_t* slots;      // [N] pool slot of each entry
  int64_t m, c, sw, rope_dim;
  bool overlap;
  float eps;
};

namespace avx512 {
// Entries [n0, n1) of float32 / bfloat16 rows; scratch: compress_scratch_floats(c, m) floats
// (v4_compressor.h).
void v4_compress_f32(const V4Compress& p, int64_t n0, int64_t n1, float* scratch);
void v4_compress_bf16(const V4Compress& p, int64_t n0, int64_t n1, float* scratch);
}  // namespace avx512

}  // namespace mlafx

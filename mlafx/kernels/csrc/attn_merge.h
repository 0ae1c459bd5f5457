// merge_attn_states, one declaration per ISA specialisation.
//
// Deliberately free of ATen/c10 includes: this header is shared between portable and
// AVX-512 objects, and anything inline in it would be compiled under both flag sets.
#pragma once

#include <cstdint>

namespace mlafx::merge {

enum class Elem : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Everything one merge needs, as raw pointers and element strides.
struct MergeArgs {
  const void* prefix;  // [T, H, D], rows at t * prefix_st + h * prefix_sh (elements)
  const void* suffix;  // [T, H, D]
  void* out;           // [T, H, D] contiguous
  int64_t prefix_st, prefix_sh, suffix_st, suffix_sh;
  const float* prefix_lse;  // [H, T] at h * prefix_lse_sh + t * prefix_lse_st
  const float* suffix_lse;
  int64_t prefix_lse_sh, prefix_lse_st, suffix_lse_sh, suffix_lse_st;
  float* out_lse;  // [H, T] contiguous
  int64_t num_tokens, num_heads, head_dim;
  Elem elem;
};

}  // namespace mlafx::merge

namespace mlafx::avx512 {

// Merges tokens [t0, t1) of every head; same arithmetic as the portable merge in
// attn_merge.cpp. Call only when mlafx::use_avx512_bf16().
void merge_attn_states(const mlafx::merge::MergeArgs& args, int64_t t0, int64_t t1);

}  // namespace mlafx::avx512

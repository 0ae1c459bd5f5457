// The log-sum-exp merge of attention results over disjoint key sets: the arithmetic of
// merge_attn_states (attn_merge.cpp, two halves) and of the attention driver's merge of a
// group's key splits (attention_driver.h, any number of parts).
//
// Free of intrinsics and in an anonymous namespace: each source compiles its own copy
// (internal linkage), so no copy built with wider vector flags can stand in for another's.
#pragma once

#include <cmath>
#include <cstdint>

namespace mlafx {
namespace {

// Weights of n non-empty parts (finite LSEs) of one row: m = max lse, e_k = exp(lse_k - m),
// w_k = e_k / sum(e); returns the merged LSE m + log(sum). The output is then
// sum_k w_k * part_k, summed in k order. A NaN LSE makes every weight and the LSE NaN.
inline float lse_merge_weights(const float* lse, int64_t n, float* w) {
  float m = lse[0];
  for (int64_t k = 1; k < n; ++k) {
    m = lse[k] > m ? lse[k] : m;
  }
  float sum = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    w[k] = std::exp(lse[k] - m);
    sum = k == 0 ? w[k] : sum + w[k];
  }
  for (int64_t k = 0; k < n; ++k) {
    w[k] = w[k] / sum;
  }
  return m + std::log(sum);
}

}  // namespace
}  // namespace mlafx

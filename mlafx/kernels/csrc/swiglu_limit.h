// DeepSeek-V4's clamped SwiGLU, shared by the routed-experts ops (moe_experts, moe_experts_fp8,
// moe_experts_fp4): h = silu(min(g, limit)) * clamp(u, -limit, limit); limit = inf is the plain
// SwiGLU. Clamping the fp32 sums before rounding gives what clamping the rounded values does
// (rounding is monotone and round(limit) is where both land).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace mlafx {

// The clamp of an op's optional swiglu_limit: positive (None: no clamp, inf).
inline float checked_swiglu_limit(const char* op, std::optional<double> limit) {
  TORCH_CHECK_VALUE(!limit.has_value() || *limit > 0, op,
                    ": swiglu_limit must be positive (or None: no clamp), got ", limit.value_or(0));
  return limit.has_value() ? static_cast<float>(*limit) : std::numeric_limits<float>::infinity();
}

// g and u clamped in place (g from above, u on both sides) when limit is finite.
inline void clamp_swiglu_inputs(float* gate, float* up, int64_t n, float limit) {
  if (!std::isfinite(limit)) {
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = std::min(gate[i], limit);
    up[i] = std::min(std::max(up[i], -limit), limit);
  }
}

}  // namespace mlafx

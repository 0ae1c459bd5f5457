// The few-row batched_matmul kernel (batched_matmul_avx512.cpp), called by batched_matmul.cpp
// after use_avx512_bf16(): decode's absorbed products, where ATen's bmm of one or a few rows
// per head reads its weights at 40-55% of the read bandwidth (batched_matmul_avx512.cpp).
#pragma once

#include <cstdint>

namespace mlafx {

// Rows per head the streaming kernel takes; above, ATen's bmm (prefill).
constexpr int64_t kBatchedMatmulStreamRows = 4;

enum class BmmElem { kBf16, kFp16 };

// out[b, m, :] = x[b, m, :] @ w[b] for b < B, m < M (M <= kBatchedMatmulStreamRows), in fp32
// with one rounding to the element type. x: element strides (xs_b, xs_m, xs_k); w: [B, K, N]
// with rows of N contiguous elements, ws_b / ws_k apart; out: contiguous [B, M, N].
struct BmmArgs {
  BmmElem elem;
  const uint16_t* x;
  int64_t xs_b, xs_m, xs_k;
  const uint16_t* w;
  int64_t ws_b, ws_k;
  uint16_t* out;
  int64_t B, M, K, N;
};

// A work item is one head's kBatchedMatmulCols output columns; items are numbered head by
// head, batched_matmul_col_items(N) per head.
constexpr int64_t kBatchedMatmulCols = 64;
inline int64_t batched_matmul_col_items(int64_t N) {
  return (N + kBatchedMatmulCols - 1) / kBatchedMatmulCols;
}

namespace avx512 {
// Items [begin, end) of `a` (the caller shares items out between threads); xf: M * K floats
// of scratch (x's rows of one head, widened).
void batched_matmul_items(const BmmArgs& a, int64_t begin, int64_t end, float* xf);
}  // namespace avx512

}  // namespace mlafx

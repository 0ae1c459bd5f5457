// The few-row batched_matmul kernels, called by batched_matmul.cpp: the streaming one
// (batched_matmul_avx512.cpp, after use_avx512_bf16(); batched_matmul_avx2.cpp, after
// use_avx2() without AVX-512 BF16) and the tile one (batched_matmul_amx_avx512.cpp, after
// use_amx_bf16()). Decode's absorbed products, where
// ATen's bmm of one or a few rows per head reads its weights at 40-55% of the read bandwidth.
#pragma once

#include <cstdint>

namespace mlafx {

// Rows per head the AVX-512 streaming kernel takes; above, the AMX kernel (bf16 up to
// kBatchedMatmulAmxMaxRows, AMX CPUs), the pairs kernel or ATen's bmm (the AVX2 streaming
// kernel's limit is kBatchedMatmulAvx2Rows).
constexpr int64_t kBatchedMatmulStreamRows = 4;

enum class BmmElem { kBf16, kFp16 };

// out[b, m, :] = x[b, m, :] @ w[b] for b < B, m < M (M <= kBatchedMatmulStreamRows for the
// AVX-512 streaming kernel, kBatchedMatmulAvx2Rows for the AVX2 one, kBatchedMatmulAmxMaxRows
// for the tile one), in fp32 with one rounding to the element type. x: element strides (xs_b,
// xs_m, xs_k); w: [B, K, N] with rows of N contiguous elements, ws_b / ws_k apart; out:
// contiguous [B, M, N].
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

// The streaming kernels' walk over items [begin, end): widen(b) when the items reach head b
// (its rows of x into the caller's scratch), then run(b, n0) for the item's first column n0.
// ISA-free: each kernel passes its own widen and run.
template <typename Widen, typename Run>
void batched_matmul_walk_items(const BmmArgs& a, int64_t begin, int64_t end, const Widen& widen,
                               const Run& run) {
  const int64_t col_items = batched_matmul_col_items(a.N);
  int64_t widened = -1;  // the head whose rows the scratch holds
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / col_items;
    if (b != widened) {
      widen(b);
      widened = b;
    }
    run(b, item % col_items * kBatchedMatmulCols);
  }
}

// The AMX kernel (batched_matmul_amx_avx512.cpp): bf16, kBatchedMatmulAmxMinRows to
// kBatchedMatmulAmxMaxRows rows per head, when use_amx_bf16(). Its items are heads.
constexpr int64_t kBatchedMatmulAmxMinRows = 5;
constexpr int64_t kBatchedMatmulAmxMaxRows = 16;

// The pairs kernel (batched_matmul_pairs_avx512.cpp): bf16, kBatchedMatmulPairsMinRows to
// kBatchedMatmulPairsMaxRows rows per head, on AVX-512 BF16 CPUs without AMX. Its items are the
// streaming kernel's. Measured on a Zen 5 EPYC (7 Dec 2026, 2 threads, 100 distinct weights,
// [16, M, 128] x [16, 128, 512] / [16, M, 512] x [16, 512, 128]): 5 rows 0.115 / 0.103 ms
// against ATen's 0.191 / 0.136, 8 rows 0.138 / 0.122 against 0.171 / 0.140, but 16 rows (two
// passes of 8) 0.187 / 0.198 against 0.164 / 0.165: ATen from 9 rows on.
constexpr int64_t kBatchedMatmulPairsMinRows = 5;
constexpr int64_t kBatchedMatmulPairsMaxRows = 8;

// The AVX2 streaming kernel (batched_matmul_avx2.cpp): bf16/fp16 up to
// kBatchedMatmulAvx2Rows rows per head, when use_avx2() and not use_avx512_bf16(). Its items are
// the streaming kernel's.
constexpr int64_t kBatchedMatmulAvx2Rows = 8;

namespace avx2 {
// Items [begin, end) of `a`; xf: M * K floats of scratch (x's rows of one head, widened).
void batched_matmul_items(const BmmArgs& a, int64_t begin, int64_t end, float* xf);
}  // namespace avx2

namespace avx512 {
// The pairs kernel on items [begin, end) of `a` (bf16); xs: batched_matmul_pairs_scratch(a)
// uint16 elements of scratch (x's rows of one head, staged).
int64_t batched_matmul_pairs_scratch(const BmmArgs& a);
void batched_matmul_items_pairs(const BmmArgs& a, int64_t begin, int64_t end, uint16_t* xs);
// Items [begin, end) of `a` (the caller shares items out between threads); xf: M * K floats
// of scratch (x's rows of one head, widened).
void batched_matmul_items(const BmmArgs& a, int64_t begin, int64_t end, float* xf);
// The AMX kernel on heads [begin, end) of `a` (bf16); scratch: batched_matmul_amx_scratch(a)
// uint16 elements per thread, 64-byte aligned (a ScratchVector).
int64_t batched_matmul_amx_scratch(const BmmArgs& a);
void batched_matmul_heads_amx(const BmmArgs& a, int64_t begin, int64_t end, uint16_t* scratch);
// The AMX kernel for any number of rows (batch-invariant mode past 16 rows): each head's w
// staged whole, the rows in blocks of 32; a row gets the bits batched_matmul_heads_amx gives
// it. Scratch: batched_matmul_amx_blocks_scratch(a) uint16 elements per thread, 64-byte aligned.
int64_t batched_matmul_amx_blocks_scratch(const BmmArgs& a);
void batched_matmul_heads_amx_blocks(const BmmArgs& a, int64_t begin, int64_t end,
                                     uint16_t* scratch);
}  // namespace avx512

}  // namespace mlafx

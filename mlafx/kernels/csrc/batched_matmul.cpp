// batched_matmul: the absorbed attention's per-head products (q_nope W_UK, out_lat W_UV^T).
//
//   x: [B, M, K]  bf16/fp16/fp32      w: [B, K, N]  x's dtype      -> out [B, M, N] (x's dtype)
//     out[b] = x[b] @ w[b]: ATen's bmm (in fp32 on widened copies, rounded once, for bf16/fp16
//     on CPUs without AVX-512 BF16, where ATen's 16-bit bmm is emulated). bf16/fp16 with at
//     most kBatchedMatmulStreamRows rows per head (decode) on AVX-512 BF16 CPUs: the streaming
//     kernel of batched_matmul_avx512.cpp (fp32 sums, one rounding), up to 1.8x ATen's there;
//     bf16 with kBatchedMatmulAmxMinRows..16 rows on AMX-BF16 CPUs: the tile kernel of
//     batched_matmul_amx_avx512.cpp (the same sums and rounding); on AVX-512 BF16 CPUs without
//     AMX, bf16 with kBatchedMatmulPairsMinRows..8 rows: the pairs kernel of
//     batched_matmul_pairs_avx512.cpp (VDPBF16PS, fp32 sums, one rounding); on AVX2 CPUs
//     without AVX-512 BF16, bf16/fp16 with at most kBatchedMatmulAvx2Rows rows per head: the
//     streaming kernel of batched_matmul_avx2.cpp (the same sums and rounding), instead of
//     widening w to an fp32 copy per call.
//
// In batch-invariant mode (batch_invariant.h), bf16 on AMX-BF16 CPUs takes the tile kernels
// at every row count (up to 16 rows the few-row one, past it the many-rows one, which stages
// each head's w once; a row's sums are the same in both). Otherwise the rows go through
// ATen's bmm as fixed [B, kTileRows, K] tiles, the last one zero-padded: the library picks
// its kernel by the problem's shape (fp32 takes another summation order below 4 rows,
// measured on Zen 4), and with every call the same shape a row's sums depend on its own
// values alone. Costs one call per 16 rows; off, this is plain bmm.
// Python reference: torch.bmm.
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "batch_invariant.h"
#include "batched_matmul.h"
#include "cpu_features.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"

namespace mlafx {
namespace {

constexpr int64_t kTileRows = 16;

BmmArgs bmm_args(const at::Tensor& x, const at::Tensor& wc, at::Tensor& out) {
  const auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); };
  return BmmArgs{x.scalar_type() == at::kHalf ? BmmElem::kFp16 : BmmElem::kBf16,
                 bits(x), x.stride(0), x.stride(1), x.stride(2),
                 bits(wc), wc.stride(0), wc.stride(1),
                 static_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), x.size(2),
                 wc.size(2)};
}

// Which of batched_matmul.h's kernels runs a call.
enum class BmmKernel { kStream, kStreamAvx2, kPairs, kAmx, kAmxBlocks };

// batched_matmul.h's kernels on 16-bit x and w.
at::Tensor run_kernel(const at::Tensor& x, const at::Tensor& w, BmmKernel kernel) {
  const at::Tensor wc = w.stride(2) == 1 ? w : w.contiguous();
  const int64_t B = x.size(0), M = x.size(1), K = x.size(2), N = w.size(2);
  at::Tensor out = at::empty({B, M, N}, x.options());
  if (out.numel() == 0) {
    return out;
  }
  if (K == 0) {
    return out.zero_();
  }
  const BmmArgs args = bmm_args(x, wc, out);
  switch (kernel) {
    case BmmKernel::kAmx:
      parallel_chunks(0, B, 1, [&](int64_t begin, int64_t end) {
        ScratchVector<uint16_t> scratch(
            static_cast<size_t>(avx512::batched_matmul_amx_scratch(args)));
        avx512::batched_matmul_heads_amx(args, begin, end, scratch.data());
      });
      break;
    case BmmKernel::kAmxBlocks:
      parallel_chunks(0, B, 1, [&](int64_t begin, int64_t end) {
        ScratchVector<uint16_t> scratch(
            static_cast<size_t>(avx512::batched_matmul_amx_blocks_scratch(args)));
        avx512::batched_matmul_heads_amx_blocks(args, begin, end, scratch.data());
      });
      break;
    case BmmKernel::kPairs:
      parallel_chunks(0, B * batched_matmul_col_items(N), 1, [&](int64_t begin, int64_t end) {
        ScratchVector<uint16_t> xs(static_cast<size_t>(avx512::batched_matmul_pairs_scratch(args)));
        avx512::batched_matmul_items_pairs(args, begin, end, xs.data());
      });
      break;
    case BmmKernel::kStream:
    case BmmKernel::kStreamAvx2: {
      const auto items = kernel == BmmKernel::kStream ? avx512::batched_matmul_items
                                                      : avx2::batched_matmul_items;
      parallel_chunks(0, B * batched_matmul_col_items(N), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> xf(static_cast<size_t>(M * K));
        items(args, begin, end, xf.data());
      });
      break;
    }
  }
  return out;
}

at::Tensor batched_matmul(const at::Tensor& x,  // [B, M, K]
                          const at::Tensor& w   // [B, K, N]
) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(),
              "batched_matmul: x and w must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 3 && w.dim() == 3 && x.size(0) == w.size(0) &&
                        x.size(2) == w.size(1),
                    "batched_matmul: x must be [B, M, K] and w [B, K, N], got shapes ", x.sizes(),
                    " and ", w.sizes());
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), "batched_matmul: w dtype ",
                   w.scalar_type(), " must equal x's ", x.scalar_type());
  // Without AVX-512 BF16, ATen's bf16/fp16 bmm is emulated at ~1 GFLOP/s: multiply fp32
  // copies (exact) and round the fp32 product once, as the native GEMM rounds its sums.
  const bool widen = x.scalar_type() != at::kFloat && !use_avx512_bf16();
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const int64_t M = x.size(1);
  const bool amx = x.scalar_type() == at::kBFloat16 && !widen && use_amx_bf16();
  if (batch_invariant() && amx) {
    // Any number of rows on the tiles: both kernels give a row the same bits.
    return run_kernel(x, w, M <= kBatchedMatmulAmxMaxRows ? BmmKernel::kAmx
                                                          : BmmKernel::kAmxBlocks);
  }
  if (!batch_invariant() && !widen && half) {
    if (amx && M >= kBatchedMatmulAmxMinRows && M <= kBatchedMatmulAmxMaxRows) {
      return run_kernel(x, w, BmmKernel::kAmx);
    }
    if (M <= kBatchedMatmulStreamRows) {
      return run_kernel(x, w, BmmKernel::kStream);
    }
    if (!amx && x.scalar_type() == at::kBFloat16 && M >= kBatchedMatmulPairsMinRows &&
        M <= kBatchedMatmulPairsMaxRows) {
      return run_kernel(x, w, BmmKernel::kPairs);
    }
  }
  if (!batch_invariant() && widen && half && use_avx2() && M <= kBatchedMatmulAvx2Rows) {
    return run_kernel(x, w, BmmKernel::kStreamAvx2);
  }
  const at::Tensor w_mm = widen ? w.to(at::kFloat) : w;
  if (!batch_invariant()) {
    return widen ? at::bmm(x.to(at::kFloat), w_mm).to(x.scalar_type()) : at::bmm(x, w);
  }
  const int64_t B = x.size(0), K = x.size(2), N = w.size(2);
  at::Tensor out = at::empty({B, M, N}, x.options());
  at::Tensor tile = at::zeros({B, kTileRows, K}, w_mm.options());
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, M - m0);
    tile.narrow(1, 0, rows).copy_(x.narrow(1, m0, rows));
    if (rows < kTileRows) {
      tile.narrow(1, rows, kTileRows - rows).zero_();
    }
    out.narrow(1, m0, rows).copy_(at::bmm(tile, w_mm).narrow(1, 0, rows));
  }
  return out;
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) { m.def("batched_matmul(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("batched_matmul", &mlafx::batched_matmul); }

// linear_quantized: y = x @ W^T (+ bias) for W in the int8/int4 packed format of
// mlafx/kernels/quant_format.py (made by quantize_linear_weight), W8A8:
//
//   linear_quantized(x [M, K], packed_weight [ceil(N/16), G, S] uint8,
//                    out_features = N, bias? [N]) -> out [M, N]   (x's dtype, contiguous)
//       x bf16/fp16/fp32, last dim contiguous (rows may be strided); the format from S (544:
//       int8, 288: int4, G = ceil(K/32); 4544: k8, 2496: k4, G = K/256, GGUF's K-quants,
//       mlafx/kernels/kquant_format.py). x is quantized per row and group of 32 to int8 (once per call), each
//       group's exact integer dots scaled by d_x * d_w and summed in fp32 in group order,
//       rounded once to x's dtype; the bias is added after that rounding (as linear_packed).
//
// Threads split the weight's blocks of 16 rows, each a contiguous range (>= ~64 KB of
// weight: waking a thread costs microseconds, streaming 64 KB about as long), so with few
// rows of x every weight byte is read once, by one thread, and both cores pull bandwidth.
// Within a range the kernel (quant.h) runs a step of blocks at a time over all rows of x,
// into an fp32 scratch of at most ~256 KB that is rounded into the output right away. With
// many rows and few blocks (M >= 64, fewer than 2 blocks per thread) threads split the rows
// instead. Python reference: quant_format.linear_quantized_reference.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "gemm_aten.h"
#include "quant_aten.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"

namespace mlafx {
namespace {

constexpr int64_t kScratchFloats = 64 << 10;  // 256 KB per thread
constexpr int64_t kMaxBlocksPerStep = 32;

// Rows [m0, m1) x blocks [b0, b1) of the product into out [M, N], one thread. Each call of
// the kernel covers at most 128 rows and then up to 32 blocks, so that its fp32 sums fit the
// scratch, a 16-row tile of x is reused across 16 blocks (the AMX kernel re-read it from L2
// every 4 blocks when 1024 rows shared the scratch) and the AMX kernel prefetches a second
// chunk of 16 blocks while it works on the first; the weights are read once.
template <typename scalar_t>
void run_range(const QuantizedActivations& xq, int format, const uint8_t* packed, int64_t groups,
               int64_t N, int64_t m0, int64_t m1, int64_t b0, int64_t b1, scalar_t* out) {
  const int64_t chunk_rows =
      std::min(m1 - m0, kScratchFloats / (kMaxBlocksPerStep * kQuantBlockRows));
  const int64_t step = std::clamp<int64_t>(kScratchFloats / (chunk_rows * kQuantBlockRows), 1,
                                           kMaxBlocksPerStep);
  const int64_t ld = step * kQuantBlockRows;
  ScratchVector<float> scratch(static_cast<size_t>(chunk_rows * ld));
  for (int64_t s0 = b0; s0 < b1; s0 += step) {
    const int64_t s1 = std::min(b1, s0 + step);
    const int64_t n0 = s0 * kQuantBlockRows;
    const int64_t n1 = std::min(N, s1 * kQuantBlockRows);
    for (int64_t r0 = m0; r0 < m1; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, m1 - r0);
      quant_dot(format, xq.view(r0), rows, packed, groups, s0, s1, scratch.data(), ld);
      for (int64_t r = 0; r < rows; ++r) {
        round_row(scratch.data() + r * ld, out + (r0 + r) * N + n0, n1 - n0);
      }
    }
  }
}

// The packed weight's format (quant.h), after checking it holds [out_features, in_features].
int check_packed(const at::Tensor& packed, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(packed.device().is_cpu(), "linear_quantized: packed_weight must be on the CPU, got ",
              packed.device());
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte,
                   "linear_quantized: packed_weight must be uint8 (from quantize_linear_weight "
                   "or a GGUF repack), got ",
                   packed.scalar_type());
  const int format = packed.dim() == 3 ? quant_format_of(packed.size(2)) : 0;
  TORCH_CHECK_VALUE(format != 0,
                    "linear_quantized: packed_weight must be an int8/int4 weight ([ceil(N/16), "
                    "ceil(K/32), 544 or 288]) or a k8/k4 one ([ceil(N/16), K/256, 4544 or "
                    "2496]), got shape ",
                    packed.sizes());
  TORCH_CHECK_VALUE(packed.is_contiguous(), "linear_quantized: packed_weight must be contiguous");
  TORCH_CHECK_VALUE(out_features >= 0 && (out_features + 15) / 16 == packed.size(0),
                    "linear_quantized: out_features = ", out_features,
                    " does not match packed_weight's ", packed.size(0), " blocks of 16 rows");
  const int64_t columns = quant_group_columns(format);
  TORCH_CHECK_VALUE(quant_groups_of(format, in_features) == packed.size(1) &&
                        (!is_kquant(format) || in_features % columns == 0),
                    "linear_quantized: x has ", in_features, " features but packed_weight has ",
                    packed.size(1), " groups of ", columns, " columns");
  return format;
}

at::Tensor linear_quantized(const at::Tensor& x,       // [M, K]
                            const at::Tensor& packed,  // [ceil(N/16), ceil(K/32), S] uint8
                            int64_t out_features,      // N
                            const std::optional<at::Tensor>& bias) {  // [N] or none
  TORCH_CHECK(x.device().is_cpu(), "linear_quantized: x must be on the CPU, got ", x.device());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "linear_quantized: x must be bfloat16, float16 or float32, got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "linear_quantized: x must be [num_rows, in_features], got shape ",
                    x.sizes());
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  const int64_t N = out_features;
  const int format = check_packed(packed, N, K);
  TORCH_CHECK_VALUE(K <= 1 || x.stride(1) == 1,
                    "linear_quantized: x's last dim must be contiguous, got strides ",
                    x.strides());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N,
                      "linear_quantized: bias must be [out_features] = [", N, "], got shape ",
                      bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "linear_quantized: bias dtype ",
                     bias->scalar_type(), " must equal x's dtype ", x.scalar_type());
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) {
    return out;
  }
  const int64_t blocks = packed.size(0);
  const int64_t groups = packed.size(1);
  const QuantizedActivations xq = quantize_activations(x);
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const int64_t block_bytes = std::max<int64_t>(groups, 1) * quant_group_bytes(format);
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / block_bytes);
  const bool split_rows = M >= 64 && blocks < 2 * at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_quantized", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    if (split_rows) {
      mlafx::parallel_chunks(0, M, 16, [&](int64_t m0, int64_t m1) {
        run_range(xq, format, w, groups, N, m0, m1, 0, blocks, out_data);
      });
    } else {
      mlafx::parallel_chunks(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        run_range(xq, format, w, groups, N, 0, M, b0, b1, out_data);
      });
    }
  });
  if (has_bias) {
    out.add_(*bias);
  }
  return out;
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "linear_quantized(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("linear_quantized", &mlafx::linear_quantized); }

// moe_experts_quantized: moe_experts (moe.cpp) over int8/int4 packed expert weights.
//
//   x:            [T, D]      bf16/fp16/fp32, last dim contiguous (rows may be strided)
//   topk_ids:     [T, k]      int64 in [0, E); ids may repeat within a token
//   topk_weights: [T, k]      float32
//   w13:          [E, ceil(2I/16), G(D), S] uint8: gate rows [0, I), then up rows
//   w2:           [E, ceil(D/16), G(I), S'] uint8; each in any format of quant.h (S 544 or
//                 288: int8 / int4, G(K) = ceil(K/32); 4544 or 2496: k8 / k4, G(K) = K/256)
//   out:          [T, D]      x's dtype, contiguous:
//     [g | u] = x[t] @ W13[e]^T rounded to x's dtype, h = silu(g) * u in x's dtype (silu in
//     fp32 of the rounded g, rounded, times u), y = h @ W2[e]^T rounded to x's dtype; every
//     product W8A8 as linear_quantized; out[t] = sum_j topk_weights[t, j] * y in fp32,
//     rounded once.
//
// As moe.cpp: the pairs are grouped by expert (moe_routing.h), so each expert some token
// picked has its weights read once per call. x is quantized once per call (each row, not
// once per expert), the rows of each expert gathered from that.
// - few pairs (<= kMaxStreamingPairs): all such experts go through two parallel passes that
//   split the weight blocks across threads (gate/up rows i of every expert, then the blocks of
//   w2's rows d): each thread streams its own share once, both cores pull bandwidth, and in
//   the second pass a thread owns output columns, so repeated ids never race.
// - many pairs: per expert, the same kernel on its gathered rows with all threads over the
//   blocks (quant_product_f32), the weights re-read from cache per tile of rows.
// Python reference: quant_format.moe_experts_quantized_reference.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "batch_invariant.h"
#include "gemm_aten.h"
#include "moe_activation.h"
#include "moe_routing.h"
#include "quant_aten.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"

namespace mlafx {
namespace {

// Both kernels' cost per weight byte grows with the rows of x, so the split is about
// parallelism, not the kernel: up to this many pairs an expert's rows are too few to give
// each thread a useful share of one expert's blocks, so experts are streamed together.
constexpr int64_t kMaxStreamingPairs = 16;
constexpr int64_t kRows = kQuantBlockRows;


struct Problem {
  int w13_format;  // quant.h; the two stacks may differ (a GGUF's Q4_K gate/up, Q6_K down)
  int w2_format;
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  const uint8_t* w13;
  const uint8_t* w2;
  int64_t w13_expert;   // bytes per expert
  int64_t w2_expert;
  const float* weights;  // topk_weights, contiguous [T, k]
  float* sum;            // fp32 [T, D]
};

int64_t blocks_of(int64_t rows) { return (rows + kRows - 1) / kRows; }

template <typename scalar_t>
void run_streaming(const Problem& pb, const Routing& routing,
                   std::span<const ExpertGroup> streaming, const QuantizedActivations& xq,
                   const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter;
  std::vector<int64_t> tokens, row_of_group;
  for (const ExpertGroup& group : streaming) {
    row_of_group.push_back(static_cast<int64_t>(tokens.size()));
    for (int64_t j = group.begin; j < group.end; ++j) {
      tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
    }
  }
  const int64_t P = static_cast<int64_t>(tokens.size());
  const QuantizedActivations xs = gather_rows(xq, tokens);  // [P] rows
  at::Tensor h = at::empty({P, I}, x.options());            // [P, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const int64_t num_groups = static_cast<int64_t>(streaming.size());
  const int64_t gd = quant_groups_of(pb.w13_format, D), gi = quant_groups_of(pb.w2_format, I);

  // Pass 1: threads split the 16-row blocks of gate rows i (and the up rows I + i with them).
  mlafx::parallel_chunks(0, blocks_of(I), 1, [&](int64_t ib0, int64_t ib1) {
    const int64_t i0 = ib0 * kRows, i1 = std::min(I, ib1 * kRows);
    const int64_t ub0 = (I + i0) / kRows, ub1 = blocks_of(I + i1);
    const int64_t ld_g = (ib1 - ib0) * kRows, ld_u = (ub1 - ub0) * kRows;
    std::vector<float> gate(static_cast<size_t>(kMaxStreamingPairs * ld_g));
    std::vector<float> up(static_cast<size_t>(kMaxStreamingPairs * ld_u));
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = streaming[g];
      const QuantRows rows = xs.view(row_of_group[g]);
      const uint8_t* w = pb.w13 + group.expert * pb.w13_expert;
      quant_dot(pb.w13_format, rows, group.size(), w, gd, ib0, ib1, gate.data(), ld_g);
      quant_dot(pb.w13_format, rows, group.size(), w, gd, ub0, ub1, up.data(), ld_u);
      for (int64_t j = 0; j < group.size(); ++j) {
        silu_times_up_row(gate.data() + j * ld_g, up.data() + j * ld_u + I + i0 - ub0 * kRows,
                          h_data + (row_of_group[g] + j) * I + i0, i1 - i0);
      }
    }
  });

  const QuantizedActivations hq = quantize_activations(h);

  // Pass 2: threads split the blocks of w2's rows d, i.e. own output columns [d0, d1).
  mlafx::parallel_chunks(0, blocks_of(D), 1, [&](int64_t db0, int64_t db1) {
    const int64_t d0 = db0 * kRows, d1 = std::min(D, db1 * kRows);
    const int64_t ld = (db1 - db0) * kRows;
    std::vector<float> y(static_cast<size_t>(kMaxStreamingPairs * ld));
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = streaming[g];
      quant_dot(pb.w2_format, hq.view(row_of_group[g]), group.size(),
                pb.w2 + group.expert * pb.w2_expert, gi, db0, db1, y.data(), ld);
      add_weighted_rows<scalar_t>(pb, routing, group, y.data(), ld, d0, d1);
    }
  });
}

template <typename scalar_t>
void run_gemm_group(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                    const QuantizedActivations& xq, const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter, c = group.size();
  std::vector<int64_t> tokens;
  for (int64_t j = group.begin; j < group.end; ++j) {
    tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
  }
  const QuantizedActivations xe = gather_rows(xq, tokens);
  ScratchVector<float> gate_up(static_cast<size_t>(c * 2 * I));  // [c, 2I] fp32
  quant_product_f32(pb.w13_format, xe.view(), c, pb.w13 + group.expert * pb.w13_expert,
                    blocks_of(2 * I), quant_groups_of(pb.w13_format, D), 2 * I, gate_up.data(),
                    2 * I);
  at::Tensor h = at::empty({c, I}, x.options());  // [c, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  mlafx::parallel_chunks(0, c, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = gate_up.data() + j * 2 * I;
      silu_times_up_row(row, row + I, h_data + j * I, I);
    }
  });
  const QuantizedActivations hq = quantize_activations(h);
  ScratchVector<float> y(static_cast<size_t>(c * D));  // [c, D] fp32
  quant_product_f32(pb.w2_format, hq.view(), c, pb.w2 + group.expert * pb.w2_expert,
                    blocks_of(D), quant_groups_of(pb.w2_format, I), D, y.data(), D);
  mlafx::parallel_chunks(0, D, 256, [&](int64_t d0, int64_t d1) {
    add_weighted_rows<scalar_t>(pb, routing, group, y.data() + d0, D, d0, d1);
  });
}

// ---- at::Tensor entry -------------------------------------------------------------------

// The stack's format (quant.h), after checking it holds E experts' [rows, width] weights.
int check_experts(const char* name, const at::Tensor& w, int64_t E, int64_t rows,
                  int64_t width) {
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, "moe_experts_quantized: ", name,
                   " must be uint8 (packed by quantize_linear_weight or a GGUF repack), got ",
                   w.scalar_type());
  const int format = w.dim() == 4 ? quant_format_of(w.size(3)) : 0;
  TORCH_CHECK_VALUE(format != 0, "moe_experts_quantized: ", name,
                    " must be packed experts [E, blocks, groups, S] with S 544 or 288 (int8, "
                    "int4) or 4544 or 2496 (k8, k4), got shape ",
                    w.sizes());
  const int64_t groups = quant_groups_of(format, width);
  TORCH_CHECK_VALUE(w.size(0) == E && w.size(1) == blocks_of(rows) && w.size(2) == groups &&
                        (!is_kquant(format) || width % quant_group_columns(format) == 0),
                    "moe_experts_quantized: ", name, " must be [num_experts = ", E, ", ",
                    blocks_of(rows), ", ", groups, ", ", w.size(3), "] (quantized [", rows,
                    ", ", width, "] per expert), got shape ", w.sizes());
  TORCH_CHECK_VALUE(w.is_contiguous(), "moe_experts_quantized: ", name, " must be contiguous");
  return format;
}

at::Tensor moe_experts_quantized(const at::Tensor& x,             // [T, D]
                                 const at::Tensor& topk_ids,      // [T, k] int64
                                 const at::Tensor& topk_weights,  // [T, k] float32
                                 const at::Tensor& w13,  // [E, ceil(2I/16), ceil(D/32), S]
                                 const at::Tensor& w2,   // [E, ceil(D/16), ceil(I/32), S]
                                 int64_t intermediate_size) {  // I
  TORCH_CHECK(x.device().is_cpu() && topk_ids.device().is_cpu() &&
                  topk_weights.device().is_cpu() && w13.device().is_cpu() &&
                  w2.device().is_cpu(),
              "moe_experts_quantized: all tensors must be on the CPU");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "moe_experts_quantized: x must be bfloat16, float16 or float32, got ",
                   x.scalar_type());
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kLong,
                   "moe_experts_quantized: topk_ids must be int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat,
                   "moe_experts_quantized: topk_weights must be float32, got ",
                   topk_weights.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "moe_experts_quantized: x must be [num_tokens, hidden], got "
                    "shape ", x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
                    "moe_experts_quantized: topk_ids must be [num_tokens, top_k] with "
                    "num_tokens = ", x.size(0), ", got shape ", topk_ids.sizes());
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(),
                    "moe_experts_quantized: topk_weights must have topk_ids's shape ",
                    topk_ids.sizes(), ", got ", topk_weights.sizes());
  TORCH_CHECK_VALUE(intermediate_size >= 0, "moe_experts_quantized: intermediate_size must be "
                    ">= 0, got ", intermediate_size);
  TORCH_CHECK_VALUE(w13.dim() == 4, "moe_experts_quantized: w13 must be packed experts [E, "
                    "blocks, groups, S], got shape ", w13.sizes());
  const int64_t D = x.size(1), I = intermediate_size, E = w13.size(0);
  const int w13_format = check_experts("w13", w13, E, 2 * I, D);
  const int w2_format = check_experts("w2", w2, E, D, I);
  TORCH_CHECK_VALUE(D <= 1 || x.stride(1) == 1,
                    "moe_experts_quantized: x's last dim must be contiguous, got strides ",
                    x.strides());
  const int64_t T = x.size(0), k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id_data = ids.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK_INDEX(id_data[p] >= 0 && id_data[p] < E, "moe_experts_quantized: topk_ids[",
                      p / k, ", ", p % k, "] = ", id_data[p], " is out of range for ", E,
                      " experts");
  }
  at::Tensor sum = at::zeros({T, D}, x.options().dtype(at::kFloat));  // fp32 [T, D]
  if (T * k == 0 || D == 0 || I == 0) {
    return sum.to(x.scalar_type());
  }
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = group_by_expert(id_data, T * k, E, kMaxStreamingPairs);
  const Problem pb{w13_format,
                   w2_format,
                   k,
                   D,
                   I,
                   w13.const_data_ptr<uint8_t>(),
                   w2.const_data_ptr<uint8_t>(),
                   w13.stride(0),
                   w2.stride(0),
                   weights.const_data_ptr<float>(),
                   sum.data_ptr<float>()};
  const QuantizedActivations xq = quantize_activations(x);  // once per call
  // Batch-invariant mode: every kernel here gives a row the same bits (the products are exact
  // integer sums, the per-group epilogue the same in each), so only the order a token's terms
  // are added in could depend on the batch: expert order, as moe.cpp.
  const bool in_expert_order = batch_invariant();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts_quantized", [&] {
        auto stream = [&](std::span<const ExpertGroup> groups) {
          run_streaming<scalar_t>(pb, routing, groups, xq, x);
        };
        auto gemm = [&](const ExpertGroup& group) {
          run_gemm_group<scalar_t>(pb, routing, group, xq, x);
        };
        run_groups(routing, in_expert_order, stream, gemm);
      });
  return sum.to(x.scalar_type());
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts_quantized(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
      "Tensor w2, int intermediate_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) {
  m.impl("moe_experts_quantized", &mlafx::moe_experts_quantized);
}

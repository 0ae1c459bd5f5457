// moe_experts_fp8: moe_experts (moe.cpp) over block FP8 expert weights as DeepSeek stores
// them (fp8.h), stacked per expert:
//
//   x:            [T, D]      bf16/fp16/fp32, last dim contiguous (rows may be strided)
//   topk_ids:     [T, k]      int64 in [0, E); ids may repeat within a token
//   topk_weights: [T, k]      float32
//   w13:          [E, 2I, D]  float8_e4m3fn: gate rows [0, I), then up rows
//   w13_scale:    [E, 2 ceil(I/bn), ceil(D/bk)] float32: the gate's blocks, then the up's
//                 (each part keeps its own blocks, so I need not be a multiple of bn)
//   w2:           [E, D, I]   float8_e4m3fn
//   w2_scale:     [E, ceil(D/bn), ceil(I/bk)] float32
//   out:          [T, D]      x's dtype, contiguous:
//     [g | u] = x[t] @ W13[e]^T rounded to x's dtype, h = silu(g) * u in x's dtype (silu in
//     fp32 of the rounded g, rounded, times u), y = h @ W2[e]^T rounded to x's dtype; every
//     product as linear_fp8; out[t] = sum_j topk_weights[t, j] * y in fp32, rounded once.
//
// As moe_experts_quantized (quant_moe.cpp): pairs grouped by expert, each picked expert's
// weights read once per call; few pairs stream all experts through two parallel passes
// (threads split gate/up rows, then w2's rows, i.e. own output columns), many pairs run each
// expert's rows with all threads over its weight rows.
// Python reference: models.fp8.moe_experts_fp8_reference.
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
#include <utility>
#include <vector>

#include "fp8_aten.h"
#include "gemm_aten.h"
#include "moe_activation.h"
#include "moe_routing.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"

namespace mlafx {
namespace {

constexpr int64_t kMaxStreamingPairs = 16;


struct Problem {
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  int64_t block_n, block_k;
  const uint8_t* w13;
  const float* s13;
  const uint8_t* w2;
  const float* s2;
  int64_t s13_expert, s2_expert;  // scale floats per expert
  const float* weights;           // topk_weights, contiguous [T, k]
  float* sum;                     // fp32 [T, D]

  Fp8Weight gate(int64_t e) const {
    return fp8_view(w13 + e * 2 * inter * hidden, s13 + e * s13_expert, hidden, block_n, block_k);
  }
  Fp8Weight up(int64_t e) const {
    Fp8Weight w = gate(e);
    w.w += inter * hidden;
    w.scale += (inter + block_n - 1) / block_n * w.lds;
    return w;
  }
  Fp8Weight down(int64_t e) const {
    return fp8_view(w2 + e * hidden * inter, s2 + e * s2_expert, inter, block_n, block_k);
  }
};

// sum[t(p)] += weight(p) * round(y[j]) over columns [d0, d1) for the group's pairs.
template <typename scalar_t>
void add_weighted_rows(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                       const float* y, int64_t ld, int64_t d0, int64_t d1) {
  for (int64_t j = 0; j < group.size(); ++j) {
    const int64_t pair = routing.sorted_pairs[group.begin + j];
    float* dst = pb.sum + (pair / pb.num_pairs_per_token) * pb.hidden;
    const float weight = pb.weights[pair];
    const float* src = y + j * ld - d0;
    for (int64_t d = d0; d < d1; ++d) {
      dst[d] += static_cast<float>(static_cast<scalar_t>(src[d])) * weight;
    }
  }
}

// Each group's rows of `a` (from row_of_group[g] on); those of a group that fp8_uses_tiles are
// staged for the AMX kernel, threads splitting the groups, into tiles that `keep` owns.
std::vector<Fp8Rows> group_rows(const Fp8Activations& a, const std::vector<int64_t>& row_of_group,
                                const std::vector<ExpertGroup>& groups, int64_t block_k,
                                std::vector<at::Tensor>& keep) {
  std::vector<Fp8Rows> rows;
  std::vector<std::pair<int64_t, uint16_t*>> to_stage;  // (group, its tiles)
  for (size_t g = 0; g < groups.size(); ++g) {
    rows.push_back(a.view(row_of_group[g]));
    if (a.is_bf16 && a.cols > 0 && fp8_uses_tiles(groups[g].size(), block_k)) {
      keep.push_back(empty_tiles(groups[g].size(), a.cols));
      auto* tiles = reinterpret_cast<uint16_t*>(keep.back().data_ptr<int16_t>());
      rows.back().tiles = tiles;
      to_stage.emplace_back(static_cast<int64_t>(g), tiles);
    }
  }
  mlafx::parallel_chunks(0, static_cast<int64_t>(to_stage.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [g, tiles] = to_stage[static_cast<size_t>(i)];
      avx512::fp8_stage_tiles(rows[g].bf16, rows[g].ld, a.cols, 0, groups[g].size(), tiles);
    }
  });
  return rows;
}

template <typename scalar_t>
void run_streaming(const Problem& pb, const Routing& routing, const Fp8Activations& xa,
                   const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter;
  std::vector<int64_t> tokens, row_of_group;
  for (const ExpertGroup& group : routing.streaming) {
    row_of_group.push_back(static_cast<int64_t>(tokens.size()));
    for (int64_t j = group.begin; j < group.end; ++j) {
      tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
    }
  }
  const int64_t P = static_cast<int64_t>(tokens.size());
  const Fp8Activations xs = gather_rows(xa, tokens);  // [P] rows
  std::vector<at::Tensor> staged;  // the groups' rows for the AMX kernel
  const std::vector<Fp8Rows> x_rows = group_rows(xs, row_of_group, routing.streaming, pb.block_k, staged);
  at::Tensor h = at::empty({P, I}, x.options());      // [P, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const int64_t num_groups = static_cast<int64_t>(routing.streaming.size());

  // Pass 1: threads split the gate rows i (and the up rows I + i with them).
  mlafx::parallel_chunks(0, I, fp8_row_grain(D), [&](int64_t i0, int64_t i1) {
    const int64_t ld = i1 - i0;
    std::vector<float> gate(static_cast<size_t>(kMaxStreamingPairs * ld));
    std::vector<float> up(gate.size());
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = routing.streaming[g];
      const Fp8Rows& rows = x_rows[g];
      fp8_dot(pb.gate(group.expert), rows, group.size(), i0, i1, gate.data(), ld);
      fp8_dot(pb.up(group.expert), rows, group.size(), i0, i1, up.data(), ld);
      for (int64_t j = 0; j < group.size(); ++j) {
        silu_times_up_row(gate.data() + j * ld, up.data() + j * ld,
                          h_data + (row_of_group[g] + j) * I + i0, i1 - i0);
      }
    }
  });

  const Fp8Activations ha = fp8_activations(h);
  const std::vector<Fp8Rows> h_rows = group_rows(ha, row_of_group, routing.streaming, pb.block_k, staged);

  // Pass 2: threads split w2's rows d, i.e. own output columns [d0, d1).
  mlafx::parallel_chunks(0, D, fp8_row_grain(I), [&](int64_t d0, int64_t d1) {
    const int64_t ld = d1 - d0;
    std::vector<float> y(static_cast<size_t>(kMaxStreamingPairs * ld));
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = routing.streaming[g];
      fp8_dot(pb.down(group.expert), h_rows[g], group.size(), d0, d1, y.data(), ld);
      add_weighted_rows<scalar_t>(pb, routing, group, y.data(), ld, d0, d1);
    }
  });
}

template <typename scalar_t>
void run_gemm_group(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                    const Fp8Activations& xa, const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter, c = group.size();
  std::vector<int64_t> tokens;
  for (int64_t j = group.begin; j < group.end; ++j) {
    tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
  }
  Fp8Activations xe = gather_rows(xa, tokens);
  xe.stage_tiles(pb.block_k);
  ScratchVector<float> gate_up(static_cast<size_t>(c * 2 * I));  // [c, 2I] fp32
  fp8_product_f32(pb.gate(group.expert), xe.view(), c, I, gate_up.data(), 2 * I);
  fp8_product_f32(pb.up(group.expert), xe.view(), c, I, gate_up.data() + I, 2 * I);
  at::Tensor h = at::empty({c, I}, x.options());  // [c, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  mlafx::parallel_chunks(0, c, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = gate_up.data() + j * 2 * I;
      silu_times_up_row(row, row + I, h_data + j * I, I);
    }
  });
  Fp8Activations ha = fp8_activations(h);
  ha.stage_tiles(pb.block_k);
  ScratchVector<float> y(static_cast<size_t>(c * D));  // [c, D] fp32
  fp8_product_f32(pb.down(group.expert), ha.view(), c, D, y.data(), D);
  mlafx::parallel_chunks(0, D, 256, [&](int64_t d0, int64_t d1) {
    add_weighted_rows<scalar_t>(pb, routing, group, y.data() + d0, D, d0, d1);
  });
}

at::Tensor moe_experts_fp8(const at::Tensor& x,             // [T, D]
                           const at::Tensor& topk_ids,      // [T, k] int64
                           const at::Tensor& topk_weights,  // [T, k] float32
                           const at::Tensor& w13,           // [E, 2I, D] e4m3
                           const at::Tensor& w13_scale,     // [E, 2 ceil(I/bn), ceil(D/bk)]
                           const at::Tensor& w2,            // [E, D, I] e4m3
                           const at::Tensor& w2_scale,      // [E, ceil(D/bn), ceil(I/bk)]
                           int64_t block_n, int64_t block_k) {
  TORCH_CHECK(x.device().is_cpu() && topk_ids.device().is_cpu() && topk_weights.device().is_cpu(),
              "moe_experts_fp8: all tensors must be on the CPU");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "moe_experts_fp8: x must be bfloat16, float16 or float32, got ",
                   x.scalar_type());
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kLong,
                   "moe_experts_fp8: topk_ids must be int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat,
                   "moe_experts_fp8: topk_weights must be float32, got ",
                   topk_weights.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "moe_experts_fp8: x must be [num_tokens, hidden], got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
                    "moe_experts_fp8: topk_ids must be [num_tokens, top_k] with num_tokens = ",
                    x.size(0), ", got shape ", topk_ids.sizes());
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(),
                    "moe_experts_fp8: topk_weights must have topk_ids's shape ",
                    topk_ids.sizes(), ", got ", topk_weights.sizes());
  TORCH_CHECK_VALUE(w13.dim() == 3 && w2.dim() == 3,
                    "moe_experts_fp8: w13 and w2 must be [num_experts, rows, cols], got shapes ",
                    w13.sizes(), " and ", w2.sizes());
  const int64_t D = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK_VALUE(block_n > 0, "moe_experts_fp8: block_n must be positive, got ", block_n);
  check_fp8_weight("moe_experts_fp8", "w13", w13, w13_scale, {E}, 2 * I, D, block_n, block_k,
                   2 * ((I + block_n - 1) / block_n));
  check_fp8_weight("moe_experts_fp8", "w2", w2, w2_scale, {E}, D, I, block_n, block_k);
  TORCH_CHECK_VALUE(D <= 1 || x.stride(1) == 1,
                    "moe_experts_fp8: x's last dim must be contiguous, got strides ", x.strides());
  const int64_t T = x.size(0), k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id_data = ids.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK_INDEX(id_data[p] >= 0 && id_data[p] < E, "moe_experts_fp8: topk_ids[", p / k,
                      ", ", p % k, "] = ", id_data[p], " is out of range for ", E, " experts");
  }
  at::Tensor sum = at::zeros({T, D}, x.options().dtype(at::kFloat));  // fp32 [T, D]
  if (T * k == 0 || D == 0 || I == 0) {
    return sum.to(x.scalar_type());
  }
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = group_by_expert(id_data, T * k, E, kMaxStreamingPairs);
  const Problem pb{k,
                   D,
                   I,
                   block_n,
                   block_k,
                   static_cast<const uint8_t*>(w13.const_data_ptr()),
                   w13_scale.const_data_ptr<float>(),
                   static_cast<const uint8_t*>(w2.const_data_ptr()),
                   w2_scale.const_data_ptr<float>(),
                   w13_scale.stride(0),
                   w2_scale.stride(0),
                   weights.const_data_ptr<float>(),
                   sum.data_ptr<float>()};
  const Fp8Activations xa = fp8_activations(x);  // once per call
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts_fp8",
                                  [&] {
                                    if (!routing.streaming.empty()) {
                                      run_streaming<scalar_t>(pb, routing, xa, x);
                                    }
                                    for (const ExpertGroup& group : routing.gemm) {
                                      run_gemm_group<scalar_t>(pb, routing, group, xa, x);
                                    }
                                  });
  return sum.to(x.scalar_type());
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts_fp8(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
      "Tensor w13_scale, Tensor w2, Tensor w2_scale, int block_n, int block_k) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("moe_experts_fp8", &mlafx::moe_experts_fp8); }

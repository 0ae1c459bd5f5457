// The routed-experts driver over stored (widened-in-registers) expert stacks, shared by
// moe_experts_fp8 (fp8_moe.cpp, block FP8) and moe_experts_fp4 (fp4_moe.cpp, e2m1 + ue8m0).
// Portable sources only (includes ATen).
//
// As moe_experts_quantized (quant_moe.cpp): pairs grouped by expert, each picked expert's
// weights read once per call; few pairs stream all experts through two parallel passes
// (threads split gate/up rows, then w2's rows, i.e. own output columns), many pairs run each
// expert's rows with all threads over its weight rows; in batch-invariant mode the two kinds of
// group interleave so that a token's terms add up in expert order (run).
//
// A `Stacks` type describes one format's stacks:
//   int64_t num_pairs_per_token, hidden, inter;  // k, D, I
//   float swiglu_limit;                          // inf: plain SwiGLU
//   const float* weights;                        // topk_weights, contiguous [T, k]
//   float* sum;                                  // fp32 [T, D]
//   Weight gate(e), up(e), down(e);              // expert e's parts, as the products read them
//   void dot(const Weight&, const Fp8Rows&, M, n0, n1, float* out, ldo);  // single-threaded
//   void product(const Weight&, const Fp8Rows&, M, N, float* out, ldo);   // all threads
//   int64_t row_grain(int64_t K);                // weight rows per parallel chunk
//   bool uses_tiles(int64_t M);                  // stage M bf16 rows in the kernel's order
//   at::Tensor empty_staging(int64_t M, int64_t K);  // storage for them, 64-byte aligned
//   void stage_rows(const Fp8Rows&, int64_t M, int64_t K, uint16_t* tiles);
//   void stage(Fp8Activations&);                 // an expert's rows for product()
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "batch_invariant.h"
#include "fp8_aten.h"
#include "gemm_aten.h"
#include "moe_activation.h"
#include "moe_routing.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"
#include "swiglu_limit.h"

namespace mlafx::expert_stacks {

constexpr int64_t kMaxStreamingPairs = 16;

// h = silu(g) * u in x's dtype (moe_activation.h), g and u first clamped at `limit`
// (swiglu_limit.h).
template <typename scalar_t>
void swiglu_row(float* gate, float* up, scalar_t* h, int64_t n, float limit) {
  clamp_swiglu_inputs(gate, up, n, limit);
  silu_times_up_row(gate, up, h, n);
}

// Each group's rows of `a` (from row_of_group[g] on); those of a group that uses_tiles are
// staged in the kernel's order, threads splitting the groups, into tiles that `keep` owns.
template <typename Stacks>
std::vector<Fp8Rows> group_rows(const Stacks& pb, const Fp8Activations& a,
                                const std::vector<int64_t>& row_of_group,
                                std::span<const ExpertGroup> groups,
                                std::vector<at::Tensor>& keep) {
  std::vector<Fp8Rows> rows;
  std::vector<std::pair<int64_t, uint16_t*>> to_stage;  // (group, its tiles)
  for (size_t g = 0; g < groups.size(); ++g) {
    rows.push_back(a.view(row_of_group[g]));
    if (a.is_bf16 && a.cols > 0 && pb.uses_tiles(groups[g].size())) {
      keep.push_back(pb.empty_staging(groups[g].size(), a.cols));
      auto* tiles = reinterpret_cast<uint16_t*>(keep.back().data_ptr<int16_t>());
      rows.back().tiles = tiles;
      to_stage.emplace_back(static_cast<int64_t>(g), tiles);
    }
  }
  mlafx::parallel_chunks(0, static_cast<int64_t>(to_stage.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [g, tiles] = to_stage[static_cast<size_t>(i)];
      pb.stage_rows(rows[g], groups[g].size(), a.cols, tiles);
    }
  });
  return rows;
}

// The streaming groups `groups` (routing.streaming or a run of it).
template <typename scalar_t, typename Stacks>
void run_streaming(const Stacks& pb, const Routing& routing, std::span<const ExpertGroup> groups,
                   const Fp8Activations& xa, const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter;
  std::vector<int64_t> tokens, row_of_group;
  for (const ExpertGroup& group : groups) {
    row_of_group.push_back(static_cast<int64_t>(tokens.size()));
    for (int64_t j = group.begin; j < group.end; ++j) {
      tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
    }
  }
  const int64_t P = static_cast<int64_t>(tokens.size());
  const Fp8Activations xs = gather_rows(xa, tokens);  // [P] rows
  std::vector<at::Tensor> staged;  // the groups' rows for the AMX kernel
  const std::vector<Fp8Rows> x_rows = group_rows(pb, xs, row_of_group, groups, staged);
  at::Tensor h = at::empty({P, I}, x.options());  // [P, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const int64_t num_groups = static_cast<int64_t>(groups.size());

  // Pass 1: threads split the gate rows i (and the up rows I + i with them).
  mlafx::parallel_chunks(0, I, pb.row_grain(D), [&](int64_t i0, int64_t i1) {
    const int64_t ld = i1 - i0;
    std::vector<float> gate(static_cast<size_t>(kMaxStreamingPairs * ld));
    std::vector<float> up(gate.size());
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = groups[g];
      const Fp8Rows& rows = x_rows[g];
      pb.dot(pb.gate(group.expert), rows, group.size(), i0, i1, gate.data(), ld);
      pb.dot(pb.up(group.expert), rows, group.size(), i0, i1, up.data(), ld);
      for (int64_t j = 0; j < group.size(); ++j) {
        swiglu_row(gate.data() + j * ld, up.data() + j * ld,
                   h_data + (row_of_group[g] + j) * I + i0, i1 - i0, pb.swiglu_limit);
      }
    }
  });

  const Fp8Activations ha = fp8_activations(h);
  const std::vector<Fp8Rows> h_rows = group_rows(pb, ha, row_of_group, groups, staged);

  // Pass 2: threads split w2's rows d, i.e. own output columns [d0, d1).
  mlafx::parallel_chunks(0, D, pb.row_grain(I), [&](int64_t d0, int64_t d1) {
    const int64_t ld = d1 - d0;
    std::vector<float> y(static_cast<size_t>(kMaxStreamingPairs * ld));
    for (int64_t g = 0; g < num_groups; ++g) {
      const ExpertGroup& group = groups[g];
      pb.dot(pb.down(group.expert), h_rows[g], group.size(), d0, d1, y.data(), ld);
      add_weighted_rows<scalar_t>(pb, routing, group, y.data(), ld, d0, d1);
    }
  });
}

template <typename scalar_t, typename Stacks>
void run_gemm_group(const Stacks& pb, const Routing& routing, const ExpertGroup& group,
                    const Fp8Activations& xa, const at::Tensor& x) {
  const int64_t D = pb.hidden, I = pb.inter, c = group.size();
  std::vector<int64_t> tokens;
  for (int64_t j = group.begin; j < group.end; ++j) {
    tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
  }
  Fp8Activations xe = gather_rows(xa, tokens);
  pb.stage(xe);
  ScratchVector<float> gate_up(static_cast<size_t>(c * 2 * I));  // [c, 2I] fp32
  pb.product(pb.gate(group.expert), xe.view(), c, I, gate_up.data(), 2 * I);
  pb.product(pb.up(group.expert), xe.view(), c, I, gate_up.data() + I, 2 * I);
  at::Tensor h = at::empty({c, I}, x.options());  // [c, I]
  scalar_t* h_data = h.data_ptr<scalar_t>();
  mlafx::parallel_chunks(0, c, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      float* row = gate_up.data() + j * 2 * I;
      swiglu_row(row, row + I, h_data + j * I, I, pb.swiglu_limit);
    }
  });
  Fp8Activations ha = fp8_activations(h);
  pb.stage(ha);
  ScratchVector<float> y(static_cast<size_t>(c * D));  // [c, D] fp32
  pb.product(pb.down(group.expert), ha.view(), c, D, y.data(), D);
  mlafx::parallel_chunks(0, D, 256, [&](int64_t d0, int64_t d1) {
    add_weighted_rows<scalar_t>(pb, routing, group, y.data() + d0, D, d0, d1);
  });
}

// Every group of the routing (the pairs' ids were range-checked, T * k > 0). Batch-invariant
// mode: the kernels give a row the same bits at any row count (fp8_aten.h), so only the order a
// token's terms are added in could depend on the batch: expert order, as moe.cpp.
template <typename scalar_t, typename Stacks>
void run(const Stacks& pb, const Routing& routing, const Fp8Activations& xa, const at::Tensor& x) {
  auto stream = [&](std::span<const ExpertGroup> groups) {
    run_streaming<scalar_t>(pb, routing, groups, xa, x);
  };
  auto gemm = [&](const ExpertGroup& group) {
    run_gemm_group<scalar_t>(pb, routing, group, xa, x);
  };
  run_groups(routing, batch_invariant(), stream, gemm);
}

}  // namespace mlafx::expert_stacks

namespace mlafx::expert_stacks {

// The checks every stacks op makes of x [T, D], topk_ids [T, k] and topk_weights [T, k], and of
// each id against E experts; `op` goes into the messages.
inline void check_routing(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                          const at::Tensor& topk_weights) {
  TORCH_CHECK(x.device().is_cpu() && topk_ids.device().is_cpu() && topk_weights.device().is_cpu(),
              op, ": all tensors must be on the CPU");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()), op,
                   ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kLong, op, ": topk_ids must be int64, got ",
                   topk_ids.scalar_type());
  TORCH_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat, op,
                   ": topk_weights must be float32, got ", topk_weights.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [num_tokens, hidden], got shape ", x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0), op,
                    ": topk_ids must be [num_tokens, top_k] with num_tokens = ", x.size(0),
                    ", got shape ", topk_ids.sizes());
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(), op,
                    ": topk_weights must have topk_ids's shape ", topk_ids.sizes(), ", got ",
                    topk_weights.sizes());
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, op,
                    ": x's last dim must be contiguous, got strides ", x.strides());
}

inline void check_ids(const char* op, const int64_t* ids, int64_t num_pairs, int64_t k,
                      int64_t num_experts) {
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK_INDEX(ids[p] >= 0 && ids[p] < num_experts, op, ": topk_ids[", p / k, ", ", p % k,
                      "] = ", ids[p], " is out of range for ", num_experts, " experts");
  }
}

// An op's call once its weights are checked: the ids checked against num_experts, the pairs
// grouped, `make(k, weights, sum)` -> the Stacks over the contiguous topk_weights and the fp32
// [T, D] sum, every group run, the sum rounded once to x's dtype.
template <typename Make>
at::Tensor run_op(const char* op, const at::Tensor& x, const at::Tensor& topk_ids,
                  const at::Tensor& topk_weights, int64_t num_experts, int64_t inter, Make make) {
  const int64_t T = x.size(0), D = x.size(1), k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id_data = ids.const_data_ptr<int64_t>();
  check_ids(op, id_data, T * k, k, num_experts);
  at::Tensor sum = at::zeros({T, D}, x.options().dtype(at::kFloat));  // fp32 [T, D]
  if (T * k == 0 || D == 0 || inter == 0) {
    return sum.to(x.scalar_type());
  }
  const at::Tensor weights = topk_weights.contiguous();
  const Routing routing = group_by_expert(id_data, T * k, num_experts, kMaxStreamingPairs);
  const auto pb = make(k, weights.const_data_ptr<float>(), sum.data_ptr<float>());
  const Fp8Activations xa = fp8_activations(x);  // once per call
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "expert_stacks",
                                  [&] { run<scalar_t>(pb, routing, xa, x); });
  return sum.to(x.scalar_type());
}

}  // namespace mlafx::expert_stacks

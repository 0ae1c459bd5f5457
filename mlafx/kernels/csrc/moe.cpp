// moe_experts: the routed experts of a DeepSeek-style MoE layer for a batch of tokens.
//
//   x:            [T, D]      bf16/fp16/fp32, last dim contiguous (rows may be strided)
//   topk_ids:     [T, k]      int64 in [0, E); ids may repeat within a token
//   topk_weights: [T, k]      float32
//   w13:          [E, 2I, D]  x's dtype, last dim contiguous; rows [0, I) gate, [I, 2I) up
//   w2:           [E, D, I]   x's dtype, last dim contiguous
//   out:          [T, D]      x's dtype, contiguous:
//     out[t] = sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e]^T,  [g | u] = x[t] @ w13[e]^T,
//     e = topk_ids[t, j]; the k terms summed in fp32, rounded once.
//
// The (token, choice) pairs are grouped by expert, so every expert some token picked has its
// weights read once per call, and experts no token picked are not read at all. Per expert:
// - few pairs (bf16: <= 32 with VDPBF16PS, 16 on AMX tiles; else 8), decode: bandwidth-bound.
//   All such experts go through two parallel passes that split the weight rows across threads
//   (gate/up rows i in [i0, i1) of every such expert, then rows d in [d0, d1) of w2): each
//   thread streams its own share of the weights once with the rows_dot kernel (gemm.h), so
//   both cores pull bandwidth. In the second pass a thread owns output columns [d0, d1), so a
//   token that picked the same expert twice, or several experts, never races with itself.
// - many pairs (prefill): compute-bound. Gather the tokens, two ATen GEMMs (oneDNN, with its
//   own blocking, threads and ISA choice) and silu*up in between, exactly the reference's
//   arithmetic; the weighted rows are added into the fp32 sum by output columns.
// Measured (bench/kernel_cases/moe_gemm.py, bf16, 2 threads, D=2048, I=1408, 4 experts, top-2,
// cold weights): 8 tokens at 81-90% of the read bandwidth over the touched experts (1.7x the
// eager grouped reference); 4096 tokens at 71-85% of the bf16 matmul rate (1.2-2.4x eager).
// Python reference: mlafx/kernels/moe_reference.py::moe_experts_ref.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gemm.h"
#include "cpu_features.h"
#include "gemm_aten.h"
#include "moe_routing.h"

namespace mlafx {
namespace {

// Experts with at most this many (token, choice) pairs stream their weights (rows_dot);
// more go to ATen's GEMM. bf16 on an AVX-512 BF16 CPU: 32 with VDPBF16PS, 16 on the tile unit
// (one tile of x holds 16 rows). Measured on Zen 4 (2 threads, the embedded default's experts,
// D=2048, I=1408): ATen's GEMM runs [17..22, 2048] x [2048, 2816] at ~200 GFLOP/s (1.2 ms),
// twice the time VDPBF16PS needs to stream that weight at 22 rows. Other dtypes take the
// scalar kernel, which pays only for a few pairs.
constexpr int64_t kMaxStreamingPairs = 32;  // the most any kernel streams
constexpr int64_t kMaxStreamingPairsTiles = 16;
constexpr int64_t kMaxStreamingPairsScalar = 8;

bool streams_on_tiles(at::ScalarType dtype, int64_t D, int64_t I) {
  return dtype == at::kBFloat16 && use_amx_bf16() &&
         avx512::rows_dot_amx_supports(kMaxStreamingPairsTiles, D) &&
         avx512::rows_dot_amx_supports(kMaxStreamingPairsTiles, I);
}

int64_t max_streaming_pairs(at::ScalarType dtype, bool tiles) {
  if (tiles) {
    return kMaxStreamingPairsTiles;
  }
  return dtype == at::kBFloat16 && use_avx512_bf16() ? kMaxStreamingPairs
                                                     : kMaxStreamingPairsScalar;
}

// Weight rows per rows_dot call inside a thread's share: the fp32 results ([pairs, 64])
// stay in L1 between the kernel and the epilogue that consumes them.
constexpr int64_t kRowsPerStep = 64;

float silu(float v) { return v / (1.0f + std::exp(-v)); }

struct Problem {
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  const float* weights;         // topk_weights, contiguous [T, k]
  float* sum;                   // fp32 [T, D], contiguous
};

// acc[t(p)] += weight(p) * rows[j] over columns [d0, d1), for the pairs of a group.
void add_weighted_rows(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                       const float* rows, int64_t ld_rows, int64_t d0, int64_t d1) {
  for (int64_t j = 0; j < group.size(); ++j) {
    const int64_t pair = routing.sorted_pairs[group.begin + j];
    const int64_t token = pair / pb.num_pairs_per_token;
    const float weight = pb.weights[pair];
    float* dst = pb.sum + token * pb.hidden;
    const float* src = rows + j * ld_rows - d0;
    for (int64_t d = d0; d < d1; ++d) {
      dst[d] += weight * src[d];
    }
  }
}

template <typename scalar_t>
void run_streaming(const Problem& pb, const Routing& routing, bool tiles, const at::Tensor& x,
                   const at::Tensor& w13, const at::Tensor& w2) {
  const FloatKind kind = float_kind(x.scalar_type());
  const int64_t D = pb.hidden;
  const int64_t I = pb.inter;
  // The tokens of every streaming pair, in pair order: [P, D] contiguous.
  std::vector<int64_t> tokens;
  std::vector<int64_t> row_of_group;  // first row of each group in `xs` / `h`
  for (const ExpertGroup& group : routing.streaming) {
    row_of_group.push_back(static_cast<int64_t>(tokens.size()));
    for (int64_t j = group.begin; j < group.end; ++j) {
      tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
    }
  }
  const int64_t P = static_cast<int64_t>(tokens.size());
  const at::Tensor token_index =
      at::from_blob(tokens.data(), {P}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor xs = at::index_select(x, 0, token_index).contiguous();  // [P, D]
  at::Tensor h = at::empty({P, I}, x.options());                           // [P, I]
  const scalar_t* xs_data = xs.const_data_ptr<scalar_t>();
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const scalar_t* w13_data = w13.const_data_ptr<scalar_t>();
  const scalar_t* w2_data = w2.const_data_ptr<scalar_t>();
  const int64_t w13_expert = w13.stride(0), w13_row = w13.stride(1);
  const int64_t w2_expert = w2.stride(0), w2_row = w2.stride(1);
  const int64_t num_groups = static_cast<int64_t>(routing.streaming.size());
  // On the tile unit each group's rows of x (then of h) are packed once as its B operand.
  const int64_t packed_elems = std::max(D, I) * 16;  // K/2 pairs x 16 rows x 2
  std::vector<uint16_t> packed(tiles ? static_cast<size_t>(num_groups * packed_elems) : 0);
  auto packed_rows = [&](int64_t g) { return packed.data() + g * packed_elems; };
  auto pack_groups = [&](const scalar_t* rows, int64_t width) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const auto* first = reinterpret_cast<const uint16_t*>(rows + row_of_group[g] * width);
      avx512::pack_rows_for_tiles(first, width, routing.streaming[g].size(), width,
                                  packed_rows(g));
    }
  };
  // out[j, n - n0] = rows j of group g (x or h, `width` wide) . w[n] for n in [n0, n1)
  auto dot = [&](int64_t g, const scalar_t* rows, int64_t width, const scalar_t* w, int64_t ldw,
                 int64_t n0, int64_t n1, float* out) {
    const int64_t M = routing.streaming[g].size();
    if (tiles) {
      avx512::rows_dot_bf16_amx(packed_rows(g), M, reinterpret_cast<const uint16_t*>(w), ldw,
                                width, n0, n1, out, kRowsPerStep);
    } else {
      rows_dot(kind, rows + row_of_group[g] * width, width, M, w, ldw, width, n0, n1, out,
               kRowsPerStep);
    }
  };
  if (tiles) {
    pack_groups(xs_data, D);
  }

  // Pass 1: h = silu(x @ gate^T) * (x @ up^T), threads split the rows i of gate and up.
  at::parallel_for(0, I, kRowsPerStep / 2, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(static_cast<size_t>(kMaxStreamingPairs * kRowsPerStep));
    std::vector<float> up(gate.size());
    for (int64_t i0 = begin; i0 < end; i0 += kRowsPerStep) {
      const int64_t i1 = std::min(end, i0 + kRowsPerStep);
      for (int64_t g = 0; g < num_groups; ++g) {
        const ExpertGroup& group = routing.streaming[g];
        const scalar_t* w = w13_data + group.expert * w13_expert;
        dot(g, xs_data, D, w, w13_row, i0, i1, gate.data());
        dot(g, xs_data, D, w, w13_row, I + i0, I + i1, up.data());
        for (int64_t j = 0; j < group.size(); ++j) {
          scalar_t* dst = h_data + (row_of_group[g] + j) * I;
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t at = j * kRowsPerStep + (i - i0);
            dst[i] = static_cast<scalar_t>(silu(gate[at]) * up[at]);
          }
        }
      }
    }
  });

  if (tiles) {
    pack_groups(h_data, I);
  }

  // Pass 2: sum[t] += weight * h @ w2^T, threads split the rows d of w2 (= output columns).
  at::parallel_for(0, D, kRowsPerStep / 2, [&](int64_t begin, int64_t end) {
    std::vector<float> y(static_cast<size_t>(kMaxStreamingPairs * kRowsPerStep));
    for (int64_t d0 = begin; d0 < end; d0 += kRowsPerStep) {
      const int64_t d1 = std::min(end, d0 + kRowsPerStep);
      for (int64_t g = 0; g < num_groups; ++g) {
        const ExpertGroup& group = routing.streaming[g];
        dot(g, h_data, I, w2_data + group.expert * w2_expert, w2_row, d0, d1, y.data());
        add_weighted_rows(pb, routing, group, y.data(), kRowsPerStep, d0, d1);
      }
    }
  });
}

template <typename scalar_t>
void run_gemm_group(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                    const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2) {
  const int64_t I = pb.inter;
  std::vector<int64_t> tokens;
  for (int64_t j = group.begin; j < group.end; ++j) {
    tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
  }
  const at::Tensor token_index =
      at::from_blob(tokens.data(), {group.size()}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor xe = at::index_select(x, 0, token_index);       // [c, D]
  const at::Tensor gate_up = at::matmul(xe, w13[group.expert].t());  // [c, 2I]
  const at::Tensor h = at::mul(at::silu(gate_up.narrow(1, 0, I)), gate_up.narrow(1, I, I));
  const at::Tensor y = at::matmul(h, w2[group.expert].t()).contiguous();             // [c, D]
  const scalar_t* y_data = y.const_data_ptr<scalar_t>();
  const int64_t D = pb.hidden;
  at::parallel_for(0, D, 256, [&](int64_t d0, int64_t d1) {
    std::vector<float> rows(static_cast<size_t>(group.size() * (d1 - d0)));
    for (int64_t j = 0; j < group.size(); ++j) {
      for (int64_t d = d0; d < d1; ++d) {
        rows[j * (d1 - d0) + (d - d0)] = static_cast<float>(y_data[j * D + d]);
      }
    }
    add_weighted_rows(pb, routing, group, rows.data(), d1 - d0, d0, d1);
  });
}

// ---- at::Tensor entry -------------------------------------------------------------------

at::Tensor moe_experts(const at::Tensor& x,             // [T, D]
                       const at::Tensor& topk_ids,      // [T, k] int64
                       const at::Tensor& topk_weights,  // [T, k] float32
                       const at::Tensor& w13,           // [E, 2I, D]
                       const at::Tensor& w2             // [E, D, I]
) {
  TORCH_CHECK(x.device().is_cpu() && topk_ids.device().is_cpu() &&
                  topk_weights.device().is_cpu() && w13.device().is_cpu() &&
                  w2.device().is_cpu(),
              "moe_experts: all tensors must be on the CPU");
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "moe_experts: x must be bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
                   "moe_experts: w13 and w2 must have x's dtype ", x.scalar_type(), ", got ",
                   w13.scalar_type(), " and ", w2.scalar_type());
  TORCH_CHECK_TYPE(topk_ids.scalar_type() == at::kLong, "moe_experts: topk_ids must be int64, got ",
                   topk_ids.scalar_type());
  TORCH_CHECK_TYPE(topk_weights.scalar_type() == at::kFloat,
                   "moe_experts: topk_weights must be float32, got ", topk_weights.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "moe_experts: x must be [num_tokens, hidden], got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
                    "moe_experts: topk_ids must be [num_tokens, top_k] with num_tokens = ",
                    x.size(0), ", got shape ", topk_ids.sizes());
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(),
                    "moe_experts: topk_weights must have topk_ids's shape ", topk_ids.sizes(),
                    ", got ", topk_weights.sizes());
  TORCH_CHECK_VALUE(w13.dim() == 3 && w13.size(1) % 2 == 0 && w13.size(2) == x.size(1),
                    "moe_experts: w13 must be [num_experts, 2 * intermediate, hidden = ",
                    x.size(1), "], got shape ", w13.sizes());
  const int64_t E = w13.size(0);
  const int64_t D = x.size(1);
  const int64_t I = w13.size(1) / 2;
  TORCH_CHECK_VALUE(w2.dim() == 3 && w2.size(0) == E && w2.size(1) == D && w2.size(2) == I,
                    "moe_experts: w2 must be [num_experts, hidden, intermediate] = [", E, ", ", D,
                    ", ", I, "] to match w13 ", w13.sizes(), ", got shape ", w2.sizes());
  TORCH_CHECK_VALUE(D <= 1 || x.stride(1) == 1,
                    "moe_experts: x's last dim must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE((D <= 1 || w13.stride(2) == 1) && (I <= 1 || w2.stride(2) == 1),
                    "moe_experts: w13 and w2 must be contiguous in their last dim, got strides ",
                    w13.strides(), " and ", w2.strides());
  const int64_t T = x.size(0);
  const int64_t k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id_data = ids.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK_INDEX(id_data[p] >= 0 && id_data[p] < E, "moe_experts: topk_ids[", p / k, ", ",
                      p % k, "] = ", id_data[p], " is out of range for ", E, " experts");
  }
  at::Tensor sum = at::zeros({T, D}, x.options().dtype(at::kFloat));  // fp32 [T, D]
  if (T * k == 0 || D == 0 || I == 0) {
    return sum.to(x.scalar_type());
  }
  const at::Tensor weights = topk_weights.contiguous();
  const bool tiles = streams_on_tiles(x.scalar_type(), D, I);
  const Routing routing =
      group_by_expert(id_data, T * k, E, max_streaming_pairs(x.scalar_type(), tiles));
  const Problem pb{k, D, I, weights.const_data_ptr<float>(), sum.data_ptr<float>()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
    if (!routing.streaming.empty()) {
      run_streaming<scalar_t>(pb, routing, tiles, x, w13, w2);
    }
    // One expert at a time: ATen's GEMM runs on all threads itself (regions never nest).
    for (const ExpertGroup& group : routing.gemm) {
      run_gemm_group<scalar_t>(pb, routing, group, x, w13, w2);
    }
  });
  return sum.to(x.scalar_type());
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("moe_experts", &mlafx::moe_experts); }

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
//   swiglu_limit: optional; given, g and u are clamped first (DeepSeek-V4: swiglu_limit.h).
//
// The (token, choice) pairs are grouped by expert, so every expert some token picked has its
// weights read once per call, and experts no token picked are not read at all. Per expert:
// - few pairs (bf16: <= 32 with VDPBF16PS, 16 on AMX tiles; else 8), decode: bandwidth-bound.
//   All such experts go through two parallel passes that split the weight rows across threads
//   (gate/up rows i in [i0, i1) of every such expert, then rows d in [d0, d1) of w2): each
//   thread streams its own share of the weights once with the rows_dot kernel (gemm.h), so
//   both cores pull bandwidth. In the second pass a thread owns output columns [d0, d1), so a
//   token that picked the same expert twice, or several experts, never races with itself.
// - many pairs (prefill): compute-bound. bf16 on an AVX-512 BF16 CPU: the same two passes
//   over each such expert with packed_dot (VDPBF16PS or tiles) on its weight rows packed a
//   chunk at a time in cache; otherwise ATen's GEMMs in fp32.
// Accuracy (issue 27): gate and up are fp32 sums, and h = silu(g) * u is not rounded to x's
// dtype before the down projection: in bf16/fp16 it goes in as two parts, hi + lo (see
// store_h), so the result is as accurate as one rounding of the fp64 value (within 1.5x;
// tests/test_kernel_bf16_accuracy.py). That costs the down projection twice the arithmetic.
// Measured (bench/kernel_cases/moe_gemm.py, bf16, 2 threads, D=2048, I=1408, 4 experts, top-2,
// cold weights; before the hi/lo split): 8 tokens at 81-90% of the read bandwidth over the
// touched experts (1.7x the eager grouped reference); 4096 tokens at 71-85% of the bf16 matmul
// rate (1.2-2.4x eager).
// Python reference: mlafx/kernels/moe_reference.py::moe_experts_ref.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_max.h>
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
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "batch_invariant.h"
#include "cpu_features.h"
#include "gemm.h"
#include "gemm_aten.h"
#include "moe_routing.h"
#include "parallel_chunks.h"
#include "swiglu_limit.h"

namespace mlafx {
namespace {

// Experts with at most this many (token, choice) pairs stream their weights (rows_dot);
// more go to ATen's GEMM. bf16 on an AVX-512 BF16 CPU: 32 with VDPBF16PS, 16 on the tile unit
// (one tile of x holds 16 rows). Measured on Zen 4 (2 threads, the embedded default's experts,
// D=2048, I=1408): ATen's GEMM runs [17..22, 2048] x [2048, 2816] at ~200 GFLOP/s (1.2 ms),
// twice the time VDPBF16PS needs to stream that weight at 22 rows. bf16 on AVX2 streams 32
// too (the fp32 GEMM path widens the expert's weights per call). Other dtypes take the scalar
// kernel, which pays only for a few pairs.
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
  return dtype == at::kBFloat16 && (use_avx512_bf16() || use_avx2()) ? kMaxStreamingPairs
                                                                     : kMaxStreamingPairsScalar;
}

// Weight rows per rows_dot call inside a thread's share: the fp32 results ([pairs, 64])
// stay in L1 between the kernel and the epilogue that consumes them.
constexpr int64_t kRowsPerStep = 64;

float silu(float v) { return v / (1.0f + std::exp(-v)); }

// silu(g) * u, g and u clamped at `limit` first (swiglu_limit.h; inf: none).
float swiglu(float g, float u, float limit) {
  clamp_swiglu_inputs(&g, &u, 1, limit);
  return silu(g) * u;
}

struct Problem {
  int64_t num_pairs_per_token;  // k
  int64_t hidden;               // D
  int64_t inter;                // I
  const float* weights;         // topk_weights, contiguous [T, k]
  float* sum;                   // fp32 [T, D], contiguous
  float swiglu_limit;           // inf: plain SwiGLU
};

// acc[t(p)] += weight(p) * (rows[parts * j] + ... + rows[parts * j + parts - 1]) over columns
// [d0, d1), for the pairs j of a group: each pair's product comes in `parts` rows (the high and
// low parts of h, or one row).
void add_weighted_rows(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                       const float* rows, int64_t ld_rows, int64_t parts, int64_t d0,
                       int64_t d1) {
  for (int64_t j = 0; j < group.size(); ++j) {
    const int64_t pair = routing.sorted_pairs[group.begin + j];
    const int64_t token = pair / pb.num_pairs_per_token;
    const float weight = pb.weights[pair];
    float* dst = pb.sum + token * pb.hidden;
    const float* src = rows + j * parts * ld_rows - d0;
    for (int64_t d = d0; d < d1; ++d) {
      float v = src[d];
      for (int64_t q = 1; q < parts; ++q) {
        v += src[q * ld_rows + d];
      }
      dst[d] += weight * v;
    }
  }
}

// h = silu(g) * u, kept at fp32 accuracy in 16-bit types as two parts, hi + lo: hi is h
// rounded, lo the rounded rest (h - hi is exact in fp32, so hi + lo is within 2^-17 |h|); the
// down projection multiplies both, like attention's P (attention_avx512.cpp). fp32 needs one.
template <typename scalar_t>
constexpr int64_t kParts = std::is_same_v<scalar_t, float> ? 1 : 2;

template <typename scalar_t>
void store_h(float v, scalar_t* dst, int64_t part_stride) {
  const scalar_t hi = static_cast<scalar_t>(v);
  dst[0] = hi;
  if constexpr (kParts<scalar_t> == 2) {
    dst[part_stride] = static_cast<scalar_t>(v - static_cast<float>(hi));
  }
}

// The rows of x of a group's pairs, in pair order: [group size, D] contiguous.
at::Tensor group_rows(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                      const at::Tensor& x) {
  std::vector<int64_t> tokens;
  for (int64_t j = group.begin; j < group.end; ++j) {
    tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
  }
  const at::Tensor index =
      at::from_blob(tokens.data(), {group.size()}, at::TensorOptions().dtype(at::kLong));
  return at::index_select(x, 0, index).contiguous();  // copies: `tokens` dies here
}

// Kept as one function (~115 lines): both passes share the gathered rows, h, the packed tile
// operands and the `dot` dispatch between rows_dot and the tile unit; split, each pass would
// take all of them as arguments.
template <typename scalar_t>
void run_streaming(const Problem& pb, const Routing& routing,
                   std::span<const ExpertGroup> streaming, bool tiles, const at::Tensor& x,
                   const at::Tensor& w13, const at::Tensor& w2) {
  constexpr int64_t parts = kParts<scalar_t>;
  const FloatKind kind = float_kind(x.scalar_type());
  const int64_t D = pb.hidden;
  const int64_t I = pb.inter;
  // The tokens of every streaming pair, in pair order: [P, D] contiguous.
  std::vector<int64_t> tokens;
  std::vector<int64_t> row_of_group;  // first row of each group in `xs` / `h`
  for (const ExpertGroup& group : streaming) {
    row_of_group.push_back(static_cast<int64_t>(tokens.size()));
    for (int64_t j = group.begin; j < group.end; ++j) {
      tokens.push_back(routing.sorted_pairs[j] / pb.num_pairs_per_token);
    }
  }
  const int64_t P = static_cast<int64_t>(tokens.size());
  const at::Tensor token_index =
      at::from_blob(tokens.data(), {P}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor xs = at::index_select(x, 0, token_index).contiguous();  // [P, D]
  // h's parts row by row: [P, parts, I], so a group's rows of parts are one strided matrix.
  at::Tensor h = at::empty({P, parts, I}, x.options());
  const scalar_t* xs_data = xs.const_data_ptr<scalar_t>();
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const scalar_t* w13_data = w13.const_data_ptr<scalar_t>();
  const scalar_t* w2_data = w2.const_data_ptr<scalar_t>();
  const int64_t w13_expert = w13.stride(0), w13_row = w13.stride(1);
  const int64_t w2_expert = w2.stride(0), w2_row = w2.stride(1);
  const int64_t num_groups = static_cast<int64_t>(streaming.size());
  // On the tile unit each group's rows of x (then each part of its rows of h) are packed once
  // as a B operand of at most 16 rows.
  const int64_t packed_elems = std::max(D, I) * 16;  // K/2 pairs x 16 rows x 2
  std::vector<uint16_t> packed(tiles ? static_cast<size_t>(num_groups * parts * packed_elems)
                                     : 0);
  auto packed_rows = [&](int64_t g, int64_t part) {
    return packed.data() + (g * parts + part) * packed_elems;
  };
  // out[r * ldo + n - n0] = row r of group g's `rows` (`width` wide, row stride ldx, r <
  // num_rows) . w[n] for n in [n0, n1); on tiles, the rows packed as `part`.
  auto dot = [&](int64_t g, int64_t part, const scalar_t* rows, int64_t ldx, int64_t num_rows,
                 int64_t width, const scalar_t* w, int64_t ldw, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
    if (tiles) {
      avx512::rows_dot_bf16_amx(packed_rows(g, part), num_rows,
                                reinterpret_cast<const uint16_t*>(w), ldw, width, n0, n1, out,
                                ldo);
    } else {
      rows_dot(kind, rows, ldx, num_rows, w, ldw, width, n0, n1, out, ldo);
    }
  };
  if (tiles) {
    for (int64_t g = 0; g < num_groups; ++g) {
      avx512::pack_rows_for_tiles(
          reinterpret_cast<const uint16_t*>(xs_data + row_of_group[g] * D), D,
          streaming[g].size(), D, packed_rows(g, 0));
    }
  }

  // Pass 1: h = silu(x @ gate^T) * (x @ up^T), threads split the rows i of gate and up.
  mlafx::parallel_chunks(0, I, kRowsPerStep, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(static_cast<size_t>(kMaxStreamingPairs * kRowsPerStep));
    std::vector<float> up(gate.size());
    for (int64_t i0 = begin; i0 < end; i0 += kRowsPerStep) {
      const int64_t i1 = std::min(end, i0 + kRowsPerStep);
      for (int64_t g = 0; g < num_groups; ++g) {
        const ExpertGroup& group = streaming[g];
        const scalar_t* rows = xs_data + row_of_group[g] * D;
        const scalar_t* w = w13_data + group.expert * w13_expert;
        dot(g, 0, rows, D, group.size(), D, w, w13_row, i0, i1, gate.data(), kRowsPerStep);
        dot(g, 0, rows, D, group.size(), D, w, w13_row, I + i0, I + i1, up.data(),
            kRowsPerStep);
        for (int64_t j = 0; j < group.size(); ++j) {
          scalar_t* dst = h_data + (row_of_group[g] + j) * parts * I;
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t at = j * kRowsPerStep + (i - i0);
            store_h(swiglu(gate[at], up[at], pb.swiglu_limit), dst + i, I);
          }
        }
      }
    }
  }, /*align=*/kRowsPerStep);

  if (tiles) {
    for (int64_t g = 0; g < num_groups; ++g) {
      for (int64_t part = 0; part < parts; ++part) {
        avx512::pack_rows_for_tiles(
            reinterpret_cast<const uint16_t*>(h_data + (row_of_group[g] * parts + part) * I),
            parts * I, streaming[g].size(), I, packed_rows(g, part));
      }
    }
  }

  // Pass 2: sum[t] += weight * h @ w2^T, threads split the rows d of w2 (= output columns).
  // Row parts * j + q of y is part q of pair j's product.
  mlafx::parallel_chunks(0, D, kRowsPerStep, [&](int64_t begin, int64_t end) {
    std::vector<float> y(static_cast<size_t>(parts * kMaxStreamingPairs * kRowsPerStep));
    for (int64_t d0 = begin; d0 < end; d0 += kRowsPerStep) {
      const int64_t d1 = std::min(end, d0 + kRowsPerStep);
      for (int64_t g = 0; g < num_groups; ++g) {
        const ExpertGroup& group = streaming[g];
        const scalar_t* w = w2_data + group.expert * w2_expert;
        const scalar_t* rows = h_data + row_of_group[g] * parts * I;
        if (tiles) {  // one packed operand per part
          for (int64_t part = 0; part < parts; ++part) {
            dot(g, part, nullptr, 0, group.size(), I, w, w2_row, d0, d1,
                y.data() + part * kRowsPerStep, parts * kRowsPerStep);
          }
        } else {  // the parts' rows interleave: one matrix of parts * size rows
          dot(g, 0, rows, I, parts * group.size(), I, w, w2_row, d0, d1, y.data(),
              kRowsPerStep);
        }
        add_weighted_rows(pb, routing, group, y.data(), kRowsPerStep, parts, d0, d1);
      }
    }
  }, /*align=*/kRowsPerStep);
}

// Many pairs, bf16 on an AVX-512 BF16 CPU: the same two passes with fp32 results, but each
// thread packs its share of the expert's weight rows (kBlockedRows at a time, into a scratch
// that stays in cache) and multiplies all the group's rows by it with packed_dot, which is
// compute-bound there (VDPBF16PS or the tile unit). The weight is read from memory once per
// call; the x (then h) rows once per chunk, from cache for prefill-sized groups.
constexpr int64_t kBlockedRows = 4 * kPackedBlockRows;

void run_blocked_group(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                       const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2) {
  using scalar_t = c10::BFloat16;
  constexpr int64_t parts = kParts<scalar_t>;
  const int64_t D = pb.hidden;
  const int64_t I = pb.inter;
  const int64_t c = group.size();
  const at::Tensor xe = group_rows(pb, routing, group, x);  // [c, D]
  at::Tensor h = at::empty({c, parts, I}, x.options());                    // [c, parts, I]
  const auto* xe_data = reinterpret_cast<const uint16_t*>(xe.const_data_ptr<scalar_t>());
  scalar_t* h_data = h.data_ptr<scalar_t>();
  const auto* w13_data =
      reinterpret_cast<const uint16_t*>(w13[group.expert].const_data_ptr<scalar_t>());
  const auto* w2_data =
      reinterpret_cast<const uint16_t*>(w2[group.expert].const_data_ptr<scalar_t>());
  const int64_t w13_row = w13.stride(1), w2_row = w2.stride(1);

  // Pass 1: threads split the rows i of gate and up.
  mlafx::parallel_chunks(0, I, kBlockedRows, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> gate_w(static_cast<size_t>(kBlockedRows * (D + 1)));
    std::vector<uint16_t> up_w(gate_w.size());
    std::vector<float> gate(static_cast<size_t>(c * kBlockedRows));
    std::vector<float> up(gate.size());
    for (int64_t i0 = begin; i0 < end; i0 += kBlockedRows) {
      const int64_t n = std::min(end - i0, kBlockedRows);
      const int64_t blocks = (n + kPackedBlockRows - 1) / kPackedBlockRows;
      pack_rows_16bit(w13_data + i0 * w13_row, w13_row, n, D, gate_w.data());
      pack_rows_16bit(w13_data + (I + i0) * w13_row, w13_row, n, D, up_w.data());
      packed_dot(FloatKind::kBFloat16, xe_data, D, c, gate_w.data(), D, 0, blocks, gate.data(),
                 kBlockedRows);
      packed_dot(FloatKind::kBFloat16, xe_data, D, c, up_w.data(), D, 0, blocks, up.data(),
                 kBlockedRows);
      for (int64_t j = 0; j < c; ++j) {
        scalar_t* dst = h_data + j * parts * I + i0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t at = j * kBlockedRows + i;
          store_h(swiglu(gate[at], up[at], pb.swiglu_limit), dst + i, I);
        }
      }
    }
  }, /*align=*/kBlockedRows);

  // Pass 2: threads split the rows d of w2; the parts of h are parts * c rows of width I.
  const auto* h_rows = reinterpret_cast<const uint16_t*>(h_data);
  mlafx::parallel_chunks(0, D, kBlockedRows, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> down_w(static_cast<size_t>(kBlockedRows * (I + 1)));
    std::vector<float> y(static_cast<size_t>(parts * c * kBlockedRows));
    for (int64_t d0 = begin; d0 < end; d0 += kBlockedRows) {
      const int64_t n = std::min(end - d0, kBlockedRows);
      pack_rows_16bit(w2_data + d0 * w2_row, w2_row, n, I, down_w.data());
      packed_dot(FloatKind::kBFloat16, h_rows, I, parts * c, down_w.data(), I, 0,
                 (n + kPackedBlockRows - 1) / kPackedBlockRows, y.data(), kBlockedRows);
      add_weighted_rows(pb, routing, group, y.data(), kBlockedRows, parts, d0, d0 + n);
    }
  }, /*align=*/kBlockedRows);
}

// Many pairs in the other cases: ATen's GEMMs in fp32 (a bf16/fp16 GEMM would round its
// result before silu and the down projection), on fp32 copies of x's rows and the expert's
// weights: the portable path and fp16 pay for the widening; fp32 is unchanged.
template <typename scalar_t>
void run_gemm_group(const Problem& pb, const Routing& routing, const ExpertGroup& group,
                    const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2) {
  const int64_t I = pb.inter;
  const at::Tensor xe = group_rows(pb, routing, group, x).to(at::kFloat);  // [c, D]
  const at::Tensor gate_up = at::matmul(xe, w13[group.expert].to(at::kFloat).t());  // [c, 2I]
  at::Tensor gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
  if (std::isfinite(pb.swiglu_limit)) {
    gate = at::clamp_max(gate, pb.swiglu_limit);
    up = at::clamp(up, -pb.swiglu_limit, pb.swiglu_limit);
  }
  const at::Tensor h = at::mul(at::silu(gate), up);
  const at::Tensor y = at::matmul(h, w2[group.expert].to(at::kFloat).t()).contiguous();  // [c, D]
  const float* y_data = y.const_data_ptr<float>();
  const int64_t D = pb.hidden;
  mlafx::parallel_chunks(0, D, 256, [&](int64_t d0, int64_t d1) {
    add_weighted_rows(pb, routing, group, y_data + d0, D, 1, d0, d1);
  });
}

// ---- at::Tensor entry -------------------------------------------------------------------

at::Tensor moe_experts(const at::Tensor& x,             // [T, D]
                       const at::Tensor& topk_ids,      // [T, k] int64
                       const at::Tensor& topk_weights,  // [T, k] float32
                       const at::Tensor& w13,           // [E, 2I, D]
                       const at::Tensor& w2,            // [E, D, I]
                       std::optional<double> swiglu_limit) {
  const float limit = checked_swiglu_limit("moe_experts", swiglu_limit);
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
  // Batch-invariant mode: every pair's products take one arithmetic and a token's terms are
  // added in expert order. On the tile unit the streaming kernel (rows_dot_bf16_amx) and the
  // blocked one (packed_dot_bf16_amx) give a row the same sums (the same pairs of products,
  // k ascending, one accumulator from zero), so large groups still block, run in expert order
  // with the streaming ones; elsewhere every pair streams (larger groups in pieces).
  const bool invariant = batch_invariant();
  const bool in_expert_order = invariant && tiles && use_avx512_bf16();
  const Routing routing = group_by_expert(id_data, T * k, E,
                                          max_streaming_pairs(x.scalar_type(), tiles),
                                          invariant && !in_expert_order);
  const Problem pb{k, D, I, weights.const_data_ptr<float>(), sum.data_ptr<float>(), limit};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
    auto run_group = [&](const ExpertGroup& group) {
      if (std::is_same_v<scalar_t, c10::BFloat16> && use_avx512_bf16()) {
        run_blocked_group(pb, routing, group, x, w13, w2);
      } else {
        run_gemm_group<scalar_t>(pb, routing, group, x, w13, w2);
      }
    };
    auto stream = [&](std::span<const ExpertGroup> groups) {
      run_streaming<scalar_t>(pb, routing, groups, tiles, x, w13, w2);
    };
    run_groups(routing, in_expert_order, stream, run_group);
  });
  return sum.to(x.scalar_type());
}

}  // namespace
}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
      "float? swiglu_limit=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("moe_experts", &mlafx::moe_experts); }

// The attention ops' driver: work items over query groups, flash-decoding splits, threads,
// and the merge of split groups. Shared by the ops over the attention core (attention.cpp:
// mla_attention_paged, varlen_attention; dsa_attention.cpp: mla_attention_sparse), which
// describe their problem as a `Problem` (below) and leave the arithmetic to the core.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "batch_invariant.h"
#include "gemm_aten.h"
#include "lse_merge.h"
#include "parallel_chunks.h"
#include "workspace_layout.h"

namespace mlafx::attn {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The core for this dtype on this CPU (attention.cpp): AMX, AVX-512 or the portable one.
const CoreOps& select_core(at::ScalarType dtype, const CoreDims& dims);

struct WorkItem {
  int64_t group;
  int64_t j0, j1;  // keys of this item
  int64_t split;   // index into the partial buffers, or -1: writes the final output
  // Batch-invariant mode: the item is a whole group whose pieces (kInvariantSplitKeys each)
  // run one after the other and are merged in the item, as split items would be.
  bool pieces = false;
};

// Below this many keys a split costs more (partials, merge) than the parallelism it buys.
// Measured (AMX core, bf16, one query x 16 heads, 2 threads): a 512-key group takes 80 us on
// one thread and 116 us split in two (waking the second thread, the partial buffers and the
// merge pass cost ~40-70 us); from ~1024 keys the split pays (4096: 663 -> 357 us).
constexpr int64_t kMinSplitKeys = 512;
// Batch-invariant mode (batch_invariant.h): every group's keys are cut at multiples of this
// and the pieces merged, so a row's arithmetic depends only on its own keys.
constexpr int64_t kInvariantSplitKeys = kMinSplitKeys;
// A group with at most this many pieces, when the groups are enough work for the threads,
// runs them in one item (WorkItem::pieces) with thread-local partials: no partial buffer of
// the whole call (hundreds of MB for a long prefill) and no separate merge pass.
constexpr int64_t kMaxItemPieces = 16;

// Problem: provides
//   int64_t num_groups(); int64_t group_keys(g); int64_t group_rows(g);
//   void rows(g, const void** q, int64_t* limits, void** out, float** lse);
//   void keys(g, j0, n, const void** ka, const void** kb, const void** v);
// and optionally
//   void finish(g, float* const* out_f32, float* const* lse);
// with which every row of the group ends in fp32 (whole items, pieces and split merges alike)
// and finish() writes the outputs from those rows and their LSEs (v4_attention: the sink
// scales each row before its one rounding). Without it the core writes `out` directly.
template <typename Problem, typename = void>
struct FinishesRows : std::false_type {};
template <typename Problem>
struct FinishesRows<Problem, std::void_t<decltype(&Problem::finish)>> : std::true_type {};

// This thread's fp32 rows for a group a Problem finishes (kMaxRows x dv).
inline void finish_rows(int64_t dv, float** rows) {
  thread_local std::vector<float> stage;
  stage.resize(static_cast<size_t>(kMaxRows * dv));
  for (int64_t g = 0; g < kMaxRows; ++g) {
    rows[g] = stage.data() + g * dv;
  }
}

// The work of one call: items over the query groups, a group split along its keys when there
// are too few groups for the threads (or always, in batch-invariant mode).
struct AttentionPlan {
  std::vector<WorkItem> items;        // largest first
  std::vector<int64_t> split_groups;  // groups whose items write partials
  std::vector<int64_t> first_split;   // per split group: index of its first partial
  std::vector<int64_t> split_count;   // per split group: its number of partials
  int64_t num_partials = 0;
};

template <typename Problem>
AttentionPlan plan_attention(const Problem& problem, int64_t threads) {
  const int64_t num_groups = problem.num_groups();
  int64_t total_keys = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    total_keys += problem.group_keys(g);
  }
  // Aim for about 4 items per thread so the tail of the schedule is short.
  int64_t chunk = std::numeric_limits<int64_t>::max();
  const bool invariant = mlafx::batch_invariant();
  const bool few_groups = threads > 1 && num_groups < 4 * threads;
  if (invariant) {
    chunk = kInvariantSplitKeys;
  } else if (few_groups) {
    const int64_t want = (total_keys + 4 * threads - 1) / (4 * threads);
    chunk = std::max(kMinSplitKeys, (want + kBlockKeys - 1) / kBlockKeys * kBlockKeys);
  }
  AttentionPlan plan;
  plan.items.reserve(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t keys = problem.group_keys(g);
    if (keys <= chunk && !invariant) {
      plan.items.push_back({g, 0, keys, -1});
      continue;
    }
    if (invariant && !few_groups && keys <= kMaxItemPieces * chunk) {
      plan.items.push_back({g, 0, keys, -1, /*pieces=*/true});
      continue;
    }
    plan.split_groups.push_back(g);
    plan.first_split.push_back(plan.num_partials);
    for (int64_t j = 0; j < keys; j += chunk) {
      plan.items.push_back({g, j, std::min(keys, j + chunk), plan.num_partials++});
    }
    plan.split_count.push_back(plan.num_partials - plan.first_split.back());
  }
  // Largest first: with dynamic scheduling that bounds the idle tail by the smallest items.
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return (a.j1 - a.j0) * problem.group_rows(a.group) >
           (b.j1 - b.j0) * problem.group_rows(b.group);
  });
  return plan;
}

// The split items' fp32 results: outputs [num_partials, kMaxRows, dv], LSEs [.., kMaxRows].
struct Partials {
  at::Tensor out, lse;
  int64_t dv = 0;
  Partials(int64_t num_partials, int64_t value_dim) : dv(value_dim) {
    if (num_partials > 0) {
      out = at::empty({num_partials, kMaxRows, dv}, at::kFloat);
      lse = at::empty({num_partials, kMaxRows}, at::kFloat);
    }
  }
  float* out_row(int64_t split, int64_t row) const {
    return out.data_ptr<float>() + (split * kMaxRows + row) * dv;
  }
  float* lse_row(int64_t split, int64_t row) const {
    return lse.data_ptr<float>() + split * kMaxRows + row;
  }
};

// One row's merge of its parts (fp32 outputs and LSEs, in key order) into dst and *lse_dst:
// the parts with an infinite LSE are empty and skipped; none left gives zeros and -inf.
// Split items' rows (merge_splits_as) and pieces items' rows both take it, so a row's bits
// do not depend on which of the two ran it. `parts`, `part_lse`, `weights`: scratch.
template <typename Out>
void merge_row(const float* const* all_parts, const float* const* all_lse, int64_t count,
               int64_t dv, Out* dst, float* lse_dst, std::vector<const float*>& parts,
               std::vector<float>& part_lse, std::vector<float>& weights) {
  parts.clear();
  part_lse.clear();
  for (int64_t k = 0; k < count; ++k) {
    const float x = *all_lse[k];
    if (!std::isinf(x)) {
      parts.push_back(all_parts[k]);
      part_lse.push_back(x);
    }
  }
  const int64_t n = static_cast<int64_t>(parts.size());
  if (n == 0) {
    std::fill_n(dst, dv, Out(0.f));
    *lse_dst = kNegInf;
    return;
  }
  weights.resize(n);
  *lse_dst = mlafx::lse_merge_weights(part_lse.data(), n, weights.data());
  // sum_k w_k * part_k in k order, part after part over the row (loops the compiler
  // vectorises), then rounded to Out as c10 rounds (round_row)
  thread_local std::vector<float> acc;
  acc.resize(static_cast<size_t>(dv));
  float* a = acc.data();
  const float w0 = weights[0];
  const float* p0 = parts[0];
  for (int64_t i = 0; i < dv; ++i) {
    a[i] = w0 * p0[i];
  }
  for (int64_t k = 1; k < n; ++k) {
    const float wk = weights[k];
    const float* pk = parts[k];
    for (int64_t i = 0; i < dv; ++i) {
      a[i] += wk * pk[i];
    }
  }
  mlafx::round_row(a, dst, dv);
}

// merge_row for the output's dtype.
inline void merge_row_dtype(at::ScalarType out_dtype, const float* const* all_parts,
                            const float* const* all_lse, int64_t count, int64_t dv, void* dst,
                            float* lse_dst, std::vector<const float*>& parts,
                            std::vector<float>& part_lse, std::vector<float>& weights) {
  switch (out_dtype) {
    case at::kBFloat16:
      return merge_row(all_parts, all_lse, count, dv, static_cast<c10::BFloat16*>(dst), lse_dst,
                       parts, part_lse, weights);
    case at::kHalf:
      return merge_row(all_parts, all_lse, count, dv, static_cast<c10::Half*>(dst), lse_dst,
                       parts, part_lse, weights);
    default:
      return merge_row(all_parts, all_lse, count, dv, static_cast<float*>(dst), lse_dst, parts,
                       part_lse, weights);
  }
}

// A pieces item (WorkItem::pieces): the group's keys in pieces of kInvariantSplitKeys, each
// finished into thread-local fp32 partials as a split item's would be, then merged per row.
template <typename Problem>
void run_pieces(const Problem& problem, const CoreOps& core, const CoreDims& dims,
                const WorkItem& item, void* ws, at::ScalarType out_dtype) {
  const void* q[kMaxRows];
  int64_t limits[kMaxRows];
  void* out[kMaxRows];
  float* lse[kMaxRows];
  float* out_f32[kMaxRows];
  float* lse_f32[kMaxRows];
  const void* ka[kBlockKeys];
  const void* kb[kBlockKeys];
  const void* v[kBlockKeys];
  const int64_t rows = problem.group_rows(item.group);
  const int64_t count = (item.j1 - item.j0 + kInvariantSplitKeys - 1) / kInvariantSplitKeys;
  thread_local std::vector<float> piece_out, piece_lse, weights;
  thread_local std::vector<const float*> parts;
  thread_local std::vector<float> part_lse;
  piece_out.resize(static_cast<size_t>(count * kMaxRows * dims.dv));
  piece_lse.resize(static_cast<size_t>(count * kMaxRows));
  problem.rows(item.group, q, limits, out, lse);
  for (int64_t p = 0; p < count; ++p) {
    const int64_t j0 = item.j0 + p * kInvariantSplitKeys;
    const int64_t j1 = std::min(item.j1, j0 + kInvariantSplitKeys);
    core.begin(ws, dims, rows, q, limits);
    for (int64_t j = j0; j < j1; j += kBlockKeys) {
      const int64_t n = std::min(kBlockKeys, j1 - j);
      problem.keys(item.group, j, n, ka, kb, v);
      core.block(ws, dims, j, n, ka, kb, v);
    }
    for (int64_t g = 0; g < rows; ++g) {
      out_f32[g] = piece_out.data() + (p * kMaxRows + g) * dims.dv;
      lse_f32[g] = piece_lse.data() + p * kMaxRows + g;
    }
    core.end(ws, dims, nullptr, out_f32, lse_f32);
  }
  const float* row_parts[kMaxItemPieces];
  const float* row_lse[kMaxItemPieces];
  float* finished[kMaxRows];
  if constexpr (FinishesRows<Problem>::value) {
    finish_rows(dims.dv, finished);
  }
  for (int64_t g = 0; g < rows; ++g) {
    for (int64_t p = 0; p < count; ++p) {
      row_parts[p] = piece_out.data() + (p * kMaxRows + g) * dims.dv;
      row_lse[p] = piece_lse.data() + p * kMaxRows + g;
    }
    if constexpr (FinishesRows<Problem>::value) {
      merge_row(row_parts, row_lse, count, dims.dv, finished[g], lse[g], parts, part_lse,
                weights);
    } else {
      merge_row_dtype(out_dtype, row_parts, row_lse, count, dims.dv, out[g], lse[g], parts,
                      part_lse, weights);
    }
  }
  if constexpr (FinishesRows<Problem>::value) {
    problem.finish(item.group, finished, lse);
  }
}

// Runs every item of the plan on the threads (dynamic schedule); whole groups write the final
// outputs, split items their partials.
template <typename Problem>
void run_items(const Problem& problem, const CoreOps& core, const CoreDims& dims,
               const AttentionPlan& plan, const Partials& partials, int64_t threads,
               at::ScalarType out_dtype) {
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t slots = std::min<int64_t>(threads, num_items);
  const size_t ws_bytes = align64(core.workspace_bytes(dims));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, slots, 1, [&](int64_t slot_begin, int64_t slot_end) {
    const void* q[kMaxRows];
    int64_t limits[kMaxRows];
    void* out[kMaxRows];
    float* lse[kMaxRows];
    float* out_f32[kMaxRows];
    // Two sets of key pointers: the block being computed and the next one, announced to the
    // core (prefetch) before the current block runs.
    const void* ka[2][kBlockKeys];
    const void* kb[2][kBlockKeys];
    const void* v[2][kBlockKeys];
    // One workspace per thread, kept across calls: decode steps are short enough that a
    // fresh few-hundred-KB allocation (and its page faults) would show. Never in the key loop.
    thread_local std::vector<char> workspace;
    if (workspace.size() < ws_bytes + 64) {
      workspace.resize(ws_bytes + 64);
    }
    void* ws = reinterpret_cast<void*>(
        (reinterpret_cast<uintptr_t>(workspace.data()) + 63) & ~uintptr_t{63});
    for (int64_t slot = slot_begin; slot < slot_end; ++slot) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const WorkItem& item = plan.items[i];
        if (item.pieces) {
          run_pieces(problem, core, dims, item, ws, out_dtype);
          continue;
        }
        const int64_t rows = problem.group_rows(item.group);
        problem.rows(item.group, q, limits, out, lse);
        core.begin(ws, dims, rows, q, limits);
        int cur = 0;
        if (item.j0 < item.j1) {
          problem.keys(item.group, item.j0, std::min(kBlockKeys, item.j1 - item.j0), ka[cur],
                       kb[cur], v[cur]);
        }
        for (int64_t j = item.j0; j < item.j1; j += kBlockKeys) {
          const int64_t n = std::min(kBlockKeys, item.j1 - j);
          const int64_t j_next = j + kBlockKeys;
          if (j_next < item.j1) {
            const int nxt = 1 - cur;
            const int64_t n_next = std::min(kBlockKeys, item.j1 - j_next);
            problem.keys(item.group, j_next, n_next, ka[nxt], kb[nxt], v[nxt]);
            if (core.prefetch != nullptr) {
              core.prefetch(ws, dims, n_next, ka[nxt], kb[nxt], v[nxt]);
            }
          }
          core.block(ws, dims, j, n, ka[cur], kb[cur], v[cur]);
          cur = 1 - cur;
        }
        if (item.split < 0) {
          if constexpr (FinishesRows<Problem>::value) {
            finish_rows(dims.dv, out_f32);
            core.end(ws, dims, nullptr, out_f32, lse);
            problem.finish(item.group, out_f32, lse);
          } else {
            core.end(ws, dims, out, nullptr, lse);
          }
        } else {
          for (int64_t g = 0; g < rows; ++g) {
            out_f32[g] = partials.out_row(item.split, g);
            lse[g] = partials.lse_row(item.split, g);
          }
          core.end(ws, dims, nullptr, out_f32, lse);
        }
      }
    }
  });
}

// Merges each split group's partials into its outputs (lse_merge.h: merge_attn_states'
// arithmetic over any number of parts; a part with an infinite LSE is empty).
template <typename Out, typename Problem>
void merge_splits_as(const Problem& problem, const AttentionPlan& plan, const Partials& partials) {
  const int64_t dv = partials.dv;
  const int64_t num_split = static_cast<int64_t>(plan.split_groups.size());
  mlafx::parallel_chunks(0, num_split, 1, [&](int64_t b, int64_t e) {
    const void* q[kMaxRows];
    int64_t limits[kMaxRows];
    void* out[kMaxRows];
    float* lse[kMaxRows];
    std::vector<const float*> parts, row_parts;
    std::vector<const float*> row_lse;
    std::vector<float> part_lse, weights;
    float* finished[kMaxRows];
    if constexpr (FinishesRows<Problem>::value) {
      finish_rows(dv, finished);
    }
    for (int64_t s = b; s < e; ++s) {
      const int64_t group = plan.split_groups[s];
      const int64_t rows = problem.group_rows(group);
      const int64_t count = plan.split_count[s];
      problem.rows(group, q, limits, out, lse);
      row_parts.resize(count);
      row_lse.resize(count);
      for (int64_t g = 0; g < rows; ++g) {
        for (int64_t k = 0; k < count; ++k) {
          row_parts[k] = partials.out_row(plan.first_split[s] + k, g);
          row_lse[k] = partials.lse_row(plan.first_split[s] + k, g);
        }
        if constexpr (FinishesRows<Problem>::value) {
          merge_row(row_parts.data(), row_lse.data(), count, dv, finished[g], lse[g], parts,
                    part_lse, weights);
        } else {
          merge_row(row_parts.data(), row_lse.data(), count, dv, static_cast<Out*>(out[g]),
                    lse[g], parts, part_lse, weights);
        }
      }
      if constexpr (FinishesRows<Problem>::value) {
        problem.finish(group, finished, lse);
      }
    }
  });
}

template <typename Problem>
void merge_splits(const Problem& problem, const AttentionPlan& plan, const Partials& partials,
                  at::ScalarType out_dtype) {
  switch (out_dtype) {
    case at::kBFloat16:
      return merge_splits_as<c10::BFloat16>(problem, plan, partials);
    case at::kHalf:
      return merge_splits_as<c10::Half>(problem, plan, partials);
    default:
      return merge_splits_as<float>(problem, plan, partials);
  }
}

// Plan, run, merge: the attention of every query group of `problem` through `core`.
template <typename Problem>
inline void run_attention(const Problem& problem, const CoreOps& core, const CoreDims& dims,
                          at::ScalarType out_dtype) {
  if (problem.num_groups() == 0) {
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const AttentionPlan plan = plan_attention(problem, threads);
  const Partials partials(plan.num_partials, dims.dv);
  run_items(problem, core, dims, plan, partials, threads, out_dtype);
  if (plan.num_partials > 0) {
    merge_splits(problem, plan, partials, out_dtype);
  }
}

}  // namespace mlafx::attn

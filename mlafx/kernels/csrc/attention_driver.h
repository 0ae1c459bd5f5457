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
#include <vector>

#include "attention.h"
#include "batch_invariant.h"
#include "parallel_chunks.h"

namespace mlafx::attn {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

// The core for this dtype on this CPU (attention.cpp): AMX, AVX-512 or the portable one.
const CoreOps& select_core(at::ScalarType dtype, const CoreDims& dims);

struct WorkItem {
  int64_t group;
  int64_t j0, j1;  // keys of this item
  int64_t split;   // index into the partial buffers, or -1: writes the final output
};

// Below this many keys a split costs more (partials, merge) than the parallelism it buys.
// Measured (AMX core, bf16, one query x 16 heads, 2 threads): a 512-key group takes 80 us on
// one thread and 116 us split in two (waking the second thread, the partial buffers and the
// merge pass cost ~40-70 us); from ~1024 keys the split pays (4096: 663 -> 357 us).
constexpr int64_t kMinSplitKeys = 512;
// Batch-invariant mode (batch_invariant.h): every group's keys are cut at multiples of this
// and the pieces merged, so a row's arithmetic depends only on its own keys.
constexpr int64_t kInvariantSplitKeys = kMinSplitKeys;

// Problem: provides
//   int64_t num_groups(); int64_t group_keys(g); int64_t group_rows(g);
//   void rows(g, const void** q, int64_t* limits, void** out, float** lse);
//   void keys(g, j0, n, const void** ka, const void** kb, const void** v);
template <typename Problem>
inline void run_attention(const Problem& problem, const CoreOps& core, const CoreDims& dims,
                          at::ScalarType out_dtype, bool allow_splits) {
  const int64_t num_groups = problem.num_groups();
  if (num_groups == 0) {
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> keys(num_groups);
  int64_t total_keys = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    keys[g] = problem.group_keys(g);
    total_keys += keys[g];
  }
  // Aim for about 4 items per thread so the tail of the schedule is short.
  int64_t chunk = std::numeric_limits<int64_t>::max();
  const bool invariant = mlafx::batch_invariant();
  if (invariant) {
    chunk = kInvariantSplitKeys;
  } else if (allow_splits && threads > 1 && num_groups < 4 * threads) {
    const int64_t want = (total_keys + 4 * threads - 1) / (4 * threads);
    chunk = std::max(kMinSplitKeys, (want + kBlockKeys - 1) / kBlockKeys * kBlockKeys);
  }
  std::vector<WorkItem> items;
  items.reserve(num_groups);
  std::vector<int64_t> split_groups;  // groups whose items write partials
  std::vector<int64_t> first_split;   // per split group: index of its first partial
  int64_t num_partials = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    if (keys[g] <= chunk && !invariant) {
      items.push_back({g, 0, keys[g], -1});
      continue;
    }
    split_groups.push_back(g);
    first_split.push_back(num_partials);
    for (int64_t j = 0; j < keys[g]; j += chunk) {
      items.push_back({g, j, std::min(keys[g], j + chunk), num_partials++});
    }
  }
  // Largest first: with dynamic scheduling that bounds the idle tail by the smallest items.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return (a.j1 - a.j0) * problem.group_rows(a.group) >
           (b.j1 - b.j0) * problem.group_rows(b.group);
  });

  const int64_t dv = dims.dv;
  at::Tensor partial_out, partial_lse;
  if (num_partials > 0) {
    partial_out = at::empty({num_partials, kMaxRows, dv}, at::kFloat);
    partial_lse = at::empty({num_partials, kMaxRows}, at::kFloat);
  }
  float* p_out = num_partials > 0 ? partial_out.data_ptr<float>() : nullptr;
  float* p_lse = num_partials > 0 ? partial_lse.data_ptr<float>() : nullptr;

  const int64_t slots = std::min<int64_t>(threads, static_cast<int64_t>(items.size()));
  const size_t ws_bytes = align64(core.workspace_bytes(dims));

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
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
        const WorkItem& item = items[i];
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
          core.end(ws, dims, out, nullptr, lse);
        } else {
          for (int64_t g = 0; g < rows; ++g) {
            out_f32[g] = p_out + (item.split * kMaxRows + g) * dv;
            lse[g] = p_lse + item.split * kMaxRows + g;
          }
          core.end(ws, dims, nullptr, out_f32, lse);
        }
      }
    }
  });
  if (num_partials == 0) {
    return;
  }

  // Merge the splits of each group: the same LSE arithmetic as merge_attn_states.
  const int64_t elem = static_cast<int64_t>(c10::elementSize(out_dtype));
  mlafx::parallel_chunks(0, static_cast<int64_t>(split_groups.size()), 1, [&](int64_t b, int64_t e) {
    const void* q[kMaxRows];
    int64_t limits[kMaxRows];
    void* out[kMaxRows];
    float* lse[kMaxRows];
    std::vector<float> acc(dv);
    for (int64_t s = b; s < e; ++s) {
      const int64_t group = split_groups[s];
      const int64_t first = first_split[s];
      const int64_t count = (keys[group] + chunk - 1) / chunk;
      const int64_t rows = problem.group_rows(group);
      problem.rows(group, q, limits, out, lse);
      for (int64_t g = 0; g < rows; ++g) {
        float mx = kNegInf;
        for (int64_t k = 0; k < count; ++k) {
          const float x = p_lse[(first + k) * kMaxRows + g];
          mx = x > mx ? x : mx;
        }
        const float shift = mx == kNegInf ? 0.f : mx;
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < count; ++k) {
          const float w = std::exp(p_lse[(first + k) * kMaxRows + g] - shift);
          if (w == 0.f) {
            continue;  // an empty split (its output is 0 anyway)
          }
          sum += w;
          const float* src = p_out + ((first + k) * kMaxRows + g) * dv;
          for (int64_t i = 0; i < dv; ++i) {
            acc[i] += w * src[i];
          }
        }
        const bool empty = sum == 0.f;
        *lse[g] = empty ? kNegInf : shift + std::log(sum);
        const float inv = empty ? 0.f : 1.f / sum;
        for (int64_t i = 0; i < dv; ++i) {
          const float x = acc[i] * inv;
          char* dst = static_cast<char*>(out[g]) + i * elem;
          switch (out_dtype) {
            case at::kBFloat16:
              *reinterpret_cast<c10::BFloat16*>(dst) = c10::BFloat16(x);
              break;
            case at::kHalf:
              *reinterpret_cast<c10::Half*>(dst) = c10::Half(x);
              break;
            default:
              *reinterpret_cast<float*>(dst) = x;
          }
        }
      }
    }
  });
}

}  // namespace mlafx::attn

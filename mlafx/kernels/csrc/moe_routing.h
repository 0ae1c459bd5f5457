// The (token, choice) pairs of a routed-experts call grouped by expert: shared by
// moe_experts (moe.cpp), moe_experts_quantized (quant_moe.cpp) and the stored expert stacks
// (expert_stacks.h). Portable sources only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace mlafx {

// The pairs routed to one expert: positions [begin, end) of the expert-sorted pair list.
struct ExpertGroup {
  int64_t expert;
  int64_t begin;
  int64_t end;
  int64_t size() const { return end - begin; }
};

struct Routing {
  std::vector<int64_t> sorted_pairs;  // pair p = t * k + j, grouped by expert, stable
  std::vector<ExpertGroup> streaming;  // 1..max_streaming_pairs pairs
  std::vector<ExpertGroup> gemm;       // more pairs
};

// Counting sort of the pairs by expert; ids were range-checked by the caller.
// stream_all (batch-invariant mode): no gemm groups; an expert with more than
// max_streaming_pairs pairs streams them as consecutive pieces of at most that many.
inline Routing group_by_expert(const int64_t* ids, int64_t num_pairs, int64_t num_experts,
                               int64_t max_streaming_pairs, bool stream_all = false) {
  std::vector<int64_t> offsets(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    ++offsets[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    offsets[e + 1] += offsets[e];
  }
  Routing routing;
  routing.sorted_pairs.resize(static_cast<size_t>(num_pairs));
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) {
    routing.sorted_pairs[fill[ids[p]]++] = p;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    const ExpertGroup group{e, offsets[e], offsets[e + 1]};
    if (group.size() == 0) {
      continue;  // never read
    }
    if (group.size() <= max_streaming_pairs) {
      routing.streaming.push_back(group);
    } else if (!stream_all) {
      routing.gemm.push_back(group);
    } else {
      for (int64_t b = group.begin; b < group.end; b += max_streaming_pairs) {
        routing.streaming.push_back({e, b, std::min(group.end, b + max_streaming_pairs)});
      }
    }
  }
  return routing;
}

// Every group of `routing` in expert order: each run of consecutive streaming groups between
// two gemm groups as one call of stream(span of them), each gemm group as gemm(group). A kernel
// that adds each pair's result into its token's fp32 sum then adds a token's terms in expert
// order, whichever path each of its experts took (batch-invariant mode).
template <typename Stream, typename Gemm>
void run_in_expert_order(const Routing& routing, Stream&& stream, Gemm&& gemm) {
  const std::span<const ExpertGroup> streaming(routing.streaming);
  size_t s = 0;
  for (const ExpertGroup& group : routing.gemm) {
    size_t e = s;
    while (e < streaming.size() && streaming[e].expert < group.expert) {
      ++e;
    }
    if (e > s) {
      stream(streaming.subspan(s, e - s));
    }
    gemm(group);
    s = e;
  }
  if (s < streaming.size()) {
    stream(streaming.subspan(s));
  }
}

// Every group of `routing`: in expert order (run_in_expert_order) when `in_expert_order`, else
// all streaming groups in one stream(span) call, then each gemm group (one expert at a time,
// each on all threads: parallel regions never nest).
template <typename Stream, typename Gemm>
void run_groups(const Routing& routing, bool in_expert_order, Stream&& stream, Gemm&& gemm) {
  if (in_expert_order) {
    run_in_expert_order(routing, stream, gemm);
    return;
  }
  if (!routing.streaming.empty()) {
    stream(std::span<const ExpertGroup>(routing.streaming));
  }
  for (const ExpertGroup& group : routing.gemm) {
    gemm(group);
  }
}

// sum[t(p)] += weight(p) * round(y[j]) over columns [d0, d1) for the group's pairs (y's row j is
// the group's j-th pair, columns from d0 at y), rounding to scalar_t as the experts' semantics
// do. `Problem` has num_pairs_per_token, hidden, weights (topk_weights [T, k]) and sum (fp32
// [T, D]).
template <typename scalar_t, typename Problem>
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

}  // namespace mlafx

// A running top-k over (score, position) candidates in a bounded buffer: dsa_indexer_topk's
// selection, one per query.
//
// Order: score descending, then position ascending (among equal scores the earlier position
// ranks first) -- what a stable descending sort of the scores by position gives. Positions are
// distinct, so this is a strict total order and the kept set is unique. A NaN score (invalid
// input: visible rows never score NaN) ranks as -inf, so the order stays total.
//
// The buffer holds up to `capacity` (>= k + 1) candidates; when it fills, nth_element keeps
// the best k and the k-th becomes the threshold a new candidate must beat to enter. Fed in
// ascending positions, a candidate tying the threshold's score never enters (it ranks after).
// Amortised O(1) per candidate plus O(capacity) per compaction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mlafx::dsa {

struct Candidate {
  float score;
  int32_t pos;
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.pos < b.pos);
}

inline float rank_score(float s) {
  return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
}

class RunningTopK {
 public:
  RunningTopK(Candidate* buf, int64_t capacity, int64_t k) : buf_(buf), cap_(capacity), k_(k) {}

  void offer(float score, int32_t pos) {
    const Candidate c{rank_score(score), pos};
    if (has_threshold_ && !ranks_before(c, threshold_)) {
      return;
    }
    buf_[size_++] = c;
    if (size_ == cap_) {
      compact();
    }
  }

  // Keeps the best min(k, offered) candidates in buf[0 .. returned count), in no order.
  int64_t finish() {
    if (size_ > k_) {
      compact();
    }
    return size_;
  }

 private:
  void compact() {
    std::nth_element(buf_, buf_ + (k_ - 1), buf_ + size_, ranks_before);
    size_ = k_;
    threshold_ = buf_[k_ - 1];  // nth_element: every kept candidate ranks at or before it
    has_threshold_ = true;
  }

  Candidate* buf_;
  int64_t cap_, k_;
  int64_t size_ = 0;
  Candidate threshold_{0.f, 0};
  bool has_threshold_ = false;
};

// The best k of n candidates (any order in, any order out), then their positions ascending
// into out[0 .. min(k, n)), -1 after that up to k. Reorders cand.
inline void write_selection(Candidate* cand, int64_t n, int64_t k, int64_t* out,
                            int64_t out_stride) {
  if (n > k) {
    std::nth_element(cand, cand + (k - 1), cand + n, ranks_before);
    n = k;
  }
  std::sort(cand, cand + n,
            [](const Candidate& a, const Candidate& b) { return a.pos < b.pos; });
  for (int64_t i = 0; i < k; ++i) {
    out[i * out_stride] = i < n ? cand[i].pos : -1;
  }
}

}  // namespace mlafx::dsa

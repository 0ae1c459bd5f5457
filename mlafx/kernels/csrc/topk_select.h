// A running top-k over (score, position) candidates in a bounded buffer: dsa_indexer_topk's
// selection, one per query.
//
// Order: score descending, then position ascending (among equal scores the earlier position
// ranks first) -- what a stable descending sort of the scores by position gives. Positions are
// distinct, so this is a strict total order and the kept set is unique. A NaN score (invalid
// input: visible rows never score NaN) ranks as -inf, so the order stays total; -0 and +0 tie.
//
// The buffer holds up to `capacity` (>= k + 1) candidates; when it fills, nth_element keeps
// the best k and the k-th becomes the threshold a new candidate must beat to enter. Fed in
// ascending positions, a candidate tying the threshold's score never enters (it ranks after).
// Amortised O(1) per candidate plus O(capacity) per compaction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>

namespace mlafx::dsa {

// A candidate as one 64-bit key whose unsigned order is the rank order, so that selecting and
// comparing are plain integer operations (against a struct comparator the selection took as
// long as the AMX scoring at 16k cached tokens): the score's bits made monotone in the high
// half (NaN as -inf, -0 as +0, so equal floats give equal halves), the position's complement
// in the low half (among equal scores the earlier position ranks first). Every key is > 0.
using Candidate = uint64_t;

inline Candidate make_candidate(float score, int32_t pos) {
  float s = std::isnan(score) ? -std::numeric_limits<float>::infinity() : score + 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof(bits));
  bits = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(pos));
}

inline int32_t candidate_pos(Candidate c) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(c & 0xFFFFFFFFu));
}

class RunningTopK {
 public:
  RunningTopK(Candidate* buf, int64_t capacity, int64_t k) : buf_(buf), cap_(capacity), k_(k) {}

  // Branch-free: every candidate is written, and counted only if it beats the threshold (0
  // before the first compaction, which every key beats).
  void offer(float score, int32_t pos) {
    const Candidate c = make_candidate(score, pos);
    buf_[size_] = c;
    size_ += c > threshold_ ? 1 : 0;
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
    std::nth_element(buf_, buf_ + (k_ - 1), buf_ + size_, std::greater<Candidate>());
    size_ = k_;
    threshold_ = buf_[k_ - 1];  // nth_element: every kept candidate ranks at or before it
  }

  Candidate* buf_;
  int64_t cap_, k_;
  int64_t size_ = 0;
  Candidate threshold_ = 0;
};

// The best k of n candidates (any order in, any order out), then their positions ascending
// into out[0 .. min(k, n)), -1 after that up to k. Reorders cand (and overwrites it).
inline void write_selection(Candidate* cand, int64_t n, int64_t k, int64_t* out,
                            int64_t out_stride) {
  if (n > k) {
    std::nth_element(cand, cand + (k - 1), cand + n, std::greater<Candidate>());
    n = k;
  }
  for (int64_t i = 0; i < n; ++i) {
    cand[i] = static_cast<Candidate>(candidate_pos(cand[i]));
  }
  std::sort(cand, cand + n);
  for (int64_t i = 0; i < k; ++i) {
    out[i * out_stride] = i < n ? static_cast<int64_t>(cand[i]) : -1;
  }
}

}  // namespace mlafx::dsa

// The rows of an attention core's next key block (CoreOps::prefetch), fetched into L2 a few
// lines at a time while the current block is computed. Shared by the AVX-512 and AMX bf16
// cores: a row that is not in cache costs far more to load than to use, and the loads a core
// issues on demand keep too few misses in flight.
//
// ATen-free, like attention.h; included from the *_avx512.cpp sources only.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

#include "attention.h"

namespace mlafx::avx512 {

// Rows of the next block still to prefetch: spans of whole cache lines and a cursor.
struct PrefetchList {
  static constexpr int64_t kMaxSpans = 3 * mlafx::attn::kBlockKeys;  // segment a, b, values
  int64_t count;  // spans
  int64_t span;   // cursor: current span
  int64_t line;   // cursor: next line within it
  int64_t total;  // lines in all spans
  const char* start[kMaxSpans];
  int64_t lines[kMaxSpans];

  void clear() { count = span = line = total = 0; }

  void add(const void* row, int64_t bytes) {
    const auto first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63};
    const auto last = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(bytes);
    start[count] = reinterpret_cast<const char*>(first);
    lines[count] = static_cast<int64_t>((last - first + 63) / 64);
    total += lines[count];
    ++count;
  }

  // The arguments of CoreOps::prefetch for bf16 keys and values: every key row's segments and
  // the value rows (unless a value is its key row's prefix, as in MLA). Replaces the list.
  void set_block(const mlafx::attn::CoreDims& d, int64_t n, const void* const* ka,
                 const void* const* kb, const void* const* v) {
    clear();
    for (int64_t k = 0; k < n; ++k) {
      add(ka[k], 2 * d.wa);
      if (d.wb > 0) {
        add(kb[k], 2 * d.wb);
      }
      if (v[k] != ka[k]) {
        add(v[k], 2 * d.dv);
      }
    }
  }

  // Issue up to `budget` more prefetches (into L2: a block is larger than L1).
  void issue(int64_t budget) {
    for (; span < count && budget > 0; ++span, line = 0) {
      const int64_t todo = std::min(budget, lines[span] - line);
      for (int64_t i = 0; i < todo; ++i) {
        _mm_prefetch(start[span] + 64 * (line + i), _MM_HINT_T1);
      }
      budget -= todo;
      line += todo;
      if (line < lines[span]) {
        return;
      }
    }
  }
};

}  // namespace mlafx::avx512

// The packed queries of the AVX-512 BF16 indexer core (dsa_indexer_avx512.cpp), which its
// AMX core (dsa_indexer_amx_avx512.cpp) reads as they lie: per group, q as bf16 pairs
// [pair][row][2] (a row = query x head, each query's heads padded to 16 lanes with zero q and
// zero weight), the odd-Di tail and the head weights per row. [pair][16 rows][2] is also the
// layout of an AMX B tile. For sources compiled with the AVX-512 flags.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention_avx512_math.h"
#include "dsa_indexer.h"

namespace mlafx::avx512 {
namespace {

// Lanes per query: heads padded to 16. At most kIndexerRows heads, so at most 16 vectors.
inline int64_t query_lanes(const mlafx::dsa::IndexerDims& d) { return round_up16(d.heads); }

struct PackedQueries {
  int64_t pairs;  // Di / 2
  size_t hdr, qp, qtail, w, total;
  explicit PackedQueries(const mlafx::dsa::IndexerDims& d) : pairs(d.dim / 2) {
    // Rows: the driver's largest group (kIndexerRows / Hi queries, dsa_indexer.cpp) with
    // each query's lanes padded to 16.
    const int64_t queries = std::max<int64_t>(1, mlafx::dsa::kIndexerRows / d.heads);
    const size_t rows = static_cast<size_t>(queries * query_lanes(d));
    WorkspaceCarver carve;
    hdr = carve.take(64);
    qp = carve.take(4 * static_cast<size_t>(pairs) * rows);
    qtail = carve.take(4 * rows);
    w = carve.take(4 * rows);
    total = carve.total();
  }
};

}  // namespace
}  // namespace mlafx::avx512

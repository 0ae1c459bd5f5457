// The scoring "core" of dsa_indexer_topk (DeepSeek Sparse Attention's lightning indexer).
//
// A group of up to kIndexerRows / Hi queries of one sequence scores chunks of at most
// kIndexerChunk cache rows:
//   score[i][n] = sum_h w[i][h] * relu(dot(q[i][h][0:D], key[n][0:D]))      (fp32)
// The driver (dsa_indexer.cpp) owns the work decomposition and the running top-k; the core
// owns the arithmetic. Behind one table of function pointers: the portable fp32 reference
// (dsa_indexer.cpp, every dtype), the AVX-512 BF16 one (dsa_indexer_avx512.cpp, bf16:
// _mm512_dpbf16_ps, each cache row loaded once for every head of every query of the group) and
// the AMX one (dsa_indexer_amx_avx512.cpp, bf16, Di a multiple of 32: tile products).
//
// Every core sums each (query, head) dot product and then the heads in a fixed order that
// depends only on the shapes, never on the chunking or the threads: a score is a function of
// its query and its key alone, so selections are the same however the work is split.
//
// Free of ATen/c10 includes: shared between portable and AVX-512 objects.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlafx::dsa {

// Query rows (query x head) per group: the packed queries of a group stay in L2.
constexpr int64_t kIndexerRows = 256;
// Cache rows per scored chunk: a chunk's rows and the portable core's fp32 copy (128 KB at
// Di = 128) stay in L2; 256, since the AMX core prefetches only within a chunk.
constexpr int64_t kIndexerChunk = 256;

struct IndexerDims {
  int64_t heads;  // Hi
  int64_t dim;    // Di
};

struct IndexerOps {
  // Bytes of workspace one group needs (64-byte aligned pointer expected).
  size_t (*workspace_bytes)(const IndexerDims& dims);
  // Start a group of nq queries (nq * heads <= kIndexerRows): q_rows[i] points at query i's
  // first head, heads q_head_stride elements apart, each `dim` contiguous elements;
  // w_rows[i][h * w_head_stride] is the weight of head h.
  void (*begin)(void* ws, const IndexerDims& dims, int64_t nq, const void* const* q_rows,
                int64_t q_head_stride, const float* const* w_rows, int64_t w_head_stride);
  // Score n <= kIndexerChunk keys (keys[k] -> `dim` contiguous elements) for every query of
  // the group: scores[i * kIndexerChunk + k].
  void (*score)(void* ws, const IndexerDims& dims, int64_t n, const void* const* keys,
                float* scores);
};

}  // namespace mlafx::dsa

namespace mlafx::avx512 {

// The AVX-512 BF16 indexer core (bf16 q and cache); call only when mlafx::use_avx512_bf16().
const mlafx::dsa::IndexerOps& dsa_indexer_core_bf16();
// The AMX one (dsa_indexer_amx_avx512.cpp): only when mlafx::use_amx_bf16() and
// dsa_indexer_amx_fits(dims) (Di a multiple of 32).
bool dsa_indexer_amx_fits(const mlafx::dsa::IndexerDims& dims);
const mlafx::dsa::IndexerOps& dsa_indexer_core_amx();

}  // namespace mlafx::avx512

// AVX-512 BF16 indexer core (compiled with -mavx512f/bw/vl/dq/bf16). Called only after the
// run-time check in cpu_features.h; the scalar reference is PortableIndexer in dsa_indexer.cpp.
//
// The attention core's layout (attention_avx512.cpp): the fp32 lanes are *query rows* (query x
// head, each query's heads padded to a multiple of 16 lanes with zero q and zero weight), and
// the dot products are a GEMM S[key, row] = sum_pair K[key, pair] . Qp[pair, row] with Q packed
// once per group as bf16 pairs ([pair][row][2]) and each key contributing a 32-bit broadcast of
// two adjacent elements straight from the cache row: keys need no packing, and each cache row
// is read from memory once for every head of every query of the group (later slabs of rows
// find the chunk's keys in L1). Then relu, times the head weight, and one horizontal sum per
// (query, key): score = sum over the query's lanes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_avx512_math.h"
#include "dsa_indexer.h"
#include "dsa_indexer_packed_q.h"

#if !defined(__AVX512BF16__) || !defined(CPU_CAPABILITY_AVX512)
#error "dsa_indexer_avx512.cpp must be compiled with the AVX-512 flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

using mlafx::dsa::IndexerDims;
using mlafx::dsa::IndexerOps;
using mlafx::dsa::kIndexerChunk;

inline uint16_t bf16_bits(const void* p, int64_t i) {
  uint16_t x;
  std::memcpy(&x, static_cast<const char*>(p) + 2 * i, sizeof(x));
  return x;
}

size_t workspace_bytes(const IndexerDims& d) { return PackedQueries(d).total; }

void begin(void* ws, const IndexerDims& d, int64_t nq, const void* const* q_rows,
           int64_t q_head_stride, const float* const* w_rows, int64_t w_head_stride) {
  const PackedQueries L(d);
  const int64_t lanes = query_lanes(d);
  const int64_t rows = nq * lanes;
  *at_offset<int64_t>(ws, L.hdr) = nq;
  uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  float* qtail = at_offset<float>(ws, L.qtail);
  float* w = at_offset<float>(ws, L.w);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < lanes; ++h) {
      const int64_t r = i * lanes + h;
      const bool real = h < d.heads;
      const char* src = static_cast<const char*>(q_rows[i]) + 2 * h * q_head_stride;
      for (int64_t p = 0; p < L.pairs; ++p) {
        uint32_t pair = 0;
        if (real) {
          std::memcpy(&pair, src + 4 * p, sizeof(pair));
        }
        qp[p * rows + r] = pair;
      }
      qtail[r] = real && (d.dim & 1) != 0 ? bf16_bits_to_fp32(bf16_bits(src, d.dim - 1)) : 0.f;
      w[r] = real ? w_rows[i][h * w_head_stride] : 0.f;
    }
  }
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// M keys x NV vectors of 16 rows starting at row r0: returns, per key, the lane-wise
// sum over the NV vectors of w * relu(q.k).
template <int M, int NV>
inline void slab(const uint32_t* qp, int64_t rows, int64_t r0, int64_t pairs, bool tail,
                 int64_t dim, const float* qtail, const float* w, const uint16_t* const* keys,
                 __m512 out[M]) {
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i qv[NV];
    for (int v = 0; v < NV; ++v) {
      qv[v] = _mm512_loadu_si512(qp + p * rows + r0 + 16 * v);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i kk = _mm512_set1_epi32(static_cast<int>(load_pair(keys[m] + 2 * p)));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = dp(acc[m][v], qv[v], kk);
      }
    }
  }
  if (tail) {  // odd Di: the last element has no partner; fp32 FMA for it
    for (int m = 0; m < M; ++m) {
      const __m512 kk = _mm512_set1_ps(bf16_bits_to_fp32(keys[m][dim - 1]));
      for (int v = 0; v < NV; ++v) {
        acc[m][v] = _mm512_fmadd_ps(_mm512_loadu_ps(qtail + r0 + 16 * v), kk, acc[m][v]);
      }
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    __m512 s = out[m];
    for (int v = 0; v < NV; ++v) {
      // relu (max_ps returns its second operand for NaN: keep NaN as the reference does)
      const __m512 relu = _mm512_max_ps(zero, acc[m][v]);
      s = _mm512_fmadd_ps(_mm512_loadu_ps(w + r0 + 16 * v), relu, s);
    }
    out[m] = s;
  }
}

template <int M>
inline void query_keys(const uint32_t* qp, int64_t rows, int64_t r0, int64_t lanes,
                       const PackedQueries& L, const IndexerDims& d, const float* qtail,
                       const float* w, const uint16_t* const* keys, float* scores) {
  __m512 sum[M];
  for (int m = 0; m < M; ++m) {
    sum[m] = _mm512_setzero_ps();
  }
  const bool tail = (d.dim & 1) != 0;
  // Slabs of up to 4 vectors (64 rows): M x 4 accumulators + 4 q vectors fit the registers.
  for (int64_t v0 = 0; v0 < lanes / 16; v0 += 4) {
    const int64_t r = r0 + 16 * v0;
    switch (std::min<int64_t>(4, lanes / 16 - v0)) {
      case 1: slab<M, 1>(qp, rows, r, L.pairs, tail, d.dim, qtail, w, keys, sum); break;
      case 2: slab<M, 2>(qp, rows, r, L.pairs, tail, d.dim, qtail, w, keys, sum); break;
      case 3: slab<M, 3>(qp, rows, r, L.pairs, tail, d.dim, qtail, w, keys, sum); break;
      default: slab<M, 4>(qp, rows, r, L.pairs, tail, d.dim, qtail, w, keys, sum); break;
    }
  }
  for (int m = 0; m < M; ++m) {
    scores[m] = _mm512_reduce_add_ps(sum[m]);
  }
}

void score(void* ws, const IndexerDims& d, int64_t n, const void* const* keys, float* scores) {
  constexpr int M = 4;
  const PackedQueries L(d);
  const int64_t nq = *at_offset<int64_t>(ws, L.hdr);
  const int64_t lanes = query_lanes(d);
  const int64_t rows = nq * lanes;
  const uint32_t* qp = at_offset<uint32_t>(ws, L.qp);
  const float* qtail = at_offset<float>(ws, L.qtail);
  const float* w = at_offset<float>(ws, L.w);
  const uint16_t* const* k = reinterpret_cast<const uint16_t* const*>(keys);
  for (int64_t i = 0; i < nq; ++i) {
    float* s = scores + i * kIndexerChunk;
    int64_t n0 = 0;
    for (; n0 + M <= n; n0 += M) {
      query_keys<M>(qp, rows, i * lanes, lanes, L, d, qtail, w, k + n0, s + n0);
    }
    for (; n0 < n; ++n0) {
      query_keys<1>(qp, rows, i * lanes, lanes, L, d, qtail, w, k + n0, s + n0);
    }
  }
}

}  // namespace

const IndexerOps& dsa_indexer_core_bf16() {
  static const IndexerOps table{&workspace_bytes, &begin, &score};
  return table;
}

}  // namespace mlafx::avx512

// The attention "core" shared by mla_attention_paged and varlen_attention.
//
// Both ops reduce to the same inner problem: a group of G query rows (G <= kMaxRows) attends
// to an ordered list of keys; row g sees keys j < limit[g]. A key j is two segments
// [ka[j][0:wa] | kb[j][0:wb]] (MLA: the whole latent row and nothing; varlen MHA: the
// per-head k_nope row and the shared k_pe row) and its value is v[j][0:dv]. The core keeps
// an online softmax (running max, running sum, fp32 output accumulator) and is fed key
// blocks of at most kBlockKeys keys by the op drivers in attention.cpp, which own the work
// decomposition (sequences, query groups, flash-decoding splits, threads).
//
// The implementations sit behind one table of function pointers: the portable scalar
// reference (attention.cpp, every dtype), the AVX-512 BF16 one (attention_avx512.cpp, bf16:
// q.k and P.V as _mm512_dpbf16_ps against packed Q and V), its AMX twin, the AVX-512 fp32-FMA
// one (attention_f32_avx512.cpp, fp32 and fp16) and, on AVX2-only CPUs, the same fp32-FMA
// core on 8 lanes (attention_f32_avx2.cpp, every dtype). The driver does not know which one
// it runs.
//
// Deliberately free of ATen/c10 includes: this header is shared between portable and
// AVX-512 objects, and anything inline in it would be compiled under both flag sets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlafx::attn {

// Query rows per group: 4 vectors of 16 fp32 lanes in the AVX-512 kernels.
constexpr int64_t kMaxRows = 64;
// Keys per block handed to the core. Large enough to amortise the per-block softmax and the
// output rescale, small enough that the packed V block stays in L2.
constexpr int64_t kBlockKeys = 64;

struct CoreDims {
  int64_t wa;   // width of key segment a (and of the first part of each query row)
  int64_t wb;   // width of key segment b (0 when unused)
  int64_t dv;   // value width
  float scale;  // softmax scale applied to q.k
};

// Element type of q, keys and values, and of `out_rows` in end().
enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct CoreOps {
  // Bytes of workspace one group needs (64-byte aligned pointer expected).
  size_t (*workspace_bytes)(const CoreDims& dims);
  // Start a group: q_rows[g] points at wa + wb elements; limits[g] = keys row g may see.
  void (*begin)(void* ws, const CoreDims& dims, int64_t num_rows, const void* const* q_rows,
                const int64_t* limits);
  // Feed keys j0 .. j0+n-1 (n <= kBlockKeys); pointer arrays are indexed 0..n-1. kb may be
  // null when dims.wb == 0. Keys at or past every row's limit must not be passed.
  void (*block)(void* ws, const CoreDims& dims, int64_t j0, int64_t n, const void* const* ka,
                const void* const* kb, const void* const* v);
  // Finish: for each row g, the normalised output goes to out_rows[g] (element type of the
  // inputs) or, if out_rows is null, to out_f32_rows[g] (fp32); the natural-log LSE to
  // *lse_ptrs[g]. A row with limit 0 gets output 0 and LSE -inf.
  void (*end)(void* ws, const CoreDims& dims, void* const* out_rows, float* const* out_f32_rows,
              float* const* lse_ptrs);
  // Optional (null when a core has no use for it): the keys the *next* block() call will be
  // fed, announced just before the current one, so the core can prefetch their rows while it
  // works; the arguments mean what block()'s do. A cold cache row costs far more to load than
  // to use, and loads the core issues on demand keep too few misses in flight.
  void (*prefetch)(void* ws, const CoreDims& dims, int64_t n, const void* const* ka,
                   const void* const* kb, const void* const* v) = nullptr;
};

}  // namespace mlafx::attn

namespace mlafx::avx512 {

// The AVX-512 BF16 core (bf16 q, keys and values); call only when mlafx::use_avx512_bf16().
const mlafx::attn::CoreOps& attention_core_bf16();
// The AMX tile core for bf16 (attention_amx_avx512.cpp); call only when mlafx::use_amx_bf16()
// and attention_core_amx_supports(dims) (segment and value widths multiples of 32).
const mlafx::attn::CoreOps& attention_core_bf16_amx();
// Its batch-invariant twin (same condition): the block's values staged in key pairs so P.V
// takes half the tile products; it pays the staging on every block, which decode's
// memory-bound blocks feel and prefill's compute-bound ones gain from.
const mlafx::attn::CoreOps& attention_core_bf16_amx_pairs();
bool attention_core_amx_supports(const mlafx::attn::CoreDims& dims);
// fp32 FMA cores for fp32 and fp16 inputs (attention_f32_avx512.cpp); same condition.
const mlafx::attn::CoreOps& attention_core_f32();
const mlafx::attn::CoreOps& attention_core_f16();

}  // namespace mlafx::avx512

namespace mlafx::avx2 {

// fp32-FMA cores for bf16, fp16 and fp32 inputs on AVX2 (attention_f32_avx2.cpp); call only
// when mlafx::use_avx2() (and AVX-512 BF16 is off: its cores come first).
const mlafx::attn::CoreOps& attention_core_bf16();
const mlafx::attn::CoreOps& attention_core_f16();
const mlafx::attn::CoreOps& attention_core_f32();

}  // namespace mlafx::avx2

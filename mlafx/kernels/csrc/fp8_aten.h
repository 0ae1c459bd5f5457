// ATen-facing helpers of the block FP8 products, shared by fp8_linear.cpp and fp8_moe.cpp.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "fp4.h"
#include "fp8.h"

namespace mlafx {

// Rows of x as the kernels read them (fp8.h): bf16 bits when x is bf16 and the AVX-512 BF16
// kernels run, else fp32. Owns the buffer Fp8Rows points into: 64-byte aligned rows whose
// stride is a whole number of cache lines but not of 4 KB pages (a 64-byte load that splits
// two lines costs twice; rows 4 KB apart share one L1 set).
struct Fp8Activations {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  bool is_bf16 = false;
  at::Tensor data;  // [rows, ld] bfloat16 or float32
  at::Tensor tiles;  // the rows staged for a tile kernel (stage_tiles), or undefined

  // Rows from row0 on; only row0 = 0 carries the staged tiles.
  Fp8Rows view(int64_t row0 = 0) const;
  // Stages the rows for a tile kernel when fp8_uses_tiles(rows, block_k) and they are bf16.
  void stage_tiles(int64_t block_k);
};

// Whether M bf16 rows of x are staged for a tile kernel against weights of this block_k:
// - with AMX (fp8_tiles_are_amx: AMX-BF16 and VBMI, and MLAFX_DISABLE_* leaves them on, block_k
//   a multiple of 64) the AMX kernel (fp8_dot_amx_avx512.cpp) from kFp8TileMinRows rows (any
//   M >= 1 in batch-invariant mode: a tile product's sums for one row of x do not depend on the
//   others, so the tiles give a row the same bits at every row count). From 4: at 2-3 rows a
//   dense linear gained ~10% on tiles, but 8 tokens' experts (groups of 1-3 rows, each staged
//   apart) lost as much (Xeon, 6 Dec 2026);
// - else with AVX-512 BF16 the pairs GEMM (fp8_pairs_avx512.cpp) from kFp8PairsMinRows rows,
//   except in batch-invariant mode (VBMI's kernel then takes 8 rows at a time, fp8_dot.cpp).
constexpr int64_t kFp8TileMinRows = 4;
constexpr int64_t kFp8PairsMinRows = 9;
bool fp8_uses_tiles(int64_t M, int64_t block_k);

// M bf16 rows at x staged for the tile kernel (int16 [fp8_tile_elements or fp8_pair_elements]
// holding bf16 bits), staged in parallel; undefined unless fp8_uses_tiles(M, block_k) and
// x.bf16 is set.
at::Tensor stage_tiles(const Fp8Rows& x, int64_t M, int64_t K, int64_t block_k);
// Uninitialised storage for M staged rows of K columns, 64-byte aligned.
at::Tensor empty_tiles(int64_t M, int64_t K, int64_t block_k);
// Stages M bf16 rows of x into `tiles` (empty_tiles(M, K, block_k)), in parallel.
void stage_rows(const Fp8Rows& x, int64_t M, int64_t K, int64_t block_k, uint16_t* tiles);

// x [M, K] bf16/fp16/fp32, last dim contiguous (rows may be strided).
Fp8Activations fp8_activations(const at::Tensor& x);

// Rows `index` of `src`, in that order (moe: the tokens of each expert).
Fp8Activations gather_rows(const Fp8Activations& src, const std::vector<int64_t>& index);

// Checks one stored weight: w [lead..., N, K] float8_e4m3fn and scale [lead...,
// scale_rows, ceil(K/block_k)] float32 (scale_rows = ceil(N/block_n) unless given), both
// contiguous, block_k a positive multiple of 32, block_n positive. `op` and `name` go into
// the messages.
void check_fp8_weight(const char* op, const char* name, const at::Tensor& w,
                      const at::Tensor& scale, at::IntArrayRef lead, int64_t N, int64_t K,
                      int64_t block_n, int64_t block_k, int64_t scale_rows = -1);

// Rows [0, N) of a 2-D weight whose first row is at w and first scale row at scale.
Fp8Weight fp8_view(const uint8_t* w, const float* scale, int64_t K, int64_t block_n,
                   int64_t block_k);

// Rows of x from which the products dequantize the weight to fp32 and run an fp32 GEMM, unless
// the rows are staged for a tile kernel (AMX or pairs: every bf16 row of x on AVX-512 BF16
// CPUs) or the mode is batch-invariant (the GEMM's sums follow the batch's shape).
constexpr int64_t kFp8GemmRows = 64;
bool fp8_uses_gemm(int64_t M, const Fp8Rows& x);

// out[m * ldo + n] for n in [0, N): fp8_dot in parallel over the weight's rows (>= ~64 KB of
// weight per thread); when fp8_uses_gemm the weight dequantized to fp32 (w * s rounded once) a
// tile of rows at a time and an fp32 GEMM (at::mm).
void fp8_product_f32(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                     int64_t ldo);

// The same over an FP4 weight (fp4.h): fp4_dot in parallel over its rows (rows staged in
// x.tiles: the AMX kernel); else from kFp4Bf16GemmRows bf16 rows of x the weight dequantized to
// bf16 (exact) a tile of rows at a time and a bf16 GEMM (at::mm: oneDNN), whose fp32 sums come
// out rounded to bf16 (as the experts round them anyway); fp32 rows from kFp8GemmRows the fp32
// GEMM.
constexpr int64_t kFp4Bf16GemmRows = 16;
void fp4_product_f32(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t N, float* out,
                     int64_t ldo);

// Weight rows per at::parallel_for grain: a multiple of 16 (the AMX kernel's tiles), ~64 KB of
// weight and at least 16 rows, so a thread's wake-up costs less than its share.
int64_t fp8_row_grain(int64_t K);

}  // namespace mlafx

// The block-scaled FP8 products: kernels behind linear_fp8 (fp8_linear.cpp) and
// moe_experts_fp8 (fp8_moe.cpp). The weights stay as the checkpoint stores them (DeepSeek's
// layout, mlafx/kernels/fp8_format.py): e4m3 bytes W [N, K] row-major and one float32 scale
// per block of block_n rows x block_k columns, scale [ceil(N/block_n), ceil(K/block_k)]; the
// dequantized weight is w[n, k] = e4m3(W[n, k]) * scale[n / block_n, k / block_k].
//
// Every e4m3 value is exact in bfloat16 (and float32), so the kernels widen the bytes in
// registers and multiply exactly: out = sum over k blocks of scale * (the block's fp32 sum of
// x * e4m3), each block's partial sum scaled once. bf16 activations go to VDPBF16PS; fp32
// activations (fp16 and fp32 x, and every x on the AVX2 and portable paths) to fp32 FMAs.
//
// Deliberately free of ATen/c10 includes: shared between portable, AVX2 and AVX-512 objects.
#pragma once

#include <cstdint>

namespace mlafx {

// block_k must be a multiple of kFp8KStep (the AVX-512 kernels' chunk of K).
constexpr int64_t kFp8KStep = 32;

// One weight (or one expert's gate/up/down part) as stored.
struct Fp8Weight {
  const uint8_t* w;      // [N, K] e4m3 bytes, row stride ldw
  int64_t ldw;
  const float* scale;    // [ceil(N/block_n), ceil(K/block_k)], row stride lds
  int64_t lds;
  int64_t K;
  int64_t block_n;
  int64_t block_k;       // a multiple of kFp8KStep
};

// M rows of activations: bf16 bits when bf16 != nullptr (only made when use_avx512_bf16()),
// else fp32 in f32. Row stride ld; K columns. `tiles`, when not null, holds the same bf16 rows
// staged in a kernel's order (made only when fp8_uses_tiles()): by avx512::fp8_stage_tiles for
// the AMX kernel when fp8_tiles_are_amx(block_k), else by avx512::fp8_stage_pairs for the pairs
// GEMM; or for an FP4 weight by avx512::fp4_stage_rows (fp4.h).
struct Fp8Rows {
  const uint16_t* bf16;
  const float* f32;
  int64_t ld;
  const uint16_t* tiles = nullptr;
};

// out[m * ldo + n - n0] = sum_kb scale[n / block_n, kb] * sum_{k in kb} x[m, k] * e4m3(W[n, k])
// for m < M and n0 <= n < n1, fp32. The AVX-512 kernels when use_avx512_bf16(), else the AVX2
// one when use_avx2(), else the portable one; they differ only in fp32 summation order.
// Single-threaded: callers split n.
void fp8_dot(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
             float* out, int64_t ldo);

// Whether rows staged for a weight of this block_k (fp8_uses_tiles) are the AMX kernel's tiles
// (AMX-BF16 and VBMI, block_k a multiple of 64), else the pairs GEMM's panels.
bool fp8_tiles_are_amx(int64_t block_k);

// The float value of every e4m3fn byte (NaN for 0x7F / 0xFF).
float e4m3_to_float(uint8_t byte);

// out[(n - n0) * K + k] = e4m3(W[n, k]) * scale[n / block_n, k / block_k] in fp32 (rounded once)
// for n0 <= n < n1. AVX-512 when use_avx512_bf16(), else AVX2 when use_avx2(), else portable;
// bit-identical.
// Single-threaded.
void fp8_dequantize(const Fp8Weight& w, int64_t n0, int64_t n1, float* out);

}  // namespace mlafx

namespace mlafx::avx512 {

// The contract of fp8_dot for bf16 rows (x.bf16) and for fp32 rows (x.f32); call only when
// mlafx::use_avx512_bf16() (fp8_dot_avx512.cpp).
void fp8_dot_bf16(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                  float* out, int64_t ldo);
void fp8_dot_f32(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo);
void fp8_dequantize(const Fp8Weight& w, int64_t n0, int64_t n1, float* out);

// The AMX-BF16 kernel (fp8_dot_amx_avx512.cpp): fp8_dot's contract for bf16 rows staged in
// x.tiles and block_k % 64 == 0; call only when use_amx_bf16() and use_avx512_vbmi().
void fp8_dot_amx(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo);

// bf16 elements of the staged tiles of M rows of K columns: for each 16 rows of x (zeros past
// M) and each 32 columns of K rounded up to 64 (in the VBMI decoder's column order, zeros past
// K), one B tile of 16 column pairs x 16 rows.
int64_t fp8_tile_elements(int64_t M, int64_t K);

// Stages rows [m0, m1) of x (bf16 bits, row stride ldx) into `tiles` (fp8_tile_elements(M, K)
// elements, 64-byte aligned); m0 a multiple of 16, m1 = M or a multiple of 16. Threads may
// stage disjoint ranges. Call only when use_avx512_bf16().
void fp8_stage_tiles(const uint16_t* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1,
                     uint16_t* tiles);

// The pairs GEMM (fp8_pairs_avx512.cpp): fp8_dot's contract for M bf16 rows staged in x.tiles
// by fp8_stage_pairs; at kFp8PairsMinRows rows and more where !fp8_tiles_are_amx(block_k) (no
// AMX, or block_k not a multiple of 64, or VBMI off).
// Call only when use_avx512_bf16().
void fp8_dot_pairs(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                   float* out, int64_t ldo);

// Rows of x per panel of the staged pairs.
constexpr int64_t kFp8PanelRows = 48;

// bf16 elements of M rows of K columns staged as pairs: per panel of kFp8PanelRows rows (zeros
// past M), per column pair (a zero past K), the pair of each of the panel's rows.
int64_t fp8_pair_elements(int64_t M, int64_t K);

// Stages panels [q0, q1) of the M rows of x (bf16 bits, row stride ldx) into `pairs`
// (fp8_pair_elements(M, K) elements, 64-byte aligned). Threads may stage disjoint panels.
void fp8_stage_pairs(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, int64_t q0,
                     int64_t q1, uint16_t* pairs);

}  // namespace mlafx::avx512

namespace mlafx::avx2 {

// The contract of fp8_dot for fp32 rows (x.f32) and of fp8_dequantize; call only when
// mlafx::use_avx2() (fp8_dot_avx2.cpp).
void fp8_dot_f32(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo);
void fp8_dequantize(const Fp8Weight& w, int64_t n0, int64_t n1, float* out);

}  // namespace mlafx::avx2

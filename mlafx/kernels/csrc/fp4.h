// The FP4 products: kernels behind moe_experts_fp4 (fp4_moe.cpp). The weights stay as
// DeepSeek-V4 publishes its routed experts (mlafx/kernels/fp4_format.py): e2m1 nibbles W [N, K/2]
// (element 2j in the low nibble of byte j, 2j+1 in the high one) and one ue8m0 scale byte per 32
// consecutive weights of a row, scale [N, ceil(K/32)]; the dequantized weight is
// w[n, k] = e2m1(W[n, k]) * 2^(scale[n, k / 32] - 127) (scale byte 255: NaN).
//
// The products have the block FP8 ones' semantics (fp8.h) with blocks of one row by 32 columns:
// every e2m1 value is exact in bfloat16, so the kernels widen the nibbles in registers and
// multiply exactly: out = sum over k groups of scale * (the group's fp32 sum of x * e2m1). bf16
// activations go to VDPBF16PS, fp32 ones (fp16 and fp32 x, and every x on the portable path) to
// fp32 FMAs.
//
// Deliberately free of ATen/c10 includes: shared between portable and AVX-512 objects.
#pragma once

#include <cstdint>

#include "fp8.h"  // Fp8Rows: the activations, bf16 or fp32

namespace mlafx {

constexpr int64_t kFp4Group = 32;  // weights per scale along K

// One weight (or one expert's gate/up/down part) as stored; K even.
struct Fp4Weight {
  const uint8_t* w;      // [N, K/2] packed nibbles, row stride ldw bytes
  int64_t ldw;
  const uint8_t* scale;  // [N, ceil(K/32)] ue8m0 bytes, row stride lds
  int64_t lds;
  int64_t K;
};

// The 256 ue8m0 values as floats: 2^(b - 127), NaN for 255.
const float* ue8m0_table();

// out[m * ldo + n - n0] = sum_g ue8m0(scale[n, g]) * sum_{k in g} x[m, k] * e2m1(W[n, k]) for
// m < M and n0 <= n < n1, fp32. The AVX-512 kernels when use_avx512_bf16(), else the portable
// one; they differ only in fp32 summation order. Single-threaded: callers split n.
void fp4_dot(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
             int64_t ldo);

// Whether M bf16 rows of x take the AMX tile kernel (fp4_dot_amx_avx512.cpp): the CPU has
// AMX-BF16 (and MLAFX_DISABLE_AMX leaves it on) and M >= kFp4AmxMinRows (up to 8 rows the
// few-rows AVX-512 kernel streams the bytes as fast; 6 Dec 2026, Xeon). Such rows are staged
// by avx512::fp4_stage_tiles; fewer (M <= 8) by avx512::fp4_stage_rows.
constexpr int64_t kFp4AmxMinRows = 9;
bool fp4_uses_amx(int64_t M);

// out[(n - n0) * K + k] = w[n, k] in fp32 (exact) for n0 <= n < n1. Single-threaded.
void fp4_dequantize(const Fp4Weight& w, int64_t n0, int64_t n1, float* out);
// The same as bf16 bits, also exact: e2m1 has 2 significant bits and bf16 fp32's exponent
// range, subnormals included. Single-threaded.
void fp4_dequantize_bf16(const Fp4Weight& w, int64_t n0, int64_t n1, uint16_t* out);

}  // namespace mlafx

namespace mlafx::avx512 {

// The contract of fp4_dot for bf16 rows (x.bf16) and for fp32 rows (x.f32), and of
// fp4_dequantize; call only when mlafx::use_avx512_bf16() (fp4_dot_avx512.cpp).
void fp4_dot_bf16(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                  float* out, int64_t ldo);
void fp4_dot_f32(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo);
void fp4_dequantize(const Fp4Weight& w, int64_t n0, int64_t n1, float* out);
void fp4_dequantize_bf16(const Fp4Weight& w, int64_t n0, int64_t n1, uint16_t* out);

// The few-rows kernel's order of x (fp4_dot_avx512.cpp): per 128 columns, element 4i + j at
// 32j + i; rows fp4_staged_ld(K) elements apart, zeros past K. fp4_dot takes M <= 8 bf16 rows
// staged so in x.tiles (else stages them itself, per call).
int64_t fp4_staged_ld(int64_t K);
// Stages M bf16 rows of x (row stride ldx, K columns) at out (M * fp4_staged_ld(K) elements,
// 64-byte aligned).
void fp4_stage_rows(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, uint16_t* out);

// The AMX kernel's B tiles of M rows of x (fp4_dot_amx_avx512.cpp): per 16 rows (zeros past
// M) and 32 columns (zeros past K) one tile of 16 column pairs x 16 rows, fp4_tile_elements
// bf16 elements, 64-byte aligned. Call only when use_amx_bf16().
int64_t fp4_tile_elements(int64_t M, int64_t K);
void fp4_stage_tiles(const uint16_t* x, int64_t ldx, int64_t K, int64_t M, uint16_t* tiles);
// fp4_dot's contract for bf16 rows staged so in x.tiles; call only when fp4_uses_amx(M).
void fp4_dot_amx(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo);

}  // namespace mlafx::avx512

// Weight-streaming dot products: the kernels behind linear_decode (gemm.cpp) and the
// decode-sized expert groups of moe_experts (moe.cpp).
//
// With few rows of x (M <= 32) a product with a [N, K] weight is bandwidth-bound: its time is
// the weight's bytes over the memory bandwidth, provided each weight byte is read once and
// the arithmetic keeps up. The AVX-512 kernels feed the bf16 weights and rows of x to
// VDPBF16PS as they lie (32 products per instruction, fp32 sums), the AMX kernels to the tile
// unit; neither widens anything per call.
//
// Two weight layouts:
// - row-major [N, K] (the checkpoint's, used for expert weights, which the moe_experts
//   contract passes as they are): lanes run along K, several weight rows per tile, one
//   horizontal sum per output at the end.
// - packed [ceil(N/16), ceil(K/2), 16, 2] (made once at load time by pack_linear_weight):
//   block b holds rows 16b..16b+15, and for each pair of columns (2p, 2p+1) the 16 rows'
//   two values side by side. Lanes run along N, so no horizontal sums, and every rows of x
//   is read once per 16 * (blocks per tile) weight rows rather than once per few rows.
//
// Deliberately free of ATen/c10 includes: this header is shared between portable and
// AVX-512 objects, and anything inline in it would be compiled under both flag sets.
#pragma once

#include <cstdint>

namespace mlafx {

// The element types the kernels accept (x and the weight always share one).
enum class FloatKind { kBFloat16, kHalf, kFloat };

// Rows per block and columns per pair of the packed layout.
constexpr int64_t kPackedBlockRows = 16;

// Row-major weight w [N, K] (row stride ldw):
//   out[m * ldo + (n - n_begin)] = sum_k x[m * ldx + k] * w[n * ldw + k]
//   for m < M, n_begin <= n < n_end; fp32 accumulation.
// Portable entry (gemm.cpp): the AVX-512 kernel for bf16 when use_avx512_bf16(), else the AVX2
// one when use_avx2(), else the scalar reference. Single-threaded: callers give each thread its own range of weight rows.
void rows_dot(FloatKind kind, const void* x, int64_t ldx, int64_t M, const void* w, int64_t ldw,
              int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo);

// Packed weight wp [num_blocks, K2, 16, 2] with K2 = ceil(K / 2) (zero-padded):
//   out[m * ldo + 16 * (b - block_begin) + i] = sum_k x[m * ldx + k] * w[16 * b + i][k]
//   for m < M, block_begin <= b < block_end, i < 16 (padding rows give 0).
void packed_dot(FloatKind kind, const void* x, int64_t ldx, int64_t M, const void* wp, int64_t K,
                int64_t block_begin, int64_t block_end, float* out, int64_t ldo);

// Rows [0, N) of a row-major 16-bit (bf16/fp16) W (row stride ldw, K columns) into the packed
// layout above: ceil(N/16) blocks, padding rows and the odd column's partner zero. What
// pack_linear_weight does at load time, for callers that pack a weight's rows into a scratch
// buffer a chunk at a time (moe_experts' compute-bound expert groups).
void pack_rows_16bit(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* packed);

}  // namespace mlafx

namespace mlafx::avx512 {

// bf16 x and weights (as raw 16-bit patterns); contracts as above. Defined in
// gemm_avx512.cpp; call only when mlafx::use_avx512_bf16().
void rows_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw,
                   int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo);
void packed_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo);
// fp32 x and packed weight; packed_dot's contract, bit-identical to the portable kernel.
void packed_dot_f32(const float* x, int64_t ldx, int64_t M, const float* wp, int64_t K,
                    int64_t block_begin, int64_t block_end, float* out, int64_t ldo);
// Rows [n_begin, n_end) of W [N, K] out of the packed layout of 16-bit elements (bf16 or fp16
// bit patterns) into dst (row stride ldd >= K): the inverse of pack_linear_weight.
void unpack_rows_16bit(const uint16_t* packed, int64_t K, int64_t n_begin, int64_t n_end,
                       uint16_t* dst, int64_t ldd);
// The same on the AMX tile unit (gemm_amx_avx512.cpp): call only when mlafx::use_amx_bf16()
// and packed_dot_amx_supports(K) (K even).
bool packed_dot_amx_supports(int64_t K);
// rows_dot on the AMX tile unit, for up to 16 rows of x packed once per call as the tile
// unit's B operand: xp = pack_rows_for_tiles(x) holds K/2 rows of 16 column pairs (x's
// columns 2p, 2p+1 for rows 0..15, zero past M): K/2 * 32 elements. Call only when
// mlafx::use_amx_bf16() and rows_dot_amx_supports(M, K) (M <= 16, K a multiple of 32).
bool rows_dot_amx_supports(int64_t M, int64_t K);
void pack_rows_for_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xp);
void rows_dot_bf16_amx(const uint16_t* xp, int64_t M, const uint16_t* w, int64_t ldw, int64_t K,
                       int64_t n_begin, int64_t n_end, float* out, int64_t ldo);
void packed_dot_bf16_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                         int64_t block_begin, int64_t block_end, float* out, int64_t ldo);

}  // namespace mlafx::avx512

namespace mlafx::avx2 {

// bf16 x and weights (raw 16-bit patterns); the contracts of rows_dot and packed_dot, widened
// to fp32 in registers. Defined in gemm_avx2.cpp; call only when mlafx::use_avx2() (and AVX-512
// BF16 is off: its kernels come first).
void rows_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t ldw,
                   int64_t K, int64_t n_begin, int64_t n_end, float* out, int64_t ldo);
void packed_dot_bf16(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                     int64_t block_begin, int64_t block_end, float* out, int64_t ldo);

}  // namespace mlafx::avx2

// The int8 / int4 quantized products (W8A8): kernels behind linear_quantized
// (quant_linear.cpp) and moe_experts_quantized (quant_moe.cpp). The format is defined in
// mlafx/kernels/quant_format.py; in short, a packed weight is uint8 [NB = ceil(N/16),
// G = ceil(K/32), S] and block b, group g holds, for rows 16b..16b+15 and columns
// 32g..32g+31, the quants laid out for VPDPBUSD (lanes along the 16 rows; byte 64s + 4i + j
// of the group is row i's column 4s+j, int4 nibbles low = column 4s+j, high = 16+4s+j), then
// the 16 rows' fp16 scales. Stored quants are unsigned: int8 as q + 128, int4 as q + 8, so
//   sum_k (stored - z) * q_x = sum_k stored * q_x - z * sum_k q_x,   z = 128 or 8,
// which is how the AVX-512 kernel uses the u8 x s8 instruction; the sums of q_x per row and
// group are made once, with the activations.
//
// Deliberately free of ATen/c10 includes: shared between portable and AVX-512 objects.
#pragma once

#include <cstdint>

namespace mlafx {

constexpr int64_t kQuantGroup = 32;      // columns per scale
constexpr int64_t kQuantBlockRows = 16;  // rows per block (16 int32 lanes)

constexpr int64_t quant_bytes(int bits) { return bits == 8 ? 512 : 256; }

// Weight formats, the `format` argument of the products (named by their bits for the int
// formats): int8 / int4 in groups of 32 columns with one fp16 scale (quant_format.py), and
// k8 / k4 in super-blocks of 256 columns holding GGUF's K-quants (kquant_format.py: per
// group of 32 the quants as int8 / int4 lay them out, then int8 a_0[16], a_1[16], uint8
// m[16]; after the 8 groups fp16 d[16], dmin[16]).
constexpr int kFormatInt8 = 8;
constexpr int kFormatInt4 = 4;
constexpr int kFormatK8 = 0x108;
constexpr int kFormatK4 = 0x104;
constexpr bool is_kquant(int format) { return format > 0xFF; }
constexpr int format_bits(int format) { return format & 0xFF; }
constexpr int64_t kSuperGroups = 8;  // groups of 32 per K super-block
constexpr int64_t kquant_region_bytes(int bits) { return quant_bytes(bits) + 3 * kQuantBlockRows; }
// Bytes per block and group (a super-block for the K formats): the last dim S.
constexpr int64_t quant_group_bytes(int format) {
  return is_kquant(format)
             ? kSuperGroups * kquant_region_bytes(format_bits(format)) + 4 * kQuantBlockRows
             : quant_bytes(format) + 2 * kQuantBlockRows;
}
// Columns per group of a packed weight: 32, or 256 for the K formats.
constexpr int64_t quant_group_columns(int format) {
  return is_kquant(format) ? kSuperGroups * kQuantGroup : kQuantGroup;
}

// A group's quants, laid out for VPDPBUSD (byte 64s + 4i + j: row i's column 4s + j; int4:
// low nibble column 4s + j, high 16 + 4s + j), as the small integers v[16][32] = stored - z.
template <int kBits>
inline void unpack_quants(const uint8_t* quants, int z, int16_t (*v)[kQuantGroup]) {
  for (int s = 0; s < (kBits == 8 ? 8 : 4); ++s) {
    for (int i = 0; i < kQuantBlockRows; ++i) {
      for (int j = 0; j < 4; ++j) {
        const int byte = quants[64 * s + 4 * i + j];
        if constexpr (kBits == 8) {
          v[i][4 * s + j] = static_cast<int16_t>(byte - z);
        } else {
          v[i][4 * s + j] = static_cast<int16_t>((byte & 0xF) - z);
          v[i][16 + 4 * s + j] = static_cast<int16_t>((byte >> 4) - z);
        }
      }
    }
  }
}

// The element type of the activations a kernel reads.
enum class ActivationType { kFloat32, kBFloat16, kFloat16 };

// Rows of x quantized per group of 32 columns (quant_format.quantize_activations):
//   q [M, ldq] int8 in [-127, 127] (zero past K), d [M, G] fp32, qsum [M, G] = sum of q.
// A group whose scale is not finite (NaN or inf in x) has q = 0: d_x then makes every
// output of that row NaN, as in the reference (0 * inf and 0 * NaN are NaN).
// The row stride of quantized activations: groups * 32 bytes rounded up to an odd number of
// cache lines, so that the 16 rows of a tile of x fall into different L1 sets (with K = 2048
// they all shared two, and the AMX kernel's x tiles evicted each other).
constexpr int64_t quant_row_stride(int64_t groups) {
  const int64_t lines = (groups * kQuantGroup + 63) / 64;
  return (lines | 1) * 64;
}

struct QuantRows {
  const int8_t* q;
  int64_t ldq;  // >= G * 32
  const float* d;
  const int32_t* qsum;
  int64_t ldd;  // row stride of d and qsum, >= G
};

// out[m * ldo + 16 * (b - block_begin) + i] = sum_g d_w[16b+i, g] * d_x[m, g] * isum(m, b, i, g)
// for m < M, block_begin <= b < block_end, i < 16, summed in fp32 in group order; packed is
// uint8 [NB, G, S] in `format` (G counts super-blocks for the K formats, whose terms are
// kquant_format.py's). Int formats: the AMX-INT8 kernel from 48 rows of x (int8) or 32 (int4)
// when use_amx_int8(), else the AVX-512 VNNI kernel when
// use_avx512_vnni(), else the AVX2 one when use_avx2(), else the portable one; K formats:
// the AVX2 kernel when use_avx2()
// (on AVX-512 hosts too), else the portable one. Every path gives bit-identical results.
// Single-threaded: callers give each thread its own range of blocks.
void quant_dot(int format, const QuantRows& x, int64_t M, const uint8_t* packed, int64_t groups,
               int64_t block_begin, int64_t block_end, float* out, int64_t ldo);

// quant_dot's K-format kernels (quant_kdot.cpp, quant_kdot_avx2.cpp).
void kquant_dot_portable(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                         int64_t supers, int64_t block_begin, int64_t block_end, float* out,
                         int64_t ldo);

}  // namespace mlafx

namespace mlafx::avx512 {

// quantize_activations' step (quant_dot.cpp) on rows [m0, m1) of x [M, K] (`type`, row
// stride ldx elements, last dim contiguous) into q [M, ldq], d and qsum [M, groups],
// bit-identical to the portable quantize_group (quant_activations_avx512.cpp); call only
// when mlafx::use_avx512_vnni().
void quantize_rows_avx512(ActivationType type, const void* x, int64_t ldx, int64_t K, int64_t m0,
                          int64_t m1, int64_t groups, int8_t* q, int64_t ldq, float* d,
                          int32_t* qsum);

// The contract of quant_dot on the AMX-INT8 tile unit for the rows in whole tiles of 16, the
// rest on quant_dot_vnni (quant_dot_amx_avx512.cpp); bit-identical. Call only when
// mlafx::use_amx_int8().
void quant_dot_amx(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                   int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                   int64_t ldo);

// The contract of quant_dot (quant_dot_avx512.cpp); call only when mlafx::use_avx512_vnni().
void quant_dot_vnni(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                    int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                    int64_t ldo);

}  // namespace mlafx::avx512

namespace mlafx::avx2 {

// The contract of quant_dot (quant_dot_avx2.cpp); call only when mlafx::use_avx2().
void quant_dot_avx2(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                    int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                    int64_t ldo);

// The weight quantizer's step (quant_weight.cpp, quant_weight_avx2.cpp) for 8 groups of 32
// fp32 weights, transposed: w_t[8 * k + l] is group l's column k. Writes q[32 * l + k] (int8:
// the signed quant; int4: q + 8 in [0, 15]) and the 8 fp16 scales' bits, bit-identical to the
// portable quantize_group_int8 / _int4. Call only when mlafx::use_avx2().
void quantize_groups8(int bits, const float* w_t, int8_t* q, uint16_t* scale_bits);

// quant_dot on a K format (k8 / k4 by bits), bit-identical to kquant_dot_portable. Call only
// when mlafx::use_avx2().
void kquant_dot_avx2(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                     int64_t supers, int64_t block_begin, int64_t block_end, float* out,
                     int64_t ldo);

}  // namespace mlafx::avx2

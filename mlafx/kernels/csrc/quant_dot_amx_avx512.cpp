// quant_dot (quant.h) for many rows of x on the AMX-INT8 tile unit (compiled with the AVX-512
// and AMX flags from setup.py; called only when mlafx::use_amx_int8()). Bit-identical to the
// VNNI and portable kernels: a group's integer dot products are exact in any order, and the
// fp32 epilogue is theirs, term for term and in group order.
//
// Every group of a chunk of 16 blocks is first staged as a signed int8 B tile (stored - z:
// the int8 group is the tile unit's B layout as it lies, byte 64s + 4i + j = weight row i's
// columns 4s + j, so its top bit is flipped; an int4 group's nibbles go to B rows 0-3 and
// 4-7), so that TDPBSSD gives the group's exact sums sum q_x * q_w and the epilogue needs no
// zero-point term. x's quantized rows are A tiles as they lie (16 rows x 32 bytes of a group,
// the row stride, padded to an odd number of cache lines by quant_row_stride, as the tile
// stride). Each group's 16 x 16 int32 sums go through a tile store and the epilogue of the
// VNNI kernel (cvt, x d_x, x d_w, + in fp32); group g + 2's product is issued and group
// g + 1's sums stored before group g's epilogue, in two alternating accumulator tiles.
//
// Where the time goes (Xeon, 6 Dec 2026, one core, a standalone copy of this loop, cycles per
// 16 x 16 x 32 product): tile loads, product and store ~51, the epilogue alone ~39, and the
// two do not overlap (~86-90 together: the tile unit's instructions and the vector ones share
// the ports), so at 1024 rows 2048 -> 3072 takes ~13 ms (2 threads, the next chunk's weights
// prefetched into L2 meanwhile) against VNNI's ~27 and bf16 AMX's ~8. Accumulators in
// registers matter: as an array indexed in a loop GCC kept them on the stack (a load and a
// store per row and group, ~55 cycles for the epilogue alone), hence the unrolled loops.
// Sharing each tile load between two products (2 row tiles x 2 blocks) is the next step;
// quant_dot.cpp's amx_min_rows says where this kernel is taken.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "quant.h"
#include "scratch_buffer.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__)
#error "quant_dot_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBRows = kQuantGroup / 4;  // 8 rows of 4 k per group
constexpr int64_t kStageBlocks = 16;         // blocks staged and walked at once

// Tiles 0/1: accumulators (16 rows x 16 int32); 2/3: x (16 rows x 32 bytes); 4/5: weights
// (8 rows x 64 bytes).
void configure() {
  TileConfig cfg;
  cfg.set(0, kTileRows, 64);
  cfg.set(1, kTileRows, 64);
  cfg.set(2, kTileRows, kQuantGroup);
  cfg.set(3, kTileRows, kQuantGroup);
  cfg.set(4, kBRows, 64);
  cfg.set(5, kBRows, 64);
  cfg.load();
}

// Group g's product for rows m0..m0+15 into accumulator tile 0 or 1, x through tile 2 or 3,
// the signed weights through 4 or 5 (the tile intrinsics take literal tile numbers only).
inline void product(int t, const QuantRows& x, int64_t m0, int64_t g, const int8_t* b_tile) {
  const int8_t* a = x.q + m0 * x.ldq + g * kQuantGroup;
  compiler_barrier();
  if (t == 0) {
    _tile_zero(0);
    _tile_loadd(2, a, x.ldq);
    _tile_loadd(4, b_tile, 64);
    _tile_dpbssd(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, a, x.ldq);
    _tile_loadd(5, b_tile, 64);
    _tile_dpbssd(1, 3, 5);
  }
}

inline void store(int t, int32_t* sums) {
  if (t == 0) {
    _tile_stored(0, sums, 64);
  } else {
    _tile_stored(1, sums, 64);
  }
  compiler_barrier();
}

// facc[r] += ((float)isum[r] * d_x) * d_w, the VNNI kernel's rounding order (its isum is
// sum stored * q_x - z * qsum, the same integer).
inline void epilogue(const float* d_x, int64_t ldd, const int32_t* sums, __m512 scales,
                     __m512 (&facc)[kTileRows]) {
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const __m512 term = _mm512_mul_round_ps(
        _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r)),
                            _mm512_set1_ps(d_x[r * ldd]), _MM_FROUND_CUR_DIRECTION),
        scales, _MM_FROUND_CUR_DIRECTION);
    facc[r] = _mm512_add_round_ps(facc[r], term, _MM_FROUND_CUR_DIRECTION);
  }
}

// Rows m0..m0+15 against one block whose groups' signed B tiles are `b_tiles` (512 bytes
// apart). Software pipeline: group g + 2's product is issued and group g + 1's sums are
// stored before group g's epilogue. facc stays in registers (the loops over its rows are
// unrolled: as an array indexed in a loop GCC kept it on the stack, a load and a store per
// row and group).
void row_tile(const QuantRows& x, int64_t m0, const int8_t* b_tiles, const uint8_t* scales_at,
              int64_t scale_stride, int64_t groups, float* out, int64_t ldo) {
  alignas(64) int32_t sums[2][kTileRows * 16];
  __m512 facc[kTileRows];
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    facc[r] = _mm512_setzero_ps();
  }
  auto scales = [&](int64_t g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(scales_at + g * scale_stride)));
  };
  product(0, x, m0, 0, b_tiles);
  if (groups > 1) {
    product(1, x, m0, 1, b_tiles + 512);
  }
  store(0, sums[0]);
  for (int64_t g = 0; g < groups; ++g) {
    const int t = static_cast<int>(g & 1);
    if (g + 2 < groups) {
      product(t, x, m0, g + 2, b_tiles + (g + 2) * 512);
    }
    if (g + 1 < groups) {
      store(1 - t, sums[1 - t]);
    }
    epilogue(x.d + m0 * x.ldd + g, x.ldd, sums[t], scales(g), facc);
  }
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    _mm512_storeu_ps(out + r * ldo, facc[r]);
  }
}

// A block's groups as signed int8 B tiles (512 bytes each, stored - z) in `staging`: the int8
// group is the B layout as it lies (flip the top bit), an int4 group's nibbles go to B rows
// 0-3 (low) and 4-7 (high).
void stage_block(int bits, const uint8_t* block, int64_t groups, int8_t* staging) {
  const int64_t S = quant_group_bytes(bits);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi8(8);
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = block + g * S;
    int8_t* dst = staging + g * 512;
    if (bits == 8) {
      for (int s = 0; s < 8; ++s) {
        _mm512_store_si512(dst + 64 * s,
                           _mm512_xor_si512(_mm512_loadu_si512(src + 64 * s), top));
      }
    } else {
      for (int s = 0; s < 4; ++s) {
        const __m512i v = _mm512_loadu_si512(src + 64 * s);
        _mm512_store_si512(dst + 64 * s, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
        _mm512_store_si512(dst + 64 * (4 + s),
                           _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
      }
    }
  }
  compiler_barrier();
}

}  // namespace

void quant_dot_amx(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                   int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                   int64_t ldo) {
  const int64_t full = M / kTileRows * kTileRows;
  if (full > 0 && groups > 0 && block_end > block_begin) {
    configure();
    const int64_t S = quant_group_bytes(bits);
    // a chunk's groups as signed B tiles, 64-byte aligned (at most 16 x 32 KB for K 2048)
    const int64_t block_staging = groups * 512;
    ScratchVector<int8_t> staging_buffer(
        static_cast<size_t>(std::min(block_end - block_begin, kStageBlocks) * block_staging));
    int8_t* staging = staging_buffer.data();
    for (int64_t c0 = block_begin; c0 < block_end; c0 += kStageBlocks) {
      const int64_t c1 = std::min(block_end, c0 + kStageBlocks);
      for (int64_t b = c0; b < c1; ++b) {
        stage_block(bits, packed + b * groups * S, groups, staging + (b - c0) * block_staging);
      }
      // the next chunk's packed bytes are prefetched into L2 a slice per row tile and block,
      // so that staging it does not wait for memory
      const char* next = reinterpret_cast<const char*>(packed + c1 * groups * S);
      const int64_t next_lines =
          (std::min(block_end, c1 + kStageBlocks) - c1) * groups * S / 64;
      const int64_t lines_per_step = (next_lines + (full / kTileRows) * (c1 - c0) - 1) /
                                     ((full / kTileRows) * (c1 - c0));
      int64_t prefetched = 0;
      // each row tile of x (16 x K bytes) stays in cache across the chunk's blocks
      for (int64_t m0 = 0; m0 < full; m0 += kTileRows) {
        for (int64_t b = c0; b < c1; ++b) {
          row_tile(x, m0, staging + (b - c0) * block_staging,
                   packed + b * groups * S + quant_bytes(bits), S, groups,
                   out + m0 * ldo + (b - block_begin) * kQuantBlockRows, ldo);
          for (const int64_t end = std::min(next_lines, prefetched + lines_per_step);
               prefetched < end; ++prefetched) {
            _mm_prefetch(next + prefetched * 64, _MM_HINT_T1);
          }
        }
      }
    }
    _tile_release();  // as gemm_amx_avx512.cpp: no tile state left to save on a switch
  }
  if (full < M) {  // the last rows on the VNNI kernel (bit-identical)
    const QuantRows rest{x.q + full * x.ldq, x.ldq, x.d + full * x.ldd, x.qsum + full * x.ldd,
                         x.ldd};
    quant_dot_vnni(bits, rest, M - full, packed, groups, block_begin, block_end,
                   out + full * ldo, ldo);
  }
}

}  // namespace mlafx::avx512

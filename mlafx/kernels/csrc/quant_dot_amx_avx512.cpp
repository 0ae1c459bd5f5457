// quant_dot (quant.h) for many rows of x on the AMX-INT8 tile unit (compiled with the AVX-512
// and AMX flags from setup.py; called only when mlafx::use_amx_int8()). Bit-identical to the
// VNNI and portable kernels: a group's integer dot products are exact in any order, and the
// fp32 epilogue is theirs, term for term and in group order.
//
// The int8 packed group is the tile unit's B layout as it lies (byte 64s + 4i + j: weight row
// i's columns 4s + j, i.e. B row s holds 4 consecutive k of each of the 16 outputs); int4
// groups are unpacked once per call, 16 blocks at a time, into an L2 staging copy in that
// layout (rows 0-3 the low nibbles, 4-7 the high). x's quantized rows are A tiles as they lie (16 rows x 32 bytes
// of a group, the row stride as the tile stride). TDPBSUD (signed x, unsigned stored weights)
// gives sum q_x * stored; the zero point comes off in the epilogue (- z * sum q_x). Each
// group's 16 x 16 int32 sums go through a tile store and the epilogue of the VNNI kernel
// (cvt, x d_x, x d_w, + in fp32). Two accumulator tiles alternate so that a group's product
// runs while the previous group's sums are scaled.
//
// VPDPBUSD does 64 products an instruction and needs 8 per row, block and group (int4: plus
// the nibble split); the tile unit does a row tile's 16 x 16 x 32 in one instruction, which
// leaves the epilogue (5 vector operations per row, block and group) and the wait for each
// tile store as the work: at 1024 rows 2048 -> 3072 takes 18.1 ms (int4) / 18.4 ms (int8)
// against VNNI's 21.4 / 19.1 (Xeon, 6 Dec 2026, 2 threads), far from the tile unit's rate.
// Hiding the store latency behind more accumulator tiles (2 row tiles x 2 blocks) is the
// next step; quant_dot.cpp's amx_min_rows says where this kernel is taken.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "quant.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__)
#error "quant_dot_amx_avx512.cpp must be compiled with the AVX-512 and AMX flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBRows = kQuantGroup / 4;  // 8 rows of 4 k per group
constexpr int64_t kStageBlocks = 16;         // blocks unpacked (int4) and walked at once

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
// the weights through 4 or 5 (the tile intrinsics take literal tile numbers only).
inline void product(int t, const QuantRows& x, int64_t m0, int64_t g, const uint8_t* b_tile) {
  const int8_t* a = x.q + m0 * x.ldq + g * kQuantGroup;
  compiler_barrier();
  if (t == 0) {
    _tile_zero(0);
    _tile_loadd(2, a, x.ldq);
    _tile_loadd(4, b_tile, 64);
    _tile_dpbsud(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, a, x.ldq);
    _tile_loadd(5, b_tile, 64);
    _tile_dpbsud(1, 3, 5);
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

// facc[r] += ((float)(sums[r] - z * qsum) * d_x) * d_w, the VNNI kernel's rounding order.
inline void epilogue(const QuantRows& x, int64_t m0, int64_t g, int32_t z, const int32_t* sums,
                     __m512 scales, __m512 (&facc)[kTileRows]) {
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = m0 + r;
    const __m512i isum = _mm512_sub_epi32(_mm512_load_si512(sums + 16 * r),
                                          _mm512_set1_epi32(z * x.qsum[row * x.ldd + g]));
    const __m512 term = _mm512_mul_round_ps(
        _mm512_mul_round_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(x.d[row * x.ldd + g]),
                            _MM_FROUND_CUR_DIRECTION),
        scales, _MM_FROUND_CUR_DIRECTION);
    facc[r] = _mm512_add_round_ps(facc[r], term, _MM_FROUND_CUR_DIRECTION);
  }
}

// Rows m0..m0+15 against one block whose groups' B tiles are `b_tiles` (stride b_stride).
void row_tile(const QuantRows& x, int64_t m0, const uint8_t* b_tiles, int64_t b_stride,
              const uint8_t* scales_at, int64_t scale_stride, int64_t groups, int32_t z,
              float* out, int64_t ldo) {
  alignas(64) int32_t sums[2][kTileRows * 16];
  __m512 facc[kTileRows];
  for (auto& f : facc) {
    f = _mm512_setzero_ps();
  }
  auto scales = [&](int64_t g) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(scales_at + g * scale_stride)));
  };
  // software pipeline: group g's product is issued before group g - 1's epilogue
  product(0, x, m0, 0, b_tiles);
  for (int64_t g = 0; g < groups; ++g) {
    const int t = static_cast<int>(g & 1);
    if (g + 1 < groups) {
      product(1 - t, x, m0, g + 1, b_tiles + (g + 1) * b_stride);
    }
    store(t, sums[t]);
    epilogue(x, m0, g, z, sums[t], scales(g), facc);
  }
  for (int r = 0; r < kTileRows; ++r) {
    _mm512_storeu_ps(out + r * ldo, facc[r]);
  }
}

// A block's int4 groups unpacked to int8 B tiles (512 bytes each) in `staging`.
void unpack_int4_block(const uint8_t* block, int64_t groups, uint8_t* staging) {
  constexpr int64_t S = quant_group_bytes(kFormatInt4);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = block + g * S;
    uint8_t* dst = staging + g * 512;
    for (int s = 0; s < 4; ++s) {
      const __m512i v = _mm512_loadu_si512(src + 64 * s);
      _mm512_store_si512(dst + 64 * s, _mm512_and_si512(v, low));
      _mm512_store_si512(dst + 64 * (4 + s), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
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
    const int32_t z = bits == 8 ? 128 : 8;
    const bool int4 = bits == 4;
    // int4: a chunk's groups as int8 B tiles, 64-byte aligned (at most 16 x 32 KB for K 2048)
    const int64_t block_staging = groups * 512;
    std::vector<uint8_t> staging_buffer;
    uint8_t* staging = nullptr;
    if (int4) {
      staging_buffer.resize(static_cast<size_t>(
          std::min(block_end - block_begin, kStageBlocks) * block_staging + 64));
      staging = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(staging_buffer.data()) + 63) / 64 * 64);
    }
    for (int64_t c0 = block_begin; c0 < block_end; c0 += kStageBlocks) {
      const int64_t c1 = std::min(block_end, c0 + kStageBlocks);
      if (int4) {
        for (int64_t b = c0; b < c1; ++b) {
          unpack_int4_block(packed + b * groups * S, groups, staging + (b - c0) * block_staging);
        }
      }
      // each row tile of x (16 x K bytes) stays in cache across the chunk's blocks
      for (int64_t m0 = 0; m0 < full; m0 += kTileRows) {
        for (int64_t b = c0; b < c1; ++b) {
          const uint8_t* block = packed + b * groups * S;
          row_tile(x, m0, int4 ? staging + (b - c0) * block_staging : block, int4 ? 512 : S,
                   block + quant_bytes(bits), S, groups, z,
                   out + m0 * ldo + (b - block_begin) * kQuantBlockRows, ldo);
        }
      }
    }
  }
  if (full < M) {  // the last rows on the VNNI kernel (bit-identical)
    const QuantRows rest{x.q + full * x.ldq, x.ldq, x.d + full * x.ldd, x.qsum + full * x.ldd,
                         x.ldd};
    quant_dot_vnni(bits, rest, M - full, packed, groups, block_begin, block_end,
                   out + full * ldo, ldo);
  }
}

}  // namespace mlafx::avx512

// AVX-512 VNNI specialisation of quant_dot (quant.h): compiled with the AVX-512 flags of
// setup.py (incl. -mavx512vnni); only called after use_avx512_vnni(). The portable kernel
// (quant_dot.cpp) is the reference; this one gives bit-identical results (below).
//
// Per block and group the 16 rows' quants are 8 vectors of 64 bytes (int8) or 4 (int4, each
// split by and/shift into the low- and high-nibble vectors), lanes along the block's 16 rows,
// 4 consecutive columns per 32-bit lane. Four bytes of a row of q_x broadcast as the dword
// operand, so one VPDPBUSD adds 64 u8 x s8 products into 16 int32 row sums with no
// horizontal sums (VDPBF16PS does 32). Stored weights are unsigned (q + z, z = 128 or 8):
// the group's sum is corrected by z * sum(q_x), precomputed with the activations. After each
// group: cvt to fp32, times d_x, times the 16 fp16 scales (VCVTPH2PS), added into fp32
// accumulators. Those are *_round_ps intrinsics on purpose: GCC may contract plain
// _mm512_mul_ps/_mm512_add_ps into an FMA, and with separate roundings the sums equal the
// portable kernel's `acc += (float)isum * d_x * d_w` bit for bit.
//
// Tiles: MR rows of x x MB blocks, each (row, block) its own int32 chain: a chain of VPDPBUSD
// has ~5 cycles of latency at 1-2 per cycle, so >= 8 independent chains keep the unit busy.
// Registers: MR*MB int32 + MR*MB fp32 accumulators + MR broadcasts + one weight vector <= 32:
// (MR, MB) = (1, 8), (2, 4), (3, 2), (4, 2), and for int4 at 5-8 rows (MR, 1). Blocks are
// walked in chunks of ~256 KB of weights, and every row tile of x runs over a chunk before the
// next one: with M <= 4 (decode; int4 up to 8) each weight byte is read once, from memory;
// with more rows the chunk is re-read from L2 per
// 4 rows of x (prefill: 4 x 8 x 64 = 2 K MACs per 64-byte L2 line). The first row tile of a
// chunk prefetches 4 groups ahead. Measured on a Zen 5 EPYC (2 Dec
// 2026, 2 threads, cold weights, interleaved A/B in one process, ms): lm_head 2048 -> 102400
// at 8 rows int8 6.6-7.0 with the prefetch against 8.9-9.1 without, int4 4.6-4.8 against
// 6.2-6.5 (3.0-3.6 at one row); no change at one row or at 1024. One-pass decode tiles of 8
// rows (int4, 8 x 2 with the fp32 sums in out) or 6 (int8) did not beat two (4, 2) passes
// (int4 8.4 against 7.1, int8 8.0-8.2 against 8.9, both without prefetch); the memory of this
// VM moved such figures by up to 2x between processes, hence the A/B in one process.
// On a Xeon with AMX (5 Dec 2026, 2 threads, cold) the one-pass (8, 1) tile took int4 q_proj
// 2048 -> 3072 at 8 rows from 0.319 to 0.276 ms (the nibble unpacking is shared by 8 rows, and
// the weights are read from memory once); int8, with nothing to unpack, gained nothing.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "quant.h"

#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__) || !defined(__F16C__)
#error "quant_dot_avx512.cpp must be compiled with the AVX-512 (+VNNI) flags from setup.py"
#endif

namespace mlafx::avx512 {
namespace {

constexpr int64_t kChunkBytes = int64_t{256} << 10;
constexpr int64_t kPrefetchGroups = 4;  // how far ahead the first row tile prefetches
// Into L2 for tiles of 1-4 rows of x, into L1 for 5-8. Zen 4 (7 Dec 2026, int4, 2 threads, cold
// weights, alternating processes): into L2, one row of x streamed 30-33 against 24-27 GB/s and
// 8 tokens' experts (1-3 rows each) 29-30 against 25, but the 8-row tile 13 against 17-18.
template <int MR>
constexpr _mm_hint kPrefetchHint = MR <= 4 ? _MM_HINT_T1 : _MM_HINT_T0;

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);  // unaligned-safe
  return _mm512_set1_epi32(v);
}

// out rows m0..m0+MR-1, blocks b..b+MB-1 (out column 16 * (b - out_block0)).
// Kept as one function (~90 lines): a register-blocked micro-kernel whose MB x MR accumulators
// must stay in registers across the group loop; split into calls, the compiler spills them.
template <int kBits, int MB, int MR>
void tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t groups, int64_t b,
          int64_t out_block0, float* out, int64_t ldo, bool prefetch) {
  constexpr int64_t S = quant_group_bytes(kBits);
  constexpr int32_t z = kBits == 8 ? 128 : 8;
  __m512 facc[MB][MR];
  for (int bb = 0; bb < MB; ++bb) {
    for (int r = 0; r < MR; ++r) {
      facc[bb][r] = _mm512_setzero_ps();
    }
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[MB];
    for (int bb = 0; bb < MB; ++bb) {
      group[bb] = packed + ((b + bb) * groups + g) * S;
    }
    if (prefetch) {  // past the end of the weight is harmless: prefetches do not fault
      for (int bb = 0; bb < MB; ++bb) {
        for (int64_t l = 0; l < S; l += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(group[bb] + kPrefetchGroups * S + l),
                       kPrefetchHint<MR>);
        }
      }
    }
    const int8_t* xq[MR];
    for (int r = 0; r < MR; ++r) {
      xq[r] = x.q + (m0 + r) * x.ldq + g * kQuantGroup;
    }
    // Each chain starts at -z * sum(q_x): the group's sum is then exact with no correction
    // after it.
    __m512i iacc[MB][MR];
    for (int r = 0; r < MR; ++r) {
      const __m512i start = _mm512_set1_epi32(-z * x.qsum[(m0 + r) * x.ldd + g]);
      for (int bb = 0; bb < MB; ++bb) {
        iacc[bb][r] = start;
      }
    }
    if constexpr (kBits == 8) {
      for (int s = 0; s < 8; ++s) {
        __m512i xb[MR];
        for (int r = 0; r < MR; ++r) {
          xb[r] = broadcast4(xq[r] + 4 * s);
        }
        for (int bb = 0; bb < MB; ++bb) {
          const __m512i w = _mm512_loadu_si512(group[bb] + 64 * s);
          for (int r = 0; r < MR; ++r) {
            iacc[bb][r] = _mm512_dpbusd_epi32(iacc[bb][r], w, xb[r]);
          }
        }
      }
    } else {
      for (int s = 0; s < 4; ++s) {
        __m512i x_low[MR], x_high[MR];
        for (int r = 0; r < MR; ++r) {
          x_low[r] = broadcast4(xq[r] + 4 * s);        // columns 4s..4s+3
          x_high[r] = broadcast4(xq[r] + 16 + 4 * s);  // columns 16+4s..
        }
        for (int bb = 0; bb < MB; ++bb) {
          const __m512i v = _mm512_loadu_si512(group[bb] + 64 * s);
          const __m512i w_low = _mm512_and_si512(v, low_nibbles);
          const __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
          for (int r = 0; r < MR; ++r) {
            iacc[bb][r] = _mm512_dpbusd_epi32(iacc[bb][r], w_low, x_low[r]);
            iacc[bb][r] = _mm512_dpbusd_epi32(iacc[bb][r], w_high, x_high[r]);
          }
        }
      }
    }
    __m512 dx[MR];
    for (int r = 0; r < MR; ++r) {
      dx[r] = _mm512_set1_ps(x.d[(m0 + r) * x.ldd + g]);
    }
    for (int bb = 0; bb < MB; ++bb) {
      const __m256i scale_bits =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group[bb] + quant_bytes(kBits)));
      const __m512 scales = _mm512_cvtph_ps(scale_bits);
      for (int r = 0; r < MR; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(iacc[bb][r]);
        const __m512 term = _mm512_mul_round_ps(
            _mm512_mul_round_ps(isum, dx[r], _MM_FROUND_CUR_DIRECTION), scales,
            _MM_FROUND_CUR_DIRECTION);
        facc[bb][r] = _mm512_add_round_ps(facc[bb][r], term, _MM_FROUND_CUR_DIRECTION);
      }
    }
  }
  for (int bb = 0; bb < MB; ++bb) {
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(out + (m0 + r) * ldo + (b + bb - out_block0) * kQuantBlockRows,
                       facc[bb][r]);
    }
  }
}

// Blocks [b0, b1) for rows m0..m0+MR-1: MB at a time, the rest MB / 2 at a time, and so on.
// A tile reads its MB blocks as MB streams; a remainder taken one block at a time was one
// stream and a single chain of VPDPBUSD, and in the MoE's per-expert slices of 44 blocks
// (8 x 5 + 4) those last 4 blocks took a third of the time (perf, Xeon, 5 Dec 2026).
template <int kBits, int MB, int MR>
void row_tile(const QuantRows& x, int64_t m0, const uint8_t* packed, int64_t groups,
              int64_t b0, int64_t b1, int64_t out_block0, float* out, int64_t ldo,
              bool prefetch) {
  static_assert((MB & (MB - 1)) == 0, "MB must be a power of two");
  int64_t b = b0;
  for (; b + MB <= b1; b += MB) {
    tile<kBits, MB, MR>(x, m0, packed, groups, b, out_block0, out, ldo, prefetch);
  }
  if constexpr (MB > 1) {
    row_tile<kBits, MB / 2, MR>(x, m0, packed, groups, b, b1, out_block0, out, ldo, prefetch);
  }
}

template <int kBits>
void quant_dot_bits(const QuantRows& x, int64_t M, const uint8_t* packed, int64_t groups,
                    int64_t block_begin, int64_t block_end, float* out, int64_t ldo) {
  const int64_t block_bytes = std::max<int64_t>(groups, 1) * quant_group_bytes(kBits);
  const int64_t chunk = std::max<int64_t>(8, kChunkBytes / block_bytes / 8 * 8);
  for (int64_t c0 = block_begin; c0 < block_end; c0 += chunk) {
    const int64_t c1 = std::min(block_end, c0 + chunk);
    // The first row tile of a chunk reads it from memory; with more than one row its
    // arithmetic per byte outruns the hardware prefetcher, so it prefetches 4 groups ahead.
    // At one row too: the MoE's short per-expert slices start new streams all the time (Xeon,
    // 5 Dec 2026: int4 experts at batch 1 1.26 -> 1.14 ms, batch 8 7.8 -> 7.6 ms a layer).
    int64_t m0 = 0;
    if (kBits == 4 && M > 4 && M <= 8) {  // decode batches: one pass, 1 block x M rows
      switch (M) {
        case 8:
          row_tile<kBits, 1, 8>(x, 0, packed, groups, c0, c1, block_begin, out, ldo, true);
          break;
        case 7:
          row_tile<kBits, 1, 7>(x, 0, packed, groups, c0, c1, block_begin, out, ldo, true);
          break;
        case 6:
          row_tile<kBits, 1, 6>(x, 0, packed, groups, c0, c1, block_begin, out, ldo, true);
          break;
        default:
          row_tile<kBits, 1, 5>(x, 0, packed, groups, c0, c1, block_begin, out, ldo, true);
          break;
      }
      continue;
    }
    for (; m0 + 4 <= M; m0 += 4) {
      row_tile<kBits, 2, 4>(x, m0, packed, groups, c0, c1, block_begin, out, ldo, m0 == 0);
    }
    switch (M - m0) {
      case 3:
        row_tile<kBits, 2, 3>(x, m0, packed, groups, c0, c1, block_begin, out, ldo, m0 == 0);
        break;
      case 2:
        row_tile<kBits, 4, 2>(x, m0, packed, groups, c0, c1, block_begin, out, ldo, m0 == 0);
        break;
      case 1:
        row_tile<kBits, 8, 1>(x, m0, packed, groups, c0, c1, block_begin, out, ldo, m0 == 0);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void quant_dot_vnni(int bits, const QuantRows& x, int64_t M, const uint8_t* packed,
                    int64_t groups, int64_t block_begin, int64_t block_end, float* out,
                    int64_t ldo) {
  if (bits == 8) {
    quant_dot_bits<8>(x, M, packed, groups, block_begin, block_end, out, ldo);
  } else {
    quant_dot_bits<4>(x, M, packed, groups, block_begin, block_end, out, ldo);
  }
}

}  // namespace mlafx::avx512

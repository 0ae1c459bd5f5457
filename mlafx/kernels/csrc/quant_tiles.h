// The walk the quantized products' vector kernels share (quant_dot_avx2.cpp, quant_kdot_avx2.cpp):
// blocks of 16 weight rows in chunks of ~256 KB of weights, every row tile of x over a chunk
// before the next (the weights come from memory once, then from L2 per MR rows of x), MB
// blocks at a time within a row tile. ISA-free: each kernel instantiates it with its own tile.
#pragma once

#include <algorithm>
#include <cstdint>

namespace mlafx {

constexpr int64_t kQuantChunkBytes = int64_t{256} << 10;

// kernel.operator()<MB, MR>(m0, b, out_block0) (a templated lambda): rows m0..m0+MR-1 of x
// against blocks b..b+MB-1 into output block b - out_block0. Blocks [b0, b1): MB at a time,
// the rest one by one.
template <int MB, int MR, typename Kernel>
void quant_row_tile(const Kernel& kernel, int64_t m0, int64_t b0, int64_t b1,
                    int64_t out_block0) {
  int64_t b = b0;
  for (; b + MB <= b1; b += MB) {
    kernel.template operator()<MB, MR>(m0, b, out_block0);
  }
  for (; b < b1; ++b) {
    kernel.template operator()<1, MR>(m0, b, out_block0);
  }
}

// M rows of x against blocks [block_begin, block_end) of block_bytes each: row tiles of 4,
// then the remainder (3: one block at a time; 2: two; 1: kOneRowBlocks).
template <int kOneRowBlocks, typename Kernel>
void quant_walk_tiles(const Kernel& kernel, int64_t M, int64_t block_begin, int64_t block_end,
                      int64_t block_bytes) {
  const int64_t chunk = std::max<int64_t>(4, kQuantChunkBytes / block_bytes / 4 * 4);
  for (int64_t c0 = block_begin; c0 < block_end; c0 += chunk) {
    const int64_t c1 = std::min(block_end, c0 + chunk);
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) {
      quant_row_tile<1, 4>(kernel, m0, c0, c1, block_begin);
    }
    switch (M - m0) {
      case 3:
        quant_row_tile<1, 3>(kernel, m0, c0, c1, block_begin);
        break;
      case 2:
        quant_row_tile<2, 2>(kernel, m0, c0, c1, block_begin);
        break;
      case 1:
        quant_row_tile<kOneRowBlocks, 1>(kernel, m0, c0, c1, block_begin);
        break;
      default:
        break;
    }
  }
}

}  // namespace mlafx

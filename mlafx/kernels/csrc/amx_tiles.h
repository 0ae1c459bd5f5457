// The AMX tile unit's configuration block, shared by the *_amx_avx512.cpp sources (include it
// only from them: they are compiled with the AMX flags and called after the run-time check).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AMX_TILE__)
#error "amx_tiles.h is for sources compiled with the AMX flags from setup.py"
#endif

namespace mlafx::avx512 {

// Tile loads and LDTILECFG are builtins that do not tell GCC they read memory: a barrier
// orders them after the plain stores that filled their source (and a tile store before the
// plain loads of what it wrote).
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// Palette 1: up to 8 tiles, each `rows` rows of `colsb` bytes (at most 16 x 64); a tile left
// at zero is unused.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int64_t num_rows, int64_t bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
  // Loads this configuration (zeroing every tile) on the calling thread. The barrier keeps
  // the row and width stores: inlined without it, GCC dropped them as dead and wrote only the
  // palette byte (tileloadd then raised SIGILL; dsa_indexer_amx_avx512.cpp, 5 Dec 2026).
  void load() const {
    compiler_barrier();
    _tile_loadconfig(this);
  }
};

}  // namespace mlafx::avx512

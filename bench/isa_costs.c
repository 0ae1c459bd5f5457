// What the FP8 products' instructions cost on this CPU, and how fast one thread streams an FP8
// weight through them from memory (README, "Block FP8 checkpoints": why the experts stay at
// ~1.4x of their bytes). Plain C, no mlafx; needs AVX-512 BF16 + VBMI (+ AMX for the tile line):
//
//   gcc -O2 -march=sapphirerapids bench/isa_costs.c -o /tmp/isa_costs && /tmp/isa_costs
//
// Times are `rdtsc` ticks (the TSC's fixed rate, not the core clock): a one-cycle instruction
// with enough independent chains shows as 1 / (core GHz / TSC GHz) ticks.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#define REPS 20000000L
// eight independent chains of one instruction (zmm0..7 accumulate from zmm30, zmm31, (%0))
#define EIGHT(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define DPBF16(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define PERMT2B(i) "vpermt2b %%zmm30, %%zmm31, %%zmm" #i "\n"
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define FMA_LOAD(i) "vmovaps (%0), %%zmm29\n vfmadd231ps %%zmm29, %%zmm31, %%zmm" #i "\n"
#define DPBUSD(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n"
#define TIME(name, body)                                                                  \
  {                                                                                       \
    uint64_t t = __rdtsc();                                                               \
    for (long i = 0; i < REPS; ++i) __asm__ volatile(EIGHT(body)::"r"(buf) : "memory");   \
    printf("%-28s %.2f ticks each\n", name, (double)(__rdtsc() - t) / (REPS * 8));        \
  }

static float buf[16] __attribute__((aligned(64)));

struct __attribute__((aligned(64))) tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void tile_products(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("TDPBF16PS: no AMX tile state granted\n");
    return;
  }
  for (int rows = 4; rows <= 16; rows *= 2) {
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    cfg.rows[0] = cfg.rows[1] = cfg.rows[3] = cfg.rows[4] = (uint8_t)rows;  // A and C rows
    _tile_loadconfig(&cfg);
    const long n = 2000000;
    uint64_t t = __rdtsc();
    for (long i = 0; i < n; ++i) {
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 1, 2);
      _tile_dpbf16ps(4, 1, 2);
    }
    printf("TDPBF16PS, A of %2d rows      %.1f ticks each\n", rows, (double)(__rdtsc() - t) / (3 * n));
    _tile_release();
  }
}

// One thread over 512 MB of e4m3 bytes, two weight rows of 2048 at a time (as the one-row
// kernel): decoded by VPERMT2B tables, multiplied by one row of x with VDPBF16PS, the same
// lines of the next two rows prefetched to L2.
static void stream(void) {
  const long size = 512L << 20;
  uint8_t* w = aligned_alloc(4096, size);
  memset(w, 0x41, size);
  const __m512i table = _mm512_set1_epi8(0x3c), x = _mm512_set1_epi16(0x3f80);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  for (int round = 0; round < 3; ++round) {
    uint64_t t = __rdtsc();
    for (long row = 0; row < size / 2048; row += 2) {
      const uint8_t* r0 = w + row * 2048;
      for (long k = 0; k < 2048; k += 64) {
        for (int r = 0; r < 2; ++r) {
          const uint8_t* p = r0 + r * 2048 + k;
          _mm_prefetch((const char*)(p + 4096), _MM_HINT_T1);
          const __m512i b = _mm512_loadu_si512(p);
          __m512i hi = _mm512_permutex2var_epi8(table, b, table);
          const __m512i lo = _mm512_permutex2var_epi8(table, b, table);
          hi = _mm512_ternarylogic_epi32(hi, b, x, 0xF8);
          acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)x, (__m512bh)_mm512_unpacklo_epi8(lo, hi));
          acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)x, (__m512bh)_mm512_unpackhi_epi8(lo, hi));
        }
      }
    }
    const double seconds = (double)(__rdtsc() - t) / 2.6e9;  // TSC rate of the host measured on
    printf("one thread, FP8 rows from memory: %.1f GB/s (at a 2.6 GHz TSC)\n", size / seconds / 1e9);
  }
  float out[16];
  _mm512_storeu_ps(out, _mm512_add_ps(acc0, acc1));
  if (out[0] == 1234.5f) printf("\n");
  free(w);
}

int main(void) {
  __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31" ::: "memory");
  TIME("VDPBF16PS", DPBF16)
  TIME("VPERMT2B", PERMT2B)
  TIME("VFMADD231PS", FMA)
  TIME("VFMADD231PS fed by a load", FMA_LOAD)
  TIME("VPDPBUSD", DPBUSD)
  tile_products();
  stream();
  return 0;
}

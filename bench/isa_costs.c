// What the FP8 and int4 products' instructions cost on this CPU, and how fast one thread streams
// an FP8 weight through them from memory (README, "Block FP8 checkpoints": why the experts stay
// at ~1.4x of their bytes; "Quantized weights": why int4 at 8 rows is bound by its arithmetic).
// Plain C, no mlafx; needs AVX-512 BF16 + VBMI (+ AMX for the tile lines):
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

// The int4 product at 8 rows of x (decode batch 8: quant_dot_avx512.cpp's one-pass tile), from
// L1: per group of 32 columns and block of 16 weight rows, 64 VPDPBUSD (the nibbles unpacked
// once, each row's 4 bytes of x broadcast from memory) and the epilogue (cvt, x d_x, x d_w, +).
// 288 bytes of weight a group, so the ticks per group bound one core's rate at 8 rows.
#define ROWS 8
#define GROUPS 64
static uint8_t w4[GROUPS * 288] __attribute__((aligned(64)));
static int8_t xq[GROUPS * ROWS * 32] __attribute__((aligned(64)));
static float dx[GROUPS * ROWS];
static int32_t zq[GROUPS * ROWS];

static inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

__attribute__((noinline)) static void int4_block_vnni(float* out) {
  __m512 facc[ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) facc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < GROUPS; ++g) {
    const uint8_t* group = w4 + g * 288;
    const int8_t* x = xq + g * ROWS * 32;
    __m512i iacc[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) iacc[r] = _mm512_set1_epi32(zq[g * ROWS + r]);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m512i v = _mm512_loadu_si512(group + 64 * s);
      const __m512i wl = _mm512_and_si512(v, low), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        iacc[r] = _mm512_dpbusd_epi32(iacc[r], wl, broadcast4(x + 32 * r + 4 * s));
        iacc[r] = _mm512_dpbusd_epi32(iacc[r], wh, broadcast4(x + 32 * r + 16 + 4 * s));
      }
    }
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(group + 256)));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 t = _mm512_mul_ps(
          _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r]), _mm512_set1_ps(dx[g * ROWS + r])), scales);
      facc[r] = _mm512_add_ps(facc[r], t);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + 16 * r, facc[r]);
}

// The same groups on the AMX-INT8 unit, two blocks at a time with each group's products issued
// before the previous group's epilogue: the nibbles staged as signed int8 B tiles (8 x 64
// bytes), x's 8 rows the A tile, TDPBSSD, the 8 x 16 sums stored and put through the same
// epilogue.
static int8_t staging[4][512] __attribute__((aligned(64)));
static int32_t sums[2][2][16 * 16] __attribute__((aligned(64)));

static inline void stage_group(const uint8_t* src, int8_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int s = 0; s < 4; ++s) {
    const __m512i v = _mm512_loadu_si512(src + 64 * s);
    _mm512_store_si512(dst + 64 * s, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
    _mm512_store_si512(dst + 64 * (4 + s),
                       _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
  }
}

__attribute__((noinline)) static void int4_two_blocks_amx(float* out) {
  __m512 f0[ROWS], f1[ROWS];
  for (int r = 0; r < ROWS; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
  stage_group(w4, staging[0]);
  stage_group(w4, staging[1]);
  __asm__ volatile("" ::: "memory");
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(2, xq, 32);
  _tile_loadd(4, staging[0], 64);
  _tile_loadd(5, staging[1], 64);
  _tile_dpbssd(0, 2, 4);
  _tile_dpbssd(1, 2, 5);
  for (int g = 0; g < GROUPS; ++g) {
    _tile_stored(0, sums[g & 1][0], 64);
    _tile_stored(1, sums[g & 1][1], 64);
    if (g + 1 < GROUPS) {
      int8_t* next = staging[2 * ((g + 1) & 1)];
      stage_group(w4 + (g + 1) * 288, next);
      stage_group(w4 + (g + 1) * 288, next + 512);
      __asm__ volatile("" ::: "memory");
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xq + (g + 1) * ROWS * 32, 32);
      _tile_loadd(4, next, 64);
      _tile_loadd(5, next + 512, 64);
      _tile_dpbssd(0, 2, 4);
      _tile_dpbssd(1, 2, 5);
    }
    __asm__ volatile("" ::: "memory");
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w4 + g * 288 + 256)));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 d = _mm512_set1_ps(dx[g * ROWS + r]);
      f0[r] = _mm512_add_ps(f0[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
                                      _mm512_load_si512(sums[g & 1][0] + 16 * r)), d), scales));
      f1[r] = _mm512_add_ps(f1[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
                                      _mm512_load_si512(sums[g & 1][1] + 16 * r)), d), scales));
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(f0[r], f1[r]));
}

static void int4_rows8(void) {
  for (int i = 0; i < (int)sizeof(w4); ++i) w4[i] = (uint8_t)(i * 13);
  for (int g = 0; g < GROUPS; ++g) {
    for (int i = 0; i < 16; ++i) w4[g * 288 + 256 + 2 * i] = 0, w4[g * 288 + 257 + 2 * i] = 0x3c;
  }
  for (int i = 0; i < (int)sizeof(xq); ++i) xq[i] = (int8_t)(i * 7);
  for (int i = 0; i < GROUPS * ROWS; ++i) dx[i] = 0.01f, zq[i] = -i;
  float out[16 * ROWS];
  const long n = 100000;
  uint64_t t = __rdtsc();
  for (long i = 0; i < n; ++i) int4_block_vnni(out);
  double ticks = (double)(__rdtsc() - t) / (n * GROUPS);
  printf("int4, 8 rows, VNNI (from L1)  %.1f ticks per 288-byte group (%.1f GB/s a core)\n", ticks,
         288 * 2.6 / ticks);
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return;
  struct tile_config cfg = {.palette = 1};
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = ROWS;
  cfg.colsb[0] = cfg.colsb[1] = 64;
  cfg.colsb[2] = 32;
  cfg.rows[4] = cfg.rows[5] = 8;
  cfg.colsb[4] = cfg.colsb[5] = 64;
  _tile_loadconfig(&cfg);
  t = __rdtsc();
  for (long i = 0; i < n / 2; ++i) int4_two_blocks_amx(out);
  ticks = (double)(__rdtsc() - t) / (n * GROUPS);
  printf("int4, 8 rows, AMX-INT8 (L1)   %.1f ticks per 288-byte group (%.1f GB/s a core)\n", ticks,
         288 * 2.6 / ticks);
  _tile_release();
  if (out[0] == 1234.5f) printf("\n");
}

int main(void) {
  __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31" ::: "memory");
  TIME("VDPBF16PS", DPBF16)
  TIME("VPERMT2B", PERMT2B)
  TIME("VFMADD231PS", FMA)
  TIME("VFMADD231PS fed by a load", FMA_LOAD)
  TIME("VPDPBUSD", DPBUSD)
  tile_products();
  int4_rows8();
  stream();
  return 0;
}

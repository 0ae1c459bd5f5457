// fp8_dot (fp8.h): the run-time choice between the AVX-512 kernels (fp8_dot_avx512.cpp), the
// AVX2 one (fp8_dot_avx2.cpp) and the portable one, which is the obvious loop: a 256-entry
// e4m3 table, fp32 products and sums per k block, each block's sum scaled once.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include <torch/library.h>

#include "batch_invariant.h"
#include "cpu_features.h"
#include "fp8.h"

namespace mlafx {
namespace {

float decode_e4m3(uint8_t byte) {
  const int exponent = (byte >> 3) & 0xF;
  const int mantissa = byte & 0x7;
  const float sign = (byte & 0x80) != 0 ? -1.0f : 1.0f;
  if (exponent == 0xF && mantissa == 0x7) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (exponent == 0) {
    return sign * std::ldexp(static_cast<float>(mantissa), -9);
  }
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = decode_e4m3(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

void fp8_dot_portable(const Fp8Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  const std::array<float, 256>& table = e4m3_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const float* scale = W.scale + (n / W.block_n) * W.lds;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x.f32 + m * x.ld;
      float total = 0.0f;
      for (int64_t k0 = 0, kb = 0; k0 < W.K; k0 += W.block_k, ++kb) {
        const int64_t k1 = std::min(W.K, k0 + W.block_k);
        float acc = 0.0f;
        for (int64_t k = k0; k < k1; ++k) acc += xm[k] * table[row[k]];
        total += acc * scale[kb];
      }
      out[m * ldo + n - n0] = total;
    }
  }
}

}  // namespace

float e4m3_to_float(uint8_t byte) { return e4m3_table()[byte]; }

bool fp8_tiles_are_amx(int64_t block_k) {
  return block_k % 64 == 0 && use_amx_bf16() && use_avx512_vbmi();
}

void fp8_dequantize(const Fp8Weight& w, int64_t n0, int64_t n1, float* out) {
  if (use_avx512_bf16()) {
    avx512::fp8_dequantize(w, n0, n1, out);
    return;
  }
  if (use_avx2()) {
    avx2::fp8_dequantize(w, n0, n1, out);
    return;
  }
  const std::array<float, 256>& table = e4m3_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.w + n * w.ldw;
    const float* scale = w.scale + (n / w.block_n) * w.lds;
    float* dst = out + (n - n0) * w.K;
    for (int64_t k0 = 0, kb = 0; k0 < w.K; k0 += w.block_k, ++kb) {
      const int64_t k1 = std::min(w.K, k0 + w.block_k);
      for (int64_t k = k0; k < k1; ++k) dst[k] = table[row[k]] * scale[kb];
    }
  }
}

void fp8_dot(const Fp8Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
             float* out, int64_t ldo) {
  if (M <= 0 || n1 <= n0) {
    return;
  }
  if (use_avx512_bf16()) {
    // Batch-invariant mode: bf16 rows without tiles from VBMI's kernel at any row count, 8 at a
    // time (its sums for one row do not depend on the tile's other rows; past 8 rows it would
    // widen a tile of weight rows for tile_bf16, which sums in another order).
    if (x.bf16 != nullptr && x.tiles == nullptr && M > 8 && w.block_k % 64 == 0 &&
        use_avx512_vbmi() && batch_invariant()) {
      for (int64_t m = 0; m < M; m += 8) {
        const Fp8Rows rows{x.bf16 + m * x.ld, nullptr, x.ld};
        avx512::fp8_dot_bf16(w, rows, std::min<int64_t>(8, M - m), n0, n1, out + m * ldo, ldo);
      }
      return;
    }
    if (x.bf16 != nullptr) {
      avx512::fp8_dot_bf16(w, x, M, n0, n1, out, ldo);
    } else {
      avx512::fp8_dot_f32(w, x, M, n0, n1, out, ldo);
    }
    return;
  }
  if (use_avx2()) {
    avx2::fp8_dot_f32(w, x, M, n0, n1, out, ldo);
    return;
  }
  fp8_dot_portable(w, x, M, n0, n1, out, ldo);
}

}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  // Which kernels the block FP8 ops take in this process: "avx512_amx" (bf16 rows of x from
  // kFp8TileMinRows on go to AMX-BF16 tiles, fewer as "avx512_vbmi"), "avx512_vbmi" (the
  // byte-table decoding), "avx512_bf16", "avx2" or "portable".
  m.def("fp8_cpu_isa() -> str", [] {
    if (mlafx::use_avx512_vbmi() && mlafx::use_amx_bf16()) {
      return std::string("avx512_amx");
    }
    if (mlafx::use_avx512_vbmi()) {
      return std::string("avx512_vbmi");
    }
    if (mlafx::use_avx512_bf16()) {
      return std::string("avx512_bf16");
    }
    return std::string(mlafx::use_avx2() ? "avx2" : "portable");
  });
}

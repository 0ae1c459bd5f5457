// fp4_dot (fp4.h): the run-time choice between the AVX-512 kernels (fp4_dot_avx512.cpp) and the
// portable one, which is the obvious loop: a 16-entry e2m1 table, fp32 products and sums per
// group of 32, each group's sum scaled once.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "fp4.h"

namespace mlafx {
namespace {

constexpr std::array<float, 16> kE2m1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float e2m1(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[k / 2];
  return kE2m1[(k % 2 == 0) ? (byte & 0xF) : (byte >> 4)];
}

void fp4_dot_portable(const Fp4Weight& W, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  const float* ue8m0 = ue8m0_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W.w + n * W.ldw;
    const uint8_t* scale = W.scale + n * W.lds;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x.f32 + m * x.ld;
      float total = 0.0f;
      for (int64_t k0 = 0, g = 0; k0 < W.K; k0 += kFp4Group, ++g) {
        const int64_t k1 = std::min(W.K, k0 + kFp4Group);
        float acc = 0.0f;
        for (int64_t k = k0; k < k1; ++k) acc += xm[k] * e2m1(row, k);
        total += acc * ue8m0[scale[g]];
      }
      out[m * ldo + n - n0] = total;
    }
  }
}

}  // namespace

bool fp4_uses_amx(int64_t M) { return M >= kFp4AmxMinRows && use_amx_bf16(); }

const float* ue8m0_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 255; ++b) t[b] = std::ldexp(1.0f, b - 127);
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  return table.data();
}

void fp4_dequantize(const Fp4Weight& w, int64_t n0, int64_t n1, float* out) {
  if (use_avx512_bf16()) {
    avx512::fp4_dequantize(w, n0, n1, out);
    return;
  }
  const float* ue8m0 = ue8m0_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.w + n * w.ldw;
    const uint8_t* scale = w.scale + n * w.lds;
    float* dst = out + (n - n0) * w.K;
    for (int64_t k = 0; k < w.K; ++k) dst[k] = e2m1(row, k) * ue8m0[scale[k / kFp4Group]];
  }
}

void fp4_dequantize_bf16(const Fp4Weight& w, int64_t n0, int64_t n1, uint16_t* out) {
  if (use_avx512_bf16()) {
    avx512::fp4_dequantize_bf16(w, n0, n1, out);
    return;
  }
  std::vector<float> row(static_cast<size_t>(w.K));
  for (int64_t n = n0; n < n1; ++n) {
    fp4_dequantize(w, n, n + 1, row.data());
    for (int64_t k = 0; k < w.K; ++k) {
      uint32_t bits;
      std::memcpy(&bits, &row[static_cast<size_t>(k)], 4);
      out[(n - n0) * w.K + k] = static_cast<uint16_t>(bits >> 16);  // exact: low half is zero
    }
  }
}

void fp4_dot(const Fp4Weight& w, const Fp8Rows& x, int64_t M, int64_t n0, int64_t n1, float* out,
             int64_t ldo) {
  if (M <= 0 || n1 <= n0) {
    return;
  }
  if (use_avx512_bf16()) {
    if (x.bf16 != nullptr) {
      avx512::fp4_dot_bf16(w, x, M, n0, n1, out, ldo);
    } else {
      avx512::fp4_dot_f32(w, x, M, n0, n1, out, ldo);
    }
    return;
  }
  fp4_dot_portable(w, x, M, n0, n1, out, ldo);
}

}  // namespace mlafx

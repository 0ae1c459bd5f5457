// fp32 <-> bf16 bits (to bf16: round to nearest even), for scalar code in portable and AVX-512
// sources alike: `static`, so every object keeps its own copy (one compiled with AVX-512 flags
// can never stand in for a portable caller's).
#pragma once

#include <cstdint>
#include <cstring>

namespace mlafx {

// NaNs follow VCVTNEPS2BF16 (quiet bit set, sign and top payload kept), so the portable and
// AVX-512 paths write identical bytes. torch itself is not consistent here (its AVX-512 copy
// writes 0xffff for every NaN, its scalar path 0x7fc0), so NaN bytes are not compared with
// torch; only NaN-ness is promised.
static inline uint16_t fp32_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

// bf16 bits -> fp32, exact.
static inline float bf16_bits_to_fp32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

}  // namespace mlafx

// Compiled portably (never with AVX-512 flags): this code runs before we know the CPU.
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace mlafx {

bool cpu_supports_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's detection also checks XCR0, i.e. that the OS saves the zmm state.
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool avx512_disabled_by_env() {
  const char* value = std::getenv("MLAFX_DISABLE_AVX512");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

bool use_avx512_bf16() {
  // A function-local static: thread-safe one-time init, and every kernel sees one answer.
  static const bool use = cpu_supports_avx512_bf16() && !avx512_disabled_by_env();
  return use;
}

const char* active_cpu_isa() { return use_avx512_bf16() ? "avx512_bf16" : "portable"; }

}  // namespace mlafx

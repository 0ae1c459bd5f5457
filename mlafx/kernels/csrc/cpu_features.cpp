// Compiled portably (never with AVX-512 flags): this code runs before we know the CPU.
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

namespace {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

}  // namespace

bool avx512_disabled_by_env() {
  return env_flag("MLAFX_DISABLE_AVX512") || env_flag("MLAFX_AVX2_ONLY");
}

bool amx_disabled_by_env() { return env_flag("MLAFX_DISABLE_AMX"); }

namespace {

// CPUID.(7, 0).EDX bit `bit` (22: AMX-BF16, 24: AMX-TILE, 25: AMX-INT8).
bool cpuid7_edx(int bit) {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 && ((edx >> bit) & 1u);
#else
  (void)bit;
  return false;
#endif
}

// Linux keeps the 8 KB tile data state off until a process asks for it (kernel 5.16+).
bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

bool cpu_supports_amx_int8() { return cpuid7_edx(24) && cpuid7_edx(25) && amx_permitted(); }

bool use_amx_int8() {
  static const bool use = use_avx512_vnni() && !amx_disabled_by_env() && cpu_supports_amx_int8();
  return use;
}

bool cpu_supports_amx_bf16() { return cpuid7_edx(22) && cpuid7_edx(24) && amx_permitted(); }

bool cpu_supports_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         // the AVX-512 objects are built with -mavx512dq too: GCC may use DQ in them
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool use_avx512_vnni() {
  static const bool use = cpu_supports_avx512_vnni() && !avx512_disabled_by_env();
  return use;
}

bool cpu_supports_avx512_vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

bool use_avx512_vbmi() {
  static const bool use =
      use_avx512_bf16() && cpu_supports_avx512_vbmi() && !env_flag("MLAFX_DISABLE_VBMI");
  return use;
}

bool avx2_disabled_by_env() { return env_flag("MLAFX_DISABLE_AVX2"); }

bool cpu_supports_avx2() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) {
    return false;
  }
  const bool fma = (ecx >> 12) & 1u;
  const bool osxsave = (ecx >> 27) & 1u;
  const bool avx = (ecx >> 28) & 1u;
  const bool f16c = (ecx >> 29) & 1u;
  if (!fma || !osxsave || !avx || !f16c) {
    return false;
  }
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0 || ((ebx >> 5) & 1u) == 0) {
    return false;  // no AVX2
  }
  // XCR0 bits 1 (SSE) and 2 (AVX): the OS saves the xmm and ymm state. Inline asm, since the
  // _xgetbv intrinsic needs -mxsave, which this portable source must not be compiled with.
  unsigned xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  return (xcr0_low & 0x6u) == 0x6u;
#else
  return false;
#endif
}

bool use_avx2() {
  static const bool use =
      cpu_supports_avx2() && !env_flag("MLAFX_DISABLE_AVX512") && !avx2_disabled_by_env();
  return use;
}

bool use_amx_bf16() {
  static const bool use = use_avx512_bf16() && !amx_disabled_by_env() && cpu_supports_amx_bf16();
  return use;
}

bool use_avx512_bf16() {
  // A function-local static: thread-safe one-time init, and every kernel sees one answer.
  static const bool use = cpu_supports_avx512_bf16() && !avx512_disabled_by_env();
  return use;
}

const char* active_cpu_isa() {
  if (use_amx_bf16()) {
    return "avx512_amx";
  }
  if (use_avx512_bf16()) {
    return "avx512_bf16";
  }
  return use_avx2() ? "avx2" : "portable";
}

}  // namespace mlafx

// Run-time CPU feature dispatch, shared by every op family.
//
// The library is built once and must load on any x86-64 CPU: `*_avx512.cpp` sources are
// compiled with AVX-512 flags, `*_avx2.cpp` with AVX2 flags (see setup.py), and may only be
// *called* when this says so. Their code lives in namespaces mlafx::avx512 / mlafx::avx2 and
// is declared in ATen-free headers; tests/test_kernel_extension.py fails if any other
// function in the .so uses AVX/AVX-512.
#pragma once

namespace mlafx {

// True iff the CPU and OS support AVX-512 F/BW/VL/DQ + BF16 (+ FMA).
bool cpu_supports_avx512_bf16();

// True iff MLAFX_DISABLE_AVX512 or MLAFX_AVX2_ONLY is set to a non-empty value other than "0".
// MLAFX_DISABLE_AVX512 lets tests and users force the portable path on an AVX-512 machine;
// MLAFX_AVX2_ONLY keeps the AVX2 tier (use_avx2()) on, so an AVX-512 machine runs what a CPU
// with AVX2 and no AVX-512 would.
bool avx512_disabled_by_env();

// The decision every kernel consults: hardware support and not disabled. Computed once per
// process (on first call), so the environment variable must be set before the first op runs.
bool use_avx512_bf16();

// True iff the CPU and OS support AVX-512 F/BW/VL + VNNI (VPDPBUSD) + F16C (the quantized
// kernels' fp16 scales): the quantized products' AVX-512 path (quant_dot_avx512.cpp).
bool cpu_supports_avx512_vnni();

// cpu_supports_avx512_vnni() and not avx512_disabled_by_env(); computed once per process.
bool use_avx512_vnni();

// True iff the CPU has AVX512_VBMI (VPERMT2B: a 128-entry byte table lookup, 64 bytes at a
// time): the block FP8 kernels' e4m3 decoding (fp8_dot_avx512.cpp).
bool cpu_supports_avx512_vbmi();

// use_avx512_bf16() and VBMI and not MLAFX_DISABLE_VBMI (non-empty, not "0": the FP8 kernels'
// arithmetic e4m3 decoding instead); computed once per process.
bool use_avx512_vbmi();

// True iff the CPU has AVX2 + FMA + F16C and the OS saves the ymm state (XGETBV): the
// quantized kernels' AVX2 path (`*_avx2.cpp`, namespace mlafx::avx2).
bool cpu_supports_avx2();

// True iff MLAFX_DISABLE_AVX2 is set (non-empty, not "0"): forces the AVX2 tier off alone.
bool avx2_disabled_by_env();

// cpu_supports_avx2() and neither MLAFX_DISABLE_AVX512 (which keeps meaning "the portable
// path" for every op) nor MLAFX_DISABLE_AVX2 set (MLAFX_AVX2_ONLY leaves it on); computed once
// per process. The
// `*_avx2.cpp` functions may only be called when this is true.
bool use_avx2();

// True iff the CPU has AMX-TILE + AMX-BF16 and Linux granted this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile instruction raises SIGILL).
bool cpu_supports_amx_bf16();

// True iff MLAFX_DISABLE_AMX is set (non-empty, not "0"): the AVX-512 kernels without tiles.
bool amx_disabled_by_env();

// use_avx512_bf16() and AMX support and not disabled; computed once per process. The tile
// kernels (`*_amx_avx512.cpp`) may only be called when this is true.
bool use_amx_bf16();

// True iff the CPU has AMX-TILE + AMX-INT8 and Linux granted this process the tile state.
bool cpu_supports_amx_int8();

// use_avx512_vnni() and AMX-INT8 support and not MLAFX_DISABLE_AMX; computed once per process:
// the quantized products' tile kernel (quant_dot_amx_avx512.cpp) may only run when true.
bool use_amx_int8();

// "avx512_amx", "avx512_bf16", "avx2" or "portable": which path the kernels take in this
// process. "avx2" (no AVX-512 BF16): the attention cores, the quantized and the block FP8
// products are vectorised; the bf16 GEMMs and experts run portably.
const char* active_cpu_isa();

}  // namespace mlafx

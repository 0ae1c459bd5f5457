// ATen-facing helpers of the weight-streaming kernels, shared by gemm.cpp and moe.cpp.
// Portable sources only (includes ATen): never include this from an *_avx512.cpp file.
#pragma once

#include <c10/core/ScalarType.h>

#include "gemm.h"

namespace mlafx {

// bfloat16 / float16 / float32 -> FloatKind; anything else raises a TypeError.
FloatKind float_kind(at::ScalarType dtype);

bool is_supported_float(at::ScalarType dtype);

}  // namespace mlafx

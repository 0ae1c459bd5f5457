// Carving a per-thread workspace into 64-byte aligned regions (a cache line, a zmm register):
// every attention core's Layout (attention.cpp, attention_avx512.cpp, attention_amx_avx512.cpp,
// attention_f32_layout.h), the DSA indexer's (dsa_indexer.cpp, dsa_indexer_avx512.cpp) and the
// AMX batched_matmul's (batched_matmul_amx_avx512.cpp) describe their regions with it, and read
// them back through `at_offset`.
//
// Free of intrinsics and in an anonymous namespace: each source (portable, AVX2, AVX-512)
// compiles its own copy (internal linkage), so no copy built with wider vector flags can stand
// in for another's.
#pragma once

#include <cstddef>

namespace mlafx {
namespace {

inline size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

// Consecutive aligned offsets: `hdr = carve.take(64); q = carve.take(bytes); ...`, then
// `carve.total()` bytes of workspace (aligned to 64 itself) hold them all.
class WorkspaceCarver {
 public:
  size_t take(size_t bytes) {
    const size_t here = total_;
    total_ += align64(bytes);
    return here;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

// A typed pointer into a carved workspace.
template <typename T>
inline T* at_offset(void* ws, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + offset);
}

}  // namespace
}  // namespace mlafx

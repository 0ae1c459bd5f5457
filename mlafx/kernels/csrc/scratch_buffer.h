// Scratch arrays for kernels that write every element before reading it: std::vector value-
// initialises (zeroes) what it allocates, and a 1024-token MoE layer's staging copies, fp32
// sums and quantized rows made that hundreds of MB of memset per layer. ScratchVector's
// resize leaves trivial elements uninitialised, and its storage starts on a cache line (the
// AMX kernels' 32- and 64-byte tile rows then never straddle two lines).
//
// std-only: shared between portable and AVX-512 objects.
#pragma once

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace mlafx {

template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: rebinding is implicit
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  // default-initialisation: nothing for int8_t, float, int32_t
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  bool operator==(const CacheLineAllocator&) const { return true; }
};

template <typename T>
using ScratchVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace mlafx

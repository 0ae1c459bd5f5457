// Work split into many small chunks that the running threads take from a shared counter.
//
// at::parallel_for hands each thread one static share, so a parallel region lasts as long as
// its slowest thread: when the scheduler parks one thread (another process wants its core),
// the others finish and wait for it. Here a region is cut into fixed chunks, several per
// thread, and every thread takes the next untaken chunk until none is left: the running
// threads do a parked thread's chunks, and the region waits only for chunks already started.
//
// The chunk boundaries depend only on the range, the minimum chunk and the thread count,
// never on which thread ran what: each chunk writes its own outputs, so results are bitwise
// the same however the chunks happen to be shared out.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace mlafx {

// Chunks per thread when the range is large: enough that a parked thread's share is spread
// over the others, few enough that taking a chunk (one atomic add) never shows.
constexpr int64_t kChunksPerThread = 8;

// The chunk length parallel_chunks uses for [0, n) with `threads` threads: at least
// min_chunk, else about n / (kChunksPerThread * threads), rounded up to a multiple of `align`.
inline int64_t chunk_length(int64_t n, int64_t min_chunk, int64_t threads, int64_t align = 1) {
  const int64_t want = (n + kChunksPerThread * threads - 1) / (kChunksPerThread * threads);
  const int64_t len = std::max<int64_t>({min_chunk, want, 1});
  return (len + align - 1) / align * align;
}

// Calls fn(chunk_begin, chunk_end) for consecutive chunks of [begin, end), each of
// chunk_length(end - begin, min_chunk, threads, align) elements (the last may be shorter), on
// the calling thread and torch's intra-op threads, each chunk exactly once. Runs serially (the
// same chunks, in order) inside another parallel region or with one thread. The first
// exception thrown by fn is rethrown here after the region ends; chunks not yet started are
// skipped.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t min_chunk, const F& fn,
                     int64_t align = 1) {
  const int64_t n = end - begin;
  if (n <= 0) {
    return;
  }
  at::internal::lazy_init_num_threads();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t len = chunk_length(n, min_chunk, threads, align);
  const int64_t chunks = (n + len - 1) / len;
  auto run = [&](int64_t c) { fn(begin + c * len, std::min(end, begin + (c + 1) * len)); };
#ifdef _OPENMP
  if (chunks > 1 && threads > 1 && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
    // No num_threads clause, as in at::parallel_for (libgomp rebuilds its pool when the team
    // size changes); threads beyond the chunk count find nothing to take.
#pragma omp parallel
    {
      at::internal::ThreadIdGuard tid(omp_get_thread_num());
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        try {
          run(c);
        } catch (...) {
          if (!failed.test_and_set()) {
            error = std::current_exception();
          }
          next.store(chunks, std::memory_order_relaxed);
        }
      }
    }
    if (error) {
      std::rethrow_exception(error);
    }
    return;
  }
#endif
  at::internal::ThreadIdGuard tid(0);
  for (int64_t c = 0; c < chunks; ++c) {
    run(c);
  }
}

}  // namespace mlafx

// Batch-invariant mode flag (batch_invariant.h) and its ops.
#include "batch_invariant.h"

#include <torch/library.h>

#include <atomic>

namespace mlafx {
namespace {
std::atomic<bool> g_batch_invariant{false};
}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

void set_batch_invariant(bool enabled) {
  g_batch_invariant.store(enabled, std::memory_order_relaxed);
}

}  // namespace mlafx

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def("batch_invariant() -> bool", &mlafx::batch_invariant);
  m.def("set_batch_invariant(bool enabled) -> ()", &mlafx::set_batch_invariant);
}

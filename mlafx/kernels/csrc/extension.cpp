// The `mlafx._C` module and the `mlafx` op namespace.
//
// Ops are registered with the dispatcher from static initialisers (TORCH_LIBRARY*), so
// loading the .so is all it takes: `import mlafx._C` here, `torch.ops.load_library(path)` in
// a process that only runs AOTInductor artifacts. The Python module itself is empty.
//
// The ops, by file (schemas at the bottom of each; contracts in docs/DESIGN.md, "Op contracts"):
//   attention.cpp       mla_attention_paged, varlen_attention (core: attention.h, driver:
//                       attention_driver.h)
//   dsa_attention.cpp   mla_attention_sparse (DeepSeek Sparse Attention, same core and driver)
//   dsa_indexer.cpp     dsa_indexer_topk (DSA's lightning indexer; core: dsa_indexer.h)
//   attn_merge.cpp      merge_attn_states          attn_gather.cpp   gather_latent
//   latent_cache.cpp    write_latent_cache         batched_matmul.cpp batched_matmul
//   gemm.cpp            pack_linear_weight, unpack_linear_weight, linear_decode, linear_packed
//   moe.cpp             moe_experts
//   quant_weight.cpp    quantize_linear_weight     quant_linear.cpp  linear_quantized
//   quant_moe.cpp       moe_experts_quantized      quant_dot.cpp     quant_cpu_isa
//   fp8_linear.cpp      linear_fp8                 fp8_moe.cpp       moe_experts_fp8
//   batch_invariant.cpp batch_invariant, set_batch_invariant
//   extension.cpp       cpu_isa, parallel_num_threads
#include <Python.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "cpu_features.h"

namespace {

std::string cpu_isa() { return mlafx::active_cpu_isa(); }

// How many distinct threads an at::parallel_for in *this* library runs on. Equals
// torch.get_num_threads() only if the extension was compiled and linked with -fopenmp
// against torch's OpenMP runtime; otherwise at::parallel_for silently runs serially.
int64_t parallel_num_threads() {
  std::mutex mutex;
  std::set<std::thread::id> threads;
  const int64_t chunks = 4 * static_cast<int64_t>(at::get_num_threads());
  at::parallel_for(0, chunks, /*grain_size=*/1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(threads.size());
}

}  // namespace

// Op families add their schemas with TORCH_LIBRARY_FRAGMENT(mlafx, m) in their own files.
TORCH_LIBRARY(mlafx, m) {
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("parallel_num_threads() -> int", &parallel_num_threads);
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "mlafx._C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

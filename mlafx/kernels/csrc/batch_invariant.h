// Batch-invariant mode (issue 27): when on, every op computes each row of its output with
// arithmetic that does not depend on the other rows of the call, so a request's results are
// bitwise the same whatever else is in the batch and however its prompt is chunked:
// - mla_attention_paged / varlen_attention split every group's keys at fixed positions
//   (multiples of kInvariantSplitKeys, attention_driver.h) and always merge the splits,
//   whether or not the threads need the parallelism; on AMX through their own core
//   (attention_core_bf16_amx_pairs);
// - moe_experts gives each (token, choice) pair one arithmetic whatever the pair count and
//   adds a token's terms in expert order (moe.cpp);
// - linear_packed streams the packed weight for any number of rows (gemm.cpp);
// - batched_matmul: the tile kernels at every row count on AMX, else fixed 16-row tiles;
// - linear_fp8 / moe_experts_fp8 (block FP8): bf16 rows on AMX tiles at every row count, else
//   the one-row-tile kernels 8 rows at a time, never the fp32 GEMM; experts in expert order
//   (fp8_aten.h, fp8_dot.cpp, expert_stacks.h);
// - linear_quantized / moe_experts_quantized: exact integer sums with one epilogue on every
//   path, and GGUF's K formats one kernel at every row count; experts in expert order.
// Off by default (the batch-dependent choices are the fast ones). Process-wide: the engine
// turns it on for each step it runs (mlafx.kernels.batch_invariant_mode).
#pragma once

namespace mlafx {

bool batch_invariant();
void set_batch_invariant(bool enabled);

}  // namespace mlafx

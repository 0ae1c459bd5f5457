// Batch-invariant mode (issue 27): when on, every op computes each row of its output with
// arithmetic that does not depend on the other rows of the call, so a request's results are
// bitwise the same whatever else is in the batch and however its prompt is chunked:
// - mla_attention_paged / varlen_attention split every group's keys at fixed positions
//   (multiples of kInvariantSplitKeys, attention.cpp) and always merge the splits, whether or
//   not the threads need the parallelism;
// - moe_experts streams every expert group, larger ones in chunks of the streaming size, so
//   each (token, choice) pair takes the same kernel whatever the pair count (moe.cpp);
// - linear_packed streams the packed weight for any number of rows (gemm.cpp).
// Off by default (the batch-dependent choices are the fast ones). Process-wide: the engine
// turns it on for each step it runs (mlafx.kernels.batch_invariant_mode).
#pragma once

namespace mlafx {

bool batch_invariant();
void set_batch_invariant(bool enabled);

}  // namespace mlafx

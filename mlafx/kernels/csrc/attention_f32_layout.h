// The workspace of one query group in the fp32-FMA attention cores (attention_f32_avx512.cpp,
// attention_f32_avx2.cpp): Q widened and stored [dim][row] (rows padded to 16), the block's
// widened keys and values, scores/P [key][row], the fp32 output accumulator [row][dim] and the
// online-softmax state per row, each at a 64-byte aligned offset.
//
// Free of intrinsics and in an anonymous namespace: each ISA's source compiles its own copy
// (internal linkage), so no copy built with wider vector flags can stand in for another's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention.h"
#include "workspace_layout.h"

namespace mlafx::attn {
namespace {

struct F32Layout {
  int64_t wq, dvp;  // query/key width; value width padded to 16 lanes
  size_t hdr, qf, lim, kf, s, vf, o, m, l, alpha, total;
  explicit F32Layout(const CoreDims& d) : wq(d.wa + d.wb), dvp((d.dv + 15) / 16 * 16) {
    WorkspaceCarver carve;
    hdr = carve.take(64);
    qf = carve.take(4 * static_cast<size_t>(wq) * kMaxRows);
    lim = carve.take(4 * kMaxRows);
    kf = carve.take(4 * kBlockKeys * static_cast<size_t>(wq));
    s = carve.take(4 * kBlockKeys * kMaxRows);
    vf = carve.take(4 * kBlockKeys * static_cast<size_t>(dvp));
    o = carve.take(4 * kMaxRows * static_cast<size_t>(dvp));
    m = carve.take(4 * kMaxRows);
    l = carve.take(4 * kMaxRows);
    alpha = carve.take(4 * kMaxRows);
    total = carve.total();
  }
};

// At offset hdr: the group's rows and their count padded to 16 (gp).
struct F32Header {
  int64_t rows, gp;
};

}  // namespace
}  // namespace mlafx::attn

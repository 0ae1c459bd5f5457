// Sparse attention over paged caches, as a Problem for the attention driver
// (attention_driver.h): every query attends to the rows of the positions it selected, which may
// come from several caches (mla_attention_sparse: one; v4_attention: DeepSeek-V4's window rows
// and pool entries). A group is one query's heads (up to kMaxRows of them); its keys are the
// query's selected rows in the order given (the softmax does not depend on it), gathered once,
// up front, while they are checked. Portable sources only (includes ATen).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention.h"

namespace mlafx::attn {

struct SparseGroup {
  int64_t t, h0, nh;
};

struct SparseProblem {
  const char* q = nullptr;
  int64_t q_st = 0, q_sh = 0;  // bytes
  char* out = nullptr;
  int64_t out_row_bytes = 0;  // one output row
  float* lse = nullptr;       // [H, T]
  int64_t num_heads = 0, num_tokens = 0;
  int64_t capacity = 0;               // keys a query may have (the selections' widths summed)
  std::vector<const char*> rows_of;   // [T, capacity]: each query's key rows, valid first
  std::vector<int64_t> count;         // [T]: valid keys of each query
  std::vector<SparseGroup> groups;

  // Room for `keys_per_query` keys of each of `tokens` queries, none yet.
  void reset_keys(int64_t tokens, int64_t keys_per_query) {
    num_tokens = tokens;
    capacity = keys_per_query;
    rows_of.assign(static_cast<size_t>(tokens * keys_per_query), nullptr);
    count.assign(static_cast<size_t>(tokens), 0);
  }

  // The queries q [T, H, >= out width] (last dim contiguous), the outputs out [T, H, width]
  // and LSEs lse [H, T] fp32 the driver writes, and the groups over them.
  void set_rows(const at::Tensor& q, at::Tensor& out, at::Tensor& lse_out) {
    const int64_t elem = static_cast<int64_t>(q.element_size());
    this->q = static_cast<const char*>(q.const_data_ptr());
    q_st = q.stride(0) * elem;
    q_sh = q.stride(1) * elem;
    this->out = static_cast<char*>(out.data_ptr());
    out_row_bytes = out.size(2) * static_cast<int64_t>(out.element_size());
    lse = lse_out.data_ptr<float>();
    make_groups();
  }

  // Groups: head slices of one query (every query has its own keys).
  void make_groups() {
    const int64_t per_group = std::min(num_heads, kMaxRows);
    groups.clear();
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t h0 = 0; h0 < num_heads; h0 += per_group) {
        groups.push_back({t, h0, std::min(per_group, num_heads - h0)});
      }
    }
  }

  int64_t num_groups() const { return static_cast<int64_t>(groups.size()); }
  int64_t group_keys(int64_t g) const { return count[groups[g].t]; }
  int64_t group_rows(int64_t g) const { return groups[g].nh; }
  void rows(int64_t gi, const void** qp, int64_t* limits, void** outp, float** lsep) const {
    const SparseGroup& g = groups[gi];
    for (int64_t r = 0; r < g.nh; ++r) {
      const int64_t h = g.h0 + r;
      qp[r] = q + g.t * q_st + h * q_sh;
      limits[r] = count[g.t];
      outp[r] = out + (g.t * num_heads + h) * out_row_bytes;
      lsep[r] = lse + h * num_tokens + g.t;
    }
  }
  void keys(int64_t gi, int64_t j0, int64_t n, const void** ka, const void** kb,
            const void** v) const {
    const char* const* rows = rows_of.data() + groups[gi].t * capacity;
    for (int64_t k = 0; k < n; ++k) {
      ka[k] = rows[j0 + k];
      kb[k] = nullptr;
      v[k] = rows[j0 + k];
    }
  }
};

// Appends to each query's keys the rows of the positions `selected` ([T, K] int64) names in
// `cache` ([NB, BS, width], contiguous) through `block_table` / `kv_lens`: query t of sequence
// b (query_start_loc) may select positions 0..kv_lens[b]-1, each at most once; -1 entries
// (anywhere) are ignored. Any other entry is an error naming `selected_name` (and `lens_name`),
// the query and the sequence. The caller checks the table (op_checks::check_paged_table).
inline void append_selected(const char* op, const char* selected_name, const char* lens_name,
                            SparseProblem& p,
                            const at::Tensor& selected, const at::Tensor& cache,
                            const at::Tensor& block_table, const at::Tensor& kv_lens,
                            const at::Tensor& query_start_loc) {
  const int64_t B = block_table.size(0), K = selected.size(1);
  const int64_t block_size = cache.size(1);
  const int64_t row_bytes = cache.size(2) * static_cast<int64_t>(cache.element_size());
  const char* base = static_cast<const char*>(cache.const_data_ptr());
  const int64_t* sel = selected.const_data_ptr<int64_t>();
  const int64_t s0 = selected.stride(0), s1 = selected.stride(1);
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int64_t qsl_s = query_start_loc.stride(0);
  std::vector<int64_t> seen;  // seen[pos] = last query that selected pos (duplicates check)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b * kv_lens.stride(0)];
    seen.assign(static_cast<size_t>(len), -1);
    for (int64_t t = qsl[b * qsl_s]; t < qsl[(b + 1) * qsl_s]; ++t) {
      const char** dst = p.rows_of.data() + t * p.capacity;
      int64_t n = p.count[t];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t pos = sel[t * s0 + k * s1];
        if (pos == -1) {
          continue;
        }
        TORCH_CHECK_INDEX(pos >= 0 && pos < len, op, ": ", selected_name, "[", t, ", ", k,
                          "] = ", pos, " is out of range for query ", t, " of sequence ", b,
                          " (", lens_name, "[", b, "] = ", len, "; -1 marks an unused entry)");
        TORCH_CHECK_VALUE(seen[pos] != t, op, ": ", selected_name, "[", t, ", :] holds position ",
                          pos, " twice (query ", t, "); selected positions must be distinct");
        seen[pos] = t;
        const int64_t block = table[b * block_table.stride(0) + (pos / block_size) *
                                                                      block_table.stride(1)];
        dst[n++] = base + (block * block_size + pos % block_size) * row_bytes;
      }
      p.count[t] = n;
    }
  }
}

}  // namespace mlafx::attn

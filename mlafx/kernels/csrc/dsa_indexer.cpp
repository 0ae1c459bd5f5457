// dsa_indexer_topk: DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5).
//
//   q:               [T, Hi, Di]    bf16/fp16/fp32, last dim contiguous (indexer queries, rotated)
//   weights:         [T, Hi]        fp32 (per-head weights, every scale folded in)
//   index_cache:     [NB, BS, Di]   q's dtype, contiguous (the indexer's paged key cache)
//   block_table:     [B, M] int32   kv_lens: [B] int32   query_start_loc: [B + 1] int32
//   positions:       [T] int64      query t of sequence b sees positions
//                                   j < min(kv_lens[b], positions[t] + 1)
//   -> [T, topk] int64: the visible positions with the topk highest
//        score(t, j) = sum_h weights[t, h] * relu(q[t, h] . index_cache row of j)   (fp32)
//      ranked by (score descending, position ascending), written in ascending position
//      order, padded with -1 when fewer than topk positions are visible.
//
// Work decomposition (this file): a *group* is up to kIndexerRows / Hi queries of one
// sequence (every cached row is loaded once for all their heads). Groups are cut along the
// positions when there are too few to keep the threads busy (decode of a small batch); each
// piece keeps a running top-k per query (topk_select.h) in a bounded per-thread buffer, so no
// [T, context] score matrix ever exists, and a second pass merges the pieces' candidates.
// Items are taken from a shared counter (parallel_chunks.h), never static shares. The scores
// come from the core (dsa_indexer.h): the portable fp32 one here, the AVX-512 BF16 one in
// dsa_indexer_avx512.cpp, the AMX one in dsa_indexer_amx_avx512.cpp. Python reference:
// mlafx/kernels/dsa_reference.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "dsa_indexer.h"
#include "op_checks.h"
#include "parallel_chunks.h"
#include "topk_select.h"
#include "workspace_layout.h"

namespace {

using mlafx::dsa::Candidate;
using mlafx::dsa::IndexerDims;
using mlafx::dsa::IndexerOps;
using mlafx::dsa::kIndexerChunk;
using mlafx::dsa::kIndexerRows;
using mlafx::dsa::RunningTopK;
using mlafx::op_checks::check_cpu;
using mlafx::op_checks::check_index;
using mlafx::op_checks::check_last_dim_contiguous;
using mlafx::op_checks::check_offsets;
using mlafx::op_checks::check_paged_table;
using mlafx::op_checks::is_supported_float;

using mlafx::align64;
using mlafx::WorkspaceCarver;

// ---- Portable core: the fp32 reference of the scores, every dtype --------------------------
//
// q is widened once per group; each chunk of keys is widened once, transposed ([Di][chunk]),
// so that a (query, head) row's dot products with the whole chunk are one axpy per element of
// the row -- independent sums per key that the compiler vectorises without reordering any.

struct PortableLayout {
  size_t hdr, qf, w, kt, acc, total;
  explicit PortableLayout(const IndexerDims& d) {
    const size_t dim = static_cast<size_t>(d.dim);
    WorkspaceCarver carve;
    hdr = carve.take(sizeof(int64_t));
    qf = carve.take(sizeof(float) * kIndexerRows * dim);
    w = carve.take(sizeof(float) * kIndexerRows);
    kt = carve.take(sizeof(float) * dim * kIndexerChunk);
    acc = carve.take(sizeof(float) * 2 * kIndexerChunk);
    total = carve.total();
  }
};

template <typename T>
struct PortableIndexer {
  static size_t workspace_bytes(const IndexerDims& d) { return PortableLayout(d).total; }

  static void begin(void* ws, const IndexerDims& d, int64_t nq, const void* const* q_rows,
                    int64_t q_head_stride, const float* const* w_rows, int64_t w_head_stride) {
    const PortableLayout L(d);
    char* base = static_cast<char*>(ws);
    *reinterpret_cast<int64_t*>(base + L.hdr) = nq;
    float* qf = reinterpret_cast<float*>(base + L.qf);
    float* w = reinterpret_cast<float*>(base + L.w);
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t h = 0; h < d.heads; ++h) {
        const T* src = static_cast<const T*>(q_rows[i]) + h * q_head_stride;
        float* dst = qf + (i * d.heads + h) * d.dim;
        for (int64_t e = 0; e < d.dim; ++e) {
          dst[e] = static_cast<float>(src[e]);
        }
        w[i * d.heads + h] = w_rows[i][h * w_head_stride];
      }
    }
  }

  static void score(void* ws, const IndexerDims& d, int64_t n, const void* const* keys,
                    float* scores) {
    constexpr int64_t C = kIndexerChunk;
    const PortableLayout L(d);
    char* base = static_cast<char*>(ws);
    const int64_t nq = *reinterpret_cast<const int64_t*>(base + L.hdr);
    const float* qf = reinterpret_cast<const float*>(base + L.qf);
    const float* w = reinterpret_cast<const float*>(base + L.w);
    float* kt = reinterpret_cast<float*>(base + L.kt);
    float* acc = reinterpret_cast<float*>(base + L.acc);
    float* sum = acc + C;
    for (int64_t k = 0; k < C; ++k) {
      const T* row = k < n ? static_cast<const T*>(keys[k]) : nullptr;
      for (int64_t e = 0; e < d.dim; ++e) {
        kt[e * C + k] = row != nullptr ? static_cast<float>(row[e]) : 0.f;
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      std::fill_n(sum, C, 0.f);
      for (int64_t h = 0; h < d.heads; ++h) {
        const float* qrow = qf + (i * d.heads + h) * d.dim;
        std::fill_n(acc, C, 0.f);
        for (int64_t e = 0; e < d.dim; ++e) {
          const float qe = qrow[e];
          const float* kr = kt + e * C;
          for (int64_t k = 0; k < C; ++k) {
            acc[k] += qe * kr[k];
          }
        }
        const float wh = w[i * d.heads + h];
        for (int64_t k = 0; k < C; ++k) {
          sum[k] += wh * (acc[k] < 0.f ? 0.f : acc[k]);  // relu; NaN stays NaN
        }
      }
      std::copy_n(sum, n, scores + i * C);
    }
  }

  static const IndexerOps& ops() {
    static const IndexerOps table{&workspace_bytes, &begin, &score};
    return table;
  }
};

const IndexerOps& select_indexer_core(at::ScalarType dtype, const IndexerDims& dims) {
  switch (dtype) {
    case at::kBFloat16:
      if (mlafx::use_amx_bf16() && mlafx::avx512::dsa_indexer_amx_fits(dims)) {
        return mlafx::avx512::dsa_indexer_core_amx();
      }
      return mlafx::use_avx512_bf16() ? mlafx::avx512::dsa_indexer_core_bf16()
                                      : PortableIndexer<c10::BFloat16>::ops();
    case at::kHalf:
      return PortableIndexer<c10::Half>::ops();
    case at::kFloat:
      return PortableIndexer<float>::ops();
    default:
      TORCH_CHECK(false, "dsa_indexer_topk: unsupported dtype ", dtype);  // checked earlier
  }
}

// ---- Scheduling ----------------------------------------------------------------------------

struct Group {
  int64_t seq, t0, nt, keys;  // keys: positions the group's furthest-seeing query sees
};

struct Item {
  int64_t group;
  int64_t j0, j1;  // positions of this item
  int64_t split;   // index into the partial candidate lists, or -1: writes the output
};

// Below this many positions a piece costs more (its own top-k pass, the merge) than the
// parallelism it buys.
constexpr int64_t kMinSplitPositions = 4096;

struct Indexer {
  const char* q;
  int64_t q_st, q_sh;  // q: bytes per token; elements per head
  const float* w;
  int64_t w_st, w_sh;  // elements
  const char* cache;
  int64_t row_bytes, block_size;
  const int32_t* block_table;
  int64_t bt_s0, bt_s1;
  const int32_t* kv_lens;
  int64_t kv_lens_s;
  const int64_t* positions;
  int64_t pos_s;
  int64_t* out;
  int64_t out_st, out_sk;
  int64_t topk;
  IndexerDims dims;

  int64_t visible(int64_t seq, int64_t t) const {
    const int64_t pos = positions[t * pos_s];
    const int64_t len = kv_lens[seq * kv_lens_s];
    return std::max<int64_t>(0, std::min<int64_t>(len, pos < len ? pos + 1 : len));
  }
  // The rows of positions j .. j + n - 1 into out, a block-table lookup per block (a division
  // per row took a tenth of the indexer's time at 16k cached tokens).
  void rows(int64_t seq, int64_t j, int64_t n, const void** out) const {
    const int32_t* table = block_table + seq * bt_s0;
    int64_t b = j / block_size, off = j % block_size;
    const char* base = cache + table[b * bt_s1] * block_size * row_bytes;
    for (int64_t c = 0; c < n; ++c) {
      out[c] = base + off * row_bytes;
      if (++off == block_size && c + 1 < n) {
        off = 0;
        base = cache + table[++b * bt_s1] * block_size * row_bytes;
      }
    }
  }
};

// One thread's scratch, kept across calls (a decode step is short: no allocation per call).
struct Scratch {
  std::vector<char> bytes;
  void* core = nullptr;
  float* scores = nullptr;
  Candidate* cand = nullptr;
  void fit(size_t core_bytes, int64_t max_queries, int64_t capacity) {
    const size_t scores_bytes = align64(sizeof(float) * max_queries * kIndexerChunk);
    const size_t cand_bytes = sizeof(Candidate) * max_queries * capacity;
    const size_t need = core_bytes + scores_bytes + cand_bytes + 64;
    if (bytes.size() < need) {
      bytes.resize(need);
    }
    char* base = reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
    core = base;
    scores = reinterpret_cast<float*>(base + core_bytes);
    cand = reinterpret_cast<Candidate*>(base + core_bytes + scores_bytes);
  }
};

// The work of one call: items over the query groups, a group split along its positions when
// there are too few groups for the threads (as the attention driver's plan_attention).
struct IndexerPlan {
  std::vector<Item> items;            // largest first
  std::vector<int64_t> split_groups;  // groups whose items write partial selections
  std::vector<int64_t> first_split;   // per split group: index of its first partial
  std::vector<int64_t> split_count;   // per split group: its number of partials
  int64_t num_partials = 0;
};

IndexerPlan plan_indexer(const std::vector<Group>& groups, int64_t threads) {
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  int64_t total = 0;
  for (const Group& g : groups) {
    total += g.keys;
  }
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (threads > 1 && num_groups < 4 * threads) {
    const int64_t want = (total + 4 * threads - 1) / (4 * threads);
    const int64_t rounded = (want + kIndexerChunk - 1) / kIndexerChunk * kIndexerChunk;
    chunk = std::max(kMinSplitPositions, rounded);
  }
  IndexerPlan plan;
  for (int64_t g = 0; g < num_groups; ++g) {
    if (groups[g].keys <= chunk) {
      plan.items.push_back({g, 0, groups[g].keys, -1});
      continue;
    }
    plan.split_groups.push_back(g);
    plan.first_split.push_back(plan.num_partials);
    for (int64_t j = 0; j < groups[g].keys; j += chunk) {
      plan.items.push_back({g, j, std::min(groups[g].keys, j + chunk), plan.num_partials++});
    }
    plan.split_count.push_back(plan.num_partials - plan.first_split.back());
  }
  // Largest first: with dynamic scheduling that bounds the idle tail by the smallest items.
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const Item& a, const Item& b) {
    return (a.j1 - a.j0) * groups[a.group].nt > (b.j1 - b.j0) * groups[b.group].nt;
  });
  return plan;
}

// The split items' candidate lists: [num_partials][max_queries][k] plus their lengths.
struct PartialSelections {
  int64_t max_queries, k;
  std::vector<Candidate> cand;
  std::vector<int64_t> len;
  PartialSelections(int64_t num_partials, int64_t queries, int64_t topk)
      : max_queries(queries),
        k(topk),
        cand(static_cast<size_t>(num_partials * queries * topk)),
        len(static_cast<size_t>(num_partials * queries), 0) {}
  int64_t slot(int64_t split, int64_t query) const { return split * max_queries + query; }
};

// One item: its queries' running top-k over its positions, written out (whole group) or kept
// as partial selections (split item).
void score_item(const Indexer& ix, const IndexerOps& core, const Group& g, const Item& item,
                Scratch& scratch, PartialSelections& partials) {
  const void* q_rows[kIndexerRows];
  const float* w_rows[kIndexerRows];
  int64_t limit[kIndexerRows];
  const void* keys[kIndexerChunk];
  const int64_t k = ix.topk, capacity = 2 * k;
  std::vector<RunningTopK> tops;
  tops.reserve(g.nt);
  for (int64_t i = 0; i < g.nt; ++i) {
    const int64_t t = g.t0 + i;
    q_rows[i] = ix.q + t * ix.q_st;
    w_rows[i] = ix.w + t * ix.w_st;
    limit[i] = ix.visible(g.seq, t);
    tops.emplace_back(scratch.cand + i * capacity, capacity, k);
  }
  core.begin(scratch.core, ix.dims, g.nt, q_rows, ix.q_sh, w_rows, ix.w_sh);
  for (int64_t j = item.j0; j < item.j1; j += kIndexerChunk) {
    const int64_t n = std::min(kIndexerChunk, item.j1 - j);
    ix.rows(g.seq, j, n, keys);
    core.score(scratch.core, ix.dims, n, keys, scratch.scores);
    for (int64_t i = 0; i < g.nt; ++i) {
      const float* s = scratch.scores + i * kIndexerChunk;
      const int64_t m = std::min(n, limit[i] - j);
      for (int64_t c = 0; c < m; ++c) {
        tops[i].offer(s[c], static_cast<int32_t>(j + c));
      }
    }
  }
  for (int64_t i = 0; i < g.nt; ++i) {
    Candidate* cand = scratch.cand + i * capacity;
    const int64_t count = tops[i].finish();
    if (item.split < 0) {
      mlafx::dsa::write_selection(cand, count, k, ix.out + (g.t0 + i) * ix.out_st, ix.out_sk);
    } else {
      const int64_t slot = partials.slot(item.split, i);
      std::copy_n(cand, count, partials.cand.data() + slot * k);
      partials.len[slot] = count;
    }
  }
}

// Merges the pieces of each split group, query by query.
void merge_selections(const Indexer& ix, const std::vector<Group>& groups,
                      const IndexerPlan& plan, const PartialSelections& partials) {
  const int64_t num_split = static_cast<int64_t>(plan.split_groups.size());
  const int64_t max_queries = partials.max_queries, k = partials.k;
  mlafx::parallel_chunks(0, num_split * max_queries, 1, [&](int64_t b, int64_t e) {
    std::vector<Candidate> merged;
    for (int64_t x = b; x < e; ++x) {
      const int64_t s = x / max_queries, i = x % max_queries;
      const Group& g = groups[plan.split_groups[s]];
      if (i >= g.nt) {
        continue;
      }
      merged.clear();
      for (int64_t p = 0; p < plan.split_count[s]; ++p) {
        const int64_t slot = partials.slot(plan.first_split[s] + p, i);
        const auto first = partials.cand.begin() + slot * k;
        merged.insert(merged.end(), first, first + partials.len[slot]);
      }
      mlafx::dsa::write_selection(merged.data(), static_cast<int64_t>(merged.size()), k,
                                  ix.out + (g.t0 + i) * ix.out_st, ix.out_sk);
    }
  });
}

// Plan, score, merge: the selection of every query of `groups` through `core`.
at::Tensor run_indexer(const Indexer& ix, const IndexerOps& core, const std::vector<Group>& groups,
                       int64_t max_queries, at::Tensor out) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const IndexerPlan plan = plan_indexer(groups, threads);
  PartialSelections partials(plan.num_partials, max_queries, ix.topk);
  const size_t core_bytes = align64(core.workspace_bytes(ix.dims));
  mlafx::parallel_chunks(0, static_cast<int64_t>(plan.items.size()), 1, [&](int64_t b, int64_t e) {
    thread_local Scratch scratch;
    scratch.fit(core_bytes, max_queries, 2 * ix.topk);
    for (int64_t it = b; it < e; ++it) {
      const Item& item = plan.items[it];
      score_item(ix, core, groups[item.group], item, scratch, partials);
    }
  });
  if (plan.num_partials > 0) {
    merge_selections(ix, groups, plan, partials);
  }
  return out;
}

// Every argument check of dsa_indexer_topk, naming the argument.
void check_indexer_inputs(const at::Tensor& q, const at::Tensor& weights,
                          const at::Tensor& index_cache, const at::Tensor& block_table,
                          const at::Tensor& kv_lens, const at::Tensor& query_start_loc,
                          const at::Tensor& positions, int64_t topk) {
  constexpr const char* op = "dsa_indexer_topk";
  check_cpu(op, {&q, &weights, &index_cache, &block_table, &kv_lens, &query_start_loc,
                 &positions});
  TORCH_CHECK_TYPE(is_supported_float(q.scalar_type()), op,
                   ": q must be bfloat16, float16 or float32, got ", q.scalar_type());
  TORCH_CHECK_TYPE(index_cache.scalar_type() == q.scalar_type(), op,
                   ": index_cache must have q's dtype ", q.scalar_type(), ", got ",
                   index_cache.scalar_type());
  TORCH_CHECK_TYPE(weights.scalar_type() == at::kFloat, op, ": weights must be float32, got ",
                   weights.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3, op, ": q must be [num_tokens, index_heads, index_dim], got ",
                    "shape ", q.sizes());
  TORCH_CHECK_VALUE(index_cache.dim() == 3, op, ": index_cache must be [num_blocks, ",
                    "block_size, index_dim], got shape ", index_cache.sizes());
  check_index(op, "block_table", block_table, at::kInt, 2);
  check_index(op, "kv_lens", kv_lens, at::kInt, 1);
  check_index(op, "query_start_loc", query_start_loc, at::kInt, 1);
  check_index(op, "positions", positions, at::kLong, 1);
  const int64_t T = q.size(0), Hi = q.size(1), Di = q.size(2);
  const int64_t NB = index_cache.size(0), BS = index_cache.size(1);
  const int64_t B = block_table.size(0);
  TORCH_CHECK_VALUE(weights.dim() == 2 && weights.size(0) == T && weights.size(1) == Hi, op,
                    ": weights must be [num_tokens, index_heads] = [", T, ", ", Hi, "], got ",
                    "shape ", weights.sizes());
  TORCH_CHECK_VALUE(index_cache.size(2) == Di, op, ": index_cache rows are ",
                    index_cache.size(2), " wide but q rows are ", Di);
  TORCH_CHECK_VALUE(Hi >= 1 && Hi <= kIndexerRows, op, ": index_heads = ", Hi,
                    " must be in 1..", kIndexerRows);
  TORCH_CHECK_VALUE(Di >= 1, op, ": index_dim must be at least 1");
  TORCH_CHECK_VALUE(topk >= 1 && topk <= std::numeric_limits<int32_t>::max(), op,
                    ": topk must be at least 1, got ", topk);
  TORCH_CHECK_VALUE(BS >= 1, op, ": block_size must be at least 1, got ", BS);
  TORCH_CHECK_VALUE(kv_lens.size(0) == B, op, ": kv_lens has ", kv_lens.size(0),
                    " entries but block_table has ", B, " rows");
  TORCH_CHECK_VALUE(query_start_loc.size(0) == B + 1, op, ": query_start_loc must have ",
                    B + 1, " entries (num_seqs + 1), got ", query_start_loc.size(0));
  TORCH_CHECK_VALUE(positions.size(0) == T, op, ": positions has ", positions.size(0),
                    " entries but q has ", T, " tokens");
  check_last_dim_contiguous(op, "q", q);
  TORCH_CHECK_VALUE(index_cache.is_contiguous(), op, ": index_cache must be contiguous, got ",
                    "strides ", index_cache.strides());
  check_offsets(op, "query_start_loc", query_start_loc.const_data_ptr<int32_t>(),
                query_start_loc.stride(0), B + 1, T, "num_tokens");
  check_paged_table(op, block_table, kv_lens, NB, BS);
}

at::Tensor dsa_indexer_topk(const at::Tensor& q,                // [T, Hi, Di]
                            const at::Tensor& weights,          // [T, Hi] fp32
                            const at::Tensor& index_cache,      // [NB, BS, Di]
                            const at::Tensor& block_table,      // [B, M] int32
                            const at::Tensor& kv_lens,          // [B] int32
                            const at::Tensor& query_start_loc,  // [B + 1] int32
                            const at::Tensor& positions,        // [T] int64
                            int64_t topk) {
  check_indexer_inputs(q, weights, index_cache, block_table, kv_lens, query_start_loc, positions,
                       topk);
  const int64_t T = q.size(0), Hi = q.size(1), Di = q.size(2);
  const int64_t BS = index_cache.size(1), B = block_table.size(0);
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int64_t qsl_s = query_start_loc.stride(0);

  at::Tensor out = at::empty({T, topk}, q.options().dtype(at::kLong));
  if (T == 0) {
    return out;
  }
  const int64_t elem = static_cast<int64_t>(q.element_size());
  Indexer ix;
  ix.q = static_cast<const char*>(q.const_data_ptr());
  ix.q_st = q.stride(0) * elem;
  ix.q_sh = q.stride(1);
  ix.w = weights.const_data_ptr<float>();
  ix.w_st = weights.stride(0);
  ix.w_sh = weights.stride(1);
  ix.cache = static_cast<const char*>(index_cache.const_data_ptr());
  ix.row_bytes = Di * elem;
  ix.block_size = BS;
  ix.block_table = block_table.const_data_ptr<int32_t>();
  ix.bt_s0 = block_table.stride(0);
  ix.bt_s1 = block_table.stride(1);
  ix.kv_lens = kv_lens.const_data_ptr<int32_t>();
  ix.kv_lens_s = kv_lens.stride(0);
  ix.positions = positions.const_data_ptr<int64_t>();
  ix.pos_s = positions.stride(0);
  ix.out = out.data_ptr<int64_t>();
  ix.out_st = topk;
  ix.out_sk = 1;
  ix.topk = topk;
  ix.dims = IndexerDims{Hi, Di};
  // Groups: as many queries of one sequence as fit in kIndexerRows rows (query x head).
  const int64_t max_queries = std::max<int64_t>(1, kIndexerRows / Hi);
  std::vector<Group> groups;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t_end = qsl[(b + 1) * qsl_s];
    for (int64_t t0 = qsl[b * qsl_s]; t0 < t_end; t0 += max_queries) {
      const int64_t nt = std::min(max_queries, t_end - t0);
      int64_t keys = 0;
      for (int64_t t = t0; t < t0 + nt; ++t) {
        keys = std::max(keys, ix.visible(b, t));
      }
      groups.push_back({b, t0, nt, keys});
    }
  }
  const IndexerOps& core = select_indexer_core(q.scalar_type(), ix.dims);
  return run_indexer(ix, core, groups, max_queries, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "dsa_indexer_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor block_table, "
      "Tensor kv_lens, Tensor query_start_loc, Tensor positions, int topk) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) { m.impl("dsa_indexer_topk", &dsa_indexer_topk); }

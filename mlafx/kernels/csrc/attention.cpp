// mla_attention_paged and varlen_attention: the two attention ops over a shared core.
//
//   mla_attention_paged (absorbed MLA over the paged latent cache):
//     q:               [T, H, Lkv + R]   bf16/fp16/fp32, last dim contiguous
//     kv_cache:        [NB, BS, Lkv + R] same dtype, contiguous
//     block_table:     [B, M] int32      kv_lens: [B] int32   query_start_loc: [B + 1] int32
//     positions:       [T] int64         query t of sequence b sees cache positions
//                                        j < min(kv_lens[b], positions[t] + 1)
//     -> out [T, H, Lkv] (q dtype), lse [H, T] fp32 (natural log of the scaled logits)
//   varlen_attention (ragged MHA, rope key shared by all heads):
//     q: [T, H, P + R]  k_nope: [S, H, P]  k_pe: [S, R]  v: [S, H, V]
//     cu_seqlens_q / cu_seqlens_k: [B + 1] int32; causal aligns the mask bottom-right
//     -> out [T, H, V], lse [H, T]
//
// Work decomposition (the groups here, the scheduling in attention_driver.h) is separate from
// the arithmetic (the "core", attention.h): a *group* is up to kMaxRows query rows that share
// keys (MLA: every head of one or more queries of a sequence, so each cached row is loaded
// once for all of them; varlen: a block of queries of one head). Long groups are split along
// the keys when there are too few groups to keep every thread busy (flash-decoding); splits
// write fp32 partial outputs and LSEs that a second pass merges. Threads take work items from
// an atomic counter, largest first (attention_driver.h, shared with dsa_attention.cpp's
// mla_attention_sparse). Python references: mlafx/kernels/attention_reference.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "attention.h"
#include "attention_driver.h"
#include "batch_invariant.h"
#include "cpu_features.h"
#include "op_checks.h"

namespace {

using mlafx::attn::CoreDims;
using mlafx::attn::CoreOps;
using mlafx::attn::kBlockKeys;
using mlafx::attn::kMaxRows;

using mlafx::WorkspaceCarver;
using mlafx::attn::kNegInf;
using mlafx::attn::run_attention;
using mlafx::attn::select_core;
using mlafx::op_checks::check_cpu;
using mlafx::op_checks::check_index;
using mlafx::op_checks::check_latent_attention;
using mlafx::op_checks::check_last_dim_contiguous;
using mlafx::op_checks::check_offsets;
using mlafx::op_checks::check_paged_table;
using mlafx::op_checks::is_supported_float;

// ---- Portable core: the scalar reference of the arithmetic, every dtype ------------------
//
// fp32 throughout: q and each key/value row are widened once, scores and the online softmax
// are plain loops. The AVX-512 core must agree with this up to bf16 rounding of P.

struct PortableLayout {
  size_t qf, kf, vf, o, m, l, lim, s, rows, total;
  explicit PortableLayout(const CoreDims& d) {
    const size_t wq = static_cast<size_t>(d.wa + d.wb);
    const size_t dv = static_cast<size_t>(d.dv);
    WorkspaceCarver carve;
    rows = carve.take(sizeof(int64_t));
    qf = carve.take(sizeof(float) * kMaxRows * wq);
    kf = carve.take(sizeof(float) * wq);
    vf = carve.take(sizeof(float) * dv);
    o = carve.take(sizeof(float) * kMaxRows * dv);
    m = carve.take(sizeof(float) * kMaxRows);
    l = carve.take(sizeof(float) * kMaxRows);
    lim = carve.take(sizeof(int64_t) * kMaxRows);
    s = carve.take(sizeof(float) * kMaxRows * kBlockKeys);
    total = carve.total();
  }
};

template <typename T>
inline void widen(const void* src, float* dst, int64_t n) {
  const T* in = static_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(in[i]);
  }
}

// Four partial sums: the compiler may not reorder a float reduction, so give it the ILP.
inline float dot(const float* a, const float* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) {
    s0 += a[i] * b[i];
  }
  return (s0 + s1) + (s2 + s3);
}

template <typename T>
struct PortableCore {
  static size_t workspace_bytes(const CoreDims& d) { return PortableLayout(d).total; }

  static void begin(void* ws, const CoreDims& d, int64_t num_rows, const void* const* q_rows,
                    const int64_t* limits) {
    const PortableLayout L(d);
    char* base = static_cast<char*>(ws);
    *reinterpret_cast<int64_t*>(base + L.rows) = num_rows;
    float* qf = reinterpret_cast<float*>(base + L.qf);
    const int64_t wq = d.wa + d.wb;
    for (int64_t g = 0; g < num_rows; ++g) {
      widen<T>(q_rows[g], qf + g * wq, wq);
    }
    std::fill_n(reinterpret_cast<float*>(base + L.o), num_rows * d.dv, 0.f);
    std::fill_n(reinterpret_cast<float*>(base + L.m), num_rows, kNegInf);
    std::fill_n(reinterpret_cast<float*>(base + L.l), num_rows, 0.f);
    std::copy_n(limits, num_rows, reinterpret_cast<int64_t*>(base + L.lim));
  }

  static void block(void* ws, const CoreDims& d, int64_t j0, int64_t n, const void* const* ka,
                    const void* const* kb, const void* const* v) {
    const PortableLayout L(d);
    char* base = static_cast<char*>(ws);
    const int64_t rows = *reinterpret_cast<const int64_t*>(base + L.rows);
    const float* qf = reinterpret_cast<const float*>(base + L.qf);
    float* kf = reinterpret_cast<float*>(base + L.kf);
    float* vf = reinterpret_cast<float*>(base + L.vf);
    float* o = reinterpret_cast<float*>(base + L.o);
    float* m = reinterpret_cast<float*>(base + L.m);
    float* l = reinterpret_cast<float*>(base + L.l);
    const int64_t* lim = reinterpret_cast<const int64_t*>(base + L.lim);
    float* s = reinterpret_cast<float*>(base + L.s);  // [n][rows]
    const int64_t wq = d.wa + d.wb;

    for (int64_t k = 0; k < n; ++k) {
      widen<T>(ka[k], kf, d.wa);
      if (d.wb > 0) {
        widen<T>(kb[k], kf + d.wa, d.wb);
      }
      for (int64_t g = 0; g < rows; ++g) {
        s[k * rows + g] = j0 + k < lim[g] ? dot(qf + g * wq, kf, wq) * d.scale : kNegInf;
      }
    }
    for (int64_t g = 0; g < rows; ++g) {
      float mx = m[g];
      for (int64_t k = 0; k < n; ++k) {
        mx = s[k * rows + g] > mx ? s[k * rows + g] : mx;  // NaN scores propagate through p
      }
      // All -inf so far (no visible key yet): subtract 0, so p = exp(-inf) = 0, not NaN.
      const float shift = mx == kNegInf ? 0.f : mx;
      const float alpha = std::exp(m[g] - shift);
      float sum = l[g] * alpha;
      for (int64_t k = 0; k < n; ++k) {
        const float p = std::exp(s[k * rows + g] - shift);
        s[k * rows + g] = p;
        sum += p;
      }
      l[g] = sum;
      m[g] = mx;
      float* og = o + g * d.dv;
      for (int64_t i = 0; i < d.dv; ++i) {
        og[i] *= alpha;
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      widen<T>(v[k], vf, d.dv);
      for (int64_t g = 0; g < rows; ++g) {
        const float p = s[k * rows + g];
        float* og = o + g * d.dv;
        for (int64_t i = 0; i < d.dv; ++i) {
          og[i] += p * vf[i];
        }
      }
    }
  }

  static void end(void* ws, const CoreDims& d, void* const* out_rows, float* const* out_f32_rows,
                  float* const* lse_ptrs) {
    const PortableLayout L(d);
    char* base = static_cast<char*>(ws);
    const int64_t rows = *reinterpret_cast<const int64_t*>(base + L.rows);
    const float* o = reinterpret_cast<const float*>(base + L.o);
    const float* m = reinterpret_cast<const float*>(base + L.m);
    const float* l = reinterpret_cast<const float*>(base + L.l);
    const int64_t* lim = reinterpret_cast<const int64_t*>(base + L.lim);
    for (int64_t g = 0; g < rows; ++g) {
      const bool empty = lim[g] <= 0;
      const float inv = empty ? 0.f : 1.f / l[g];
      *lse_ptrs[g] = empty ? kNegInf : m[g] + std::log(l[g]);
      const float* og = o + g * d.dv;
      if (out_rows != nullptr) {
        T* out = static_cast<T*>(out_rows[g]);
        for (int64_t i = 0; i < d.dv; ++i) {
          out[i] = static_cast<T>(empty ? 0.f : og[i] * inv);
        }
      } else {
        float* out = out_f32_rows[g];
        for (int64_t i = 0; i < d.dv; ++i) {
          out[i] = empty ? 0.f : og[i] * inv;
        }
      }
    }
  }

  static const CoreOps& ops() {
    static const CoreOps table{&workspace_bytes, &begin, &block, &end};
    return table;
  }
};

}  // namespace

namespace mlafx::attn {

const CoreOps& select_core(at::ScalarType dtype, const CoreDims& dims) {
  const bool avx512 = mlafx::use_avx512_bf16();
  const bool avx2 = !avx512 && mlafx::use_avx2();
  switch (dtype) {
    case at::kBFloat16:
      if (mlafx::use_amx_bf16() && mlafx::avx512::attention_core_amx_supports(dims)) {
        return mlafx::batch_invariant() ? mlafx::avx512::attention_core_bf16_amx_pairs()
                                        : mlafx::avx512::attention_core_bf16_amx();
      }
      if (avx512) return mlafx::avx512::attention_core_bf16();
      return avx2 ? mlafx::avx2::attention_core_bf16() : PortableCore<c10::BFloat16>::ops();
    case at::kHalf:
      if (avx512) return mlafx::avx512::attention_core_f16();
      return avx2 ? mlafx::avx2::attention_core_f16() : PortableCore<c10::Half>::ops();
    case at::kFloat:
      if (avx512) return mlafx::avx512::attention_core_f32();
      return avx2 ? mlafx::avx2::attention_core_f32() : PortableCore<float>::ops();
    default:
      TORCH_CHECK(false, "attention: unsupported dtype ", dtype);  // checked earlier
  }
}

}  // namespace mlafx::attn

namespace {

// ---- mla_attention_paged -----------------------------------------------------------------

struct PagedGroup {
  int64_t seq, t0, nt, h0, nh, keys;
};

struct PagedProblem {
  const char* q;
  int64_t q_st, q_sh;  // bytes
  const char* cache;
  int64_t row_bytes, block_size;
  const int32_t* block_table;
  int64_t bt_s0, bt_s1;
  const int32_t* kv_lens;
  int64_t kv_lens_s;
  const int64_t* positions;
  int64_t pos_s;
  char* out;
  int64_t out_row_bytes;  // one [Lkv] row
  float* lse;
  int64_t num_heads, num_tokens;
  std::vector<PagedGroup> groups;

  int64_t visible(int64_t seq, int64_t t) const {
    const int64_t pos = positions[t * pos_s];
    const int64_t len = kv_lens[seq * kv_lens_s];
    return std::max<int64_t>(0, std::min<int64_t>(len, pos < len ? pos + 1 : len));
  }
  int64_t num_groups() const { return static_cast<int64_t>(groups.size()); }
  int64_t group_keys(int64_t g) const { return groups[g].keys; }
  int64_t group_rows(int64_t g) const { return groups[g].nt * groups[g].nh; }
  void rows(int64_t gi, const void** qp, int64_t* limits, void** outp, float** lsep) const {
    const PagedGroup& g = groups[gi];
    int64_t r = 0;
    for (int64_t t = g.t0; t < g.t0 + g.nt; ++t) {
      const int64_t lim = visible(g.seq, t);
      for (int64_t h = g.h0; h < g.h0 + g.nh; ++h, ++r) {
        qp[r] = q + t * q_st + h * q_sh;
        limits[r] = lim;
        outp[r] = out + (t * num_heads + h) * out_row_bytes;
        lsep[r] = lse + h * num_tokens + t;
      }
    }
  }
  void keys(int64_t gi, int64_t j0, int64_t n, const void** ka, const void** kb,
            const void** v) const {
    const int32_t* table = block_table + groups[gi].seq * bt_s0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t j = j0 + k;
      const int64_t block = table[(j / block_size) * bt_s1];
      const char* row = cache + (block * block_size + j % block_size) * row_bytes;
      ka[k] = row;
      kb[k] = nullptr;
      v[k] = row;
    }
  }
};

std::tuple<at::Tensor, at::Tensor> mla_attention_paged(
    const at::Tensor& q,                // [T, H, Lkv + R]
    const at::Tensor& kv_cache,         // [NB, BS, Lkv + R]
    const at::Tensor& block_table,      // [B, M] int32
    const at::Tensor& kv_lens,          // [B] int32
    const at::Tensor& query_start_loc,  // [B + 1] int32
    const at::Tensor& positions,        // [T] int64
    double scale, int64_t kv_lora_rank) {
  constexpr const char* op = "mla_attention_paged";
  check_cpu(op, {&q, &kv_cache, &block_table, &kv_lens, &query_start_loc, &positions});
  check_index(op, "positions", positions, at::kLong, 1);
  check_latent_attention(op, q, kv_cache, block_table, kv_lens, query_start_loc, scale,
                         kv_lora_rank);
  const int64_t T = q.size(0), H = q.size(1), W = q.size(2);
  const int64_t BS = kv_cache.size(1);
  const int64_t B = block_table.size(0);
  TORCH_CHECK_VALUE(positions.size(0) == T, op, ": positions has ", positions.size(0),
                    " entries but q has ", T, " tokens");
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int64_t qsl_s = query_start_loc.stride(0);
  const int32_t* lens = kv_lens.const_data_ptr<int32_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();

  at::Tensor out = at::empty({T, H, kv_lora_rank}, q.options());
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) {
    return {out, lse};
  }
  const int64_t elem = static_cast<int64_t>(q.element_size());
  PagedProblem p;
  p.q = static_cast<const char*>(q.const_data_ptr());
  p.q_st = q.stride(0) * elem;
  p.q_sh = q.stride(1) * elem;
  p.cache = static_cast<const char*>(kv_cache.const_data_ptr());
  p.row_bytes = W * elem;
  p.block_size = BS;
  p.block_table = table;
  p.bt_s0 = block_table.stride(0);
  p.bt_s1 = block_table.stride(1);
  p.kv_lens = lens;
  p.kv_lens_s = kv_lens.stride(0);
  p.positions = positions.const_data_ptr<int64_t>();
  p.pos_s = positions.stride(0);
  p.out = static_cast<char*>(out.data_ptr());
  p.out_row_bytes = kv_lora_rank * elem;
  p.lse = lse.data_ptr<float>();
  p.num_heads = H;
  p.num_tokens = T;
  // Groups: all heads of as many queries of one sequence as fit in kMaxRows rows (so every
  // cached row is loaded once for all of them), or head slices of one query when H is larger.
  const int64_t heads_per_group = std::min(H, kMaxRows);
  const int64_t queries_per_group = std::max<int64_t>(1, kMaxRows / H);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t_end = qsl[(b + 1) * qsl_s];
    for (int64_t t0 = qsl[b * qsl_s]; t0 < t_end; t0 += queries_per_group) {
      const int64_t nt = std::min(queries_per_group, t_end - t0);
      int64_t keys = 0;
      for (int64_t t = t0; t < t0 + nt; ++t) {
        keys = std::max(keys, p.visible(b, t));
      }
      for (int64_t h0 = 0; h0 < H; h0 += heads_per_group) {
        p.groups.push_back({b, t0, nt, h0, std::min(heads_per_group, H - h0), keys});
      }
    }
  }
  const CoreDims dims{W, 0, kv_lora_rank, static_cast<float>(scale)};
  run_attention(p, select_core(q.scalar_type(), dims), dims, q.scalar_type());
  return {out, lse};
}

// ---- varlen_attention --------------------------------------------------------------------

struct VarlenGroup {
  int64_t q0, k0, head, i0, n, q_len, k_len, keys;
};

struct VarlenProblem {
  const char* q;
  int64_t q_st, q_sh;
  const char* k_nope;
  int64_t kn_st, kn_sh;
  const char* k_pe;
  int64_t kp_st;
  const char* v;
  int64_t v_st, v_sh;
  char* out;
  int64_t out_row_bytes;
  float* lse;
  int64_t num_heads, num_tokens;
  bool causal;
  std::vector<VarlenGroup> groups;

  static int64_t visible(bool causal, int64_t i, int64_t q_len, int64_t k_len) {
    if (!causal) {
      return k_len;
    }
    return std::max<int64_t>(0, std::min<int64_t>(k_len, i + k_len - q_len + 1));
  }
  int64_t num_groups() const { return static_cast<int64_t>(groups.size()); }
  int64_t group_keys(int64_t g) const { return groups[g].keys; }
  int64_t group_rows(int64_t g) const { return groups[g].n; }
  void rows(int64_t gi, const void** qp, int64_t* limits, void** outp, float** lsep) const {
    const VarlenGroup& g = groups[gi];
    for (int64_t r = 0; r < g.n; ++r) {
      const int64_t t = g.q0 + g.i0 + r;
      qp[r] = q + t * q_st + g.head * q_sh;
      limits[r] = visible(causal, g.i0 + r, g.q_len, g.k_len);
      outp[r] = out + (t * num_heads + g.head) * out_row_bytes;
      lsep[r] = lse + g.head * num_tokens + t;
    }
  }
  void keys(int64_t gi, int64_t j0, int64_t n, const void** ka, const void** kb,
            const void** vp) const {
    const VarlenGroup& g = groups[gi];
    for (int64_t k = 0; k < n; ++k) {
      const int64_t s = g.k0 + j0 + k;
      ka[k] = k_nope + s * kn_st + g.head * kn_sh;
      kb[k] = k_pe + s * kp_st;
      vp[k] = v + s * v_st + g.head * v_sh;
    }
  }
};

std::tuple<at::Tensor, at::Tensor> varlen_attention(
    const at::Tensor& q,             // [T, H, P + R]
    const at::Tensor& k_nope,        // [S, H, P]
    const at::Tensor& k_pe,          // [S, R]
    const at::Tensor& v,             // [S, H, V]
    const at::Tensor& cu_seqlens_q,  // [B + 1] int32
    const at::Tensor& cu_seqlens_k,  // [B + 1] int32
    double scale, bool causal) {
  constexpr const char* op = "varlen_attention";
  check_cpu(op, {&q, &k_nope, &k_pe, &v, &cu_seqlens_q, &cu_seqlens_k});
  TORCH_CHECK_TYPE(is_supported_float(q.scalar_type()), op,
                   ": q must be bfloat16, float16 or float32, got ", q.scalar_type());
  TORCH_CHECK_TYPE(k_nope.scalar_type() == q.scalar_type() &&
                       k_pe.scalar_type() == q.scalar_type() &&
                       v.scalar_type() == q.scalar_type(),
                   op, ": q, k_nope, k_pe and v must have one dtype, got ", q.scalar_type(), ", ",
                   k_nope.scalar_type(), ", ", k_pe.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3 && k_nope.dim() == 3 && k_pe.dim() == 2 && v.dim() == 3, op,
                    ": expected q [T, H, P + R], k_nope [S, H, P], k_pe [S, R], v [S, H, V], "
                    "got shapes ", q.sizes(), ", ", k_nope.sizes(), ", ", k_pe.sizes(), ", ",
                    v.sizes());
  check_index(op, "cu_seqlens_q", cu_seqlens_q, at::kInt, 1);
  check_index(op, "cu_seqlens_k", cu_seqlens_k, at::kInt, 1);
  const int64_t T = q.size(0), H = q.size(1);
  const int64_t S = k_nope.size(0), P = k_nope.size(2), R = k_pe.size(1), V = v.size(2);
  TORCH_CHECK_VALUE(k_nope.size(1) == H && v.size(1) == H, op, ": k_nope and v must have ", H,
                    " heads like q, got ", k_nope.size(1), " and ", v.size(1));
  TORCH_CHECK_VALUE(k_pe.size(0) == S && v.size(0) == S, op,
                    ": k_nope, k_pe and v must have the same number of keys, got ", S, ", ",
                    k_pe.size(0), ", ", v.size(0));
  TORCH_CHECK_VALUE(q.size(2) == P + R, op, ": q rows are ", q.size(2), " wide but P (", P,
                    ") + R (", R, ") is ", P + R);
  const int64_t B = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK_VALUE(B >= 0 && cu_seqlens_k.size(0) == B + 1, op,
                    ": cu_seqlens_q and cu_seqlens_k must both have num_seqs + 1 >= 1 entries, "
                    "got ", cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
  check_last_dim_contiguous(op, "q", q);
  check_last_dim_contiguous(op, "k_nope", k_nope);
  check_last_dim_contiguous(op, "k_pe", k_pe);
  check_last_dim_contiguous(op, "v", v);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const int32_t* cq = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* ck = cu_seqlens_k.const_data_ptr<int32_t>();
  const int64_t cq_s = cu_seqlens_q.stride(0), ck_s = cu_seqlens_k.stride(0);
  if (B >= 0 && cu_seqlens_q.size(0) > 0) {
    check_offsets(op, "cu_seqlens_q", cq, cq_s, B + 1, T, "num_tokens (q.size(0))");
    check_offsets(op, "cu_seqlens_k", ck, ck_s, B + 1, S, "num_keys (k_nope.size(0))");
  }

  at::Tensor out = at::empty({T, H, V}, q.options());
  at::Tensor lse = at::empty({H, T}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) {
    return {out, lse};
  }
  const int64_t elem = static_cast<int64_t>(q.element_size());
  VarlenProblem p;
  p.q = static_cast<const char*>(q.const_data_ptr());
  p.q_st = q.stride(0) * elem;
  p.q_sh = q.stride(1) * elem;
  p.k_nope = static_cast<const char*>(k_nope.const_data_ptr());
  p.kn_st = k_nope.stride(0) * elem;
  p.kn_sh = k_nope.stride(1) * elem;
  p.k_pe = static_cast<const char*>(k_pe.const_data_ptr());
  p.kp_st = k_pe.stride(0) * elem;
  p.v = static_cast<const char*>(v.const_data_ptr());
  p.v_st = v.stride(0) * elem;
  p.v_sh = v.stride(1) * elem;
  p.out = static_cast<char*>(out.data_ptr());
  p.out_row_bytes = V * elem;
  p.lse = lse.data_ptr<float>();
  p.num_heads = H;
  p.num_tokens = T;
  p.causal = causal;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cq[b * cq_s], q_len = cq[(b + 1) * cq_s] - q0;
    const int64_t k0 = ck[b * ck_s], k_len = ck[(b + 1) * ck_s] - k0;
    for (int64_t i0 = 0; i0 < q_len; i0 += kMaxRows) {
      const int64_t n = std::min(kMaxRows, q_len - i0);
      const int64_t keys = VarlenProblem::visible(causal, i0 + n - 1, q_len, k_len);
      for (int64_t h = 0; h < H; ++h) {
        p.groups.push_back({q0, k0, h, i0, n, q_len, k_len, keys});
      }
    }
  }
  const CoreDims dims{P, R, V, static_cast<float>(scale)};
  run_attention(p, select_core(q.scalar_type(), dims), dims, q.scalar_type());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlafx, m) {
  m.def(
      "mla_attention_paged(Tensor q, Tensor kv_cache, Tensor block_table, Tensor kv_lens, "
      "Tensor query_start_loc, Tensor positions, float scale, int kv_lora_rank) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "varlen_attention(Tensor q, Tensor k_nope, Tensor k_pe, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, float scale, bool causal) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(mlafx, CPU, m) {
  m.impl("mla_attention_paged", &mla_attention_paged);
  m.impl("varlen_attention", &varlen_attention);
}

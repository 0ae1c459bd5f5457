// v4_compress_pool's arithmetic (the problem: v4_compressor_entry.h): the portable loops over
// a range of entries (compress_entries), and what both forms share (finish_entry, slot_plan,
// Bits). Included inside an unnamed namespace by v4_compressor.cpp (the op, portable) and
// v4_compressor_avx512.cpp (its own 16-channel loops): every function here has internal
// linkage, so the AVX-512 object's copies can never stand in for the portable ones.
//
// Entry n (window w closing), channel j < c, over its L slots (CSA: 2m, window w-1's series A
// then window w's series B; HCA: m, window w's):
//   g[s] = gate[src(s), j'] + bias[s % m, j']        (j' = j, or c + j for series B)
//   a[s] = softmax_s(g) rounded to the dtype          (CSA, w = 0: series A masked to -inf)
//   e[j] = sum_s round(kv[src(s), j'] * a[s])         fp32 sum, rounded
//   e    = round(norm_weight * e / sqrt(mean(e^2) + eps))
//   e    = rope(e)                                    (last R dims, interleaved pairs, cos/sin)
// which is PoolCompressor.close's arithmetic (models/deepseek_v4/compressor.py), rounding
// where it rounds.
// The includer includes <algorithm>, <cmath>, <cstdint>, <cstring>, <limits>, bf16_bits.h and
// v4_compressor_entry.h first (outside the unnamed namespace).

// fp32 <-> the cache dtype's bits. bf16 rounds to nearest even (NaN kept quiet).
template <typename T>
struct Bits;
template <>
struct Bits<float> {
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
  static float round(float v) { return v; }
};
struct Bf16 {
  uint16_t bits;
};
template <>
struct Bits<Bf16> {
  static float load(const Bf16* p) { return mlafx::bf16_bits_to_fp32(p->bits); }
  static void store(Bf16* p, float v) { p->bits = mlafx::fp32_to_bf16_bits(v); }
  static float round(float v) { return mlafx::bf16_bits_to_fp32(mlafx::fp32_to_bf16_bits(v)); }
};

// Floats of scratch one thread's compress_entries (either form) needs.
inline int64_t compress_scratch_floats(int64_t c, int64_t m) { return 4 * c + 32 * m; }

// An entry's pooled sum (fp32, per channel) -> rounded, normed, roped, written to its slot.
template <typename T>
void finish_entry(const mlafx::V4Compress& p, int64_t n, float* acc) {
  const int64_t c = p.c;
  float square = 0.0f;
  for (int64_t j = 0; j < c; ++j) {
    acc[j] = Bits<T>::round(acc[j]);
    square += acc[j] * acc[j];
  }
  const float inv = 1.0f / std::sqrt(square / static_cast<float>(c) + p.eps);
  for (int64_t j = 0; j < c; ++j) {
    acc[j] = Bits<T>::round(p.norm_weight[j] * (acc[j] * inv));
  }
  const int64_t half = p.rope_dim / 2, base = c - p.rope_dim;
  const float* cs = p.cos + n * half;
  const float* sn = p.sin + n * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = acc[base + 2 * i], x2 = acc[base + 2 * i + 1];
    acc[base + 2 * i] = x1 * cs[i] - x2 * sn[i];
    acc[base + 2 * i + 1] = x2 * cs[i] + x1 * sn[i];
  }
  T* dst = static_cast<T*>(p.pool) + p.slots[n] * c;
  for (int64_t j = 0; j < c; ++j) Bits<T>::store(dst + j, acc[j]);
}

// Where slot s of an entry reads: its source (index into the entry's 2m sources), the column
// offset of its series, and whether it is masked (CSA's series A of window 0).
struct SlotPlan {
  int64_t slots, first;
  bool overlap;
  int64_t m, c;
  int64_t source(int64_t s) const { return first + s; }
  int64_t series(int64_t s) const { return overlap && s >= m ? c : 0; }
  bool masked(int64_t s, bool has_previous) const { return overlap && s < m && !has_previous; }
};

inline SlotPlan slot_plan(const mlafx::V4Compress& p) {
  return {p.overlap ? 2 * p.m : p.m, p.overlap ? 0 : p.m, p.overlap, p.m, p.c};
}

// Entries [n0, n1), scalar loops; scratch: compress_scratch_floats(c, m).
template <typename T>
void compress_entries(const mlafx::V4Compress& p, int64_t n0, int64_t n1, float* scratch) {
  const int64_t m = p.m, c = p.c, sw = p.sw, width = 2 * sw;
  const SlotPlan plan = slot_plan(p);
  const T* rows = static_cast<const T*>(p.rows);
  float* top = scratch;
  float* denom = scratch + c;
  float* acc = scratch + 2 * c;
  float* g = scratch + 3 * c;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t* src = p.sources + n * 2 * m;
    const bool has_previous = p.has_previous[n];
    auto gate_row = [&](int64_t s, float* out) {
      const T* row = rows + src[plan.source(s)] * width + sw + plan.series(s);
      const float* b = p.bias + (plan.source(s) % m) * sw + plan.series(s);
      for (int64_t j = 0; j < c; ++j) {
        out[j] = Bits<T>::load(row + j) + b[j];
      }
    };
    std::fill(top, top + c, kNegInf);
    for (int64_t s = 0; s < plan.slots; ++s) {
      if (plan.masked(s, has_previous)) continue;
      gate_row(s, g);
      for (int64_t j = 0; j < c; ++j) top[j] = std::max(top[j], g[j]);
    }
    std::fill(denom, denom + c, 0.0f);
    for (int64_t s = 0; s < plan.slots; ++s) {
      if (plan.masked(s, has_previous)) continue;
      gate_row(s, g);
      for (int64_t j = 0; j < c; ++j) denom[j] += std::exp(g[j] - top[j]);
    }
    std::fill(acc, acc + c, 0.0f);
    for (int64_t s = 0; s < plan.slots; ++s) {
      if (plan.masked(s, has_previous)) continue;
      gate_row(s, g);
      const T* kv = rows + src[plan.source(s)] * width + plan.series(s);
      for (int64_t j = 0; j < c; ++j) {
        const float a = Bits<T>::round(std::exp(g[j] - top[j]) / denom[j]);
        acc[j] += Bits<T>::round(Bits<T>::load(kv + j) * a);
      }
    }
    finish_entry<T>(p, n, acc);
  }
}

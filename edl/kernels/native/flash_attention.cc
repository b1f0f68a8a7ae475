// Blocked ("flash") attention for CPU training: a forward pass that keeps the log-sum-exp of
// each query row and a backward pass that recomputes the probabilities from it. The kernels
// behind edl.kernels.native.flash_attention_cpu (see that module for why they exist).
//
// Operands (row-major, as XLA:CPU hands them over):
//   q      (batch, q_len, heads, head_dim)        f32 | bf16
//   k, v   (batch, kv_len, kv_heads, head_dim)    q's dtype
//   q_ids  (batch, q_len) s32, kv_ids (batch, kv_len) s32: segment ids, or empty arrays
//          when the call has none
// Attributes: scale (f32), softcap (f32, 0: none), window (s64, 0: none), causal (bool).
// Forward results: out (q's shape and dtype), lse (batch, heads, q_len) f32.
// Backward also takes out, lse and d_out; results: dq, dk, dv (the operands' shapes, dtype).
//
// Semantics are edl.ops.attention.attention_mask + masked_attention: query i (at key
// position i + kv_len - q_len) sees key j when j <= that position (causal), that position
// minus j < window (window), and q_ids[i] == kv_ids[j] (segments). Logits, softmax and sums
// are float32; a query that sees no key gives zeros (its lse is +inf, so the backward pass
// gives it zero gradients too).
//
// Work is split over (batch, kv head) items, each holding its kv head's keys and values as
// float32 (keys also transposed, so a block of logits is a sum of rows scaled by one query
// element) and doing every query head of its group: the backward pass accumulates dk and dv
// per item, so no two threads ever write the same output.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using edl::Elem;
namespace ffi = xla::ffi;

constexpr int64_t kBlockQ = 64;  // query rows per block
constexpr int64_t kBlockK = 64;  // keys per block
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Spec {
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim;
  float scale, softcap;
  int64_t window;
  bool causal, segmented;
  int64_t kv_padded;  // kv_len rounded up to a whole block: the scratch arrays' key extent
  int64_t offset() const { return kv_len - q_len; }
  int64_t group() const { return heads / kv_heads; }
  // Keys [first, last) the query at row i may see before segments are applied.
  int64_t first(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, i + offset() - window + 1) : 0;
  }
  int64_t last(int64_t i) const {
    return causal ? std::max<int64_t>(0, std::min(kv_len, i + offset() + 1)) : kv_len;
  }
};

// Vectors through GCC / clang vector extensions, so that one source compiles for any target:
// sixteen floats (one register) where AVX-512 is there, eight elsewhere (one AVX register, two
// NEON ones). Wider vectors than the target's registers compile to slow code (measured 5x on
// AVX2), narrower ones left AVX-512 products ~1.5x slower (Zen 4).
#if defined(__AVX512F__)
#define EDL_LANES 16
#else
#define EDL_LANES 8
#endif
typedef float Lanes __attribute__((vector_size(EDL_LANES * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(EDL_LANES * sizeof(int32_t))));
typedef float EightLanes __attribute__((vector_size(8 * sizeof(float))));  // column tails
constexpr int64_t kLanes = EDL_LANES;
constexpr int64_t kCols = 16;  // columns of a product's register block: 1-2 vectors per row
static_assert(kCols % kLanes == 0 && kBlockK % kCols == 0, "blocks are whole vectors");

template <typename V>
inline V load_as(const float* p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename V>
inline void store_as(float* p, V x) {
  std::memcpy(p, &x, sizeof x);
}
inline Lanes load(const float* p) { return load_as<Lanes>(p); }
inline void store(float* p, Lanes x) { store_as(p, x); }
inline Lanes splat(float x) { return Lanes{} + x; }

inline IntLanes load_ints(const int32_t* p) {
  IntLanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// exp, lane by lane: Cody-Waite range reduction and Cephes' degree-6 polynomial (~1 ulp),
// written on lanes because compilers leave std::exp (and a scalar polynomial with a float
// floor and a bit cast) unvectorized. Inputs are clamped to [-87, 88], so -inf gives ~1e-38,
// not 0: callers mask explicitly.
inline Lanes exp_lanes(Lanes x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const Lanes magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes t = x * 1.44269504088896341f + magic;
  const Lanes n = t - magic;
  const Lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Lanes p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IntLanes two_n = ((reinterpret_cast<const IntLanes&>(t) -
                           reinterpret_cast<const IntLanes&>(magic)) + 127) << 23;
  return p * reinterpret_cast<const Lanes&>(two_n);
}

inline float sum_lanes(Lanes x) {
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += x[l];
  return total;
}

// Largest logit of a block among the visible keys (-inf when none is); `visible` null: all.
inline float masked_max(const float* logits, const float* visible) {
  Lanes m = splat(-kInf);
  for (int64_t j = 0; j < kBlockK; j += kLanes) {
    Lanes x = load(logits + j);
    if (visible != nullptr) x = load(visible + j) > splat(0.0f) ? x : splat(-kInf);
    m = x > m ? x : m;
  }
  float out = m[0];
  for (int64_t l = 1; l < kLanes; ++l) out = std::max(out, m[l]);
  return out;
}

// p = visible * exp(logits - shift) over a block's keys; returns the sum of p. `visible`
// null: every key is.
inline float exp_block(const float* logits, float shift, const float* visible, float* p) {
  Lanes total = {};
  for (int64_t j = 0; j < kBlockK; j += kLanes) {
    Lanes e = exp_lanes(load(logits + j) - shift);
    if (visible != nullptr) e *= load(visible + j);
    store(p + j, e);
    total += e;
  }
  return sum_lanes(total);
}


// Per-thread scratch, reused across a thread's items.
struct Scratch {
  std::vector<float> kt, vt;      // keys / values transposed, block by block (load_head)
  std::vector<float> kf, vf;      // (kv_padded, head_dim)
  std::vector<float> dk, dv;      // (kv_padded, head_dim): gradient accumulators
  std::vector<float> qb, ob, dob, dqb;  // (kBlockQ, head_dim)
  std::vector<float> s, p, dp;    // (kBlockQ, kBlockK)
  std::vector<float> m, l, delta, lse;  // (kBlockQ,)
  std::vector<float> tanh_s;      // (kBlockQ, kBlockK): tanh(logits / softcap)
};

// The item's kv head as float32, zero-padded to kv_padded keys: rows (kv_padded, d) and,
// when `transposed` is given, also each block of kBlockK keys transposed, (d, kBlockK), the
// blocks one after another: a block's slab is contiguous however long the sequence (a
// whole-sequence (d, kv_padded) layout put each of its d rows on another page).
template <typename T>
void load_head(const Spec& s, const T* src, int64_t b, int64_t hk, std::vector<float>& rows,
               std::vector<float>* transposed) {
  const int64_t d = s.head_dim, stride = s.kv_heads * d;
  rows.assign(s.kv_padded * d, 0.0f);
  const T* base = src + (b * s.kv_len * s.kv_heads + hk) * d;
  for (int64_t j = 0; j < s.kv_len; ++j)
    for (int64_t c = 0; c < d; ++c) rows[j * d + c] = Elem<T>::load(base[j * stride + c]);
  if (transposed == nullptr) return;
  transposed->assign(d * s.kv_padded, 0.0f);
  for (int64_t j = 0; j < s.kv_len; ++j)
    for (int64_t c = 0; c < d; ++c)
      (*transposed)[(j - j % kBlockK) * d + c * kBlockK + j % kBlockK] = rows[j * d + c];
}

// Query rows [i0, i0 + n) of head h as float32 (n, d), times `factor`.
template <typename T>
void load_rows(const Spec& s, const T* src, int64_t b, int64_t h, int64_t i0, int64_t n,
               float factor, std::vector<float>& dst) {
  const int64_t d = s.head_dim;
  for (int64_t r = 0; r < n; ++r) {
    const T* row = src + ((b * s.q_len + i0 + r) * s.heads + h) * d;
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = Elem<T>::load(row[c]) * factor;
  }
}

// c[:, j : j + kVecs * width of V] += a @ b[:, j : ...] for kRows rows: kRows x kVecs
// accumulators.
template <int64_t kRows, int64_t kVecs, typename V>
inline void gemm_columns(int64_t j, int64_t k, const float* a, int64_t a_row, int64_t a_col,
                         const float* b, int64_t ldb, float* c, int64_t ldc) {
  constexpr int64_t width = sizeof(V) / sizeof(float);
  V acc[kRows][kVecs];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t u = 0; u < kVecs; ++u) acc[r][u] = load_as<V>(c + r * ldc + j + u * width);
  for (int64_t t = 0; t < k; ++t) {
    V bt[kVecs];
    for (int64_t u = 0; u < kVecs; ++u) bt[u] = load_as<V>(b + t * ldb + j + u * width);
    for (int64_t r = 0; r < kRows; ++r) {
      const float x = a[r * a_row + t * a_col];
      for (int64_t u = 0; u < kVecs; ++u) acc[r][u] += x * bt[u];
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t u = 0; u < kVecs; ++u) store_as(c + r * ldc + j + u * width, acc[r][u]);
}

// c (kRows, m) += a (kRows, k) @ b (k, m): b and c row-major with leading dimensions ldb, ldc;
// a's element (r, t) at a[r * a_row + t * a_col], so a transposed operand needs no copy.
// Columns in blocks of kCols, a tail of 8, then scalars.
template <int64_t kRows>
inline void gemm_rows(int64_t m, int64_t k, const float* a, int64_t a_row, int64_t a_col,
                      const float* b, int64_t ldb, float* c, int64_t ldc) {
  int64_t j = 0;
  for (; j + kCols <= m; j += kCols)
    gemm_columns<kRows, kCols / kLanes, Lanes>(j, k, a, a_row, a_col, b, ldb, c, ldc);
  for (; j + 8 <= m; j += 8)
    gemm_columns<kRows, 1, EightLanes>(j, k, a, a_row, a_col, b, ldb, c, ldc);
  for (; j < m; ++j)
    for (int64_t r = 0; r < kRows; ++r) {
      float acc = c[r * ldc + j];
      for (int64_t t = 0; t < k; ++t) acc += a[r * a_row + t * a_col] * b[t * ldb + j];
      c[r * ldc + j] = acc;
    }
}

constexpr int64_t kGroup = 4;  // rows per register block

inline void gemm_strided(int64_t n, int64_t m, int64_t k, const float* a, int64_t a_row,
                         int64_t a_col, const float* b, int64_t ldb, float* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup)
    gemm_rows<kGroup>(m, k, a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc);
  for (; i < n; ++i) gemm_rows<1>(m, k, a + i * a_row, a_row, a_col, b, ldb, c + i * ldc, ldc);
}

// c (n, m) += a (n, k) @ b (k, m), a row-major with leading dimension lda.
inline void gemm(int64_t n, int64_t m, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc) {
  gemm_strided(n, m, k, a, lda, 1, b, ldb, c, ldc);
}

// The causal mask's shape within a block, for the products below: a group of query rows
// sees no key of the block at or past keys_seen (rounded up to whole register blocks, at
// most kBlockK), and a key is seen by no query row before rows_from. Products over a
// block's diagonal so skip about half their work; what they skip is masked (zero) anyway.
inline int64_t keys_seen(const Spec& s, int64_t i_last, int64_t j0) {
  const int64_t end = std::min(s.last(i_last), s.kv_len) - j0;
  const int64_t rounded = (std::max<int64_t>(0, end) + kCols - 1) / kCols * kCols;
  return std::min(kBlockK, rounded);
}
inline int64_t rows_from(const Spec& s, int64_t j, int64_t i0, int64_t n) {
  return s.causal ? std::min(n, std::max<int64_t>(0, j - s.offset() - i0)) : 0;
}

// out (n, kBlockK) += a (n, k) @ b (k, kBlockK) (b: a block's transposed slab), each group
// of rows only over the keys it may see.
inline void gemm_seen_keys_out(const Spec& s, int64_t i0, int64_t n, int64_t j0, int64_t k,
                               const float* a, const float* b, float* out) {
  for (int64_t r = 0; r < n; r += kGroup) {
    const int64_t rows = std::min(kGroup, n - r), m = keys_seen(s, i0 + r + rows - 1, j0);
    if (m > 0) gemm(rows, m, k, a + r * k, k, b, kBlockK, out + r * kBlockK, kBlockK);
  }
}

// c (n, d) += p (n, kBlockK) @ x (kBlockK, d) (x: the block's key rows), each group of rows
// only over the keys it may see.
inline void gemm_seen_keys_in(const Spec& s, int64_t i0, int64_t n, int64_t j0, int64_t d,
                              const float* p, const float* x, float* c) {
  for (int64_t r = 0; r < n; r += kGroup) {
    const int64_t rows = std::min(kGroup, n - r), k = keys_seen(s, i0 + r + rows - 1, j0);
    if (k > 0) gemm(rows, d, k, p + r * kBlockK, kBlockK, x, d, c + r * d, d);
  }
}

// c (kBlockK, d) += p^T (kBlockK, n) @ x (n, d): each group of keys only over the query rows
// that may see it.
inline void gemm_seen_rows(const Spec& s, int64_t i0, int64_t n, int64_t j0, int64_t d,
                           const float* p, const float* x, float* c) {
  for (int64_t j = 0; j < kBlockK; j += kGroup) {
    const int64_t from = rows_from(s, j0 + j, i0, n);
    if (from < n)
      gemm_strided(kGroup, d, n - from, p + from * kBlockK + j, 1, kBlockK, x + from * d, d,
                   c + j * d, d);
  }
}

// Whether query row i sees key j0 + j, for the block's kBlockK keys (1.0f / 0.0f) written
// to `out` and returned; null when it sees every key of the block (no mask to apply).
inline const float* visible_keys(const Spec& s, const int32_t* q_ids, const int32_t* kv_ids,
                                 int64_t b, int64_t i, int64_t j0, float* out) {
  const int32_t lo = static_cast<int32_t>(s.first(i) - j0);
  const int32_t hi = static_cast<int32_t>(std::min(s.last(i), s.kv_len) - j0);
  if (!s.segmented && lo <= 0 && hi >= kBlockK) return nullptr;  // the whole block
  const int32_t qid = s.segmented ? q_ids[b * s.q_len + i] : 0;
  const int32_t* kid = s.segmented ? kv_ids + b * s.kv_len + j0 : nullptr;
  if (s.segmented && j0 + kBlockK > s.kv_len) {  // the last block: ids end before it does
    for (int64_t j = 0; j < kBlockK; ++j)
      out[j] = (j >= lo && j < hi && kid[j] == qid) ? 1.0f : 0.0f;
    return out;
  }
  IntLanes iota;
  for (int l = 0; l < kLanes; ++l) iota[l] = l;
  for (int64_t j = 0; j < kBlockK; j += kLanes) {
    const IntLanes at = iota + static_cast<int32_t>(j);
    IntLanes seen = (at >= lo) & (at < hi);
    if (s.segmented) seen &= load_ints(kid + j) == qid;
    store(out + j, seen ? splat(1.0f) : splat(0.0f));
  }
  return out;
}

// Key blocks [first, last) that any of query rows [i0, i1) may see.
inline void key_blocks(const Spec& s, int64_t i0, int64_t i1, int64_t& first, int64_t& last) {
  first = s.first(i0) / kBlockK;
  last = (std::max(s.last(i1 - 1), s.first(i0)) + kBlockK - 1) / kBlockK;
}

// Logits of a block: a @ kt (already scaled through a), soft-capped when asked; keeps
// tanh(logits / softcap) in tanh_s for the backward pass.
inline void logits_block(const Spec& s, const float* qb, int64_t i0, int64_t n,
                         const float* kt, int64_t j0, float* out, float* tanh_s) {
  std::fill(out, out + n * kBlockK, 0.0f);
  gemm_seen_keys_out(s, i0, n, j0, s.head_dim, qb, kt + j0 * s.head_dim, out);
  if (s.softcap <= 0.0f) return;
  for (int64_t e = 0; e < n * kBlockK; ++e) {
    const float t = std::tanh(out[e] / s.softcap);
    tanh_s[e] = t;
    out[e] = s.softcap * t;
  }
}

template <typename T>
void forward_item(const Spec& s, const T* q, const T* k, const T* v, const int32_t* q_ids,
                  const int32_t* kv_ids, T* out, float* lse, int64_t b, int64_t hk,
                  Scratch& w) {
  const int64_t d = s.head_dim;
  load_head(s, k, b, hk, w.kf, &w.kt);
  load_head(s, v, b, hk, w.vf, nullptr);
  w.qb.resize(kBlockQ * d);
  w.ob.resize(kBlockQ * d);
  w.s.resize(kBlockQ * kBlockK);
  w.p.resize(kBlockQ * kBlockK);
  w.tanh_s.resize(kBlockQ * kBlockK);
  w.m.resize(kBlockQ);
  w.l.resize(kBlockQ);
  float visible[kBlockK];
  for (int64_t h = hk * s.group(); h < (hk + 1) * s.group(); ++h) {
    for (int64_t i0 = 0; i0 < s.q_len; i0 += kBlockQ) {
      const int64_t n = std::min(kBlockQ, s.q_len - i0);
      load_rows(s, q, b, h, i0, n, s.scale, w.qb);
      std::fill(w.ob.begin(), w.ob.begin() + n * d, 0.0f);
      std::fill(w.m.begin(), w.m.end(), -kInf);
      std::fill(w.l.begin(), w.l.end(), 0.0f);
      int64_t first, last;
      key_blocks(s, i0, i0 + n, first, last);
      for (int64_t jb = first; jb < last; ++jb) {
        const int64_t j0 = jb * kBlockK;
        logits_block(s, w.qb.data(), i0, n, w.kt.data(), j0, w.s.data(), w.tanh_s.data());
        for (int64_t r = 0; r < n; ++r) {
          float* sr = w.s.data() + r * kBlockK;
          float* pr = w.p.data() + r * kBlockK;
          const float* seen = visible_keys(s, q_ids, kv_ids, b, i0 + r, j0, visible);
          const float m_new = std::max(w.m[r], masked_max(sr, seen));
          if (m_new == -kInf) {  // nothing visible yet: this block adds nothing
            std::fill(pr, pr + kBlockK, 0.0f);
            continue;
          }
          const float alpha = w.m[r] == -kInf ? 0.0f : std::exp(w.m[r] - m_new);
          const float sum = exp_block(sr, m_new, seen, pr);
          w.l[r] = w.l[r] * alpha + sum;
          w.m[r] = m_new;
          float* orow = w.ob.data() + r * d;
          for (int64_t c = 0; c < d; ++c) orow[c] *= alpha;
        }
        // ob += p @ v[j0 : j0 + kBlockK]
        gemm_seen_keys_in(s, i0, n, j0, d, w.p.data(), w.vf.data() + j0 * d, w.ob.data());
      }
      for (int64_t r = 0; r < n; ++r) {
        const float l = w.l[r];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* dst = out + ((b * s.q_len + i0 + r) * s.heads + h) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = Elem<T>::store(w.ob[r * d + c] * inv);
        lse[(b * s.heads + h) * s.q_len + i0 + r] = l > 0.0f ? w.m[r] + std::log(l) : kInf;
      }
    }
  }
}

template <typename T>
void backward_item(const Spec& s, const T* q, const T* k, const T* v, const int32_t* q_ids,
                   const int32_t* kv_ids, const T* out, const float* lse, const T* d_out,
                   T* dq, T* dk, T* dv, int64_t b, int64_t hk, Scratch& w) {
  const int64_t d = s.head_dim;
  load_head(s, k, b, hk, w.kf, &w.kt);
  load_head(s, v, b, hk, w.vf, &w.vt);
  w.dk.assign(s.kv_padded * d, 0.0f);
  w.dv.assign(s.kv_padded * d, 0.0f);
  for (auto* buffer : {&w.qb, &w.ob, &w.dob, &w.dqb}) buffer->resize(kBlockQ * d);
  for (auto* buffer : {&w.s, &w.p, &w.dp, &w.tanh_s}) buffer->resize(kBlockQ * kBlockK);
  w.delta.resize(kBlockQ);
  w.lse.resize(kBlockQ);
  float visible[kBlockK];
  for (int64_t h = hk * s.group(); h < (hk + 1) * s.group(); ++h) {
    for (int64_t i0 = 0; i0 < s.q_len; i0 += kBlockQ) {
      const int64_t n = std::min(kBlockQ, s.q_len - i0);
      load_rows(s, q, b, h, i0, n, s.scale, w.qb);
      load_rows(s, out, b, h, i0, n, 1.0f, w.ob);
      load_rows(s, d_out, b, h, i0, n, 1.0f, w.dob);
      std::fill(w.dqb.begin(), w.dqb.begin() + n * d, 0.0f);
      for (int64_t r = 0; r < n; ++r) {
        float delta = 0.0f;
        for (int64_t c = 0; c < d; ++c) delta += w.dob[r * d + c] * w.ob[r * d + c];
        w.delta[r] = delta;
        w.lse[r] = lse[(b * s.heads + h) * s.q_len + i0 + r];
      }
      int64_t first, last;
      key_blocks(s, i0, i0 + n, first, last);
      for (int64_t jb = first; jb < last; ++jb) {
        const int64_t j0 = jb * kBlockK;
        logits_block(s, w.qb.data(), i0, n, w.kt.data(), j0, w.s.data(), w.tanh_s.data());
        std::fill(w.dp.begin(), w.dp.end(), 0.0f);
        gemm_seen_keys_out(s, i0, n, j0, d, w.dob.data(), w.vt.data() + j0 * d, w.dp.data());
        // p = softmax probabilities; s becomes dS, the gradient of the (capped) logits
        // carried back through the cap: p * (dp - delta) * (1 - tanh^2).
        for (int64_t r = 0; r < n; ++r) {
          const float* seen = visible_keys(s, q_ids, kv_ids, b, i0 + r, j0, visible);
          float* sr = w.s.data() + r * kBlockK;
          float* pr = w.p.data() + r * kBlockK;
          const float* dpr = w.dp.data() + r * kBlockK;
          const float row_lse = w.lse[r], delta = w.delta[r];
          if (row_lse == kInf) {
            std::fill(pr, pr + kBlockK, 0.0f);
            std::fill(sr, sr + kBlockK, 0.0f);
            continue;
          }
          exp_block(sr, row_lse, seen, pr);
          for (int64_t j = 0; j < kBlockK; j += kLanes)
            store(sr + j, load(pr + j) * (load(dpr + j) - delta));
          if (s.softcap > 0.0f) {
            const float* tr = w.tanh_s.data() + r * kBlockK;
            for (int64_t j = 0; j < kBlockK; ++j) sr[j] *= 1.0f - tr[j] * tr[j];
          }
        }
        // dv += p^T dob; dk += ds^T qb (qb carries the scale); dqb += ds k (scaled when
        // written). Rows of p / ds past n are stale: only the first n are read.
        gemm_seen_rows(s, i0, n, j0, d, w.p.data(), w.dob.data(), w.dv.data() + j0 * d);
        gemm_seen_rows(s, i0, n, j0, d, w.s.data(), w.qb.data(), w.dk.data() + j0 * d);
        gemm_seen_keys_in(s, i0, n, j0, d, w.s.data(), w.kf.data() + j0 * d, w.dqb.data());
      }
      for (int64_t r = 0; r < n; ++r) {
        T* dst = dq + ((b * s.q_len + i0 + r) * s.heads + h) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = Elem<T>::store(w.dqb[r * d + c] * s.scale);
      }
    }
  }
  const int64_t stride = s.kv_heads * d;
  T* dk_base = dk + (b * s.kv_len * s.kv_heads + hk) * d;
  T* dv_base = dv + (b * s.kv_len * s.kv_heads + hk) * d;
  for (int64_t j = 0; j < s.kv_len; ++j) {
    for (int64_t c = 0; c < d; ++c) {
      dk_base[j * stride + c] = Elem<T>::store(w.dk[j * d + c]);
      dv_base[j * stride + c] = Elem<T>::store(w.dv[j * d + c]);
    }
  }
}

// Shapes, dtypes and segment ids checked; on success fills `s`.
ffi::Error make_spec(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const ffi::Buffer<ffi::S32>& q_ids, const ffi::Buffer<ffi::S32>& kv_ids,
                     float scale, float softcap, int64_t window, bool causal, Spec& s) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("edl flash_attention_cpu: q, k, v must be 4-d");
  for (size_t a = 0; a < 4; ++a)
    if (kd[a] != vd[a])
      return ffi::Error::InvalidArgument("edl flash_attention_cpu: k and v differ in shape");
  if (kd[0] != qd[0] || kd[3] != qd[3] || kd[2] <= 0 || qd[2] % kd[2] != 0)
    return ffi::Error::InvalidArgument("edl flash_attention_cpu: inconsistent q / k shapes");
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("edl flash_attention_cpu: q, k, v differ in dtype");
  s = Spec{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], scale, softcap, window, causal, false, 0};
  s.kv_padded = (s.kv_len + kBlockK - 1) / kBlockK * kBlockK;
  s.segmented = q_ids.element_count() > 0;
  if (s.segmented && (static_cast<int64_t>(q_ids.element_count()) != s.batch * s.q_len ||
                      static_cast<int64_t>(kv_ids.element_count()) != s.batch * s.kv_len))
    return ffi::Error::InvalidArgument("edl flash_attention_cpu: segment ids' shapes");
  return ffi::Error::Success();
}

template <typename T>
const T* data(const ffi::AnyBuffer& x) {
  return static_cast<const T*>(x.untyped_data());
}
template <typename T>
T* data(ffi::Result<ffi::AnyBuffer>& x) {
  return static_cast<T*>(x->untyped_data());
}

template <typename T>
void forward(const Spec& s, ffi::ThreadPool& pool, const ffi::AnyBuffer& q,
             const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const int32_t* q_ids,
             const int32_t* kv_ids, ffi::Result<ffi::AnyBuffer>& out, float* lse) {
  const T *qp = data<T>(q), *kp = data<T>(k), *vp = data<T>(v);
  T* op = data<T>(out);
  edl::parallel_items<Scratch>(pool, s.batch * s.kv_heads, [=](int64_t item, Scratch& w) {
    forward_item<T>(s, qp, kp, vp, q_ids, kv_ids, op, lse, item / s.kv_heads,
                    item % s.kv_heads, w);
  });
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_ids,
                       ffi::Buffer<ffi::S32> kv_ids, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, float softcap,
                       int64_t window, bool causal) {
  Spec s;
  ffi::Error error = make_spec(q, k, v, q_ids, kv_ids, scale, softcap, window, causal, s);
  if (error.failure()) return error;
  const int32_t *qi = q_ids.typed_data(), *ki = kv_ids.typed_data();
  float* lp = lse->typed_data();
  switch (q.element_type()) {
    case ffi::F32:
      forward<float>(s, pool, q, k, v, qi, ki, out, lp);
      return ffi::Error::Success();
    case ffi::BF16:
      forward<uint16_t>(s, pool, q, k, v, qi, ki, out, lp);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("edl flash_attention_cpu: dtype must be f32 or bf16");
  }
}

template <typename T>
void backward(const Spec& s, ffi::ThreadPool& pool, const ffi::AnyBuffer& q,
              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const int32_t* q_ids,
              const int32_t* kv_ids, const ffi::AnyBuffer& out, const float* lse,
              const ffi::AnyBuffer& d_out, ffi::Result<ffi::AnyBuffer>& dq,
              ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv) {
  const T *qp = data<T>(q), *kp = data<T>(k), *vp = data<T>(v), *op = data<T>(out);
  const T* dop = data<T>(d_out);
  T *dqp = data<T>(dq), *dkp = data<T>(dk), *dvp = data<T>(dv);
  edl::parallel_items<Scratch>(pool, s.batch * s.kv_heads, [=](int64_t item, Scratch& w) {
    backward_item<T>(s, qp, kp, vp, q_ids, kv_ids, op, lse, dop, dqp, dkp, dvp,
                     item / s.kv_heads, item % s.kv_heads, w);
  });
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_ids,
                        ffi::Buffer<ffi::S32> kv_ids, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, float scale, float softcap,
                        int64_t window, bool causal) {
  Spec s;
  ffi::Error error = make_spec(q, k, v, q_ids, kv_ids, scale, softcap, window, causal, s);
  if (error.failure()) return error;
  if (out.element_type() != q.element_type() || d_out.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("edl flash_attention_cpu: out / d_out dtype");
  const int32_t *qi = q_ids.typed_data(), *ki = kv_ids.typed_data();
  switch (q.element_type()) {
    case ffi::F32:
      backward<float>(s, pool, q, k, v, qi, ki, out, lse.typed_data(), d_out, dq, dk, dv);
      return ffi::Error::Success();
    case ffi::BF16:
      backward<uint16_t>(s, pool, q, k, v, qi, ki, out, lse.typed_data(), d_out, dq, dk, dv);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("edl flash_attention_cpu: dtype must be f32 or bf16");
  }
}

// The operands both passes take first: q, k, v and the segment ids.
inline auto bind_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()           // q
      .Arg<ffi::AnyBuffer>()           // k
      .Arg<ffi::AnyBuffer>()           // v
      .Arg<ffi::Buffer<ffi::S32>>()    // q_ids
      .Arg<ffi::Buffer<ffi::S32>>();   // kv_ids
}

// The attributes both passes take last (edl.kernels.native's _attrs).
template <typename Binding>
auto bind_attributes(Binding binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("window")
      .template Attr<bool>("causal");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EdlFlashAttentionForward, ForwardImpl,
                              bind_attributes(bind_operands()
                                                  .Ret<ffi::AnyBuffer>()           // out
                                                  .Ret<ffi::Buffer<ffi::F32>>()));  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(EdlFlashAttentionBackward, BackwardImpl,
                              bind_attributes(bind_operands()
                                                  .Arg<ffi::AnyBuffer>()           // out
                                                  .Arg<ffi::Buffer<ffi::F32>>()    // lse
                                                  .Arg<ffi::AnyBuffer>()           // d_out
                                                  .Ret<ffi::AnyBuffer>()           // dq
                                                  .Ret<ffi::AnyBuffer>()           // dk
                                                  .Ret<ffi::AnyBuffer>()));        // dv

// Paged attention for a few new tokens per row, read from the page pool in place: the CPU
// kernel behind edl.kernels.native.paged_attention_cpu (see that module for why it exists).
//
// Operands (row-major, as XLA:CPU hands them over):
//   q          (batch, new_tokens, heads, head_dim)                       f32 | bf16
//   k_pages    (layers, num_pages, page_size, kv_heads, head_dim)         same dtype as q
//   v_pages    (layers, num_pages, page_size, kv_heads, head_dim)         same dtype as q
//   page_table (batch, pages_per_seq)                                     s32
//   lengths    (batch,)                                                   s32
//   layer      ()                                                         s32
// Attributes: scale (f32), softcap (f32, 0: none), window (s64, 0: none).
// Result:     (batch, new_tokens, heads, head_dim), q's dtype.
//
// EdlPagedAttentionQuantized reads quantized pools (edl.ops.kv_quant: an int8 / fp8 KV
// cache) instead: k_pages / v_pages hold codes (s8 or f8e4m3fn) and two more operands follow
// them, k_scales / v_scales (layers, num_pages, page_size, kv_heads, 1) f32, one scale per
// token and kv head. A position's codes are dequantized (code * scale, float32) into a
// per-thread buffer of one position's kv heads as the kernel reads it, never a copy of the
// pool; the float kernel's loops are the same code (templated on the pool's reader).
//
// Semantics are edl.ops.cached_attention.cache_mask + masked_attention over each row's
// gathered pages: row b's query i sits at position q = lengths[b] - new_tokens + i and sees
// key positions p with p <= q, p < lengths[b], p < pages_per_seq * page_size and, with a
// window, q - p < window; a query that sees nothing gives zeros. Logits, softmax and sums are
// float32; with bf16 operands the probabilities are rounded to bf16 before the value sum, as
// the reference does. Page ids are clamped into the pool (XLA's gather clamps too); pages at
// or past a row's length are never read.
//
// Work is split over items, rows or (row, block of kv heads), shared by the calling thread and
// helpers from XLA's intra-op thread pool; an item reads its pages' positions in order, so
// within a page the memory it reads is contiguous.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using edl::Elem;
namespace ffi = xla::ffi;

inline float code_value(int8_t c) { return static_cast<float>(c); }

// fp8 e4m3fn bits -> float32: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN. Integer arithmetic without branches or selects, so the
// dequantizing loop vectorizes (a table lookup, or ternaries that compiled to branches, ran
// 10-60x slower), and no float32 subnormal is formed (XLA's threads may flush them).
inline float code_value(uint8_t c) {
  const uint32_t b = c, exponent = (b >> 3) & 15u, mantissa = b & 7u;
  const uint32_t normal = (exponent + 15u) >> 4;  // 1 unless the exponent field is 0
  // (8 + m) * 2^(e - 10) for a normal code, m * 2^-9 = m * 2^(1 - 10) for a subnormal one.
  const float digits = static_cast<float>(static_cast<int32_t>(mantissa + 8u * normal));
  const uint32_t power_bits = (exponent + (1u - normal) + 117u) << 23;
  float power;
  std::memcpy(&power, &power_bits, sizeof power);
  const float magnitude = digits * power;
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  const uint32_t nan = ((b & 127u) + 1u) >> 7;  // 1 for S.1111.111
  bits |= ((b & 128u) << 24) | (nan * 0x7fc00000u);
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Readers of one position's (kv heads [j0, j1)) n contiguous elements at element `offset`
// of a pool, as float32. A float32 pool hands out its own memory; bf16 converts into
// `buffer`.
template <typename T>
struct PlainPool {
  const T* data;
  const float* row(int64_t offset, int64_t n, int64_t, float* buffer) const {
    return Elem<T>::row(data + offset, n, buffer);
  }
};

// Codes C (int8_t, or uint8_t holding fp8 e4m3fn bits) with one float32 scale per head_dim
// elements: element `offset` (a multiple of head_dim) has its scale at offset / head_dim.
template <typename C>
struct QuantizedPool {
  const C* codes;
  const float* scales;
  const float* row(int64_t offset, int64_t n, int64_t d, float* buffer) const {
    const float* scale = scales + offset / d;
    for (int64_t h = 0; h < n / d; ++h) {
      const C* src = codes + offset + h * d;
      float* dst = buffer + h * d;
      const float sh = scale[h];
      for (int64_t c = 0; c < d; ++c) dst[c] = code_value(src[c]) * sh;
    }
    return buffer;
  }
};

struct Shape {
  int64_t batch, new_tokens, heads, head_dim;
  int64_t num_pages, page_size, kv_heads, pages_per_seq;
  int64_t layer;  // already checked to be in range
  float scale, softcap;
  int64_t window;
};

// One item: row b's queries of kv heads [j0, j1) (their new_tokens * (j1 - j0) * group query
// rows) against the row's pages. Within a page the item reads the positions' (j1 - j0) *
// head_dim contiguous values one after another.
template <typename T, typename Pool>
void attend_item(const Shape& s, const T* q, const Pool& k, const Pool& v, const int32_t* table,
                 const int32_t* lengths, T* out, int64_t b, int64_t j0, int64_t j1,
                 std::vector<float>& logits, std::vector<float>& acc, std::vector<float>& qf,
                 std::vector<float>& buffer) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t heads = (j1 - j0) * group, rows = s.new_tokens * heads;
  const int64_t capacity = s.pages_per_seq * s.page_size;
  const int64_t length = lengths[b];
  const int64_t keys = std::max<int64_t>(0, std::min(length, capacity));

  // Query row r = i * heads + h: token i, head j0 * group + h (kv head j0 + h / group).
  qf.assign(rows * d, 0.0f);
  for (int64_t i = 0; i < s.new_tokens; ++i) {
    const T* src = q + ((b * s.new_tokens + i) * s.heads + j0 * group) * d;
    float* dst = qf.data() + i * heads * d;
    for (int64_t c = 0; c < heads * d; ++c) dst[c] = Elem<T>::load(src[c]);
  }
  // The key range token i sees: [first_of(i), last_of(i)).
  auto first_of = [&](int64_t i) -> int64_t {
    const int64_t qpos = length - s.new_tokens + i;
    return s.window > 0 ? std::max<int64_t>(0, qpos - s.window + 1) : 0;
  };
  auto last_of = [&](int64_t i) -> int64_t {
    const int64_t qpos = length - s.new_tokens + i;
    return std::max<int64_t>(0, std::min(keys, qpos + 1));
  };
  int64_t lo = keys, hi = 0;
  for (int64_t i = 0; i < s.new_tokens; ++i) {
    if (first_of(i) < last_of(i)) {
      lo = std::min(lo, first_of(i));
      hi = std::max(hi, last_of(i));
    }
  }
  const int64_t span = std::max<int64_t>(0, hi - lo);
  logits.assign(rows * std::max<int64_t>(span, 1), 0.0f);
  acc.assign(rows * d, 0.0f);

  const int64_t pos_stride = s.kv_heads * d;  // between positions within a page
  const int64_t page_stride = s.page_size * pos_stride;
  const int64_t layer_offset = s.layer * s.num_pages * page_stride + j0 * d;
  buffer.resize((j1 - j0) * d);  // a bf16 or quantized position converted to float32
  auto position = [&](const Pool& pool, int64_t p) -> const float* {
    int64_t page = table[b * s.pages_per_seq + p / s.page_size];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), s.num_pages - 1);
    const int64_t at = layer_offset + page * page_stride + (p % s.page_size) * pos_stride;
    return pool.row(at, (j1 - j0) * d, d, buffer.data());
  };

  // Pass 1: logits.
  for (int64_t p = lo; p < hi; ++p) {
    const float* kp = position(k, p);
    for (int64_t i = 0; i < s.new_tokens; ++i) {
      if (p < first_of(i) || p >= last_of(i)) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t r = i * heads + h;
        const float* qr = qf.data() + r * d;
        const float* kh = kp + (h / group) * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qr[c] * kh[c];
        float x = dot * s.scale;
        if (s.softcap > 0.0f) x = s.softcap * std::tanh(x / s.softcap);
        logits[r * span + (p - lo)] = x;
      }
    }
  }
  // Softmax per query row over the keys its token sees.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / heads;
    const int64_t a = first_of(i), e = last_of(i);
    if (a >= e) continue;
    float* row = logits.data() + r * span - lo;  // row[p]: position p's logit
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = a; p < e; ++p) m = std::max(m, row[p]);
    float sum = 0.0f;
    for (int64_t p = a; p < e; ++p) sum += (row[p] = std::exp(row[p] - m));
    const float inv = 1.0f / sum;
    for (int64_t p = a; p < e; ++p) row[p] = Elem<T>::round(row[p] * inv);
  }
  // Pass 2: probability-weighted values, only over seen keys (stale data elsewhere).
  for (int64_t p = lo; p < hi; ++p) {
    const float* vp = position(v, p);
    for (int64_t i = 0; i < s.new_tokens; ++i) {
      if (p < first_of(i) || p >= last_of(i)) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t r = i * heads + h;
        const float w = logits[r * span + (p - lo)];
        const float* vh = vp + (h / group) * d;
        float* ar = acc.data() + r * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) ar[c] += w * vh[c];
      }
    }
  }
  for (int64_t i = 0; i < s.new_tokens; ++i) {
    T* dst = out + ((b * s.new_tokens + i) * s.heads + j0 * group) * d;
    const float* src = acc.data() + i * heads * d;
    for (int64_t c = 0; c < heads * d; ++c) dst[c] = Elem<T>::store(src[c]);
  }
}

struct Scratch {
  std::vector<float> logits, acc, qf, buffer;
};

template <typename T, typename Pool>
void run(const Shape& s, const T* q, const Pool& k, const Pool& v, const int32_t* table,
         const int32_t* lengths, T* out, ffi::ThreadPool& pool) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Whole rows (every kv head: a position's values are contiguous) where there are rows
  // enough to keep every thread busy, else rows cut into blocks of kv heads.
  const int64_t head_blocks =
      std::min(s.kv_heads, std::max<int64_t>(1, (2 * threads + s.batch - 1) / s.batch));
  const int64_t per_block = (s.kv_heads + head_blocks - 1) / head_blocks;
  edl::parallel_items<Scratch>(pool, s.batch * head_blocks, [=](int64_t item, Scratch& w) {
    const int64_t b = item / head_blocks, j0 = (item % head_blocks) * per_block;
    const int64_t j1 = std::min(s.kv_heads, j0 + per_block);
    if (j0 < j1)
      attend_item<T, Pool>(s, q, k, v, table, lengths, out, b, j0, j1, w.logits, w.acc, w.qf,
                           w.buffer);
  });
}

// The shapes both handlers take, checked (an error naming the problem, else Success).
ffi::Error checked_shape(ffi::AnyBuffer& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                         ffi::Buffer<ffi::S32>& page_table, ffi::Buffer<ffi::S32>& layer,
                         float scale, float softcap, int64_t window, Shape& s) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "edl paged_attention_cpu: expected q 4-d, pools 5-d, page table 2-d");
  s = Shape{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[3], td[1], 0, scale, softcap, window};
  const int64_t layers = kd[0];
  s.layer = layer.typed_data()[0];
  if (s.layer < 0 || s.layer >= layers)
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: layer out of range");
  if (kd[4] != s.head_dim || s.heads % s.kv_heads != 0 || td[0] != s.batch)
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: inconsistent shapes");
  auto vd = v_pages.dimensions();
  if (!std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: k and v pools differ in shape");
  return ffi::Error::Success();
}

// run<T> over q of element type `type` (f32 or bf16) with pool readers made by make(T{}).
template <typename Make>
ffi::Error run_typed(ffi::DataType type, const Shape& s, ffi::AnyBuffer& q,
                     ffi::Buffer<ffi::S32>& table, ffi::Buffer<ffi::S32>& lengths,
                     ffi::Result<ffi::AnyBuffer>& out, ffi::ThreadPool& pool, Make make) {
  const int32_t* tab = table.typed_data();
  const int32_t* lens = lengths.typed_data();
  switch (type) {
    case ffi::F32: {
      auto [k, v] = make(float{});
      run(s, static_cast<const float*>(q.untyped_data()), k, v, tab, lens,
          static_cast<float*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    }
    case ffi::BF16: {
      auto [k, v] = make(uint16_t{});
      run(s, static_cast<const uint16_t*>(q.untyped_data()), k, v, tab, lens,
          static_cast<uint16_t*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    }
    default:
      return ffi::Error::InvalidArgument("edl paged_attention_cpu: q must be f32 or bf16");
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                              int64_t window) {
  Shape s{};
  if (auto e = checked_shape(q, k_pages, v_pages, page_table, layer, scale, softcap, window, s);
      e.failure())
    return e;
  if (q.element_type() != k_pages.element_type() || q.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: q and pools differ in dtype");
  return run_typed(q.element_type(), s, q, page_table, lengths, out, pool, [&](auto t) {
    using T = decltype(t);
    return std::pair{PlainPool<T>{static_cast<const T*>(k_pages.untyped_data())},
                     PlainPool<T>{static_cast<const T*>(v_pages.untyped_data())}};
  });
}

ffi::Error QuantizedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                         ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> page_table,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                         ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                         int64_t window) {
  Shape s{};
  if (auto e = checked_shape(q, k_pages, v_pages, page_table, layer, scale, softcap, window, s);
      e.failure())
    return e;
  auto kd = k_pages.dimensions();
  for (auto* scales : {&k_scales, &v_scales}) {
    auto sd = scales->dimensions();
    if (sd.size() != 5 || sd[4] != 1 || !std::equal(kd.begin(), kd.end() - 1, sd.begin()))
      return ffi::Error::InvalidArgument(
          "edl paged_attention_cpu: scales must be the pools' shape with a last dim of 1");
  }
  const float* ks = k_scales.typed_data();
  const float* vs = v_scales.typed_data();
  const ffi::DataType codes = k_pages.element_type();
  if (v_pages.element_type() != codes)
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: k and v codes differ in dtype");
  auto pools = [&](auto c) {
    using C = decltype(c);
    return [&, ks, vs](auto) {
      return std::pair{QuantizedPool<C>{static_cast<const C*>(k_pages.untyped_data()), ks},
                       QuantizedPool<C>{static_cast<const C*>(v_pages.untyped_data()), vs}};
    };
  };
  switch (codes) {
    case ffi::S8:
      return run_typed(q.element_type(), s, q, page_table, lengths, out, pool, pools(int8_t{}));
    case ffi::F8E4M3FN:
      return run_typed(q.element_type(), s, q, page_table, lengths, out, pool, pools(uint8_t{}));
    default:
      return ffi::Error::InvalidArgument(
          "edl paged_attention_cpu: quantized pools must hold s8 or f8e4m3fn codes");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EdlPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_pages
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EdlPagedAttentionQuantized, QuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k codes
                                  .Arg<ffi::AnyBuffer>()          // v codes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));

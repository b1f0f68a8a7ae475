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
#include <limits>
#include <vector>

#include "common.h"

namespace {

using edl::Elem;
namespace ffi = xla::ffi;

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
template <typename T>
void attend_item(const Shape& s, const T* q, const T* k, const T* v, const int32_t* table,
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
  buffer.resize((j1 - j0) * d);  // a bf16 position converted to float32
  auto position = [&](const T* pool, int64_t p) -> const float* {
    int64_t page = table[b * s.pages_per_seq + p / s.page_size];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), s.num_pages - 1);
    const T* at = pool + layer_offset + page * page_stride + (p % s.page_size) * pos_stride;
    return Elem<T>::row(at, (j1 - j0) * d, buffer.data());
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

template <typename T>
void run(const Shape& s, const T* q, const T* k, const T* v, const int32_t* table,
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
      attend_item<T>(s, q, k, v, table, lengths, out, b, j0, j1, w.logits, w.acc, w.qf,
                     w.buffer);
  });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                              int64_t window) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "edl paged_attention_cpu: expected q 4-d, pools 5-d, page table 2-d");
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[3], td[1], 0, scale, softcap, window};
  const int64_t layers = kd[0];
  s.layer = layer.typed_data()[0];
  if (s.layer < 0 || s.layer >= layers)
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: layer out of range");
  if (kd[4] != s.head_dim || s.heads % s.kv_heads != 0 || td[0] != s.batch)
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: inconsistent shapes");
  if (q.element_type() != k_pages.element_type() || q.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("edl paged_attention_cpu: q and pools differ in dtype");
  const int32_t* table = page_table.typed_data();
  const int32_t* lens = lengths.typed_data();
  switch (q.element_type()) {
    case ffi::F32:
      run<float>(s, static_cast<const float*>(q.untyped_data()),
                 static_cast<const float*>(k_pages.untyped_data()),
                 static_cast<const float*>(v_pages.untyped_data()), table, lens,
                 static_cast<float*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    case ffi::BF16:
      run<uint16_t>(s, static_cast<const uint16_t*>(q.untyped_data()),
                    static_cast<const uint16_t*>(k_pages.untyped_data()),
                    static_cast<const uint16_t*>(v_pages.untyped_data()), table, lens,
                    static_cast<uint16_t*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("edl paged_attention_cpu: dtype must be f32 or bf16");
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

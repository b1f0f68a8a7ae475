// What edl's native CPU kernels share: bfloat16 conversion, element access by dtype, and a
// work-sharing loop over items on XLA's intra-op thread pool.
#ifndef EDL_KERNELS_NATIVE_COMMON_H_
#define EDL_KERNELS_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace edl {

namespace ffi = xla::ffi;

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Element access by storage type: float, or uint16_t holding bfloat16 bits.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }
  // A row as float32: the source's own memory, no copy.
  static const float* row(const float* src, int64_t, float*) { return src; }
};
template <>
struct Elem<uint16_t> {
  static float load(uint16_t x) { return bf16_to_f32(x); }
  static uint16_t store(float x) { return f32_to_bf16(x); }
  static float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
  static const float* row(const uint16_t* src, int64_t d, float* buffer) {
    for (int64_t c = 0; c < d; ++c) buffer[c] = bf16_to_f32(src[c]);
    return buffer;
  }
};

// Items are claimed from a shared counter; helpers that start after all are claimed return
// at once, and the caller waits only for items in progress (it never waits on a helper that
// has not started, so a busy or one-thread pool cannot deadlock it).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

// Runs body(item, scratch) for every item in [0, total) on the calling thread and up to
// one helper per pool thread; each thread owns one default-constructed Scratch. body must
// be copyable; a copy held by a helper that starts late is never called.
template <typename Scratch, typename Body>
void parallel_items(ffi::ThreadPool& pool, int64_t total, const Body& body) {
  auto work = std::make_shared<Work>();
  work->total = total;
  auto worker = [work, body] {
    Scratch scratch;
    for (;;) {
      const int64_t item = work->next.fetch_add(1);
      if (item >= work->total) return;
      body(item, scratch);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, total - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([worker] { worker(); });
  worker();
  while (work->done.load(std::memory_order_acquire) < total) {
    // Items still in progress on helpers; yield in case one was descheduled on a busy CPU.
    std::this_thread::yield();
  }
}

}  // namespace edl

#endif  // EDL_KERNELS_NATIVE_COMMON_H_

// What the CPU kernels share: element loads as float32, AVX-512 helpers with portable fallbacks,
// and work sharing over XLA's intra-op thread pool (the FFI ThreadPool context).
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LLMJAX_AVX512 1
#else
#define LLMJAX_AVX512 0
#endif

// AVX-512 VNNI: vpdpbusd, int8 dot products (qmatmul's activations, attention's int8 keys).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLMJAX_VNNI 1
#else
#define LLMJAX_VNNI 0
#endif

#include "xla/ffi/api/ffi.h"

namespace llmjax_cpu {
namespace ffi = xla::ffi;

// bfloat16 is the upper half of a float32.
inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Loads n elements of type T (float or uint16_t bf16) as float32 into out.
template <typename T>
inline void load_f32(const T* src, float* out, int64_t n);

template <>
inline void load_f32<float>(const float* src, float* out, int64_t n) {
  std::memcpy(out, src, n * sizeof(float));
}

template <>
inline void load_f32<uint16_t>(const uint16_t* src, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
}

template <typename T>
inline void store_from_f32(const float* src, T* out, int64_t n);

template <>
inline void store_from_f32<float>(const float* src, float* out, int64_t n) {
  std::memcpy(out, src, n * sizeof(float));
}

template <>
inline void store_from_f32<uint16_t>(const float* src, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(src[i]);
}

// sum_i a[i] * b[i], a in float32, b of type T, in float32.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n);

template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if LLMJAX_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if LLMJAX_AVX512
inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <>
inline float dot<uint16_t>(const float* a, const uint16_t* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if LLMJAX_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load_bf16x16(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += a[i] * bf16_to_f32(b[i]);
  return s;
}

template <>
inline float dot<int8_t>(const float* a, const int8_t* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// acc[i] += p * b[i] (b of type T).
template <typename T>
inline void axpy(float p, const T* b, float* acc, int64_t n);

template <>
inline void axpy<float>(float p, const float* b, float* acc, int64_t n) {
  int64_t i = 0;
#if LLMJAX_AVX512
  __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(b + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * b[i];
}

template <>
inline void axpy<uint16_t>(float p, const uint16_t* b, float* acc, int64_t n) {
  int64_t i = 0;
#if LLMJAX_AVX512
  __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load_bf16x16(b + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * bf16_to_f32(b[i]);
}

// Prefetches n elements from p into the caches.
template <typename E>
inline void prefetch_row(const E* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(E)); b += 64) __builtin_prefetch(c + b);
}

#if LLMJAX_AVX512
// exp(x) for x <= 0 (-inf: ~0): Cephes-style range reduction and a degree-6 polynomial
// (relative error ~2e-7 over the range softmax uses).
inline __m512 exp16(__m512 x) {
  const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);  // p * 2^k
}
#endif

// x[i] = exp(x[i] - shift) in place (exp16, vectorized on AVX-512); returns their sum.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.0f;
#if LLMJAX_AVX512
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// The CPUs this process may run on (its affinity mask), counted once.
inline int64_t usable_cpus() {
  static const int64_t n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

// Pool threads to wake beside the calling thread: XLA's intra-op pool has a thread per CPU and
// the calling thread (XLA's executor) is another, so waking them all puts one thread more than
// there are CPUs on the work: whichever is descheduled holds its chunk while the rest spin, and
// on 2 CPUs a decode step then took 60-70 ms instead of 40 (about a third of the steps).
inline int64_t max_helpers(ffi::ThreadPool& pool) {
  return std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), usable_cpus() - 1));
}

// Runs fn(i) for i in [0, n) over the calling thread and XLA's intra-op pool, in chunks; returns
// once every index is done. A pool task that starts late finds no work left and returns (the
// shared state outlives this call).
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t chunk, Fn fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  // Copies of `work` (and of fn, whose references may dangle once this call returns) outlive it
  // in late helpers, which then find no chunk left and never call fn.
  auto work = [state, n, chunk, num_chunks, fn]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < num_chunks;) {
      const int64_t end = std::min(n, (c + 1) * chunk);
      for (int64_t i = c * chunk; i < end; ++i) fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(max_helpers(pool), num_chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

// Loops over the registers of a tile are unrolled whole, so that GCC keeps them in registers.
#define LLMJAX_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
// Transposes the 16 x 16 matrix of 32-bit elements whose rows are r[0..15], in place.
[[gnu::always_inline]] inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  LLMJAX_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + k], 128-bit lane l: rows 4i .. 4i+3 of column 4l + k
  LLMJAX_UNROLL
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // then the 4 x 4 transposition of those 128-bit lanes, for each k
  LLMJAX_UNROLL
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);  // lanes 0, 2 | 0, 2
    const __m512i v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);  // lanes 1, 3 | 1, 3
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
    t[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[8 + k] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    t[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
  LLMJAX_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif  // __AVX512F__

#if LLMJAX_VNNI
// acc += the sums of 4 products u8 a x s8 b per int32 lane, in place: inline assembly, as GCC
// copies each accumulator of the intrinsic's loops through another register (and spills).
inline void dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}
#endif  // LLMJAX_VNNI

}  // namespace llmjax_cpu

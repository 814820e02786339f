// Dense float matmul for CPUs, for the small token counts of decoding: y[T, out] = x[T, in] @ W^T
// in float32, W [out, in] (one layer of a stack [L, out, in], read in place) in float32 or
// bfloat16, x float32 or bfloat16. Any in >= 1 and out >= 1 (the tails are masked loads and
// one-output tiles).
//
// What it computes:
//   W float32:  x widened to float32 (exact), products and sums in float32 (FMA).
//   W bfloat16: x rounded to bfloat16 (to nearest even), each product exact in float32, the sums
//               in float32 (vdpbf16ps, or the AMX tiles' tdpbf16ps). Both instructions treat
//               bfloat16 denormals as zero and flush float32 denormal results to zero.
//
// The AVX-512 engine (every T for float32 weights; bfloat16 weights below kAmxMinTokens tokens,
// or without AMX): register tiles of M tokens x N outputs hold M * N float32 vectors of partial
// dot products along `in` (M x N = 1 x 16 for T = 1, 2 x 8 for T = 2, else 4 x 4), 16 float32
// or 32 bfloat16 elements (one 64-byte line of each weight row) per step, reduced horizontally
// once at the end (16 vectors into one vector of 16 sums). A tile's N weight rows stay in L1
// while the token tiles of its token block (up to kTokenBlock tokens) run over them, so each
// weight is read from memory once per token block. The work is shared over XLA's thread pool as
// contiguous parts of the outputs (several per thread, taken dynamically); within a part, the
// token tiles over each tile of rows prefetch the next tile's rows into L2, spread evenly over
// their steps, and each part starts with a burst of prefetches of its first tile (up to kBurst
// bytes: the hardware's prefetchers take the rest).
//
// The AMX engine (bfloat16 weights, from kAmxMinTokens tokens, in a multiple of 32, where Linux
// grants the tiles): the weight rows are the A tiles, read in place (16 rows x 32 elements, a
// row's stride apart), and x the B tiles, packed once per call by 16-token tiles into the pair
// layout [in / 2][16 tokens][2] (64-byte aligned: tile rows that straddle cache lines load 3-4x
// slower); 2 x 2 C tiles of [16 outputs x 16 tokens] accumulate 32 outputs x 32 tokens over the
// whole row (a last single token tile: 2 x 1, with two sets of A / B tiles taking alternate
// steps, as tile registers are not renamed), transposed on the way out. Outputs past the last
// multiple of 16 go through the AVX-512 engine.
//
// int8 weights with bfloat16 x (W8A16: quantization='int8', format 'int8_a16'; or float32 x
// with round_x) take the AMX engine too, from kAmxMinTokens tokens where out is a multiple of
// 16: each block of 32 weight rows is widened to bfloat16 (exactly: |code| <= 128 has 8
// significant bits) into a per-thread buffer, once per block and token group, and multiplied as
// bfloat16 rows are; the product is the one the other engines compute (bfloat16 x widened, int8
// codes widened, products exact, float32 sums) up to the sums' rounding. (int8 weights with
// float32 x and no round_x stay on the float32 engines.)
//
// The AVX2 engine (CPUs without AVX-512; below, beside the others) works as the AVX-512 one on
// 8-lane vectors; bfloat16 weights are widened exactly and multiplied with the activations'
// bfloat16 values in float32 (no vdpbf16ps there). Without AVX2 either, the portable engine's
// scalar dot products run far slower than XLA's dot, and the model does not call the kernel.

#include <atomic>
#include <type_traits>
#include <vector>

#include "common.h"

#if LLMJAX_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMJAX_DENSE_AVX512 1
#else
#define LLMJAX_DENSE_AVX512 0
#endif

#if !LLMJAX_DENSE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define LLMJAX_DENSE_AVX2 1
#include <immintrin.h>
#else
#define LLMJAX_DENSE_AVX2 0
#endif

#if LLMJAX_DENSE_AVX512 && defined(__AVX512BF16__)
#define LLMJAX_DENSE_BF16DOT 1
#else
#define LLMJAX_DENSE_BF16DOT 0
#endif

#if LLMJAX_DENSE_BF16DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLMJAX_DENSE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LLMJAX_DENSE_AMX 0
#endif

namespace llmjax_cpu {

namespace {

constexpr int64_t kTokenBlock = 64;    // tokens per work item (AVX-512 engine)
constexpr int64_t kPartsPerWorker = 2;  // output parts per thread, for the dynamic balance
constexpr double kMinPartWork = 64 << 10;  // see units_per_part
constexpr int64_t kBurst = 16 << 10;        // bytes prefetched at once as a part starts
constexpr int64_t kAmxMinTokens = 8;    // AMX from here on (where it is usable)
constexpr int64_t kAmxGroupTiles = 16;  // 16-token tiles per AMX work item, at most

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// n elements of v's storage from a 64-byte boundary on (v grown as needed).
template <typename E>
E* aligned64(std::vector<E>& v, int64_t n) {
  v.resize(n + 64 / sizeof(E));
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<E*>((p + 63) & ~uintptr_t{63});
}

// Contiguous parts of `units` units over `groups` groups of tokens: enough items for every
// thread to take several, but none smaller than kMinPartWork of `work` (the weight bytes times
// 1 + T / 8, a guess at the cost), as waking the pool's threads costs microseconds.
int64_t units_per_part(ffi::ThreadPool& pool, int64_t units, int64_t groups, double work) {
  const int64_t workers = max_helpers(pool) + 1;  // the pool's helpers and the calling thread
  const int64_t by_work = static_cast<int64_t>(work / (kMinPartWork * groups)) + 1;
  const int64_t parts =
      std::clamp<int64_t>(std::min(ceil_div(kPartsPerWorker * workers, groups), by_work), 1, units);
  return ceil_div(units, parts);
}

double work_of(int64_t weight_bytes, int64_t T) { return weight_bytes * (1.0 + T / 8.0); }

// Tokens per chunk of a conversion of x: 64K elements at least.
int64_t convert_chunk(int64_t in) { return std::max<int64_t>(16, (1 << 16) / in); }

#if LLMJAX_DENSE_AVX512

// Loops over the registers of a tile are unrolled whole, so that GCC keeps them in registers.
#define LLMJAX_DENSE_UNROLL _Pragma("GCC unroll 16")

// Lane i of the result: the sum of v[i]'s 16 lanes, for i < n (n <= 16; lanes from n on are 0).
[[gnu::always_inline]] inline __m512 reduce16(const __m512* v, int n) {
  __m512 a[16];
  LLMJAX_DENSE_UNROLL
  for (int i = 0; i < 16; ++i) a[i] = i < n ? v[i] : _mm512_setzero_ps();
  // per 128-bit lane: [v0 + v2, w0 + w2, v1 + v3, w1 + w3] of v = a[2i], w = a[2i + 1]
  LLMJAX_DENSE_UNROLL
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  // per 128-bit lane: the lane's sums of the 4 vectors 4i .. 4i + 3, in order
  LLMJAX_DENSE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    a[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // the 4 lanes of each: (lanes 0 + 1, 2 + 3) of x, then of y, twice
  auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  };
  return fold(fold(a[0], a[1]), fold(a[2], a[3]));
}

// The engines' element types: a step takes 64 bytes of each weight row (kStep elements), loads
// the weights (W) and activations (X) as 512-bit vectors, and accumulates their products.
struct F32Kernel {  // float32 weights and activations: FMA
  using W = float;
  using X = float;
  static constexpr int64_t kStep = 16;
  static __m512 load_w(const W* p) { return _mm512_loadu_ps(p); }
  static __m512 load_x(const X* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const W* p, int64_t n) {  // n < kStep elements, the rest 0
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static __m512 load_x(const X* p, int64_t n) { return load_w(p, n); }
  [[gnu::always_inline]] static void madd(__m512& acc, __m512 x, __m512 w) {
    acc = _mm512_fmadd_ps(x, w, acc);
  }
};

#if LLMJAX_DENSE_BF16DOT
struct Bf16Kernel {  // bfloat16 weights and activations: pairs of products per float32 lane
  using W = uint16_t;
  using X = uint16_t;
  static constexpr int64_t kStep = 32;
  static __m512 load_w(const W* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 load_x(const X* p) { return load_w(p); }
  static __m512 load_w(const W* p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p));
  }
  static __m512 load_x(const X* p, int64_t n) { return load_w(p, n); }
  // acc += x[2i] w[2i] + x[2i + 1] w[2i + 1] per lane i, in place (inline assembly: GCC copies
  // the intrinsic's accumulators through other registers).
  [[gnu::always_inline]] static void madd(__m512& acc, __m512 x, __m512 w) {
    asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  }
};
#else
struct Bf16Kernel {  // no vdpbf16ps: bfloat16 weights widened, activations float32 (bf16 values)
  using W = uint16_t;
  using X = float;
  static constexpr int64_t kStep = 16;
  static __m512 load_w(const W* p) { return load_bf16x16(p); }
  static __m512 load_x(const X* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const W* p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load_x(const X* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  [[gnu::always_inline]] static void madd(__m512& acc, __m512 x, __m512 w) {
    acc = _mm512_fmadd_ps(x, w, acc);
  }
};
#endif

struct I8Kernel {  // int8 weights (the caller scales the outputs), widened exactly; float32 x
  using W = int8_t;
  using X = float;
  static constexpr int64_t kStep = 16;
  static __m512 load_w(const W* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static __m512 load_x(const X* p) { return _mm512_loadu_ps(p); }
  static __m512 load_w(const W* p, int64_t n) {
    const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static __m512 load_x(const X* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  [[gnu::always_inline]] static void madd(__m512& acc, __m512 x, __m512 w) {
    acc = _mm512_fmadd_ps(x, w, acc);
  }
};

// What a tile prefetches of the next tile's rows (p, null for nothing): N lines (as many as a
// step reads) at the steps s with s % period == phase, so that the token tiles over one tile of
// rows (period of them, phases 0, 1, ...) share the next tile's lines evenly.
struct Prefetch {
  const char* p = nullptr;
  int64_t phase = 0, period = 1;
};

// M tokens (x, x_stride apart) x N outputs (weight rows w, `in` apart) into y (y_stride apart).
template <class K, int M, int N>
void tile(const typename K::W* w, int64_t in, const typename K::X* x, int64_t x_stride, float* y,
          int64_t y_stride, Prefetch pf) {
  static_assert(M * N <= 16, "the accumulators fit one reduction");
  const typename K::W* rows[N];
  LLMJAX_DENSE_UNROLL
  for (int n = 0; n < N; ++n) rows[n] = w + n * in;
  const typename K::X* xs[M];
  LLMJAX_DENSE_UNROLL
  for (int m = 0; m < M; ++m) xs[m] = x + m * x_stride;
  __m512 acc[M * N];
  LLMJAX_DENSE_UNROLL
  for (auto& v : acc) v = _mm512_setzero_ps();

  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m512 xv[M];
    LLMJAX_DENSE_UNROLL
    for (int m = 0; m < M; ++m) xv[m] = K::load_x(xs[m] + k);
    LLMJAX_DENSE_UNROLL
    for (int n = 0; n < N; ++n) {
      const __m512 wv = K::load_w(rows[n] + k);
      LLMJAX_DENSE_UNROLL
      for (int m = 0; m < M; ++m) K::madd(acc[m * N + n], xv[m], wv);
    }
  };
  const int64_t full = in - in % K::kStep;
  int64_t k = 0;
  if (pf.p != nullptr) {
    const char* q = pf.p;
    for (int64_t wait = pf.phase; k < full; k += K::kStep, q += N * 64, --wait) {
      if (wait == 0) {
        LLMJAX_DENSE_UNROLL
        for (int n = 0; n < N; ++n) _mm_prefetch(q + n * 64, _MM_HINT_T1);
        wait = pf.period;
      }
      step(k);
    }
  }
  for (; k < full; k += K::kStep) step(k);
  if (k < in) {  // the tail, masked (the elements past `in` load as 0)
    const int64_t rest = in - k;
    __m512 wv[N];
    LLMJAX_DENSE_UNROLL
    for (int n = 0; n < N; ++n) wv[n] = K::load_w(rows[n] + k, rest);
    LLMJAX_DENSE_UNROLL
    for (int m = 0; m < M; ++m) {
      const __m512 xv = K::load_x(xs[m] + k, rest);
      LLMJAX_DENSE_UNROLL
      for (int n = 0; n < N; ++n) K::madd(acc[m * N + n], xv, wv[n]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc, M * N));
  LLMJAX_DENSE_UNROLL
  for (int m = 0; m < M; ++m) std::memcpy(y + m * y_stride, sums + m * N, N * sizeof(float));
}

// tile<K, m, N> for a run-time m <= M.
template <class K, int N, int M>
void tile_upto(int64_t m, const typename K::W* w, int64_t in, const typename K::X* x,
               int64_t x_stride, float* y, int64_t y_stride, Prefetch pf) {
  if constexpr (M > 1) {
    if (m < M) return tile_upto<K, N, M - 1>(m, w, in, x, x_stride, y, y_stride, pf);
  }
  tile<K, M, N>(w, in, x, x_stride, y, y_stride, pf);
}

template <typename E>
void prefetch_bytes(const E* p, int64_t n_elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n_elements * static_cast<int64_t>(sizeof(E)); b += 64)
    _mm_prefetch(c + b, _MM_HINT_T1);
}

// Outputs [o0, o1) for tokens [t0, t1): tiles of N rows (the rest one row at a time) x up to M
// tokens. w is the layer's [out, in], x [T, x_stride], y [T, out].
template <class K, int N, int M>
void part(const typename K::W* w, int64_t in, int64_t out, const typename K::X* x,
          int64_t x_stride, int64_t t0, int64_t t1, int64_t o0, int64_t o1, float* y) {
  const int64_t full = o0 + (o1 - o0) / N * N;
  prefetch_bytes(w + o0 * in, std::min<int64_t>(std::min<int64_t>(N, o1 - o0) * in, kBurst / sizeof(*w)));
  const int64_t passes = ceil_div(t1 - t0, M);  // token tiles over each tile of rows
  for (int64_t o = o0; o < full; o += N) {
    Prefetch pf;
    if (o + 2 * N <= full) pf = {reinterpret_cast<const char*>(w + (o + N) * in), 0, passes};
    for (int64_t t = t0; t < t1; t += M, ++pf.phase) {
      tile_upto<K, N, M>(std::min<int64_t>(M, t1 - t), w + o * in, in, x + t * x_stride, x_stride,
                         y + t * out + o, out, pf);
    }
  }
  for (int64_t o = full; o < o1; ++o) {
    for (int64_t t = t0; t < t1; t += M) {
      tile_upto<K, 1, M>(std::min<int64_t>(M, t1 - t), w + o * in, in, x + t * x_stride, x_stride,
                         y + t * out + o, out, Prefetch{});
    }
  }
}

template <class K, int N, int M>
void run_parts(ffi::ThreadPool& pool, const typename K::W* w, int64_t in, int64_t out,
               const typename K::X* x, int64_t x_stride, int64_t T, int64_t o0, int64_t o1,
               float* y) {
  const int64_t blocks = ceil_div(T, kTokenBlock), tiles = ceil_div(o1 - o0, N);
  const double work = work_of((o1 - o0) * in * sizeof(typename K::W), T);
  const int64_t rows = units_per_part(pool, tiles, blocks, work) * N;
  const int64_t parts = ceil_div(o1 - o0, rows);
  parallel_for(pool, blocks * parts, 1, [&](int64_t i) {
    const int64_t t0 = (i / parts) * kTokenBlock, p0 = o0 + (i % parts) * rows;
    part<K, N, M>(w, in, out, x, x_stride, t0, std::min(T, t0 + kTokenBlock), p0,
                  std::min(o1, p0 + rows), y);
  });
}

// The AVX-512 engine over outputs [o0, o1), with the tile shape for T.
template <class K>
void avx512_dots(ffi::ThreadPool& pool, const typename K::W* w, int64_t in, int64_t out,
                 const typename K::X* x, int64_t x_stride, int64_t T, int64_t o0, int64_t o1,
                 float* y) {
  if (T == 1)
    run_parts<K, 16, 1>(pool, w, in, out, x, x_stride, T, o0, o1, y);
  else if (T == 2)
    run_parts<K, 8, 2>(pool, w, in, out, x, x_stride, T, o0, o1, y);
  else
    run_parts<K, 4, 4>(pool, w, in, out, x, x_stride, T, o0, o1, y);
}

#if LLMJAX_DENSE_BF16DOT
// x float32 [T, in] -> bfloat16 (round to nearest even) in dst [T, in].
void to_bf16(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t in, uint16_t* dst) {
  parallel_for(pool, T, convert_chunk(in), [&](int64_t t) {
    const float* s = x + t * in;
    uint16_t* d = dst + t * in;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
    if (i < in) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (in - i)) - 1);
      _mm256_mask_storeu_epi16(d + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, s + i)));
    }
  });
}
#endif

#endif  // LLMJAX_DENSE_AVX512

#if LLMJAX_DENSE_AMX

// Whether this process may use the AMX tile registers (Linux grants them on request, once).
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// C 0-3 [16 outputs x 16 tokens] float32, A 4-5 [16 outputs x 32 bf16], B 6-7 [16 pairs x 16
// tokens x 2 bf16]: every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = 16;
    }
  }
};
const TileConfig kTiles;

inline __m512i load_pairs(const float* p) {  // 32 float32 -> 32 bf16, as 16 pairs
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}
inline __m512i load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }

// Token tile tt (tokens 16 tt .. 16 tt + 15, zeros past T) of x [T, in] as B tiles: dst
// [in / 2][16 tokens] pairs of bf16.
template <typename E>
void pack_tile(const E* x, int64_t T, int64_t in, int64_t tt, uint32_t* dst) {
  const int64_t tokens = std::min<int64_t>(16, T - tt * 16);
  for (int64_t k = 0; k < in; k += 32) {
    __m512i r[16];
    LLMJAX_DENSE_UNROLL
    for (int j = 0; j < 16; ++j)
      r[j] = j < tokens ? load_pairs(x + (tt * 16 + j) * in + k) : _mm512_setzero_si512();
    transpose16(r);
    LLMJAX_DENSE_UNROLL
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (k / 2 + i) * 16, r[i]);
  }
}

// A C tile c [16 outputs][16 tokens] into y [T, out] (at the tile's first output), transposed;
// tokens t0 .. t0 + 15 while below T.
inline void store_c(const float* c, int64_t T, int64_t t0, float* y, int64_t out) {
  __m512i r[16];
  LLMJAX_DENSE_UNROLL
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(c + j * 16);
  transpose16(r);  // r[token]: its 16 outputs
  const int64_t tokens = std::min<int64_t>(16, T - t0);
  for (int64_t j = 0; j < tokens; ++j) _mm512_storeu_si512(y + (t0 + j) * out, r[j]);
}

// NA x 16 outputs (rows a, `in` apart) x NB x 16 tokens (B tiles b, b + tile_stride), NA * NB
// <= 2, over the whole row, into y (row t0 of [T, out], column of a's first row). Two sets of
// A and B tiles (2-4 and 5-7) take alternate 32-element steps, so that one set loads while the
// other's products run (the tile registers are not renamed); C is 0 and 1. pf: pf_rows rows of
// the next block to prefetch (a line of each per step), or null.
template <int NA, int NB>
void amx_block(const uint16_t* a, int64_t in, const uint32_t* b, int64_t tile_stride, int64_t T,
               int64_t t0, float* y, int64_t out, const uint16_t* pf, int64_t pf_rows) {
  static_assert(NA * NB <= 2, "two C tiles");
  _tile_zero(0);
  if constexpr (NA * NB == 2) _tile_zero(1);
  const int64_t a_stride = in * 2;
  const uint16_t* a1 = a + 16 * in;          // NA == 2: the second 16 rows
  const uint32_t* b1 = b + tile_stride;      // NB == 2: the second 16 tokens
  auto prefetch = [&](int64_t k) __attribute__((always_inline)) {
    if (pf != nullptr) {
      for (int64_t r = 0; r < pf_rows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * in + k), _MM_HINT_T1);
    }
  };
  // One step of 32 elements from k on the tiles from 2 (set 0) or 5 (set 1): A [, A1], B [, B1].
#define LLMJAX_AMX_STEP(A, X, Y, k)                                          \
  do {                                                                       \
    _tile_loadd(A, a + (k), a_stride);                                       \
    if constexpr (NA == 2) {                                                 \
      _tile_loadd(X, a1 + (k), a_stride);                                    \
      _tile_loadd(Y, b + (k) / 2 * 16, 64);                                  \
      _tile_dpbf16ps(0, A, Y);                                               \
      _tile_dpbf16ps(1, X, Y);                                               \
    } else if constexpr (NB == 2) {                                          \
      _tile_loadd(X, b + (k) / 2 * 16, 64);                                  \
      _tile_loadd(Y, b1 + (k) / 2 * 16, 64);                                 \
      _tile_dpbf16ps(0, A, X);                                               \
      _tile_dpbf16ps(1, A, Y);                                               \
    } else {                                                                 \
      _tile_loadd(X, b + (k) / 2 * 16, 64);                                  \
      _tile_dpbf16ps(0, A, X);                                               \
    }                                                                        \
  } while (0)
  int64_t k = 0;
  for (; k + 64 <= in; k += 64) {
    prefetch(k);
    LLMJAX_AMX_STEP(2, 3, 4, k);
    prefetch(k + 32);
    LLMJAX_AMX_STEP(5, 6, 7, k + 32);
  }
  if (k < in) {
    prefetch(k);
    LLMJAX_AMX_STEP(2, 3, 4, k);
  }
#undef LLMJAX_AMX_STEP
  alignas(64) float c[2][16 * 16];  // [C tile][output][token]
  _tile_stored(0, c[0], 64);
  if constexpr (NA * NB == 2) _tile_stored(1, c[1], 64);
  for (int i = 0; i < NA * NB; ++i)
    store_c(c[i], T, t0 + (NB == 2 ? i * 16 : 0), y + (NA == 2 ? i * 16 : 0), out);
}

// 32 outputs x 32 tokens (as amx_block), for the weights' rows the dearer tiles to load: C 0-3,
// A 4-5, B 6-7, each A and B tile used twice per step (one set of tiles: loads wait for the
// products reading their registers).
void amx_block22(const uint16_t* a, int64_t in, const uint32_t* b, int64_t tile_stride, int64_t T,
                 int64_t t0, float* y, int64_t out, const uint16_t* pf, int64_t pf_rows) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = in * 2;
  const uint16_t* a1 = a + 16 * in;
  const uint32_t* b1 = b + tile_stride;
  for (int64_t k = 0; k < in; k += 32) {
    if (pf != nullptr) {
      for (int64_t r = 0; r < pf_rows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(pf + r * in + k), _MM_HINT_T1);
    }
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(6, b + k / 2 * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + k / 2 * 16, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16 * 16];  // [C tile: 2 * (outputs / 16) + tokens / 16][output][token]
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  for (int i = 0; i < 4; ++i) store_c(c[i], T, t0 + (i % 2) * 16, y + (i / 2) * 16, out);
}

// n int8 rows of `in` codes (contiguous, in % 32 == 0) widened exactly to bfloat16 in dst,
// prefetching the line kWidenAhead bytes on (before `end`) per line read: the rows of a part
// are one contiguous stream. (Prefetching a whole next block at once, 288-768 lines, stalled
// on the line fill buffers: W8A16 at 16 tokens ran at half the speed.)
constexpr int64_t kWidenAhead = 2048;
inline void widen_rows(const int8_t* w, int64_t in, int64_t n, uint16_t* dst, const int8_t* end) {
  for (int64_t i = 0; i < n * in; i += 32) {
    if (i % 64 == 0 && w + i + kWidenAhead < end)
      _mm_prefetch(reinterpret_cast<const char*>(w + i + kWidenAhead), _MM_HINT_T0);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(w + i))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(w + i + 16))));
    _mm512_store_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Outputs [o0, o1) (a multiple of 16) x token tiles [tt0, tt1), in blocks of 32 outputs (the
// last maybe 16) x 32 tokens (amx_block22) or x 16 (the last token tile, amx_block). w the
// layer's [out, in] (bfloat16, or int8 widened a block at a time), b the packed tiles (in * 16
// pairs each), y [T, out].
template <typename W>
void amx_part(const W* w, int64_t in, int64_t out, const uint32_t* b, int64_t T,
              int64_t tt0, int64_t tt1, int64_t o0, int64_t o1, float* y) {
  static_assert(std::is_same_v<W, uint16_t> || std::is_same_v<W, int8_t>);
  constexpr bool kWiden = std::is_same_v<W, int8_t>;
  thread_local std::vector<uint16_t> widened;  // int8: the block's rows as bfloat16
  uint16_t* wbuf = kWiden ? aligned64(widened, 32 * in) : nullptr;
  asm volatile("" ::: "memory");  // the tiles' loads read what pass 1 stored
  _tile_loadconfig(&kTiles);
  const int64_t tile_stride = in * 16;
  if (!kWiden)  // (int8: widen_rows streams its own)
    prefetch_bytes(w + o0 * in, std::min<int64_t>(std::min<int64_t>(32, o1 - o0) * in, kBurst / 2));
  for (int64_t o = o0; o < o1; o += 32) {
    const int64_t next = o + 32, pf_rows = std::clamp<int64_t>(o1 - next, 0, 32);
    const bool two_a = o + 32 <= o1;
    const uint16_t* a;
    if constexpr (kWiden) {
      widen_rows(w + o * in, in, two_a ? 32 : 16, wbuf, w + o1 * in);
      asm volatile("" ::: "memory");  // the tile loads read the widened rows
      a = wbuf;
    } else {
      a = w + o * in;
    }
    for (int64_t tt = tt0; tt < tt1; tt += 2) {
      // prefetch the next bfloat16 block as the first token tiles run (int8: widen_rows
      // streams its own prefetches)
      const uint16_t* pf = !kWiden && tt == tt0 && pf_rows > 0
                               ? reinterpret_cast<const uint16_t*>(w + next * in)
                               : nullptr;
      const uint32_t* bt = b + tt * tile_stride;
      if (tt + 1 < tt1) {
        if (two_a)
          amx_block22(a, in, bt, tile_stride, T, tt * 16, y + o, out, pf, pf_rows);
        else
          amx_block<1, 2>(a, in, bt, tile_stride, T, tt * 16, y + o, out, pf, pf_rows);
      } else {
        if (two_a)
          amx_block<2, 1>(a, in, bt, tile_stride, T, tt * 16, y + o, out, pf, pf_rows);
        else
          amx_block<1, 1>(a, in, bt, tile_stride, T, tt * 16, y + o, out, pf, pf_rows);
      }
    }
  }
  _tile_release();
}

template <typename W, typename E>
void amx_dots(ffi::ThreadPool& pool, const W* w, int64_t in, int64_t out, const E* x,
              int64_t T, int64_t out16, float* y) {
  const int64_t tiles = ceil_div(T, 16);
  thread_local std::vector<uint32_t> packed;  // reused by this thread's calls
  uint32_t* b = aligned64(packed, tiles * in * 16);  // tile rows that straddle lines load slowly
  parallel_for(pool, tiles, std::max<int64_t>(1, (1 << 16) / (16 * in)),  // >= 64K elements each
               [&](int64_t tt) { pack_tile(x, T, in, tt, b + tt * in * 16); });
  const int64_t groups = ceil_div(tiles, kAmxGroupTiles), blocks = ceil_div(out16, 32);
  const int64_t rows =
      units_per_part(pool, blocks, groups, work_of(out16 * in * sizeof(W), T)) * 32;
  const int64_t parts = ceil_div(out16, rows);
  parallel_for(pool, groups * parts, 1, [&](int64_t i) {
    const int64_t tt0 = (i / parts) * kAmxGroupTiles, o0 = (i % parts) * rows;
    amx_part(w, in, out, b, T, tt0, std::min(tiles, tt0 + kAmxGroupTiles), o0,
             std::min(out16, o0 + rows), y);
  });
}

#endif  // LLMJAX_DENSE_AMX

#if LLMJAX_DENSE_AVX2

// The AVX2 engine (CPUs without AVX-512: AMD Zen 2/3, Intel Haswell to Comet Lake). Register tiles
// of M tokens x N outputs hold M * N vectors of 8 float32 partial sums along `in` (1 x 8 for
// T = 1, 2 x 4 for T = 2, else 3 x 4 or 4 x 3: with the M activation vectors and one weight
// vector, within the 16 ymm registers), 8 elements of each weight row per step (float32, or bfloat16 widened exactly, with
// activations already rounded to bfloat16 values), reduced once at the end; the elements past
// the last multiple of 8 are added in scalar code. Token blocks and output parts go over the
// pool as in the AVX-512 engine, and the token tiles over a tile of rows share the prefetches
// of the next tile's lines.

#define LLMJAX_AVX2_UNROLL _Pragma("GCC unroll 8")

struct Avx2F32 {
  using W = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static float at(const float* p) { return *p; }
};

struct Avx2Bf16 {
  using W = uint16_t;
  static __m256 load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static float at(const uint16_t* p) { return bf16_to_f32(*p); }
};

struct Avx2I8 {  // int8 weights, widened exactly (the caller scales the outputs)
  using W = int8_t;
  static __m256 load(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  static float at(const int8_t* p) { return static_cast<float>(*p); }
};

// Lane i of the result: the sum of v[i]'s 8 lanes, for i < n (n <= 8; lanes from n on are 0).
[[gnu::always_inline]] inline __m256 reduce8(const __m256* v, int n) {
  __m256 a[8];
  LLMJAX_AVX2_UNROLL
  for (int i = 0; i < 8; ++i) a[i] = i < n ? v[i] : _mm256_setzero_ps();
  // per 128-bit lane: the sums of that lane's 4 elements of a[0..3] (u0) and a[4..7] (u1)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// M tokens (x, x_stride apart) x N outputs (weight rows w, `in` apart) into y (y_stride apart).
// `next` (or null): the next tile's rows, whose cache lines with index % period == phase this
// tile prefetches.
template <class K, int M, int N>
void avx2_tile(const typename K::W* w, int64_t in, const float* x, int64_t x_stride, float* y,
               int64_t y_stride, const typename K::W* next, int64_t phase, int64_t period) {
  static_assert(M * N <= 12, "the accumulators, activations and a weight fit 16 registers");
  constexpr int64_t kLine = 64 / sizeof(typename K::W);  // elements per cache line
  __m256 acc[M * N];
  LLMJAX_AVX2_UNROLL
  for (auto& v : acc) v = _mm256_setzero_ps();
  const int64_t full = in - in % 8;
  for (int64_t k = 0; k < full; k += 8) {
    if (next != nullptr && k % kLine == 0 && (k / kLine) % period == phase) {
      LLMJAX_AVX2_UNROLL
      for (int n = 0; n < N; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(next + n * in + k), _MM_HINT_T1);
    }
    __m256 xv[M];
    LLMJAX_AVX2_UNROLL
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * x_stride + k);
    LLMJAX_AVX2_UNROLL
    for (int n = 0; n < N; ++n) {
      const __m256 wv = K::load(w + n * in + k);
      LLMJAX_AVX2_UNROLL
      for (int m = 0; m < M; ++m) acc[m * N + n] = _mm256_fmadd_ps(xv[m], wv, acc[m * N + n]);
    }
  }
  alignas(32) float sums[16];
  _mm256_store_ps(sums, reduce8(acc, std::min(8, M * N)));
  if constexpr (M * N > 8) _mm256_store_ps(sums + 8, reduce8(acc + 8, M * N - 8));
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      float s = sums[m * N + n];
      for (int64_t k = full; k < in; ++k) s += x[m * x_stride + k] * K::at(w + n * in + k);
      y[m * y_stride + n] = s;
    }
  }
}

// avx2_tile<K, m, N> for a run-time m <= M.
template <class K, int N, int M>
void avx2_tile_upto(int64_t m, const typename K::W* w, int64_t in, const float* x, float* y,
                    int64_t out, const typename K::W* next, int64_t phase, int64_t period) {
  if constexpr (M > 1) {
    if (m < M) return avx2_tile_upto<K, N, M - 1>(m, w, in, x, y, out, next, phase, period);
  }
  avx2_tile<K, M, N>(w, in, x, in, y, out, next, phase, period);
}

// Outputs [o0, o1) for tokens [t0, t1): tiles of N rows (the rest one row at a time) x up to M
// tokens. w is the layer's [out, in], x [T, in], y [T, out].
template <class K, int N, int M>
void avx2_part(const typename K::W* w, int64_t in, int64_t out, const float* x, int64_t t0,
               int64_t t1, int64_t o0, int64_t o1, float* y) {
  const int64_t full = o0 + (o1 - o0) / N * N, passes = ceil_div(t1 - t0, M);
  for (int64_t o = o0; o < o1;) {
    const int n = o < full ? N : 1;
    const typename K::W* next = o + n + N <= full ? w + (o + n) * in : nullptr;
    int64_t phase = 0;
    for (int64_t t = t0; t < t1; t += M, ++phase) {
      const typename K::W* wo = w + o * in;
      const int64_t m = std::min<int64_t>(M, t1 - t);
      if (n == N)
        avx2_tile_upto<K, N, M>(m, wo, in, x + t * in, y + t * out + o, out, next, phase, passes);
      else
        avx2_tile_upto<K, 1, M>(m, wo, in, x + t * in, y + t * out + o, out, nullptr, 0, 1);
    }
    o += n;
  }
}

template <class K, int N, int M>
void avx2_run(ffi::ThreadPool& pool, const typename K::W* w, int64_t in, int64_t out,
              const float* x, int64_t T, float* y) {
  const int64_t blocks = ceil_div(T, kTokenBlock), tiles = ceil_div(out, N);
  const double work = work_of(out * in * sizeof(typename K::W), T);
  const int64_t rows = units_per_part(pool, tiles, blocks, work) * N;
  const int64_t parts = ceil_div(out, rows);
  parallel_for(pool, blocks * parts, 1, [&](int64_t i) {
    const int64_t t0 = (i / parts) * kTokenBlock, p0 = (i % parts) * rows;
    avx2_part<K, N, M>(w, in, out, x, t0, std::min(T, t0 + kTokenBlock), p0,
                       std::min(out, p0 + rows), y);
  });
}

// The register tile for T >= 3 tokens (tokens x outputs), 0 for the default; set only to compare
// them (LlmjaxDenseMatmulSetAvx2Tile, scripts/bench_dense_matmul.py --avx2_tiles).
std::atomic<int> g_avx2_tile{0};

// The AVX2 engine, with the tile shape for T. x float32 [T, in] (bfloat16 weights: its values
// rounded to bfloat16), y [T, out].
template <class K>
void avx2_dots(ffi::ThreadPool& pool, const typename K::W* w, int64_t in, int64_t out,
               const float* x, int64_t T, float* y) {
  if (T == 1) return avx2_run<K, 8, 1>(pool, w, in, out, x, T, y);
  if (T == 2) return avx2_run<K, 4, 2>(pool, w, in, out, x, T, y);
  // By default 3 tokens x 4 outputs for float32 weights, 4 x 3 for bfloat16 ones (whose widening
  // the extra token shares): scripts/bench_dense_matmul.py on a Zen 3, [576, 1536] at T = 16-32,
  // 5-20 % faster than 2 x 4 (docs/cpu_performance.md).
  int tile = g_avx2_tile.load(std::memory_order_relaxed);
  if (tile == 0) tile = sizeof(typename K::W) == 4 ? 34 : 43;  // int8 weights as bfloat16 ones
  switch (tile) {
    case 24: return avx2_run<K, 4, 2>(pool, w, in, out, x, T, y);
    case 42: return avx2_run<K, 2, 4>(pool, w, in, out, x, T, y);
    case 33: return avx2_run<K, 3, 3>(pool, w, in, out, x, T, y);
    case 43: return avx2_run<K, 3, 4>(pool, w, in, out, x, T, y);
    default: return avx2_run<K, 4, 3>(pool, w, in, out, x, T, y);
  }
}

#endif  // LLMJAX_DENSE_AVX2

#if !LLMJAX_DENSE_AVX512 && !LLMJAX_DENSE_AVX2
// The portable engine: one dot product per output (common.h's dot), outputs over the pool.
template <typename W>
void portable_dots(ffi::ThreadPool& pool, const W* w, int64_t in, int64_t out, const float* x,
                   int64_t T, float* y) {
  parallel_for(pool, out, 16, [&](int64_t o) {
    for (int64_t t = 0; t < T; ++t) y[t * out + o] = dot<W>(x + t * in, w + o * in, in);
  });
}
#endif

// x as float32 [T, in] in dst (bf16 x widened; rounded to bf16 values first when `round`).
template <typename E>
void to_f32(ffi::ThreadPool& pool, const E* x, int64_t T, int64_t in, bool round, float* dst) {
  parallel_for(pool, T, convert_chunk(in), [&](int64_t t) {
    load_f32<E>(x + t * in, dst + t * in, in);
    if (round) {
      for (int64_t i = 0; i < in; ++i) dst[t * in + i] = bf16_to_f32(f32_to_bf16(dst[t * in + i]));
    }
  });
}

// Float32 or int8 weights (W) with float32 x: the products and sums in float32 (int8 codes
// widened exactly; the caller scales the outputs), by the engine compiled for this CPU.
template <typename W>
void float_x_dots(ffi::ThreadPool& pool, const W* w, int64_t in, int64_t out, const float* x,
                  int64_t T, float* y) {
  static_assert(std::is_same_v<W, float> || std::is_same_v<W, int8_t>);
#if LLMJAX_DENSE_AVX512
  using K = std::conditional_t<std::is_same_v<W, float>, F32Kernel, I8Kernel>;
  avx512_dots<K>(pool, w, in, out, x, in, T, 0, out, y);
#elif LLMJAX_DENSE_AVX2
  using K = std::conditional_t<std::is_same_v<W, float>, Avx2F32, Avx2I8>;
  avx2_dots<K>(pool, w, in, out, x, T, y);
#else
  portable_dots(pool, w, in, out, x, T, y);
#endif
}

// The element size of an accepted weight dtype.
int64_t w_bytes(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? 2 : t == ffi::DataType::S8 ? 1 : 4;
}

// One matrix's product y [T, out] = x [T, in] @ W^T: x float32 or bfloat16 at `xv`, W [out, in]
// at `wv` of dtype `wt` (float32, bfloat16 or int8), each a row's stride apart.
void dense_product(ffi::ThreadPool& pool, const void* xv, bool x_bf16, int64_t T, int64_t in,
                   const void* wv, ffi::DataType wt, int64_t out, float* yp, bool round_x) {
  if (T == 0 || out == 0) return;
  const float* xf = static_cast<const float*>(xv);
  const uint16_t* xh = static_cast<const uint16_t*>(xv);
  thread_local std::vector<float> xf_scratch;  // reused by this thread's calls
  thread_local std::vector<uint16_t> xh_scratch;

  const bool a16 = wt == ffi::DataType::S8 && (x_bf16 || round_x);  // W8A16
#if LLMJAX_DENSE_AMX
  if (a16 && T >= kAmxMinTokens && in % 32 == 0 && out % 16 == 0 && amx_usable()) {
    if (x_bf16)  // on the tiles (float32 x rounded to bfloat16 as it is packed)
      amx_dots(pool, static_cast<const int8_t*>(wv), in, out, xh, T, out, yp);
    else
      amx_dots(pool, static_cast<const int8_t*>(wv), in, out, xf, T, out, yp);
    return;
  }
#endif
  if (wt != ffi::DataType::BF16) {  // float32 or int8 weights: x in float32 (bf16 x widened)
    if (x_bf16 || a16) {  // W8A16: float32 x's bfloat16 values
      float* buf = aligned64(xf_scratch, T * in);
      if (x_bf16)
        to_f32(pool, xh, T, in, false, buf);
      else
        to_f32(pool, xf, T, in, true, buf);
      xf = buf;
    }
    if (wt == ffi::DataType::S8)
      float_x_dots(pool, static_cast<const int8_t*>(wv), in, out, xf, T, yp);
    else
      float_x_dots(pool, static_cast<const float*>(wv), in, out, xf, T, yp);
    return;
  }

  const uint16_t* wp = static_cast<const uint16_t*>(wv);
  int64_t done = 0;  // outputs [0, done) computed
#if LLMJAX_DENSE_AMX
  if (T >= kAmxMinTokens && in % 32 == 0 && out >= 16 && amx_usable()) {
    done = out / 16 * 16;
    if (x_bf16)
      amx_dots(pool, wp, in, out, xh, T, done, yp);
    else
      amx_dots(pool, wp, in, out, xf, T, done, yp);
    if (done == out) return;
  }
#endif
#if LLMJAX_DENSE_BF16DOT
  if (!x_bf16) {
    uint16_t* buf = aligned64(xh_scratch, T * in);
    to_bf16(pool, xf, T, in, buf);
    xh = buf;
  }
  avx512_dots<Bf16Kernel>(pool, wp, in, out, xh, in, T, done, out, yp);
#else
  float* buf = aligned64(xf_scratch, T * in);  // the activations' bf16 values, as float32
  if (x_bf16)
    to_f32(pool, xh, T, in, false, buf);
  else
    to_f32(pool, xf, T, in, true, buf);
#if LLMJAX_DENSE_AVX512
  avx512_dots<Bf16Kernel>(pool, wp, in, out, buf, in, T, done, out, yp);
#elif LLMJAX_DENSE_AVX2
  avx2_dots<Avx2Bf16>(pool, wp, in, out, buf, T, yp);
#else
  portable_dots(pool, wp, in, out, buf, T, yp);
#endif
#endif
}

// The dtypes both entry points take; an error message, or nullptr.
const char* check_dtypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w) {
  const auto xt = x.element_type(), wt = w.element_type();
  if ((xt == ffi::DataType::BF16 || xt == ffi::DataType::F32) &&
      (wt == ffi::DataType::BF16 || wt == ffi::DataType::S8 || wt == ffi::DataType::F32))
    return nullptr;
  return "dense_matmul: x must be float32 or bfloat16, w float32, bfloat16 or int8";
}

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool round_x) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1] || wd[0] < 1 || xd[1] < 1)
    return ffi::Error::InvalidArgument("dense_matmul: want x [T, in], w [L, out, in]");
  if (const char* e = check_dtypes(x, w)) return ffi::Error::InvalidArgument(e);
  const int64_t T = xd[0], in = xd[1], L = wd[0], out = wd[1];
  // the layer, clamped as dynamic_slice clamps
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const auto wt = w.element_type();
  const char* wp = static_cast<const char*>(w.untyped_data()) + l * out * in * w_bytes(wt);
  dense_product(pool, x.untyped_data(), x.element_type() == ffi::DataType::BF16, T, in, wp, wt,
                out, y->typed_data(), round_x);
  return ffi::Error::Success();
}

// The grouped form (a mixture of experts' projections): rows x [M, in] in groups, group g's
// group_sizes[g] rows after group g-1's, times that group's matrix of w [L, G, out, in] (layer
// `layer`, clamped): y [M, out], each group one dense_product over its rows, so a decode step's
// few rows read only the experts they were routed to, in place. Rows past the groups give zeros;
// negative sizes count as 0, and groups reaching past M are cut at M.
ffi::Error GroupedDenseMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y, bool round_x) {
  auto xd = x.dimensions(), wd = w.dimensions(), gd = group_sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[3] != xd[1] || wd[0] < 1 || xd[1] < 1 ||
      gd.size() != 1 || gd[0] != wd[1])
    return ffi::Error::InvalidArgument(
        "grouped_dense_matmul: want x [M, in], w [L, G, out, in], group_sizes [G]");
  if (const char* e = check_dtypes(x, w)) return ffi::Error::InvalidArgument(e);
  const int64_t M = xd[0], in = xd[1], L = wd[0], G = wd[1], out = wd[2];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const auto wt = w.element_type();
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  const int64_t x_row = in * (x_bf16 ? 2 : 4), w_mat = out * in * w_bytes(wt);
  const char* xp = static_cast<const char*>(x.untyped_data());
  const char* wp = static_cast<const char*>(w.untyped_data()) + l * G * w_mat;
  float* yp = y->typed_data();
  int64_t start = 0;
  for (int64_t g = 0; g < G && start < M; ++g) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(group_sizes.typed_data()[g], 0),
                                           M - start);
    dense_product(pool, xp + start * x_row, x_bf16, rows, in, wp + g * w_mat, wt, out,
                  yp + start * out, round_x);
    start += rows;
  }
  std::fill(yp + start * out, yp + M * out, 0.0f);
  return ffi::Error::Success();
}

}  // namespace

}  // namespace llmjax_cpu

// The engine compiled for this CPU (kernels_cpu/build.py's `engines()`): 0 portable (scalar dot
// products, far slower than XLA's dot: the model then uses XLA's), 1 AVX-512, 2 AVX-512 with
// vdpbf16ps, 3 that and AMX tiles for bfloat16 weights, 4 AVX2 with FMA.
extern "C" int LlmjaxDenseMatmulEngine() {
  return LLMJAX_DENSE_AMX      ? 3
         : LLMJAX_DENSE_BF16DOT ? 2
         : LLMJAX_DENSE_AVX512  ? 1
         : LLMJAX_DENSE_AVX2    ? 4
                                : 0;
}

// The AVX2 engine's register tile for 3 tokens or more, as tokens * 10 + outputs (24, 42, 33,
// 34, 43; 0 the default), for comparing them; returns whether this library has the AVX2 engine.
extern "C" int LlmjaxDenseMatmulSetAvx2Tile(int tile) {
#if LLMJAX_DENSE_AVX2
  llmjax_cpu::g_avx2_tile.store(tile);
  return 1;
#else
  (void)tile;
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxDenseMatmul, llmjax_cpu::DenseMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<bool>("round_x"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxGroupedDenseMatmul, llmjax_cpu::GroupedDenseMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<bool>("round_x"));

// Quantized matmul for CPUs: y[T, out] = x[T, in] @ W^T in float32, W [out, in] in one of four
// formats (a "row" is one output channel o; blocks b of 32 elements run along `in`):
//   int8  values s8 [out, in],   scales [out]:     W[o, i] = values[o, i] * scales[o]
//   q8_0  values s8 [out, in],   scales [out, nb]: W[o, 32b+j] = values[o, 32b+j] * scales[o, b]
//   q4_0  values u8 [out, in/2], scales [out, nb]: byte j of block b, values[o, 16b+j], holds
//         element 32b+j in its low nibble and 32b+16+j in its high one; W = (nibble - 8) * scale
//   q4_1  as q4_0, plus mins [out, nb]:            W = nibble * scales[o, b] + mins[o, b]
//
// The activations are quantized to int8 first, once per call: per token (row of x) for int8,
// per 32-element block for the others. d = max|x| / 127 (1 where the max is 0) and
// q = rint(x / d) (ties to even), clipped to [-127, 127], all in float32, so that the reference
// (kernels_cpu/qmatmul.py) reproduces q bit for bit. Then, with int32 sums over int8 products,
//   int8:        y[t, o] = d[t] scales[o] sum_i q[t, i] values[o, i]
//   q8_0, q4_0:  y[t, o] = sum_b scales[o, b] d[t, b] sum_j q[t, b, j] w[o, b, j]
//                (w = values, or nibble - 8)
//   q4_1:        y[t, o] = sum_b (scales[o, b] d[t, b] sum_j q[t, b, j] nibble[o, b, j]
//                             + mins[o, b] d[t, b] sum_j q[t, b, j])
//
// Pass 1 quantizes x into a scratch buffer, once (tokens shared over the thread pool). Pass 2
// shares items of (up to 256 tokens) x (32 outputs) over the pool, on one of two engines:
//
// AMX (int8 tiles; where the CPU and Linux allow it, from 3-8 tokens on, use_amx): the
// weights are the A tiles, 16 output rows read in place (q4: unpacked once per item to bytes,
// q4_0 as nibble - 8), and the activations the B tiles, stored by pass 1 in 16-token tiles in
// the B layout ([in/4][16 tokens][4 bytes]), so that C = [16 outputs x 16 tokens] of int32.
// int8 accumulates C over the whole row (2 x 2 tiles: 32 outputs x 32 tokens) and scales once;
// the block formats take one 32-deep product per block and fold it into float32 accumulators
// with that block's scales (the mins term as a float term with c = d sum_j q). C is transposed
// on the way out.
//
// AVX-512 VNNI (vpdpbusd, fewer tokens, or no AMX): tiles of M <= 4 tokens x N = 4 outputs keep
// their M x N accumulators in registers over the whole of `in`, so each weight vector is loaded
// once per M tokens, and a row's weights stay in L1 over the item's tokens. vpdpbusd multiplies
// unsigned by signed bytes: nibbles are unsigned already, and signed weights are made unsigned
// by adding 128 (xor 0x80). What the 128 adds, like q4_0's -8 and q4_1's min, is a multiple of
// the activations' sum: int8 takes 128 d[t] sum_i q[t, i] off in int32; the block formats add
// sum_b a[o, b] c[t, b] with c = d sum_j q times -128 (q8_0), -8 (q4_0) or 1 (q4_1), and
// a = mins for q4_1, scales otherwise. The block formats' scratch puts 4 blocks (a group, 128
// elements) in two 64-byte vectors: the first halves of the 4 blocks, then their second halves,
// which is how a q4 group's 64 bytes unpack (v & 15, v >> 4); q8_0's weights are permuted to
// match. Each 128-bit lane of an int32 product then holds one block, and the activation scales
// are stored repeated 4x to match.

#include <new>
#include <string_view>
#include <vector>

#include "common.h"

#if LLMJAX_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define LLMJAX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LLMJAX_AMX 0
#endif

namespace llmjax_cpu {

namespace {

enum class Fmt { kInt8, kQ8_0, kQ4_0, kQ4_1 };

constexpr int64_t kBlock = 32;      // elements per block
constexpr int64_t kGroup = 4;       // blocks per group
constexpr int64_t kTileT = 4;       // tokens per register tile (M)
constexpr int64_t kTileO = 4;       // outputs per register tile (N)
constexpr int64_t kItemO = 32;      // outputs per work item
constexpr int64_t kMaxItemT = 256;  // tokens per work item, at most
constexpr int64_t kTile = 16;       // AMX: tokens per B tile, outputs per A tile

// Allocations on 64-byte boundaries: tile rows that straddle cache lines load several times slower.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;

// One layer's weights.
struct Weights {
  Fmt fmt;
  int64_t in, out, nb;  // nb: blocks per row
  const uint8_t* values;
  int64_t row_bytes;
  const float* scales;  // [out] (int8) or [out, nb]
  const float* mins;    // [out, nb] (q4_1)
  // The per-block factors of the activation-sum term: mins for q4_1, the scales otherwise.
  const float* sum_factors() const { return fmt == Fmt::kQ4_1 ? mins : scales; }
};

// The quantized activations, in one of two layouts ("rows": tokens, or for AMX 16-token tiles):
//   VNNI  per token: q in order (int8) or in the group layout (the blocks), zero-padded; d: one
//         scale (int8) or 16 per group (each block's 4x); int8: sum q; blocks: c per block
//   AMX   per 16-token tile: q as B tiles [in/4, rounded up to 16][16 tokens][4 bytes];
//         d: the 16 tokens' scale (int8) or [nb][16] (the blocks); q4_1: c [nb][16]
// Tokens past T are zero.
struct Acts {
  bool tiles;  // the AMX layout
  int64_t q_stride, d_stride, c_stride;
  AlignedVector<int8_t> q;
  AlignedVector<float> d, c;
  std::vector<int32_t> sum;
  const int8_t* q_row(int64_t r) const { return q.data() + r * q_stride; }
  const float* d_row(int64_t r) const { return d.data() + r * d_stride; }
  const float* c_row(int64_t r) const { return c.data() + r * c_stride; }
};

int64_t num_groups(int64_t nb) { return (nb + kGroup - 1) / kGroup; }
int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---- Pass 1: quantizing the activations ----

#if LLMJAX_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
#else
inline float bf16_or_f32(float x) { return x; }
inline float bf16_or_f32(uint16_t x) { return bf16_to_f32(x); }
#endif

// max |x[i]| over n elements (n a multiple of 16).
template <typename E>
float absmax(const E* x, int64_t n) {
#if LLMJAX_AVX512
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + i)));
  return _mm512_reduce_max_ps(m);
#else
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(bf16_or_f32(x[i])));
  return m;
#endif
}

// The scale of a row or block whose largest magnitude is amax.
inline float scale_of(float amax) { return amax == 0.0f ? 1.0f : amax / 127.0f; }

// q[i] = rint(x[i] / d) clipped to [-127, 127] for n elements (a multiple of 16); returns sum q.
template <typename E>
int32_t quantize(const E* x, int64_t n, float d, int8_t* q) {
#if LLMJAX_AVX512
  const __m512 dv = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i), dv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
    sum = _mm512_add_epi32(sum, v);
  }
  return _mm512_reduce_add_epi32(sum);
#else
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    float r = std::nearbyint(bf16_or_f32(x[i]) / d);
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
    sum += q[i];
  }
  return sum;
#endif
}

// int8: one token's row, in order, zero-padded to q_stride.
template <typename E>
void quantize_row(const E* x, int64_t in, Acts& a, int64_t t) {
  int8_t* q = a.q.data() + t * a.q_stride;
  const float d = scale_of(absmax(x, in));
  a.d[t] = d;
  a.sum[t] = quantize(x, in, d, q);
  std::memset(q + in, 0, a.q_stride - in);
}

// The block formats: one token's blocks in the group layout; c = factor * d * sum q per block.
template <typename E>
void quantize_blocks(const E* x, int64_t nb, float factor, Acts& a, int64_t t) {
  int8_t* q = a.q.data() + t * a.q_stride;
  float* d = a.d.data() + t * a.d_stride;
  float* c = a.c.data() + t * a.c_stride;
  std::memset(q, 0, a.q_stride);  // the last group's missing blocks stay 0
  std::fill(d, d + a.d_stride, 0.0f);
  std::fill(c, c + a.c_stride, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const E* xb = x + b * kBlock;
    const float db = scale_of(absmax(xb, kBlock));
    int8_t* first = q + (b / kGroup) * kGroup * kBlock + (b % kGroup) * 16;  // see the top
    const int32_t sum = quantize(xb, 16, db, first) + quantize(xb + 16, 16, db, first + 64);
    std::fill(d + b * 4, d + b * 4 + 4, db);
    c[b] = db * (factor * static_cast<float>(sum));
  }
}

// ---- Pass 2: the dot products ----

#if LLMJAX_VNNI

// Lane i of the result: the sum of v[i]'s 16 lanes, for i < n (n <= 16); add adds two vectors.
template <typename Add>
[[gnu::always_inline]] inline __m512i hsum16(const __m512i* v, int n, Add add) {
  __m512i a[16];
  LLMJAX_UNROLL
  for (int i = 0; i < 16; ++i) a[i] = i < n ? v[i] : _mm512_setzero_si512();
  // pairs: per 128-bit lane [v0+v2, w0+w2, v1+v3, w1+w3] of v = a[2i], w = a[2i+1]
  LLMJAX_UNROLL
  for (int i = 0; i < 8; ++i)
    a[i] = add(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
               _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  // quads: per 128-bit lane, the lane's sums of a[4i .. 4i+3]
  LLMJAX_UNROLL
  for (int i = 0; i < 4; ++i)
    a[i] = add(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
               _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  // the 4 lanes of each: lanes 0,2 + lanes 1,3, twice
  auto fold = [&](__m512i x, __m512i y) {
    return add(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xdd));
  };
  return fold(fold(a[0], a[1]), fold(a[2], a[3]));
}

struct AddEpi32 {
  __m512i operator()(__m512i x, __m512i y) const { return _mm512_add_epi32(x, y); }
};
struct AddPs {
  __m512i operator()(__m512i x, __m512i y) const {
    return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y)));
  }
};

// int8: M tokens from t0 x N outputs from o0, into y [T, out].
template <int M, int N>
void int8_tile(const Weights& w, const Acts& a, int64_t t0, int64_t o0, float* y) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* rows[N];
  LLMJAX_UNROLL
  for (int n = 0; n < N; ++n) rows[n] = w.values + (o0 + n) * w.row_bytes;
  const int8_t* xs[M];
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m) xs[m] = a.q_row(t0 + m);
  __m512i acc[M * N];
  LLMJAX_UNROLL
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t k = 0; k < w.in; k += 64) {
    const __mmask64 mask = w.in - k >= 64 ? ~0ull : (1ull << (w.in - k)) - 1;
    __m512i wv[N];
    LLMJAX_UNROLL
    for (int n = 0; n < N; ++n)  // values + 128, unsigned
      wv[n] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, rows[n] + k), bias);
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_loadu_si512(xs[m] + k);
      LLMJAX_UNROLL
      for (int n = 0; n < N; ++n) dpbusd(acc[m * N + n], wv[n], xv);
    }
  }
  alignas(64) int32_t sums[M * N];
  LLMJAX_UNROLL
  for (int i = 0; i < M * N; i += 16)
    _mm512_store_si512(sums + i, hsum16(acc + i, std::min(16, M * N - i), AddEpi32()));
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m) {
    const int64_t t = t0 + m;
    LLMJAX_UNROLL
    for (int n = 0; n < N; ++n) {
      const int32_t dot = sums[m * N + n] - 128 * a.sum[t];
      y[t * w.out + o0 + n] = static_cast<float>(dot) * (a.d[t] * w.scales[o0 + n]);
    }
  }
}

// The block formats' weights of group g of a row (`blocks` of its 4 present) as the unsigned
// bytes of the group layout: lo, the 4 blocks' first halves, hi their second halves.
template <Fmt F>
inline void load_group(const uint8_t* row, int64_t g, int64_t blocks, __m512i& lo, __m512i& hi) {
  if constexpr (F == Fmt::kQ8_0) {
    const int64_t bytes = blocks * kBlock;  // of the group's 128
    const __mmask64 m0 = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
    const __mmask64 m1 = bytes >= 128 ? ~0ull : bytes <= 64 ? 0 : (1ull << (bytes - 64)) - 1;
    const __m512i v0 = _mm512_maskz_loadu_epi8(m0, row + g * 128);  // blocks 0, 1
    const __m512i v1 = _mm512_maskz_loadu_epi8(m1, row + g * 128 + 64);  // blocks 2, 3
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i first = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);  // qwords, v1 = 8..15
    const __m512i second = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
    lo = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, first, v1), bias);
    hi = _mm512_xor_si512(_mm512_permutex2var_epi64(v0, second, v1), bias);
  } else {
    const int64_t bytes = blocks * 16;
    const __mmask64 mask = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(mask, row + g * 64);
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    lo = _mm512_and_si512(v, nibble);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}

// The block formats: M tokens from t0 x N outputs from o0, into y [T, out].
template <Fmt F, int M, int N>
void block_tile(const Weights& w, const Acts& a, int64_t t0, int64_t o0, float* y) {
  const int64_t nb = w.nb, ng = num_groups(nb);
  const __m512i repeat4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const uint8_t* rows[N];
  const float* scales[N];
  LLMJAX_UNROLL
  for (int n = 0; n < N; ++n) {
    rows[n] = w.values + (o0 + n) * w.row_bytes;
    scales[n] = w.scales + (o0 + n) * nb;
  }
  const int8_t* xs[M];
  const float* dxs[M];
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m) {
    xs[m] = a.q_row(t0 + m);
    dxs[m] = a.d_row(t0 + m);
  }
  __m512 acc[M * N];
  LLMJAX_UNROLL
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t blocks = std::min(kGroup, nb - g * kGroup);
    const __mmask8 smask = (1u << blocks) - 1;
    __m512i lo[N], hi[N];
    __m512 ds[N];  // the row's block scales, each 4x
    LLMJAX_UNROLL
    for (int n = 0; n < N; ++n) {
      load_group<F>(rows[n], g, blocks, lo[n], hi[n]);
      const __m128 s = _mm_maskz_loadu_ps(smask, scales[n] + g * kGroup);
      ds[n] = _mm512_permutexvar_ps(repeat4, _mm512_castps128_ps512(s));
    }
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) {
      const int8_t* q = xs[m] + g * kGroup * kBlock;
      const __m512i xlo = _mm512_loadu_si512(q), xhi = _mm512_loadu_si512(q + 64);
      const __m512 dx = _mm512_loadu_ps(dxs[m] + g * 16);
      LLMJAX_UNROLL
      for (int n = 0; n < N; ++n) {
        __m512i dot = _mm512_setzero_si512();
        dpbusd(dot, lo[n], xlo);
        dpbusd(dot, hi[n], xhi);
        acc[m * N + n] =
            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx), ds[n], acc[m * N + n]);
      }
    }
  }
  // + sum_b a[o, b] c[t, b], 16 blocks at a time (c is zero-padded)
  const float* factors = w.sum_factors();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 mask = nb - b >= 16 ? 0xffff : (1u << (nb - b)) - 1;
    __m512 f[N];
    LLMJAX_UNROLL
    for (int n = 0; n < N; ++n) f[n] = _mm512_maskz_loadu_ps(mask, factors + (o0 + n) * nb + b);
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) {
      const __m512 c = _mm512_loadu_ps(a.c_row(t0 + m) + b);
      LLMJAX_UNROLL
      for (int n = 0; n < N; ++n) acc[m * N + n] = _mm512_fmadd_ps(f[n], c, acc[m * N + n]);
    }
  }
  alignas(64) float sums[M * N];
  LLMJAX_UNROLL
  for (int i = 0; i < M * N; i += 16) {
    __m512i v[16];
    LLMJAX_UNROLL
    for (int j = 0; j < 16 && i + j < M * N; ++j) v[j] = _mm512_castps_si512(acc[i + j]);
    _mm512_store_si512(sums + i, hsum16(v, std::min(16, M * N - i), AddPs()));
  }
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m)
    LLMJAX_UNROLL
    for (int n = 0; n < N; ++n) y[(t0 + m) * w.out + o0 + n] = sums[m * N + n];
}

template <Fmt F, int M, int N>
void tile(const Weights& w, const Acts& a, int64_t t0, int64_t o0, float* y) {
  if constexpr (F == Fmt::kInt8)
    int8_tile<M, N>(w, a, t0, o0, y);
  else
    block_tile<F, M, N>(w, a, t0, o0, y);
}

#else  // portable: one (token, output) at a time, from the same scratch

template <Fmt F, int M, int N>
void tile(const Weights& w, const Acts& a, int64_t t0, int64_t o0, float* y) {
  for (int m = 0; m < M; ++m) {
    const int64_t t = t0 + m;
    const int8_t* q = a.q_row(t);
    for (int n = 0; n < N; ++n) {
      const int64_t o = o0 + n;
      const uint8_t* row = w.values + o * w.row_bytes;
      float out;
      if constexpr (F == Fmt::kInt8) {
        int32_t dot = 0;
        for (int64_t i = 0; i < w.in; ++i) dot += q[i] * static_cast<int8_t>(row[i]);
        out = static_cast<float>(dot) * (a.d[t] * w.scales[o]);
      } else {
        out = 0.0f;
        for (int64_t b = 0; b < w.nb; ++b) {
          const int8_t* first = q + (b / kGroup) * kGroup * kBlock + (b % kGroup) * 16;
          int32_t dot = 0;  // over w = values, or the nibbles (q4_0's -8 is in c)
          for (int64_t j = 0; j < kBlock; ++j) {
            const int32_t x = j < 16 ? first[j] : first[64 + j - 16];
            int32_t v;
            if constexpr (F == Fmt::kQ8_0)
              v = static_cast<int8_t>(row[b * kBlock + j]) + 128;  // as the AVX-512 path
            else
              v = j < 16 ? row[b * 16 + j] & 15 : row[b * 16 + j - 16] >> 4;
            dot += x * v;
          }
          out += static_cast<float>(dot) * a.d_row(t)[b * 4] * w.scales[o * w.nb + b] +
                 w.sum_factors()[o * w.nb + b] * a.c_row(t)[b];
        }
      }
      y[t * w.out + o] = out;
    }
  }
}

#endif  // LLMJAX_VNNI

// The tokens [t0, t1) x outputs [o0, o0 + N), in tiles of up to kTileT tokens.
template <Fmt F, int N>
void tokens(const Weights& w, const Acts& a, int64_t t0, int64_t t1, int64_t o0, float* y) {
  int64_t t = t0;
  for (; t + kTileT <= t1; t += kTileT) tile<F, kTileT, N>(w, a, t, o0, y);
  switch (t1 - t) {
    case 3: tile<F, 3, N>(w, a, t, o0, y); break;
    case 2: tile<F, 2, N>(w, a, t, o0, y); break;
    case 1: tile<F, 1, N>(w, a, t, o0, y); break;
  }
  static_assert(kTileT == 4, "the remainder cases above");
}

template <Fmt F>
void vnni_dots(ffi::ThreadPool& pool, const Weights& w, const Acts& a, int64_t T, float* y) {
  const int64_t items_o = w.out / kItemO;
  int64_t item_t = kMaxItemT;  // smaller while that leaves the pool too few items
  while (item_t > 16 && (T + item_t - 1) / item_t * items_o < 32) item_t /= 2;
  const int64_t items_t = (T + item_t - 1) / item_t;
  parallel_for(pool, items_t * items_o, 1, [&](int64_t i) {
    const int64_t t0 = (i / items_o) * item_t, t1 = std::min(T, t0 + item_t);
    const int64_t o0 = (i % items_o) * kItemO;
    for (int64_t o = o0; o < o0 + kItemO; o += kTileO) tokens<F, kTileO>(w, a, t0, t1, o, y);
  });
}

#if LLMJAX_AMX

// Whether this process may use the AMX tile registers (Linux grants them on request, once).
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Stores tile T to the 16 x 16 int32 at c. (GCC's _tile_stored clobbers all of memory, which
// keeps the caller's float accumulators out of registers; this one names the 1 KB it writes.
// GCC's tile loads name no memory at all: whatever they read that the same function wrote
// must come before a compiler barrier, LLMJAX_STORES_DONE.)
#define LLMJAX_TILE_STORED(T, c)                                             \
  asm volatile("tilestored %%tmm" #T ", (%1,%2,1)"                           \
               : "=m"(*reinterpret_cast<int32_t(*)[kTile * kTile]>(c))       \
               : "r"(c), "r"(int64_t{64}))
#define LLMJAX_STORES_DONE() asm volatile("" ::: "memory")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};
  TileConfig& tile(int i, int r, int bytes) {
    rows[i] = r;
    colsb[i] = bytes;
    return *this;
  }
};

// int8: C 0-3 [16 outputs x 16 tokens] int32, A 4-5 [16 outputs x 64 bytes], B 6-7 [16 x 64].
const TileConfig kInt8Tiles = TileConfig()
                                  .tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, 16, 64)
                                  .tile(4, 16, 64).tile(5, 16, 64).tile(6, 16, 64).tile(7, 16, 64);
// The blocks: C 0-3, A 4-5 [16 outputs x 32 bytes: one block], B 6-7 [8 x 64: its 32 x 16 tokens].
const TileConfig kBlockTiles = TileConfig()
                                   .tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, 16, 64)
                                   .tile(4, 16, 32).tile(5, 16, 32).tile(6, 8, 64).tile(7, 8, 64);

// Pass 1 for AMX: token tile tt (16 tokens from 16 tt, zero past T) quantized into the B layout.
// Each token's q is made in order into rows [16][kq], then every 64 bytes of the 16 rows are
// transposed as 16 x 16 dwords: the 16 B-tile rows of those 64 elements.
template <typename E>
void quantize_tile(const E* x, const Weights& w, int64_t T, Acts& a, int64_t tt) {
  const int64_t in = w.in, kq = a.q_stride / kTile;  // kq: in rounded up to 64
  const int64_t tokens = std::min(kTile, T - tt * kTile);
  thread_local AlignedVector<int8_t> rows;
  rows.assign(kTile * kq, 0);
  float* d = a.d.data() + tt * a.d_stride;
  float* c = a.c.data() + tt * a.c_stride;
  std::fill(d, d + a.d_stride, 0.0f);
  std::fill(c, c + a.c_stride, 0.0f);
  for (int64_t j = 0; j < tokens; ++j) {
    const E* xt = x + (tt * kTile + j) * in;
    int8_t* q = rows.data() + j * kq;
    if (w.fmt == Fmt::kInt8) {
      d[j] = scale_of(absmax(xt, in));
      quantize(xt, in, d[j], q);
      continue;
    }
    for (int64_t b = 0; b < w.nb; ++b) {
      const float db = scale_of(absmax(xt + b * kBlock, kBlock));
      const int32_t sum = quantize(xt + b * kBlock, kBlock, db, q + b * kBlock);
      d[b * kTile + j] = db;
      if (w.fmt == Fmt::kQ4_1) c[b * kTile + j] = db * static_cast<float>(sum);
    }
  }
  int8_t* out = a.q.data() + tt * a.q_stride;
  for (int64_t k = 0; k < kq; k += 64) {
    __m512i r[16];
    LLMJAX_UNROLL
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows.data() + j * kq + k);
    transpose16(r);
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (k / 4 + i) * 64, r[i]);
  }
}

// Rows r[o] (16 outputs from o0, lanes: the 16 tokens of tile tt) into y, transposed.
inline void store_transposed(__m512i r[16], const Weights& w, int64_t T, int64_t tt, int64_t o0,
                             float* y) {
  transpose16(r);
  const int64_t tokens = std::min(kTile, T - tt * kTile);
  for (int64_t j = 0; j < tokens; ++j)
    _mm512_storeu_ps(y + (tt * kTile + j) * w.out + o0, _mm512_castsi512_ps(r[j]));
}

// int8: C tile kC (outputs from o0, token tile tt) scaled by d[t] scales[o] into y.
template <int kC>
void int8_out(const Weights& w, const Acts& a, int64_t T, int64_t tt, int64_t o0, float* y) {
  alignas(64) int32_t c[kTile * kTile];
  // (literal tile numbers: the tile instructions spell them into their assembly)
  if constexpr (kC == 0) LLMJAX_TILE_STORED(0, c);
  if constexpr (kC == 1) LLMJAX_TILE_STORED(1, c);
  if constexpr (kC == 2) LLMJAX_TILE_STORED(2, c);
  if constexpr (kC == 3) LLMJAX_TILE_STORED(3, c);
  const __m512 d = _mm512_loadu_ps(a.d_row(tt));
  __m512i r[16];
  LLMJAX_UNROLL
  for (int o = 0; o < 16; ++o) {
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(w.scales[o0 + o]));
    r[o] = _mm512_castps_si512(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + o * kTile)), scale));
  }
  store_transposed(r, w, T, tt, o0, y);
}

// int8: outputs [o0, o0 + 32) x token tiles tt (and tt + 1 when kTiles = 2), over all of `in`.
template <int kTiles>
void amx_int8(const Weights& w, const Acts& a, int64_t T, int64_t tt, int64_t o0, float* y) {
  alignas(64) thread_local uint8_t tail[2 * kTile * 64];  // the last 32 columns of 32 rows, zero-padded
  const int8_t* b0 = a.q_row(tt);
  const int8_t* b1 = a.q_row(tt + kTiles - 1);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < w.in; k += 64) {
    const uint8_t* A = w.values + o0 * w.row_bytes + k;
    int64_t stride = w.row_bytes;
    if (k + 2 * 64 < w.in) {  // tile loads that miss L1 stall: bring two steps on into it
      for (int64_t r = 0; r < 2 * kTile; ++r) _mm_prefetch(A + 2 * 64 + r * stride, _MM_HINT_T0);
      for (int64_t r = 0; r < kTile; ++r) {
        _mm_prefetch(b0 + (k + 2 * 64) * kTile + r * 64, _MM_HINT_T0);
        if constexpr (kTiles == 2) _mm_prefetch(b1 + (k + 2 * 64) * kTile + r * 64, _MM_HINT_T0);
      }
    }
    if (w.in - k < 64) {
      for (int64_t r = 0; r < 2 * kTile; ++r) {
        std::memcpy(tail + r * 64, A + r * stride, 32);
        std::memset(tail + r * 64 + 32, 0, 32);
      }
      LLMJAX_STORES_DONE();
      A = tail;
      stride = 64;
    }
    // Tiles are not renamed: a load waits for the products reading its tile. In this order
    // each load follows the products that last read its tile by one or two products.
    _tile_loadd(4, A, stride);
    _tile_loadd(6, b0 + k * kTile, 64);  // B rows k/4 ..: 64 bytes each
    _tile_dpbssd(0, 4, 6);
    if constexpr (kTiles == 2) {
      _tile_loadd(7, b1 + k * kTile, 64);
      _tile_dpbssd(2, 4, 7);
    }
    _tile_loadd(5, A + kTile * stride, stride);
    _tile_dpbssd(1, 5, 6);
    if constexpr (kTiles == 2) _tile_dpbssd(3, 5, 7);
  }
  int8_out<0>(w, a, T, tt, o0, y);
  int8_out<1>(w, a, T, tt, o0 + kTile, y);
  if constexpr (kTiles == 2) {
    int8_out<2>(w, a, T, tt + 1, o0, y);
    int8_out<3>(w, a, T, tt + 1, o0 + kTile, y);
  }
}

// q4: 16 rows from o0 as bytes, [16][in], each block's 32 in order (q4_0: nibble - 8, signed).
template <Fmt F>
void unpack_q4(const Weights& w, int64_t o0, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);  // lo 0-1, hi 0-1, ...
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t ng = num_groups(w.nb);
  for (int64_t o = 0; o < kTile; ++o) {
    const uint8_t* row = w.values + (o0 + o) * w.row_bytes;
    uint8_t* dst = out + o * w.in;
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t bytes = std::min(kGroup, w.nb - g * kGroup) * kBlock;  // unpacked
      const __mmask64 m0 = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
      const __mmask64 m1 = bytes >= 128 ? ~0ull : bytes <= 64 ? 0 : (1ull << (bytes - 64)) - 1;
      const __mmask64 packed = bytes >= 128 ? ~0ull : (1ull << (bytes / 2)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(packed, row + g * 64);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      __m512i p0 = _mm512_permutex2var_epi64(lo, first, hi);  // blocks 0, 1 of the group
      __m512i p1 = _mm512_permutex2var_epi64(lo, second, hi);  // blocks 2, 3
      if constexpr (F == Fmt::kQ4_0) {
        p0 = _mm512_sub_epi8(p0, eight);
        p1 = _mm512_sub_epi8(p1, eight);
      }
      _mm512_mask_storeu_epi8(dst + g * 128, m0, p0);
      _mm512_mask_storeu_epi8(dst + g * 128 + 64, m1, p1);
    }
  }
}

// A block's product, A (16 rows of the block) x B (its 32 x 16 tokens), into c, on the tiles
// of slot kSlot: C = kSlot, A = 4 + kSlot % 2, B = 6 + kSlot % 2.
template <Fmt F, int kSlot>
inline void block_product(const uint8_t* A, int64_t a_stride, const int8_t* B, int32_t* c) {
#define LLMJAX_PRODUCT(TC, TA, TB)          \
  _tile_zero(TC);                           \
  _tile_loadd(TA, A, a_stride);             \
  _tile_loadd(TB, B, 64);                   \
  if constexpr (F == Fmt::kQ4_1)            \
    _tile_dpbusd(TC, TA, TB); /* nibbles */ \
  else                                      \
    _tile_dpbssd(TC, TA, TB);               \
  LLMJAX_TILE_STORED(TC, c);
  if constexpr (kSlot == 0) {
    LLMJAX_PRODUCT(0, 4, 6)
  } else if constexpr (kSlot == 1) {
    LLMJAX_PRODUCT(1, 5, 7)
  } else if constexpr (kSlot == 2) {
    LLMJAX_PRODUCT(2, 4, 6)
  } else {
    LLMJAX_PRODUCT(3, 5, 7)
  }
#undef LLMJAX_PRODUCT
}

// The blocks: 16 outputs from o0 (their A rows at A, a_stride apart) x token tile tt, into y.
// Each block's int32 product goes through memory (tiles have no way into vector registers) to
// be folded into float32 accumulators, acc[o] += d_w[o] d_x C[o] (+ m[o] c). The tile unit (a
// product or a store: about 16 cycles each, whatever K) runs 4 blocks ahead of the folding: the
// products of blocks b + 4 .. b + 7 go to one set of 4 buffers while blocks b .. b + 3 are
// folded from the other. (GCC keeps acc in memory around the tile instructions, so a group of
// 4 is folded in one pass: one load and store of acc per 4 blocks.)
template <Fmt F>
void amx_blocks(const Weights& w, const Acts& a, const uint8_t* A, int64_t a_stride, int64_t T,
                int64_t tt, int64_t o0, float* y) {
  const int64_t nb = w.nb;
  const int8_t* B = a.q_row(tt);
  const float* dx = a.d_row(tt);
  const float* c = a.c_row(tt);
  const float* scales = w.scales + o0 * nb;
  const float* mins = F == Fmt::kQ4_1 ? w.mins + o0 * nb : nullptr;
  alignas(64) int32_t prod[2][kGroup][kTile * kTile];
  __m512 acc[16];
  LLMJAX_UNROLL
  for (auto& v : acc) v = _mm512_setzero_ps();
  const int64_t b_bytes = kBlock * kTile;  // one block's B rows
  auto issue = [&](int64_t g) {  // the products of group g's blocks into prod[g % 2]
    const int64_t b = g * kGroup;
    int32_t(*p)[kTile * kTile] = prod[g % 2];
#define LLMJAX_ISSUE(S) \
  if (b + (S) < nb) block_product<F, S>(A + (b + (S)) * kBlock, a_stride, B + (b + (S)) * b_bytes, p[S]);
    LLMJAX_ISSUE(0)
    LLMJAX_ISSUE(1)
    LLMJAX_ISSUE(2)
    LLMJAX_ISSUE(3)
#undef LLMJAX_ISSUE
  };
  // acc[o] += block b's term for row o, from its product p
  auto fold = [&](__m512& acc, int o, int64_t b, const int32_t* p) [[gnu::always_inline]] {
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scales[o * nb + b]), _mm512_loadu_ps(dx + b * kTile));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(p + o * kTile)), s, acc);
    if constexpr (F == Fmt::kQ4_1)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(mins[o * nb + b]), _mm512_loadu_ps(c + b * kTile), acc);
  };
  const int64_t ng = num_groups(nb);
  issue(0);
  for (int64_t g = 0; g < ng; ++g) {
    if (g + 1 < ng) issue(g + 1);
    const int64_t b = g * kGroup;
    int32_t(*p)[kTile * kTile] = prod[g % 2];
    if (b + kGroup <= nb) {
      LLMJAX_UNROLL
      for (int o = 0; o < 16; ++o) {
        LLMJAX_UNROLL
        for (int k = 0; k < kGroup; ++k) fold(acc[o], o, b + k, p[k]);
      }
    } else {
      for (int64_t k = 0; b + k < nb; ++k) {
        LLMJAX_UNROLL
        for (int o = 0; o < 16; ++o) fold(acc[o], o, b + k, p[k]);
      }
    }
  }
  __m512i r[16];
  LLMJAX_UNROLL
  for (int o = 0; o < 16; ++o) r[o] = _mm512_castps_si512(acc[o]);
  store_transposed(r, w, T, tt, o0, y);
}

template <Fmt F>
void amx_dots(ffi::ThreadPool& pool, const Weights& w, const Acts& a, int64_t T, float* y) {
  const int64_t tiles = (T + kTile - 1) / kTile, items_o = w.out / kItemO;
  int64_t item_tiles = kMaxItemT / kTile;  // fewer while that leaves the pool too few items
  while (item_tiles > 1 && (tiles + item_tiles - 1) / item_tiles * items_o < 32) item_tiles /= 2;
  const int64_t items_t = (tiles + item_tiles - 1) / item_tiles;
  parallel_for(pool, items_t * items_o, 1, [&](int64_t i) {
    const int64_t tt0 = (i / items_o) * item_tiles, tt1 = std::min(tiles, tt0 + item_tiles);
    const int64_t o0 = (i % items_o) * kItemO;
    if constexpr (F == Fmt::kInt8) {
      _tile_loadconfig(&kInt8Tiles);
      for (int64_t tt = tt0; tt < tt1; tt += 2) {
        if (tt + 1 < tt1)
          amx_int8<2>(w, a, T, tt, o0, y);
        else
          amx_int8<1>(w, a, T, tt, o0, y);
      }
    } else {
      _tile_loadconfig(&kBlockTiles);
      thread_local AlignedVector<uint8_t> unpacked;
      for (int64_t o = o0; o < o0 + kItemO; o += kTile) {
        const uint8_t* A = w.values + o * w.row_bytes;
        int64_t a_stride = w.row_bytes;
        if constexpr (F != Fmt::kQ8_0) {
          unpacked.resize(kTile * w.in);
          unpack_q4<F>(w, o, unpacked.data());
          LLMJAX_STORES_DONE();
          A = unpacked.data();
          a_stride = w.in;
        }
        for (int64_t tt = tt0; tt < tt1; ++tt) amx_blocks<F>(w, a, A, a_stride, T, tt, o, y);
      }
    }
    _tile_release();
  });
}

#endif  // LLMJAX_AMX

// Whether a call of T tokens takes the AMX path (and so the tile layout): where a 16-token tile
// costs less than the VNNI path's T tokens (measured on Sapphire Rapids, one core, 576 x 1536
// and 1536 x 576: from 3 tokens for int8, 4 for q8_0, 8 for q4, which unpacks its weights).
bool use_amx(Fmt fmt, int64_t T) {
#if LLMJAX_AMX
  const int64_t min_tokens = fmt == Fmt::kInt8 ? 3 : fmt == Fmt::kQ8_0 ? 4 : 8;
  return T >= min_tokens && amx_usable();
#else
  return false;
#endif
}

template <typename E>
void quantize_all(ffi::ThreadPool& pool, const E* x, const Weights& w, int64_t T, Acts& a) {
#if LLMJAX_AMX
  if (a.tiles) {
    parallel_for(pool, (T + kTile - 1) / kTile, 1,
                 [&](int64_t tt) { quantize_tile(x, w, T, a, tt); });
    return;
  }
#endif
  const float factor = w.fmt == Fmt::kQ8_0 ? -128.0f : w.fmt == Fmt::kQ4_0 ? -8.0f : 1.0f;
  parallel_for(pool, T, 16, [&](int64_t t) {
    if (w.fmt == Fmt::kInt8)
      quantize_row(x + t * w.in, w.in, a, t);
    else
      quantize_blocks(x + t * w.in, w.nb, factor, a, t);
  });
}

template <Fmt F>
void dots(ffi::ThreadPool& pool, const Weights& w, const Acts& a, int64_t T, float* y) {
#if LLMJAX_AMX
  if (a.tiles) return amx_dots<F>(pool, w, a, T, y);
#endif
  vnni_dots<F>(pool, w, a, T, y);
}

bool parse(std::string_view name, Fmt& fmt) {
  if (name == "int8") fmt = Fmt::kInt8;
  else if (name == "q8_0") fmt = Fmt::kQ8_0;
  else if (name == "q4_0") fmt = Fmt::kQ4_0;
  else if (name == "q4_1") fmt = Fmt::kQ4_1;
  else return false;
  return true;
}

// One matrix's product y [T, out] = x [T, in] @ dequantize(W)^T: the activations quantized
// (once per call, into this thread's scratch), then the dots of the format.
template <typename E>
void qmatmul_product(ffi::ThreadPool& pool, const E* x, int64_t T, const Weights& w, float* yp) {
  if (T == 0) return;
  const int64_t in = w.in;
  thread_local Acts a;  // reused by the calls on this thread; parallel_for returns when done
  a.tiles = use_amx(w.fmt, T);
  const int64_t rows = a.tiles ? (T + kTile - 1) / kTile : T;
  if (a.tiles) {
    a.q_stride = round_up(in, 64) * kTile;
    a.d_stride = w.fmt == Fmt::kInt8 ? kTile : w.nb * kTile;
    a.c_stride = w.fmt == Fmt::kQ4_1 ? w.nb * kTile : 0;
  } else if (w.fmt == Fmt::kInt8) {
    a.q_stride = round_up(in, 64);
    a.d_stride = 1;
    a.c_stride = 0;
    a.sum.resize(T);
  } else {
    a.q_stride = num_groups(w.nb) * kGroup * kBlock;
    a.d_stride = num_groups(w.nb) * 16;
    a.c_stride = round_up(w.nb, 16);
  }
  a.q.resize(rows * a.q_stride);
  a.d.resize(rows * a.d_stride);
  a.c.resize(rows * a.c_stride);
  quantize_all(pool, x, w, T, a);
  switch (w.fmt) {
    case Fmt::kInt8: dots<Fmt::kInt8>(pool, w, a, T, yp); break;
    case Fmt::kQ8_0: dots<Fmt::kQ8_0>(pool, w, a, T, yp); break;
    case Fmt::kQ4_0: dots<Fmt::kQ4_0>(pool, w, a, T, yp); break;
    case Fmt::kQ4_1: dots<Fmt::kQ4_1>(pool, w, a, T, yp); break;
  }
}

// The matrices of a stack: values [N, out, row_bytes], scales (and mins) [N, out(, nb)], checked
// against x [T, in] and the format. `lead` leading axes make up N (1: layers; 2: layers, groups).
struct Stack {
  Fmt fmt;
  int64_t in, out, row_bytes, count;
  const uint8_t* values;
  const float* scales;
  const float* mins;
  int64_t scales_per_matrix() const { return fmt == Fmt::kInt8 ? out : out * (in / kBlock); }
  Weights at(int64_t i) const {
    Weights w;
    w.fmt = fmt;
    w.in = in;
    w.out = out;
    w.nb = in / kBlock;
    w.row_bytes = row_bytes;
    w.values = values + i * out * row_bytes;
    w.scales = scales + i * scales_per_matrix();
    w.mins = fmt == Fmt::kQ4_1 ? mins + i * scales_per_matrix() : nullptr;
    return w;
  }
};

// An error message, or nullptr with `st` filled in.
const char* stack_of(std::string_view fmt_name, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& values, const ffi::Buffer<ffi::F32>& scales,
                     const ffi::Buffer<ffi::F32>& mins, size_t lead, Stack& st) {
  if (!parse(fmt_name, st.fmt)) return "fmt: int8, q8_0, q4_0 or q4_1";
  const Fmt fmt = st.fmt;
  auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || vd.size() != lead + 2 || sd.size() != lead + (fmt == Fmt::kInt8 ? 1 : 2))
    return "qmatmul: want x [T, in], values [lead..., out, *], scales [lead..., out, *]";
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return "qmatmul: x must be float32 or bfloat16";
  st.count = 1;
  for (size_t i = 0; i < lead; ++i) {
    if (sd[i] != vd[i] || vd[i] < 1) return "qmatmul: values and scales differ in leading axes";
    st.count *= vd[i];
  }
  st.in = xd[1];
  st.out = vd[lead];
  const bool q4 = fmt == Fmt::kQ4_0 || fmt == Fmt::kQ4_1;
  const auto want_values = q4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if (st.in % kBlock || st.out % kItemO || vd[lead + 1] != (q4 ? st.in / 2 : st.in) ||
      values.element_type() != want_values || sd[lead] != st.out ||
      (fmt != Fmt::kInt8 && sd[lead + 1] != st.in / kBlock))
    return "qmatmul: shapes or dtypes do not match the format";
  auto md = mins.dimensions();
  if (fmt == Fmt::kQ4_1) {
    bool same = md.size() == sd.size();
    for (size_t i = 0; same && i < sd.size(); ++i) same = md[i] == sd[i];
    if (!same) return "qmatmul: q4_1 wants mins shaped as the scales";
  }
  st.row_bytes = vd[lead + 1];
  st.values = static_cast<const uint8_t*>(values.untyped_data());
  st.scales = scales.typed_data();
  st.mins = fmt == Fmt::kQ4_1 ? mins.typed_data() : nullptr;
  return nullptr;
}

void product(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, int64_t row0, int64_t T,
             const Weights& w, float* yp) {
  if (x.element_type() == ffi::DataType::F32)
    qmatmul_product(pool, static_cast<const float*>(x.untyped_data()) + row0 * w.in, T, w, yp);
  else
    qmatmul_product(pool, static_cast<const uint16_t*>(x.untyped_data()) + row0 * w.in, T, w,
                    yp);
}

ffi::Error Qmatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                   ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                   ffi::Buffer<ffi::S32> layer, std::string_view fmt_name,
                   ffi::ResultBuffer<ffi::F32> y) {
  Stack st;
  if (const char* e = stack_of(fmt_name, x, values, scales, mins, 1, st))
    return ffi::Error::InvalidArgument(e);
  // the layer, clamped as dynamic_slice clamps
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, st.count - 1);
  product(pool, x, 0, x.dimensions()[0], st.at(l), y->typed_data());
  return ffi::Error::Success();
}

// The grouped form (a mixture of experts' projections): rows x [M, in] in groups, group g's
// group_sizes[g] rows after group g-1's, times that group's matrix of the stack [L, G, out, *]
// (layer `layer`, clamped): y [M, out]; each group's rows quantized and multiplied on their own,
// so the result for a row is what `Qmatmul` gives for it with its group's matrix. Rows past the
// groups give zeros; negative sizes count as 0, and groups reaching past M are cut at M.
ffi::Error GroupedQmatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> layer,
                          std::string_view fmt_name, ffi::ResultBuffer<ffi::F32> y) {
  Stack st;
  if (const char* e = stack_of(fmt_name, x, values, scales, mins, 2, st))
    return ffi::Error::InvalidArgument(e);
  const int64_t G = values.dimensions()[1], L = values.dimensions()[0];
  if (group_sizes.dimensions().size() != 1 || group_sizes.dimensions()[0] != G)
    return ffi::Error::InvalidArgument("grouped_qmatmul: want group_sizes [G]");
  const int64_t M = x.dimensions()[0];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  float* yp = y->typed_data();
  int64_t start = 0;
  for (int64_t g = 0; g < G && start < M; ++g) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(group_sizes.typed_data()[g], 0),
                                           M - start);
    product(pool, x, start, rows, st.at(l * G + g), yp + start * st.out);
    start += rows;
  }
  std::fill(yp + start * st.out, yp + M * st.out, 0.0f);
  return ffi::Error::Success();
}

}  // namespace

}  // namespace llmjax_cpu

// The engine compiled for this CPU (kernels_cpu/build.py's `engines()`): 0 portable (scalar),
// 1 AVX-512, 2 AVX-512 VNNI, 3 that and AMX tiles.
extern "C" int LlmjaxQmatmulEngine() {
  return LLMJAX_AMX ? 3 : LLMJAX_VNNI ? 2 : LLMJAX_AVX512 ? 1 : 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxQmatmul, llmjax_cpu::Qmatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<std::string_view>("fmt")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxGroupedQmatmul, llmjax_cpu::GroupedQmatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<std::string_view>("fmt")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

// Ragged paged attention for CPUs: the contract of
// kernels_pallas/ragged_paged_attention/reference.py (the specification).
//
// AVX-512 path (H % 16 == 0 and H <= 1024). Work items are tiles: a sequence, a few consecutive
// query rows of it, and a group of its kv heads. For each kv head k a tile holds M <= 16 query
// vectors, its rows' query heads of k (the Q = N / K of k's group; decode: M = Q), so that each
// key and value row is read once for all M of them. A group is all K heads where that still
// leaves tiles enough for the threads (a key position's rows of every head are contiguous in
// its page: one stream), else one head. A tile walks its keys once, 16 at a time, flash-attention
// style (online softmax), the K and V rows two blocks on prefetched, and for each kv head:
//   1. scores s[m, i] = (q_m * sm_scale) . key i of the 16 keys, either
//      - transposed (M > 4): the keys' rows in 16 x 16 blocks (transpose16) into kt[h] = element
//        h of the 16 keys, then s_m += q_m[h] * kt[h]: 16 scores per FMA, the H / 16 transposes
//        shared by the M vectors; or
//      - by rows (M <= 4, decode mostly): 16 lanes of partial sums per key, then the 16 keys'
//        sums at once (sum_lanes16: 30 shuffles per vector, against 4 H for the transposes).
//      The missing keys of a tail block read a zero row.
//   2. the soft cap, then the mask: a query sees the keys <= its position, < kv_len, within its
//      page table (P * G) and the sliding window; the others get weight exactly 0. Each vector
//      keeps its running maximum (what it summed is rescaled when that grows), the weights are
//      exp(s - maximum), and it sums them.
//   3. values: 64, 32 or 16 lanes of H at a time, M of each in registers, every value row loaded
//      once and multiplied into all M.
// At the end each vector's sum of values is divided by its sum of weights. All of it in float32.
// Other head dims, or no AVX-512: one query row at a time (attend_row), each key row dotted with
// every query head, in three passes (scores, exponentials, values). Work items are shared over
// XLA's intra-op thread pool; K/V are read in place from their pages.
//
// A quantized KV cache (llmjax/model/kv_cache.py): the pages hold one byte per element (int8, or
// fp8 e4m3fn / e5m2 bits, converted to float32 through float16: e5m2 is float16's upper byte,
// e4m3fn's bits shifted into float16's are its value / 256) and k_scales / v_scales a float32
// per row and kv head; a key's scale multiplies its 16 scores, a value's its weight (after the
// weights are summed for the softmax's denominator), so the loops read the bytes as they are.
// int8_scores (an int8 cache, AVX-512 VNNI; the default): the scores as int8 dot products, as
// llama.cpp's CPU attention does with a q8_0 cache. Each query vector q_m * sm_scale is quantized
// to int8 at its own scale d_m = max |.| / 127, once per tile; the 16 keys' codes, + 128 to be
// unsigned, are transposed in 32-bit words (4 elements: one transpose per 64 of H), and vpdpbusd
// sums 4 products a lane, so a score takes H / 4 instructions per vector (against H FMAs and the
// codes' conversion to float32). sum (k + 128) q8 less 128 sum q8 is k . q8, exact in int32
// (H <= 1024: no overflow); the score is d_m x that x the key's scale. What it adds to the
// dequantizing reference's error is q's rounding (tests/kernels/test_rpa_quantized.py bounds it;
// scripts/eval_kv_cache.py measures its perplexity). The values stay float32.
//
// Arguments (shapes as in the reference):
//   q [T, N, H] (float32 or bfloat16), k_pages / v_pages [num_pages, G, K, H] (q's dtype, or
//   int8 / uint8 for a quantized cache), k_scales / v_scales [num_pages, G, K, 1] float32
//   (read only for a quantized cache; anything else otherwise)
//   kv_lens [S], page_indices [S, P], cu_q_lens [S + 1], num_seqs [1]  (int32)
//   attributes: sm_scale (f32), sliding_window (i64, 0 = none), soft_cap (f32, 0 = none),
//   kv_format (i64: 0 the pages in q's dtype, 1 int8, 2 fp8_e4m3, 3 fp8_e5m2)
//   int8_scores (i64: 1 an int8 cache's scores as int8 dots where the CPU has VNNI, else 0)
// Result: [T, N, H] in q's dtype; rows from cu_q_lens[num_seqs] on are 0.

#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace llmjax_cpu {

namespace {

// The one-byte KV elements of a quantized cache (int8_t is the third).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

inline float f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                         : std::ldexp(static_cast<float>(m | 0x400), e - 25);  // no inf/NaN here
  return (h & 0x8000) ? -v : v;
}
inline uint16_t e4m3_as_f16(uint8_t b) {  // its value / 256 (normal and subnormal alike)
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
}
inline float kv_to_f32(int8_t x) { return static_cast<float>(x); }
inline float kv_to_f32(Fp8E5M2 x) { return f16_to_f32(static_cast<uint16_t>(x.bits << 8)); }
inline float kv_to_f32(Fp8E4M3 x) { return f16_to_f32(e4m3_as_f16(x.bits)) * 256.0f; }

template <typename KE>
constexpr bool kQuantized = !std::is_same_v<KE, float> && !std::is_same_v<KE, uint16_t>;

// sum_i a[i] * b[i] and acc[i] += p * b[i] over a row of KV elements.
template <typename KE>
inline float dot_kv(const float* a, const KE* b, int64_t n) {
  if constexpr (!kQuantized<KE>) {
    return dot<KE>(a, b, n);
  } else {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * kv_to_f32(b[i]);
    return s;
  }
}
template <typename KE>
inline void axpy_kv(float p, const KE* b, float* acc, int64_t n) {
  if constexpr (!kQuantized<KE>) {
    axpy<KE>(p, b, acc, n);
  } else {
    for (int64_t i = 0; i < n; ++i) acc[i] += p * kv_to_f32(b[i]);
  }
}

// What every work item reads: the inputs, shapes and attributes of one call. E: q's and the
// output's element; KE: the pages' (E, or a quantized cache's byte, with its scales).
template <typename E, typename KE>
struct Args {
  const E* q;
  const KE* k_pages;
  const KE* v_pages;
  const float* k_scales;  // [num_pages, G, K] (a quantized cache)
  const float* v_scales;
  const int32_t* pages;  // [S, P]
  const int32_t* kv_lens;
  E* out;
  int64_t N, K, H, G, P;
  float scale, soft_cap;
  int64_t window;
  bool int8_scores;  // an int8 cache's scores as int8 dots (VNNI; see the header)
};

// The keys a query at position pos sees: [lo, hi] (empty when hi < lo): causal, within the
// sequence's keys and its page table, and the sliding window.
struct Span {
  int64_t lo, hi;
};

inline Span visible(int64_t pos, int64_t kv_len, int64_t capacity, int64_t window) {
  return {window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0,
          std::min<int64_t>({pos, kv_len - 1, capacity - 1})};
}

// ---- The portable path: one query row, all N heads. ----

struct Row {
  int32_t t;    // query row
  int32_t seq;  // its sequence
  int32_t pos;  // its position in the sequence
};

// Each visible key's row [K, H] (all heads, contiguous in the page) is read once for the scores,
// and each value row once for the sum.
template <typename E, typename KE>
void attend_row(const Args<E, KE>& a, Row row, std::vector<float>& buf) {
  const int64_t N = a.N, K = a.K, H = a.H, G = a.G, Q = N / K;
  const int32_t* pages = a.pages + static_cast<int64_t>(row.seq) * a.P;
  const Span span = visible(row.pos, a.kv_lens[row.seq], a.P * G, a.window);
  const int64_t start = span.lo, C = span.hi - span.lo + 1;
  E* out = a.out + row.t * N * H;
  if (C <= 0) {  // no visible key: the row is 0
    std::memset(out, 0, N * H * sizeof(E));
    return;
  }
  // buf: the N query heads (float32) | N x C scores | N accumulators | N maxima, N 1/sums
  buf.resize(N * H + N * C + N * H + 2 * N);
  float* qf = buf.data();
  float* scores = qf + N * H;
  float* acc = scores + N * C;
  float* maxima = acc + N * H;
  float* inv_sum = maxima + N;
  load_f32(a.q + row.t * N * H, qf, N * H);
  std::fill(maxima, maxima + N, -INFINITY);
  const int64_t row_stride = K * H;  // one position's keys of every head
  auto slot = [&](int64_t key) { return static_cast<int64_t>(pages[key / G]) * G + key % G; };
  auto key_row = [&](const KE* base, int64_t key) { return base + slot(key) * row_stride; };
  for (int64_t c = 0; c < C; ++c) {
    const KE* kp = key_row(a.k_pages, start + c);
    if (c + 2 < C) prefetch_row(key_row(a.k_pages, start + c + 2), row_stride);
    const float* ks = kQuantized<KE> ? a.k_scales + slot(start + c) * K : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      float s = dot_kv(qf + n * H, kp + (n / Q) * H, H) * a.scale;
      if constexpr (kQuantized<KE>) s *= ks[n / Q];
      if (a.soft_cap > 0) s = a.soft_cap * std::tanh(s / a.soft_cap);
      scores[n * C + c] = s;
      maxima[n] = std::max(maxima[n], s);
    }
  }
  for (int64_t n = 0; n < N; ++n) inv_sum[n] = 1.0f / exp_shifted_sum(scores + n * C, C, maxima[n]);
  std::fill(acc, acc + N * H, 0.0f);
  for (int64_t c = 0; c < C; ++c) {
    const KE* vp = key_row(a.v_pages, start + c);
    if (c + 2 < C) prefetch_row(key_row(a.v_pages, start + c + 2), row_stride);
    const float* vs = kQuantized<KE> ? a.v_scales + slot(start + c) * K : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      const float w = kQuantized<KE> ? scores[n * C + c] * vs[n / Q] : scores[n * C + c];
      axpy_kv(w, vp + (n / Q) * H, acc + n * H, H);
    }
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) acc[n * H + h] *= inv_sum[n];
  store_from_f32(acc, out, N * H);
}

// ---- The AVX-512 path: tiles of M query vectors for each of a group of kv heads. ----

constexpr int kMaxM = 16;            // query vectors per kv head of a tile (M registers)
constexpr int64_t kMaxKvHeads = 16;  // kv heads per tile
constexpr int64_t kMaxH = 1024;      // the longest head the zero row covers

struct Tile {
  int32_t seq;          // the sequence
  int32_t t;            // its first query row
  int32_t pos;          // that row's position in the sequence
  int16_t rows;         // consecutive query rows
  int16_t k, kv_heads;  // kv heads k .. k + kv_heads - 1
  int16_t q0, heads;    // query heads q0 .. q0 + heads - 1 of each one's group (of Q)
  int M() const { return rows * heads; }  // vector m: row m / heads, head q0 + m % heads
};

// A thread's buffers, reused from tile to tile.
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> rows;  // the tile's keys' row offsets in the pages (head 0)
};

#if LLMJAX_AVX512

alignas(64) const float kZeros[kMaxH] = {};  // the row that missing keys of a block read

template <typename E>
inline __m512 load16(const E* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  return load_bf16x16(p);
}
template <>
inline __m512 load16<int8_t>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i load_bytes16(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m512 load16<Fp8E5M2>(const Fp8E5M2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(load_bytes16(p), 8));
}
template <>
inline __m512 load16<Fp8E4M3>(const Fp8E4M3* p) {
  const __m256i b = load_bytes16(p);
  const __m256i h =
      _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

template <typename E>
inline void store16(__m512 x, E* p);
template <>
inline void store16<float>(__m512 x, float* p) {
  _mm512_storeu_ps(p, x);
}
template <>
inline void store16<uint16_t>(__m512 x, uint16_t* p) {  // as f32_to_bf16: nearest even, NaN quiet
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// kt[h * 16 + i] = element h of keys[i] (H of them), as float32: H / 16 transposes.
template <typename E>
[[gnu::always_inline]] inline void transpose_keys(const E* const* keys, int64_t H, float* kt) {
  for (int64_t j = 0; j < H; j += 16) {
    __m512i r[16];
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(load16(keys[i] + j));
    transpose16(r);
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (j + i) * 16, _mm512_castsi512_ps(r[i]));
  }
}

// s[m * 16 + i] = q_m . key i for the M query vectors qf [M, H] and the 16 transposed keys kt.
// With few vectors each keeps two sums (even and odd h), for the FMAs' latency.
template <int M>
[[gnu::always_inline]] inline void scores_transposed(const float* qf, const float* kt, int64_t H,
                                                     float* s) {
  constexpr int S = M <= 4 ? 2 : 1;
  __m512 acc[S][M];
  LLMJAX_UNROLL
  for (int j = 0; j < S; ++j)
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; h += S) {
    LLMJAX_UNROLL
    for (int j = 0; j < S; ++j) {
      const __m512 key = _mm512_load_ps(kt + (h + j) * 16);
      LLMJAX_UNROLL
      for (int m = 0; m < M; ++m)
        acc[j][m] = _mm512_fmadd_ps(_mm512_set1_ps(qf[m * H + h + j]), key, acc[j][m]);
    }
  }
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m)
    _mm512_store_ps(s + m * 16, S == 2 ? _mm512_add_ps(acc[0][m], acc[1][m]) : acc[0][m]);
}

// Lane i = the sum of p[i]'s 16 lanes: a tree of in-lane and lane shuffles (30, and 15 adds).
[[gnu::always_inline]] inline __m512 sum_lanes16(const __m512 p[16]) {
  __m512 t[8], u[4];
  LLMJAX_UNROLL
  for (int i = 0; i < 8; ++i)  // 128-bit lane l: p[2i] and p[2i + 1]'s partial sums, interleaved
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  LLMJAX_UNROLL
  for (int g = 0; g < 4; ++g) {  // 128-bit lane l: that lane's partial sums of p[4g .. 4g + 3]
    const __m512d a = _mm512_castps_pd(t[2 * g]), b = _mm512_castps_pd(t[2 * g + 1]);
    u[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // then the lanes' sums: lanes 0 + 1 and 2 + 3 of u[0], u[1] | of u[2], u[3]; then of those
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                  _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                  _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xdd));
}

// As scores_transposed, from the keys' float32 rows keys[i] (H each): per vector 16 lanes of
// partial sums for each key, then the 16 keys' sums at once.
template <int M>
[[gnu::always_inline]] inline void scores_by_rows(const float* qf, const float* const* keys,
                                                  int64_t H, float* s) {
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m) {
    __m512 p[16];
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i) p[i] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h += 16) {
      const __m512 qv = _mm512_load_ps(qf + m * H + h);
      LLMJAX_UNROLL
      for (int i = 0; i < 16; ++i) p[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[i] + h), p[i]);
    }
    _mm512_store_ps(s + m * 16, sum_lanes16(p));
  }
}

// o[m, h0 : h0 + 16 J] += sum_i w[m * 16 + i] * values[i][h0 : h0 + 16 J] over the block's n
// value rows: M x J accumulators in registers, each row's 16 J lanes loaded once for the M.
template <typename E, int M, int J>
[[gnu::always_inline]] inline void add_values(const E* const* values, int n, const float* w,
                                              int64_t h0, int64_t H, float* o) {
  __m512 acc[M][J];
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m)
    LLMJAX_UNROLL
    for (int j = 0; j < J; ++j) acc[m][j] = _mm512_load_ps(o + m * H + h0 + 16 * j);
  for (int i = 0; i < n; ++i) {
    __m512 x[J];
    LLMJAX_UNROLL
    for (int j = 0; j < J; ++j) x[j] = load16(values[i] + h0 + 16 * j);
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) {
      const __m512 wm = _mm512_set1_ps(w[m * 16 + i]);
      LLMJAX_UNROLL
      for (int j = 0; j < J; ++j) acc[m][j] = _mm512_fmadd_ps(wm, x[j], acc[m][j]);
    }
  }
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m)
    LLMJAX_UNROLL
    for (int j = 0; j < J; ++j) _mm512_store_ps(o + m * H + h0 + 16 * j, acc[m][j]);
}

#if LLMJAX_VNNI
// An int8 cache's scores as int8 dot products (int8_scores; see the header).

// qb = x (H floats) in int8 at the scale d = max |x| / 127 (rounded to nearest even); returns d,
// and in *sum the codes' sum.
inline float quantize_query(const float* x, int64_t H, int8_t* qb, int32_t* sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; h += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_load_ps(x + h)));
  const float m = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(m > 0 ? 127.0f / m : 0.0f);
  __m512i s = _mm512_setzero_si512();
  for (int64_t h = 0; h < H; h += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x + h), inv));
    s = _mm512_add_epi32(s, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + h), _mm512_cvtepi32_epi8(v));
  }
  *sum = _mm512_reduce_add_epi32(s);
  return m / 127.0f;
}

// kt[g] lane i = the 16 keys' codes 4g .. 4g + 3 of key i, each + 128 (unsigned, for
// vpdpbusd): the 64-byte slices of the rows as 16 x 16 transposes of 32-bit words (H / 4 groups;
// the last slice's missing bytes are never read).
[[gnu::always_inline]] inline void transpose_codes(const int8_t* const* keys, int64_t H,
                                                   __m512i* kt) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < H; j += 64) {
    const __mmask64 mask = H - j >= 64 ? ~0ull : (1ull << (H - j)) - 1;
    __m512i r[16];
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i)
      r[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, keys[i] + j), bias);
    transpose16(r);
    LLMJAX_UNROLL
    for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + j / 4 + i, r[i]);
  }
}

// s[m * 16 + i] = d[m] (q8_m . key i) for the M int8 query vectors q4 [M, groups] (4 codes a
// word) and the 16 transposed keys kt: vpdpbusd gives sum (key + 128) q8_m, less bias[m] (128
// times the codes' sum of q8_m), exact in int32. groups (H / 4) is a multiple of 4.
template <int M>
[[gnu::always_inline]] inline void scores_int8(const int32_t* q4, const __m512i* kt,
                                               int64_t groups, const float* d,
                                               const int32_t* bias, float* s) {
  constexpr int S = M <= 4 ? 2 : 1;  // few vectors: two sums each, for vpdpbusd's latency
  __m512i acc[S][M];
  LLMJAX_UNROLL
  for (int j = 0; j < S; ++j)
    LLMJAX_UNROLL
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; g += S) {
    LLMJAX_UNROLL
    for (int j = 0; j < S; ++j) {
      const __m512i key = _mm512_load_si512(kt + g + j);
      LLMJAX_UNROLL
      for (int m = 0; m < M; ++m) dpbusd(acc[j][m], key, _mm512_set1_epi32(q4[m * groups + g + j]));
    }
  }
  LLMJAX_UNROLL
  for (int m = 0; m < M; ++m) {
    __m512i x = S == 2 ? _mm512_add_epi32(acc[0][m], acc[S - 1][m]) : acc[0][m];
    x = _mm512_sub_epi32(x, _mm512_set1_epi32(bias[m]));
    _mm512_store_ps(s + m * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(d[m])));
  }
}
#endif  // LLMJAX_VNNI

// One tile (see the header).
template <typename E, typename KE, int M>
void attend_tile(const Args<E, KE>& a, const Tile& tile, Scratch& scratch) {
  const int64_t N = a.N, K = a.K, H = a.H, G = a.G, Q = N / K, nk = tile.kv_heads;
  const int32_t* pages = a.pages + static_cast<int64_t>(tile.seq) * a.P;
  // each vector's visible keys (a row's), and the tile's: [lo, lo + C)
  Span span[M];
  int64_t lo = INT64_MAX, hi = -1;
  for (int m = 0; m < M; ++m) {
    span[m] = visible(tile.pos + m / tile.heads, a.kv_lens[tile.seq], a.P * G, a.window);
    if (span[m].hi >= span[m].lo) lo = std::min(lo, span[m].lo), hi = std::max(hi, span[m].hi);
  }
  // vector m of kv head k: query row t + m / heads, head k * Q + q0 + m % heads
  auto offset = [&](int64_t k, int m) {
    return ((tile.t + m / tile.heads) * N + k * Q + tile.q0 + m % tile.heads) * H;
  };
  if (hi < lo) {  // no vector sees a key: they are 0
    for (int64_t k = tile.k; k < tile.k + nk; ++k)
      for (int m = 0; m < M; ++m) std::memset(a.out + offset(k, m), 0, H * sizeof(E));
    return;
  }
  const int64_t C = hi - lo + 1;

  // scratch.f: q * sm_scale [nk, M, H] | accumulators [nk, M, H] | a key block [16, H] |
  // the block's scores, then weights [M, 16] | per-lane sums of the weights [nk, M, 16] |
  // int8 scores: q's codes [nk, M, H] (bytes), their scales [nk, M] and 128 x their sums [nk, M]
  constexpr bool kInt8Dots = LLMJAX_VNNI && std::is_same_v<KE, int8_t>;
  const bool int8_dots = kInt8Dots && a.int8_scores;
  scratch.f.resize(2 * nk * M * H + 16 * H + M * 16 + nk * M * 16 + 16 +
                   (int8_dots ? nk * M * (H / 4 + 2) : 0));
  float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.f.data()) + 63) & ~63);
  float* o = qf + nk * M * H;
  float* kt = o + nk * M * H;
  float* w = kt + 16 * H;
  float* sums = w + M * 16;
  int8_t* q8 = reinterpret_cast<int8_t*>(sums + nk * M * 16);
  float* q8_scales = sums + nk * M * 16 + nk * M * H / 4;
  int32_t* q8_bias = reinterpret_cast<int32_t*>(q8_scales + nk * M);
  std::fill(o, o + nk * M * H, 0.0f);
  std::fill(sums, sums + nk * M * 16, 0.0f);
  float maxima[kMaxKvHeads][M];
  for (int64_t kk = 0; kk < nk; ++kk) std::fill(maxima[kk], maxima[kk] + M, -INFINITY);
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t kk = 0; kk < nk; ++kk)
    for (int m = 0; m < M; ++m) {
      const E* qm = a.q + offset(tile.k + kk, m);
      for (int64_t h = 0; h < H; h += 16)
        _mm512_store_ps(qf + (kk * M + m) * H + h, _mm512_mul_ps(load16(qm + h), scale));
#if LLMJAX_VNNI
      if (int8_dots) {
        const int64_t v = kk * M + m;
        q8_scales[v] = quantize_query(qf + v * H, H, q8 + v * H, q8_bias + v);
        q8_bias[v] *= 128;
      }
#endif
    }
  scratch.rows.resize(C);
  int64_t* rows = scratch.rows.data();  // key lo + c's row: pages + rows[c] + k * H
  for (int64_t c = 0, key = lo; c < C;) {  // page by page
    const int64_t page = pages[key / G], end = std::min(C, c + G - key % G);
    for (int64_t r = (page * G + key % G) * K * H; c < end; ++c, ++key, r += K * H) rows[c] = r;
  }

  // scores by rows for few vectors (30 shuffles each; the transposes take 4 H for all M)
  constexpr bool by_rows = M <= 4;
  constexpr int J = M <= 6 ? 4 : M <= 12 ? 2 : 1;  // lanes of 16 per value pass: M J <= 24
  const KE* zeros = reinterpret_cast<const KE*>(kZeros);
  constexpr int64_t kAhead = 32;
  for (int64_t b = 0; b < C; b += 16) {  // keys lo + b .. lo + b + n - 1
    const int n = static_cast<int>(std::min<int64_t>(16, C - b));
    // the K and V rows (the tile's heads) kAhead keys on, into L2: from DRAM this takes a
    // quarter off a decode's time, from L3 or L2 it adds about a fifth (the instructions)
    for (int64_t c = b + kAhead; c < std::min(C, b + kAhead + 16); ++c) {
      const char* k_row = reinterpret_cast<const char*>(a.k_pages + rows[c] + tile.k * H);
      const char* v_row = reinterpret_cast<const char*>(a.v_pages + rows[c] + tile.k * H);
      for (int64_t l = 0; l < nk * H * static_cast<int64_t>(sizeof(KE)); l += 64) {
        __builtin_prefetch(k_row + l, 0, 2);
        __builtin_prefetch(v_row + l, 0, 2);
      }
    }
    for (int64_t kk = 0; kk < nk; ++kk) {
      const int64_t head = (tile.k + kk) * H;
      const KE* keys[16];
      const KE* values[16];
      alignas(64) float ks[16], vs[16];  // a quantized cache's scales of the 16 rows (0: none)
      for (int i = 0; i < 16; ++i) {
        keys[i] = i < n ? a.k_pages + rows[b + i] + head : zeros;
        values[i] = i < n ? a.v_pages + rows[b + i] + head : nullptr;
        if constexpr (kQuantized<KE>) {
          const int64_t r = i < n ? rows[b + i] / H + tile.k + kk : -1;  // [.., K] row index
          ks[i] = r >= 0 ? a.k_scales[r] : 0.0f;
          vs[i] = r >= 0 ? a.v_scales[r] : 0.0f;
        }
      }
      // 1. scores
      bool scored = false;
#if LLMJAX_VNNI
      if constexpr (kInt8Dots) {
        if (int8_dots) {
          __m512i* kt8 = reinterpret_cast<__m512i*>(kt);
          transpose_codes(keys, H, kt8);
          scores_int8<M>(reinterpret_cast<const int32_t*>(q8 + kk * M * H), kt8, H / 4,
                         q8_scales + kk * M, q8_bias + kk * M, w);
          scored = true;
        }
      }
#endif
      if (!scored) {
        if constexpr (by_rows) {
          const float* keys32[16];
          for (int i = 0; i < 16; ++i) {
            if constexpr (std::is_same_v<KE, float>) {
              keys32[i] = keys[i];
            } else {  // bfloat16 or quantized rows as float32, once for the M vectors
              for (int64_t h = 0; h < H; h += 16)
                _mm512_store_ps(kt + i * H + h, load16(keys[i] + h));
              keys32[i] = kt + i * H;
            }
          }
          scores_by_rows<M>(qf + kk * M * H, keys32, H, w);
        } else {
          transpose_keys(keys, H, kt);
          scores_transposed<M>(qf + kk * M * H, kt, H, w);
        }
      }
      // 2. the weights, the running maxima and sums
      float* ok = o + kk * M * H;
      for (int m = 0; m < M; ++m) {
        float* wm = w + m * 16;
        if constexpr (kQuantized<KE>)  // each key's scale times its scores
          _mm512_store_ps(wm, _mm512_mul_ps(_mm512_load_ps(wm), _mm512_load_ps(ks)));
        const int64_t first = std::max<int64_t>(span[m].lo - lo - b, 0);
        const int64_t last = std::min<int64_t>(span[m].hi - lo - b + 1, n);
        if (last <= first) {  // it sees none of these keys
          _mm512_store_ps(wm, _mm512_setzero_ps());
          continue;
        }
        const __mmask16 mask = static_cast<__mmask16>(((1u << last) - 1) & ~((1u << first) - 1));
        if (a.soft_cap > 0)
          for (int i = 0; i < 16; ++i) wm[i] = a.soft_cap * std::tanh(wm[i] / a.soft_cap);
        const __m512 x = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), _mm512_load_ps(wm));
        const float block_max = _mm512_reduce_max_ps(x);
        float& max = maxima[kk][m];
        float* sum = sums + (kk * M + m) * 16;
        if (block_max > max) {  // rescale what was summed to the new maximum
          if (max > -INFINITY) {
            const __m512 f = _mm512_set1_ps(std::exp(max - block_max));
            for (int64_t h = 0; h < H; h += 16)
              _mm512_store_ps(ok + m * H + h, _mm512_mul_ps(_mm512_load_ps(ok + m * H + h), f));
            _mm512_store_ps(sum, _mm512_mul_ps(_mm512_load_ps(sum), f));
          }
          max = block_max;
        }
        const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, _mm512_set1_ps(max))));
        // a quantized cache: each value's scale times its weight (the sum keeps the weights)
        _mm512_store_ps(wm, kQuantized<KE> ? _mm512_mul_ps(e, _mm512_load_ps(vs)) : e);
        _mm512_store_ps(sum, _mm512_add_ps(_mm512_load_ps(sum), e));
      }
      // 3. values
      int64_t h0 = 0;
      for (; h0 + 16 * J <= H; h0 += 16 * J) add_values<KE, M, J>(values, n, w, h0, H, ok);
      for (; h0 < H; h0 += 16) add_values<KE, M, 1>(values, n, w, h0, H, ok);
    }
  }
  for (int64_t kk = 0; kk < nk; ++kk)
    for (int m = 0; m < M; ++m) {
      const float sum = _mm512_reduce_add_ps(_mm512_load_ps(sums + (kk * M + m) * 16));
      const __m512 inv = _mm512_set1_ps(sum > 0 ? 1.0f / sum : 0.0f);  // 0: it saw no key
      const float* om = o + (kk * M + m) * H;
      E* out = a.out + offset(tile.k + kk, m);
      for (int64_t h = 0; h < H; h += 16)
        store16(_mm512_mul_ps(_mm512_load_ps(om + h), inv), out + h);
    }
}

// attend_tile<E, KE, M> for M = 1 .. kMaxM, by M - 1.
template <typename E, typename KE, int... I>
constexpr auto tile_kernels(std::integer_sequence<int, I...>) {
  return std::array<void (*)(const Args<E, KE>&, const Tile&, Scratch&), sizeof...(I)>{
      &attend_tile<E, KE, I + 1>...};
}

#endif  // LLMJAX_AVX512

template <typename E, typename KE>
ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
               ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> kv_lens,
               ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
               ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t sliding_window,
               float soft_cap, bool int8_scores, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), pd = page_indices.dimensions();
  const int64_t num_tokens = qd[0], N = qd[1], H = qd[2];
  const int64_t G = kd[1], K = kd[2], P = pd[1];
  const int64_t S = kv_lens.dimensions()[0];
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], S);
  const Args<E, KE> args{reinterpret_cast<const E*>(q.untyped_data()),
                         reinterpret_cast<const KE*>(k_pages.untyped_data()),
                         reinterpret_cast<const KE*>(v_pages.untyped_data()),
                         k_scales.typed_data(),
                         v_scales.typed_data(),
                         page_indices.typed_data(),
                     lens,
                     reinterpret_cast<E*>(out->untyped_data()),
                     N, K, H, G, P, sm_scale, soft_cap, sliding_window, int8_scores};

  // Every sequence's query rows (those before row num_tokens); the rest are padding, zeroed here
  // (each work item writes all of its own rows).
  std::vector<char> covered(num_tokens, 0);
  std::vector<Row> rows;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t q_len = cu[s + 1] - cu[s];
    for (int32_t i = 0; i < q_len && cu[s] + i < num_tokens; ++i) {
      rows.push_back({cu[s] + i, static_cast<int32_t>(s), lens[s] - q_len + i});
      covered[cu[s] + i] = 1;
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t)
    if (!covered[t]) std::memset(args.out + t * N * H, 0, N * H * sizeof(E));

#if LLMJAX_AVX512
  if (H % 16 == 0 && H <= kMaxH) {
    const int64_t Q = N / K;
    // Tiles: a sequence's rows in runs of kMaxM / Q (one row, and its Q heads in parts of at
    // most kMaxM, where Q > kMaxM), each for all kv heads (at most kMaxKvHeads) where that still
    // makes tiles enough to share, else for one; the costliest (most keys) first.
    const int64_t tile_rows = std::max<int64_t>(1, kMaxM / Q);
    const int64_t tile_heads = std::min<int64_t>(Q, kMaxM);
    std::vector<std::pair<size_t, size_t>> runs;  // rows[first, last): consecutive, one sequence
    for (size_t r = 0, e; r < rows.size(); r = e) {
      for (e = r + 1; e < rows.size() && e - r < static_cast<size_t>(tile_rows) &&
                      rows[e].seq == rows[r].seq && rows[e].t == rows[e - 1].t + 1;
           ++e) {
      }
      runs.emplace_back(r, e);
    }
    const int64_t parts = (Q + tile_heads - 1) / tile_heads;
    const bool group = static_cast<int64_t>(runs.size()) * parts >= 2 * (max_helpers(pool) + 1);
    const int64_t kv_group = group ? std::min<int64_t>(K, kMaxKvHeads) : 1;
    std::vector<std::pair<int64_t, Tile>> tiles;  // (keys of the last row, the tile)
    for (auto [r, e] : runs) {
      const Row& last = rows[e - 1];
      const int64_t keys = std::min<int64_t>({last.pos + 1, lens[last.seq], P * G,
                                              sliding_window > 0 ? sliding_window : INT64_MAX});
      for (int64_t k = 0; k < K; k += kv_group)
        for (int64_t q0 = 0; q0 < Q; q0 += tile_heads)
          tiles.push_back({keys,
                           {rows[r].seq, rows[r].t, rows[r].pos, static_cast<int16_t>(e - r),
                            static_cast<int16_t>(k),
                            static_cast<int16_t>(std::min(kv_group, K - k)),
                            static_cast<int16_t>(q0),
                            static_cast<int16_t>(std::min(tile_heads, Q - q0))}});
    }
    std::stable_sort(tiles.begin(), tiles.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    static constexpr auto kernels =
        tile_kernels<E, KE>(std::make_integer_sequence<int, kMaxM>{});
    parallel_for(pool, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i) {
      thread_local Scratch scratch;
      const Tile& tile = tiles[i].second;
      kernels[tile.M() - 1](args, tile, scratch);
    });
    return ffi::Error::Success();
  }
#endif
  parallel_for(pool, static_cast<int64_t>(rows.size()), 1, [&](int64_t r) {
    thread_local std::vector<float> buf;
    attend_row<E, KE>(args, rows[r], buf);
  });
  return ffi::Error::Success();
}

}  // namespace

// Run<E, KE> for each (q dtype, KV dtype) as a function of its own, so that kernels_cpu/build.py
// compiles them in separate translation units at once: LLMJAX_RPA_PART = k (1..8) defines the
// k-th, 0 the FFI handler that dispatches to them, and without it (one translation unit)
// everything. Most of the build's time is these instantiations (16 tile sizes each).
#ifndef LLMJAX_RPA_PART
#define LLMJAX_RPA_PART -1
#endif
#define LLMJAX_RPA_PARAMS                                                                       \
  ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,        \
      ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,                           \
      ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,                        \
      ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,           \
      int64_t sliding_window, float soft_cap, bool int8_scores, ffi::Result<ffi::AnyBuffer> out
#define LLMJAX_RPA_CALL                                                                         \
  pool, q, k_pages, v_pages, k_scales, v_scales, kv_lens, page_indices, cu_q_lens, num_seqs,    \
      sm_scale, sliding_window, soft_cap, int8_scores, out
#define LLMJAX_RPA_PART_IS(k) (LLMJAX_RPA_PART < 0 || LLMJAX_RPA_PART == (k))

using RunFn = ffi::Error (*)(LLMJAX_RPA_PARAMS);
// by kv_format (0 q's dtype, 1 int8, 2 fp8_e4m3, 3 fp8_e5m2), float32 q then bfloat16 q
ffi::Error RunF32(LLMJAX_RPA_PARAMS);
ffi::Error RunF32Int8(LLMJAX_RPA_PARAMS);
ffi::Error RunF32E4M3(LLMJAX_RPA_PARAMS);
ffi::Error RunF32E5M2(LLMJAX_RPA_PARAMS);
ffi::Error RunBF16(LLMJAX_RPA_PARAMS);
ffi::Error RunBF16Int8(LLMJAX_RPA_PARAMS);
ffi::Error RunBF16E4M3(LLMJAX_RPA_PARAMS);
ffi::Error RunBF16E5M2(LLMJAX_RPA_PARAMS);

#if LLMJAX_RPA_PART_IS(1)
ffi::Error RunF32(LLMJAX_RPA_PARAMS) { return Run<float, float>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(2)
ffi::Error RunF32Int8(LLMJAX_RPA_PARAMS) { return Run<float, int8_t>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(3)
ffi::Error RunF32E4M3(LLMJAX_RPA_PARAMS) { return Run<float, Fp8E4M3>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(4)
ffi::Error RunF32E5M2(LLMJAX_RPA_PARAMS) { return Run<float, Fp8E5M2>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(5)
ffi::Error RunBF16(LLMJAX_RPA_PARAMS) { return Run<uint16_t, uint16_t>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(6)
ffi::Error RunBF16Int8(LLMJAX_RPA_PARAMS) { return Run<uint16_t, int8_t>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(7)
ffi::Error RunBF16E4M3(LLMJAX_RPA_PARAMS) { return Run<uint16_t, Fp8E4M3>(LLMJAX_RPA_CALL); }
#endif
#if LLMJAX_RPA_PART_IS(8)
ffi::Error RunBF16E5M2(LLMJAX_RPA_PARAMS) { return Run<uint16_t, Fp8E5M2>(LLMJAX_RPA_CALL); }
#endif

#if LLMJAX_RPA_PART_IS(0)
namespace {

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                    ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> kv_lens,
                    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                    ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t sliding_window,
                    float soft_cap, int64_t kv_format, int64_t int8_scores_attr,
                    ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = q.element_type();
  if (kv_format < 0 || kv_format > 3)
    return ffi::Error::InvalidArgument("kv_format must be 0 (q's dtype), 1, 2 or 3");
  const ffi::DataType kv_dtype = kv_format == 0   ? dtype
                                 : kv_format == 1 ? ffi::DataType::S8
                                                  : ffi::DataType::U8;
  if (k_pages.element_type() != kv_dtype || v_pages.element_type() != kv_dtype ||
      out->element_type() != dtype)
    return ffi::Error::InvalidArgument(
        "the pages need q's dtype (int8 / uint8 for a quantized cache), the output q's");
  if (q.dimensions().size() != 3 || k_pages.dimensions().size() != 4 ||
      q.dimensions()[2] != k_pages.dimensions()[3] || q.dimensions()[1] % k_pages.dimensions()[2])
    return ffi::Error::InvalidArgument("want q [T, N, H], pages [num_pages, G, K, H], K | N");
  if (kv_format != 0) {
    const auto kd = k_pages.dimensions();
    const int64_t rows = kd[0] * kd[1] * kd[2];
    if (k_scales.element_count() != rows || v_scales.element_count() != rows)
      return ffi::Error::InvalidArgument("want k/v scales [num_pages, G, K, 1] float32");
  }
  static constexpr RunFn kRuns[2][4] = {{RunF32, RunF32Int8, RunF32E4M3, RunF32E5M2},
                                        {RunBF16, RunBF16Int8, RunBF16E4M3, RunBF16E5M2}};
  const bool int8_scores = int8_scores_attr != 0;
  if (dtype == ffi::DataType::F32) return kRuns[0][kv_format](LLMJAX_RPA_CALL);
  if (dtype == ffi::DataType::BF16) return kRuns[1][kv_format](LLMJAX_RPA_CALL);
  return ffi::Error::InvalidArgument("ragged paged attention (CPU) takes float32 or bfloat16");
}

}  // namespace
#endif  // LLMJAX_RPA_PART_IS(0)

}  // namespace llmjax_cpu

#if LLMJAX_RPA_PART_IS(0)
// The engine compiled for this CPU (kernels_cpu/build.py's `engines()`): 0 portable (one query
// row at a time), 1 AVX-512 tiles, 2 those with an int8 cache's scores as VNNI int8 dots.
extern "C" int LlmjaxRaggedPagedAttentionEngine() {
  return LLMJAX_VNNI ? 2 : LLMJAX_AVX512 ? 1 : 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxRaggedPagedAttention, llmjax_cpu::Dispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("kv_format")
                                  .Attr<int64_t>("int8_scores")
                                  .Ret<xla::ffi::AnyBuffer>());
#endif  // LLMJAX_RPA_PART_IS(0)

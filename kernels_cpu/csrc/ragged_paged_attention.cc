// Ragged paged attention for CPUs: the contract of
// kernels_pallas/ragged_paged_attention/reference.py (the specification), one query row at a time.
//
// Work items are query rows: a row's N query heads score every visible key of its sequence (each
// key position's [K, H] row read once, straight from its page, the next ones prefetched) in one
// pass that also finds the maxima, take the exponentials in one vectorized pass, and sum the
// value rows in a third; accumulation in float32. Rows are shared over XLA's intra-op thread
// pool. Nothing is gathered or transposed.
//
// Arguments (shapes as in the reference):
//   q [T, N, H], k_pages / v_pages [num_pages, G, K, H]  (float32 or bfloat16, all the same)
//   kv_lens [S], page_indices [S, P], cu_q_lens [S + 1], num_seqs [1]  (int32)
//   attributes: sm_scale (f32), sliding_window (i64, 0 = none), soft_cap (f32, 0 = none)
// Result: [T, N, H] in q's dtype; rows from cu_q_lens[num_seqs] on are 0.

#include <vector>

#include "common.h"

namespace llmjax_cpu {

namespace {

struct Row {
  int32_t t;    // query row
  int32_t seq;  // its sequence
  int32_t pos;  // its position in the sequence
};

// One query row over every kv head: each visible key's row [K, H] (all heads, contiguous in the
// page) is read once for the scores and each value row once for the sum.
template <typename E>
void attend(const E* q, const E* k_pages, const E* v_pages, const int32_t* pages, Row row,
            int64_t N, int64_t K, int64_t H, int64_t G, int64_t P, float scale, int64_t window,
            float soft_cap, int64_t kv_len, E* out, std::vector<float>& buf) {
  const int64_t Q = N / K;
  // the last visible key: causal, within the sequence's keys and its page table
  int64_t end = std::min<int64_t>({static_cast<int64_t>(row.pos), kv_len - 1, P * G - 1});
  int64_t start = window > 0 ? std::max<int64_t>(0, row.pos - window + 1) : 0;
  int64_t C = end - start + 1;
  if (C <= 0) return;  // no visible key: the row stays 0
  // buf: the N query heads (float32) | N x C scores | N accumulators | N maxima, N 1/sums
  buf.resize(N * H + N * C + N * H + 2 * N);
  float* qf = buf.data();
  float* scores = qf + N * H;
  float* acc = scores + N * C;
  float* maxima = acc + N * H;
  float* inv_sum = maxima + N;
  load_f32(q, qf, N * H);
  std::fill(maxima, maxima + N, -INFINITY);
  const int64_t row_stride = K * H;  // one position's keys of every head
  auto key_row = [&](const E* base, int64_t key) {
    return base + (static_cast<int64_t>(pages[key / G]) * G + key % G) * row_stride;
  };
  for (int64_t c = 0; c < C; ++c) {
    const E* kp = key_row(k_pages, start + c);
    if (c + 2 < C) prefetch_row(key_row(k_pages, start + c + 2), row_stride);
    for (int64_t n = 0; n < N; ++n) {
      float s = dot(qf + n * H, kp + (n / Q) * H, H) * scale;
      if (soft_cap > 0) s = soft_cap * std::tanh(s / soft_cap);
      scores[n * C + c] = s;
      maxima[n] = std::max(maxima[n], s);
    }
  }
  for (int64_t n = 0; n < N; ++n) inv_sum[n] = 1.0f / exp_shifted_sum(scores + n * C, C, maxima[n]);
  std::fill(acc, acc + N * H, 0.0f);
  for (int64_t c = 0; c < C; ++c) {
    const E* vp = key_row(v_pages, start + c);
    if (c + 2 < C) prefetch_row(key_row(v_pages, start + c + 2), row_stride);
    for (int64_t n = 0; n < N; ++n) axpy(scores[n * C + c], vp + (n / Q) * H, acc + n * H, H);
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) acc[n * H + h] *= inv_sum[n];
  store_from_f32(acc, out, N * H);
}

template <typename E>
ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
               ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
               ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t sliding_window,
               float soft_cap, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), pd = page_indices.dimensions();
  const int64_t num_tokens = qd[0], N = qd[1], H = qd[2];
  const int64_t G = kd[1], K = kd[2], P = pd[1];
  const int64_t S = kv_lens.dimensions()[0];
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* pages = page_indices.typed_data();
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], S);
  const E* qp = reinterpret_cast<const E*>(q.untyped_data());
  const E* kp = reinterpret_cast<const E*>(k_pages.untyped_data());
  const E* vp = reinterpret_cast<const E*>(v_pages.untyped_data());
  E* op = reinterpret_cast<E*>(out->untyped_data());
  std::memset(op, 0, num_tokens * N * H * sizeof(E));  // padding rows stay 0

  std::vector<Row> rows;  // every valid query row: its sequence and position
  rows.reserve(num_tokens);
  for (int64_t s = 0; s < n; ++s) {
    int32_t q_len = cu[s + 1] - cu[s];
    for (int32_t i = 0; i < q_len && cu[s] + i < num_tokens; ++i)
      rows.push_back({cu[s] + i, static_cast<int32_t>(s), lens[s] - q_len + i});
  }
  parallel_for(pool, static_cast<int64_t>(rows.size()), 1, [&](int64_t r) {
    thread_local std::vector<float> buf;
    const Row row = rows[r];
    const int64_t t = row.t;
    attend<E>(qp + t * N * H, kp, vp, pages + static_cast<int64_t>(row.seq) * P, row, N, K, H, G,
              P, sm_scale, sliding_window, soft_cap, lens[row.seq], op + t * N * H, buf);
  });
  return ffi::Error::Success();
}

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                    ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                    ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                    ffi::Buffer<ffi::S32> num_seqs, float sm_scale, int64_t sliding_window,
                    float soft_cap, ffi::Result<ffi::AnyBuffer> out) {
  auto dtype = q.element_type();
  if (k_pages.element_type() != dtype || v_pages.element_type() != dtype ||
      out->element_type() != dtype)
    return ffi::Error::InvalidArgument("q, k_pages, v_pages and the output need one dtype");
  if (q.dimensions().size() != 3 || k_pages.dimensions().size() != 4 ||
      q.dimensions()[2] != k_pages.dimensions()[3] || q.dimensions()[1] % k_pages.dimensions()[2])
    return ffi::Error::InvalidArgument("want q [T, N, H], pages [num_pages, G, K, H], K | N");
  if (dtype == ffi::DataType::F32)
    return Run<float>(pool, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                      sm_scale, sliding_window, soft_cap, out);
  if (dtype == ffi::DataType::BF16)
    return Run<uint16_t>(pool, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                         sm_scale, sliding_window, soft_cap, out);
  return ffi::Error::InvalidArgument("ragged paged attention (CPU) takes float32 or bfloat16");
}

}  // namespace

}  // namespace llmjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxRaggedPagedAttention, llmjax_cpu::Dispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<xla::ffi::AnyBuffer>());

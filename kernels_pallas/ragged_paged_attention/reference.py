"""Ragged paged attention, the specification: plain jnp, written for clarity, not speed.

One call attends a flat batch of T query tokens from up to S sequences (prefill chunks and decodes
mixed). Sequence s < num_seqs[0] owns query rows cu_q_lens[s]:cu_q_lens[s+1] (q_len of them) and
kv_lens[s] keys in its pages page_indices[s] (key j lives in page page_indices[s, j // G] at
offset j % G); its new tokens are the last q_len of its keys, so its query i sits at position
kv_lens[s] - q_len + i. Key j is visible to the query at position p iff j <= p (causal) and, with
a sliding window W, p - j < W. Scores are q.k * sm_scale, then soft_cap * tanh(score / soft_cap)
if soft_cap is set, then the mask; softmax and the weighted sum accumulate in float32; the output
has q's dtype. Rows from cu_q_lens[num_seqs[0]] on (padding) are 0. Query head n reads kv head
n // (N // K) (grouped-query attention).

Example (page size 4): seq 0 = 3-token prefill chunk with kv_len 3 in page 5; seq 1 = a decode at
position 6 (kv_len 7) in pages 2, 3; T = 8, S = 4:

    cu_q_lens    [0 3 4 4 4]     kv_lens  [3 7 0 0]     num_seqs [2]
    page_indices [[5 0] [2 3] [0 0] [0 0]]
    rows 0..2 -> seq 0 at positions 0, 1, 2; row 3 -> seq 1 at position 6; rows 4..7 -> 0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import dequantize

HIGHEST = jax.lax.Precision.HIGHEST  # full float32 on GPUs too (their default is TF32)


def query_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """-> (seq [T], pos [T]): each query row's sequence (clamped to the last one for padding) and
    its position in that sequence, kv_lens[s] - q_len + i."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    return seq, kv_lens[seq] - q_len + (t - cu_q_lens[seq])


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,  # [num_pages, G, K, H]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [num_pages, G, K, 1] float32: a quantized cache
    v_scales: jax.Array | None = None,
    kv_cache_dtype: str | None = None,  # None/'auto': pages in q's dtype; else kv_quant.py
) -> jax.Array:
    """-> [T, N, H]: every query row attends over its own sequence's cached keys (a quantized
    cache's rows read back as `kv_quant.dequantize(codes, scales, q.dtype, kv_cache_dtype)`)."""
    T, N, H = q.shape
    _, G, K, _ = k_pages.shape
    _, P = page_indices.shape
    seq, pos = query_positions(cu_q_lens, kv_lens, T)  # [T], [T]
    valid = jnp.arange(T) < cu_q_lens[num_seqs[0]]  # [T]

    pages = page_indices[seq]  # [T, P]
    k, v = k_pages[pages], v_pages[pages]  # [T, P, G, K, H]
    if kv_cache_dtype not in (None, "auto"):
        k = dequantize(k, k_scales[pages], q.dtype, kv_cache_dtype)
        v = dequantize(v, v_scales[pages], q.dtype, kv_cache_dtype)
    k = k.reshape(T, P * G, K, H).astype(jnp.float32)  # [T, C, K, H]
    v = v.reshape(T, P * G, K, H).astype(jnp.float32)
    qg = q.reshape(T, K, N // K, H).astype(jnp.float32)
    s = jnp.einsum("tkqh,tckh->tkqc", qg, k, precision=HIGHEST) * sm_scale  # [T, K, Q, C]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key = jnp.arange(P * G, dtype=jnp.int32)[None, :]  # [1, C]
    visible = (key <= pos[:, None]) & (key < kv_lens[seq][:, None])  # [T, C]
    if sliding_window is not None:
        visible &= pos[:, None] - key < sliding_window
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(valid[:, None, None, None], p, 0.0)  # padding rows: no NaNs, zeros out
    o = jnp.einsum("tkqc,tckh->tkqh", p, v, precision=HIGHEST).reshape(T, N, H)
    return o.astype(q.dtype)

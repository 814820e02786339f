"""Flash-attention prefill, the specification: plain jnp, written for clarity, not speed.

Causal self-attention of ONE sequence's prompt when nothing of it is cached: q, k and v are the
new tokens' own projections (not paged), padded to a bucket of T rows of which the first
seq_len[0] are real. Row i attends key j iff j <= i (causal), j < seq_len[0] and, with a sliding
window W, i - j < W. Scores are q.k * sm_scale, then soft_cap * tanh(score / soft_cap) if
soft_cap is set, then the mask; softmax and the weighted sum accumulate in float32; the output
has q's dtype. Rows i >= seq_len[0] (padding) are 0. Query head n reads kv head n // (N // K)
(grouped-query attention).

Example: T = 8, seq_len [5], sliding_window 3: row 4 attends keys 2, 3, 4; row 1 attends keys
0, 1; rows 5..7 -> 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # full float32 on GPUs too (their default is TF32)


def flash_prefill_reference(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    seq_len: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """-> [T, N, H]: causal attention of the first seq_len[0] rows over themselves."""
    T, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(T, K, N // K, H).astype(jnp.float32)
    s = (
        jnp.einsum("tkqh,ckh->kqtc", qg, k.astype(jnp.float32), precision=HIGHEST) * sm_scale
    )  # [K, Q, T, C]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    row = jnp.arange(T, dtype=jnp.int32)[:, None]  # [T, 1]
    key = jnp.arange(T, dtype=jnp.int32)[None, :]  # [1, C]
    n = seq_len[0]
    visible = (key <= row) & (key < n)  # [T, C]
    if sliding_window is not None:
        visible &= row - key < sliding_window
    s = jnp.where(visible, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where((row < n)[None, None], p, 0.0)  # padding rows: no NaNs, zeros out
    o = jnp.einsum("kqtc,ckh->tkqh", p, v.astype(jnp.float32), precision=HIGHEST).reshape(T, N, H)
    return o.astype(q.dtype)

"""Attention over the paged KV cache: the backend interface and its plain-jnp reference.

Letters: T tokens, S sequences, P pages per sequence, G page size, K kv heads, Q query heads per kv
head, N = K * Q query heads, H head dim, C key positions (= P * G).

The reference gathers, for every query token, its own sequence's pages and masks by position:
key j is visible to a token at position p iff j <= p (and p - j < sliding_window). Its cost is
O(T * C) like the attention itself, with no waste across sequences of a mixed batch. The Pallas
kernels (kernels_pallas/) implement the same contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Query tokens per block in the reference; bounds the gathered KV at [block, C, K, H].
REFERENCE_Q_BLOCK = 32


def token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[S + 1] cumulative lengths -> [T] sequence index of every token (padding maps past the end,
    clamped to the last sequence row, whose outputs are dropped)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2)


def paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,  # [num_pages, G, K, H]
    positions: jax.Array,  # [T] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    page_indices: jax.Array,  # [S, P] int32
    *,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal attention of every query token over its sequence's cached keys -> [T, N, H]."""
    T, N, H = q.shape
    K = k_pages.shape[2]
    seq_ids = token_seq_ids(cu_q_lens, T)  # [T]

    def attend(q_blk, pos_blk, seq_blk):
        B = q_blk.shape[0]
        pages = page_indices[seq_blk]  # [B, P]
        k = k_pages[pages].reshape(B, -1, K, H)  # [B, C, K, H]
        v = v_pages[pages].reshape(B, -1, K, H)
        qg = q_blk.reshape(B, K, N // K, H)  # [B, K, Q, H]
        s = jnp.einsum("bkqh,bckh->bkqc", qg, k, preferred_element_type=jnp.float32) * scale
        key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]  # [1, C]
        visible = key_pos <= pos_blk[:, None]  # [B, C]
        if sliding_window is not None:
            visible &= key_pos > pos_blk[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkqc,bckh->bkqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.reshape(B, N, H).astype(q.dtype)

    if T <= REFERENCE_Q_BLOCK or T % REFERENCE_Q_BLOCK:
        return attend(q, positions, seq_ids)
    nb = T // REFERENCE_Q_BLOCK
    blocks = (
        q.reshape(nb, REFERENCE_Q_BLOCK, N, H),
        positions.reshape(nb, REFERENCE_Q_BLOCK),
        seq_ids.reshape(nb, REFERENCE_Q_BLOCK),
    )
    out = jax.lax.map(lambda b: attend(*b), blocks)
    return out.reshape(T, N, H)

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
    """Causal attention of every query token over its sequence's cached keys -> [T, N, H].

    Query tokens go in blocks of REFERENCE_Q_BLOCK. A block whose tokens all belong to one
    sequence (the body of a prefill chunk) gathers that sequence's pages once; a mixed block
    (decodes, chunk boundaries) gathers each token's pages. Both give the same numbers; the first
    moves 1/REFERENCE_Q_BLOCK of the bytes.
    """
    T, N, H = q.shape
    K = k_pages.shape[2]
    page_indices = jnp.asarray(page_indices)  # indexed by traced ids inside lax.map/cond
    seq_ids = token_seq_ids(jnp.asarray(cu_q_lens), T)  # [T]

    def attend(qg, k, v, pos_blk, kv_spec):
        """qg: [B, K, Q, H]; k, v: [C, K, H] shared by the block ("ckh") or [B, C, K, H] one per
        token ("bckh") -> [B, N, H]."""
        B = qg.shape[0]
        s = jnp.einsum(f"bkqh,{kv_spec}->bkqc", qg, k, preferred_element_type=jnp.float32)
        key_pos = jnp.arange(s.shape[-1], dtype=jnp.int32)[None, :]  # [1, C]
        visible = key_pos <= pos_blk[:, None]  # [B, C]
        if sliding_window is not None:
            visible &= key_pos > pos_blk[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s * scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum(f"bkqc,{kv_spec}->bkqh", p, v, preferred_element_type=jnp.float32)
        return o.reshape(B, N, H).astype(q.dtype)

    def per_token(q_blk, pos_blk, seq_blk):
        B = q_blk.shape[0]
        pages = page_indices[seq_blk]  # [B, P]
        k = k_pages[pages].reshape(B, -1, K, H)  # [B, C, K, H]
        v = v_pages[pages].reshape(B, -1, K, H)
        return attend(q_blk.reshape(B, K, N // K, H), k, v, pos_blk, "bckh")

    def one_sequence(q_blk, pos_blk, seq_blk):
        B = q_blk.shape[0]
        pages = page_indices[seq_blk[0]]  # [P]
        k = k_pages[pages].reshape(-1, K, H)  # [C, K, H]
        v = v_pages[pages].reshape(-1, K, H)
        return attend(q_blk.reshape(B, K, N // K, H), k, v, pos_blk, "ckh")

    def block(q_blk, pos_blk, seq_blk):
        # Sequence ids never decrease along the flat batch, so first == last means one sequence.
        is_one_sequence = seq_blk[0] == seq_blk[-1]
        return jax.lax.cond(is_one_sequence, one_sequence, per_token, q_blk, pos_blk, seq_blk)

    B = min(T, REFERENCE_Q_BLOCK)
    if T % B:
        return per_token(q, positions, seq_ids)
    blocks = (q.reshape(-1, B, N, H), positions.reshape(-1, B), seq_ids.reshape(-1, B))
    return jax.lax.map(lambda b: block(*b), blocks).reshape(T, N, H)

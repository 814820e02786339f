"""H2O (Zhang et al., NeurIPS'23), heavy-hitter eviction, on the sparse-KV pool
(`SparseKVConfig.mode='h2o'`; llmjax/sparse/infinigen.py runs the step).

Per layer (past the first `num_dense_layers`) and kv head, every cached token carries its
*accumulated attention*: the attention probabilities it received from every query so far (summed
over the kv head's query heads), kept on the device as `acc` [num_pages, G, K] float32. A token's
entry is reset to 0 when its slot is written (a new token, or a reused page).

- Every query adds its probabilities: prefill and mixed steps attend with `dense_attention`
  (full attention over the token's sequence, minus evicted tokens, whose column sums are added
  in blocks of query tokens), decode-only steps with the rows selected (`select`).
- A decode-only step keeps, besides the sinks and the recent window, the `max_num_kv` tokens
  with the highest accumulated attention and *evicts* the others: their `acc` becomes -inf and
  they are never attended again, in any later step. With one new token leaving the recent window
  per step, that is H2O's greedy rule (evict the lowest-scored token once the cache is over its
  budget).

Unlike InfiniGen, Quest and the oracle, which choose again at every step from everything the
pool holds, H2O's choice is permanent: a token evicted early cannot come back when a later query
needs it. Here eviction is logical (the pool keeps the rows; the bytes saved are the fetches
skipped); a page is not returned to the free list. Eviction state lives in the pages, so H2O
needs pages that are not shared: prefix caching must be off (`EngineConfig` checks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.model.step_input import RESERVED_PAGE, StepInput
from llmjax.sparse.select import candidates, select_rows

Q_BLOCK = 32  # query tokens per block of the dense path


def reset(acc: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """The written slots' accumulated attention starts at 0."""
    G = acc.shape[1]
    return acc.at[slot_mapping // G, slot_mapping % G].set(0.0)


def _slots(step: StepInput, seq_ids: jax.Array, C: int, G: int) -> jax.Array:
    """Every key position's pool slot for each token's sequence -> [T, C]."""
    pos = jnp.arange(C, dtype=jnp.int32)
    table = jnp.asarray(step.page_indices)[seq_ids]  # [T, P]
    return table[:, pos // G] * G + pos % G


def accumulate(acc: jax.Array, probs: jax.Array, slots: jax.Array, real: jax.Array) -> jax.Array:
    """Add probabilities [T, K, M] at pool slots [T, K, M] (real tokens [T] only)."""
    num_pages, G, K = acc.shape
    flat = acc.reshape(num_pages * G, K)
    heads = jnp.broadcast_to(jnp.arange(K)[None, :, None], probs.shape)
    probs = jnp.where(real[:, None, None], probs, 0.0)
    return flat.at[slots, heads].add(probs).reshape(acc.shape)


def dense_attention(
    q: jax.Array,  # [T, N, H]
    k_all: jax.Array,  # [S * P, G, K, H] every sequence's pages, fetched
    v_all: jax.Array,
    acc: jax.Array,
    step: StepInput,
    seq_ids: jax.Array,  # [T]
    scale: float,
    window: int | None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of every token over its sequence's keys except the evicted ones, and
    the accumulated attention with this step's probabilities added -> (o [T, N, H], acc)."""
    T, N, H = q.shape
    S, P = step.page_indices.shape
    G, K = k_all.shape[1], k_all.shape[2]
    C = P * G
    keys = k_all.reshape(S, C, K, H)
    vals = v_all.reshape(S, C, K, H)
    B = min(Q_BLOCK, T)
    pad = -T % B
    n_real = step.cu_q_lens[step.num_seqs[0]]

    def padded(x):
        return jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x

    qb = padded(q).reshape(-1, B, K, N // K, H)
    sb = padded(seq_ids).reshape(-1, B)
    pb = padded(step.positions).reshape(-1, B)
    tb = jnp.arange(T + pad, dtype=jnp.int32).reshape(-1, B)

    def block(acc, xs):
        qg, seq, pos, t = xs
        slots = _slots(step, seq, C, G)  # [B, C]
        gone = acc.reshape(-1, K)[slots] == -jnp.inf  # [B, C, K] evicted
        key_pos = jnp.arange(C, dtype=jnp.int32)
        visible = key_pos[None] <= pos[:, None]
        visible &= jnp.repeat(jnp.asarray(step.page_indices)[seq] != RESERVED_PAGE, G, axis=1)
        if window is not None:
            visible &= key_pos[None] > pos[:, None] - window
        visible = visible[:, None, :] & ~jnp.swapaxes(gone, 1, 2)  # [B, K, C]
        s = jnp.einsum("bkqh,bckh->bkqc", qg, keys[seq], preferred_element_type=jnp.float32)
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[:, :, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(visible[:, :, None], p, 0.0)
        o = jnp.einsum("bkqc,bckh->bkqh", p.astype(vals.dtype), vals[seq])
        slots_k = jnp.broadcast_to(slots[:, None, :], (B, K, C))
        acc = accumulate(acc, p.sum(axis=2), slots_k, t < n_real)
        return acc, o.reshape(B, N, H).astype(q.dtype)

    acc, o = jax.lax.scan(block, acc, (qb, sb, pb, tb))
    return o.reshape(-1, N, H)[:T], acc


def select(
    acc: jax.Array,
    step: StepInput,
    seq_ids: jax.Array,  # [D] the decode tokens' sequences
    sparse,
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode-only step's rows: the sinks, the recent window and the `max_num_kv` heavy
    hitters -> (positions [D, K, M], valid, acc with every other candidate evicted)."""
    _, G, K = acc.shape
    D = seq_ids.shape[0]
    C = step.page_indices.shape[1] * G
    slots = _slots(step, seq_ids, C, G)  # [D, C]
    s = jnp.swapaxes(acc.reshape(-1, K)[slots], 1, 2)  # [D, K, C]
    positions, valid = select_rows(s, None, step, seq_ids, sparse, G, window, alpha=None)
    kept = jnp.zeros((D, K, C), bool)
    d = jnp.arange(D)[:, None, None]
    k = jnp.arange(K)[None, :, None]
    kept = kept.at[d, k, positions].max(valid)
    cand = candidates(step, seq_ids, sparse, G, window)  # [D, C]
    evict = cand[:, None, :] & ~kept & (s > -jnp.inf)
    real = seq_ids < step.num_seqs[0]
    evict &= real[:, None, None]
    mark = jnp.where(evict, -jnp.inf, jnp.inf)  # min with +inf leaves an entry as it is
    flat = acc.reshape(-1, K)
    heads = jnp.broadcast_to(k, (D, K, C))
    flat = flat.at[jnp.broadcast_to(slots[:, None, :], (D, K, C)), heads].min(mark)
    return positions, valid, flat.reshape(acc.shape)

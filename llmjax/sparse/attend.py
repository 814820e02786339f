"""The sparse KV's selection and attention: InfiniGen's speculation (the next layer's query
against the partial keys), the oracle's and Quest's scores, and attention over the selected rows
(jnp, or the Pallas kernel over a fetched page table) or over all pages (the dense layers).
infinigen.py's step uses them (its module doc gives the letters)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import SparseKVConfig
from llmjax.model.attention import paged_attention_reference
from llmjax.model.step_input import RESERVED_PAGE, StepInput
from llmjax.sparse.pool import (
    fetch_pages,
)
from llmjax.sparse.select import select_rows


def speculate(
    q_next: jax.Array,  # [T, N, H] the next layer's query (post-RoPE) of the step's first T tokens
    partial_pages: jax.Array,  # [num_pages, G, K, c] the next layer's partial keys
    a_part: jax.Array,  # [K, H, c]
    step: StepInput,
    seq_ids: jax.Array,  # [T] their sequences
    sparse: SparseKVConfig,
    sm_scale: float,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """InfiniGen's speculation for decode tokens -> (positions [T, K, M], valid [T, K, M]) of the
    rows the next layer attends to besides the token itself: the sink tokens, the recent ones,
    and the speculated ones (M = num_sink + num_recent - 1 + the cap). `partial_pages` and
    `a_part` as `allocate_partial_keys` and `speculation_weights` give them (pairs and the whole
    skew with `page_residual`)."""
    s = speculated_scores(q_next, partial_pages, a_part, step, seq_ids, sparse.page_residual)
    G = (partial_pages[0] if isinstance(partial_pages, tuple) else partial_pages).shape[1]
    return select_rows(s * sm_scale, None, step, seq_ids, sparse, G, window, alpha=sparse.alpha)


def speculated_scores(
    q: jax.Array,  # [T, N, H] post-RoPE queries
    state,  # partial keys [num_pages, G, K, c], or (those, bounds [num_pages, 2, K, H - c])
    weights: jax.Array,  # [K, H, c], or [K, H, H] (kept columns first) with the bounds
    step: StepInput,
    seq_ids: jax.Array,  # [T]
    page_residual: str = "none",
) -> jax.Array:
    """InfiniGen's speculated logits (unscaled) of each query token against every key position
    of its sequence, the group's best query head per kv head -> [T, K, C]: the partial skewed
    query times the partial keys, plus, with `page_residual`, the estimate of the left-out
    columns from the key's page bounds (the interval's midpoint, 'page_mid', or its upper end,
    'page_upper')."""
    partial, bounds = state if isinstance(state, tuple) else (state, None)
    T, N, H = q.shape
    _, G, K, c = partial.shape
    Q = N // K
    P = step.page_indices.shape[1]
    table = step.page_indices[seq_ids]  # [T, P]
    qs = jnp.einsum("tkqh,khc->tkqc", q.reshape(T, K, Q, H).astype(jnp.float32), weights)
    keys = partial[table].reshape(T, P * G, K, c)
    s = jnp.einsum("tkqc,tjkc->tkqj", qs[..., :c], keys.astype(jnp.float32))
    if bounds is not None and page_residual != "none":
        b = bounds[table]  # [T, P, 2, K, H - c]
        qr = qs[..., c:]
        lo = jnp.einsum("tkqr,tpkr->tkqpr", qr, b[:, :, 0])
        hi = jnp.einsum("tkqr,tpkr->tkqpr", qr, b[:, :, 1])
        upper = jnp.maximum(lo, hi).sum(axis=-1)  # [T, K, Q, P]
        est = upper if page_residual == "page_upper" else (upper + jnp.minimum(lo, hi).sum(-1)) / 2
        s = s + jnp.repeat(est, G, axis=-1)
    return s.max(axis=2)  # [T, K, C]: the group's best query head


def oracle_scores(q: jax.Array, k_pages: jax.Array, step: StepInput, seq_ids, host: bool):
    """The exact attention logits (unscaled) of each query token [T, N, H] against every key of
    its sequence, the group's best query head per kv head -> [T, K, C]. Reads every key of the
    layer (the oracle saves no bytes)."""
    T, N, H = q.shape
    _, G, K, _ = k_pages.shape
    P = step.page_indices.shape[1]
    keys = fetch_pages(k_pages, step.page_indices[seq_ids], host, q.dtype)
    keys = keys.reshape(T, P * G, K, H)
    s = jnp.einsum(
        "tkqh,tjkh->tkqj",
        q.reshape(T, K, N // K, H).astype(jnp.float32),
        keys.astype(jnp.float32),
    )
    return s.max(axis=2)


def quest_page_scores(q: jax.Array, bounds: jax.Array, step: StepInput, seq_ids) -> jax.Array:
    """Quest's upper bound of each page's attention logits (unscaled) -> [T, K, P]: sum over
    dims of max(q * min, q * max), the group's best query head per kv head. Never below the
    true logit of any key written to the page."""
    T, N, H = q.shape
    K = bounds.shape[2]
    b = bounds[step.page_indices[seq_ids]]  # [T, P, 2, K, H]
    qg = q.reshape(T, K, N // K, H).astype(jnp.float32)
    lo = jnp.einsum("tkqh,tpkh->tkqph", qg, b[:, :, 0])
    hi = jnp.einsum("tkqh,tpkh->tkqph", qg, b[:, :, 1])
    return jnp.maximum(lo, hi).sum(axis=-1).max(axis=2)


def sparse_attention(
    q: jax.Array,  # [T, N, H]
    k_rows: jax.Array,  # [T, K, M, H]
    v_rows: jax.Array,
    valid: jax.Array,  # [T, K, M]
    k_new: jax.Array,  # [T, K, H] each token's own key and value
    v_new: jax.Array,
    sm_scale: float,
    soft_cap: float | None = None,
    with_probs: bool = False,
) -> jax.Array:
    """Each token over its fetched rows and itself -> [T, N, H] (float32 softmax; scores capped
    at `soft_cap` as the model's attention caps them); with
    `with_probs`, also each row's probability summed over the kv head's queries [T, K, M + 1]
    (the token's own row last)."""
    T, N, H = q.shape
    K = k_rows.shape[1]
    k = jnp.concatenate([k_rows, k_new[:, :, None].astype(k_rows.dtype)], axis=2)
    v = jnp.concatenate([v_rows, v_new[:, :, None].astype(v_rows.dtype)], axis=2)
    valid = jnp.concatenate([valid, jnp.ones((T, K, 1), bool)], axis=2)
    v = jnp.where(valid[..., None], v, 0)  # unselected rows (page 0's garbage) weigh exactly 0
    qg = q.reshape(T, K, N // K, H)
    s = jnp.einsum("tkqh,tkmh->tkqm", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    p32 = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("tkqm,tkmh->tkqh", p32.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o.reshape(T, N, H).astype(q.dtype)
    return (o, p32.sum(axis=2)) if with_probs else o


def sparse_attention_pallas(
    q,
    k_rows,
    v_rows,
    valid,
    k_new,
    v_new,
    sm_scale,
    soft_cap: float | None = None,
    page_size: int = 16,
    implementation: str | None = None,
) -> jax.Array:
    """`sparse_attention` with the ragged paged attention kernel `implementation` (None: the
    platform's; kernels_pallas/; interpreted on the CPU): each (token, kv head) becomes one decode
    sequence with a single kv head, its valid rows moved to the front and its own row after
    them, laid out as pages of `page_size`, so the kernel attends exactly those kv_len =
    n_valid + 1 rows."""
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention

    D, K, M, H = k_rows.shape
    N = q.shape[1]
    order = jnp.argsort(~valid, axis=-1, stable=True)  # valid rows first, in their order
    n = valid.sum(axis=-1).astype(jnp.int32)  # [D, K]
    Mp = -(-(M + 1) // page_size) * page_size

    def compact(rows, new):
        rows = jnp.take_along_axis(rows, order[..., None], axis=2)
        buf = jnp.zeros((D, K, Mp, H), rows.dtype).at[:, :, :M].set(rows)
        d, k = jnp.meshgrid(jnp.arange(D), jnp.arange(K), indexing="ij")
        buf = buf.at[d, k, n].set(new.astype(rows.dtype))  # the token's own row after them
        return buf.reshape(D * K * Mp // page_size, page_size, 1, H)

    pages_per_seq = Mp // page_size
    out = ragged_paged_attention(
        q.reshape(D * K, N // K, H),
        compact(k_rows, k_new),
        compact(v_rows, v_new),
        (n + 1).reshape(-1),
        jnp.arange(D * K * pages_per_seq, dtype=jnp.int32).reshape(D * K, pages_per_seq),
        jnp.arange(D * K + 1, dtype=jnp.int32),
        jnp.array([D * K], jnp.int32),
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        implementation=implementation,
    )
    return out.reshape(D, N, H)


def dense_attention(
    q,
    pages_k,
    pages_v,
    step: StepInput,
    host: bool,
    sm_scale,
    window,
    pallas: bool = False,
    implementation: str | None = None,
    soft_cap: float | None = None,
):
    """Full attention over each sequence's fetched pages (holes masked; with `pallas`, the
    ragged paged attention kernel `implementation` over them, for pools without holes)."""
    S, P = step.page_indices.shape
    k_all = fetch_pages(pages_k, step.page_indices, host, q.dtype)  # [S * P, G, K, H]
    v_all = fetch_pages(pages_v, step.page_indices, host, q.dtype)
    local = jnp.arange(S * P, dtype=jnp.int32).reshape(S, P)
    # Holes and padding keep page id 0 in the local table, so mask_holes sees them.
    local = jnp.where(step.page_indices == RESERVED_PAGE, 0, local + 1)
    pad = jnp.zeros((1, *k_all.shape[1:]), k_all.dtype)
    if pallas:
        from kernels_pallas.ragged_paged_attention import ragged_paged_attention

        return ragged_paged_attention(
            q,
            jnp.concatenate([pad, k_all]),
            jnp.concatenate([pad, v_all]),
            step.kv_lens,
            local,
            step.cu_q_lens,
            step.num_seqs,
            sm_scale=sm_scale,
            sliding_window=window,
            soft_cap=soft_cap,
            implementation=implementation,
        )
    return paged_attention_reference(
        q,
        jnp.concatenate([pad, k_all]),
        jnp.concatenate([pad, v_all]),
        step.positions,
        step.cu_q_lens,
        local,
        scale=sm_scale,
        sliding_window=window,
        soft_cap=soft_cap,
        mask_holes=True,
    )

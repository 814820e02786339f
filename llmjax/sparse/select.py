"""Which KV rows a decode token attends to, given scores: the selection every sparse method
shares (InfiniGen's speculated scores, the oracle's exact ones, Quest's page bounds, H2O's
accumulated attention; infinigen.py and h2o.py compute the scores). The sinks and the recent
window always; of the other resident rows (inside a sliding window), up to the cap, the best
scored first (`SparseKVConfig`: max_num_kv, granularity, the sinks and recent counts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import SparseKVConfig
from llmjax.model.step_input import RESERVED_PAGE, StepInput


def page_of(step: StepInput, seq_ids: jax.Array, positions: jax.Array, G: int) -> jax.Array:
    """The page id holding each position [T, ...] of the token's sequence."""
    table = step.page_indices[seq_ids]  # [T, P]
    shape = positions.shape
    flat = positions.reshape(shape[0], -1) // G
    return jnp.take_along_axis(table, flat, axis=1).reshape(shape)


def candidates(step: StepInput, seq_ids, sparse: SparseKVConfig, G: int, window) -> jax.Array:
    """[T, C]: the key positions a decode token's selection chooses among (resident, neither a
    sink nor in the recent window, inside a sliding window)."""
    T = seq_ids.shape[0]
    C = step.page_indices.shape[1] * G
    pos = step.positions[:T]
    key_pos = jnp.arange(C, dtype=jnp.int32)
    table = step.page_indices[seq_ids]  # [T, P]
    resident = jnp.repeat(table != RESERVED_PAGE, G, axis=1)  # [T, C]
    candidate = (
        (key_pos[None] < pos[:, None] - (sparse.num_recent_tokens - 1))  # older than recent
        & (key_pos[None] >= sparse.num_sink_tokens)
        & resident
    )
    if window is not None:  # a sliding-window model never attends further back
        candidate &= key_pos[None] > pos[:, None] - window
    return candidate


def select_rows(
    s: jax.Array | None,  # [T, K, C] token scores (None: pages only)
    page_scores: jax.Array | None,  # [T, K, P] page scores (None: the best token's per page)
    step: StepInput,
    seq_ids: jax.Array,  # [T]
    sparse: SparseKVConfig,
    G: int,
    window: int | None,
    alpha: float | None,
) -> tuple[jax.Array, jax.Array]:
    """The rows a decode token attends to besides itself -> (positions [T, K, M], valid): the
    sinks, the recent tokens, and up to the cap (`max_num_kv` tokens, or that many // G pages
    with granularity 'page' or page scores) of the others, the best scored first. `alpha`:
    keep only those within alpha of the best (InfiniGen's count, averaged over kv heads);
    None keeps the cap (exact top-k)."""
    T = seq_ids.shape[0]
    P = step.page_indices.shape[1]
    C = P * G
    K = (s if s is not None else page_scores).shape[1]
    pos = step.positions[:T]  # the step's first T tokens (its decodes)
    n_sink, n_recent = sparse.num_sink_tokens, sparse.num_recent_tokens
    candidate = candidates(step, seq_ids, sparse, G, window)
    cap = C if sparse.max_num_kv is None else min(sparse.max_num_kv, C)
    if s is not None:
        s = jnp.where(candidate[:, None, :], s, -jnp.inf)
    if page_scores is not None or sparse.granularity == "page":
        has = candidate.reshape(T, 1, P, G).any(axis=-1)
        if page_scores is None:
            page_scores = s.reshape(T, K, P, G).max(axis=-1)  # [T, K, P]
        page_scores = jnp.where(has, page_scores, -jnp.inf)
        n_pages = max(cap // G, 1)
        top_val, top_page = jax.lax.top_k(page_scores, n_pages)
        rank = jnp.arange(n_pages)
        page_ok = top_val > -jnp.inf
        if alpha is not None:
            page_ok &= rank[None, None] < _count(page_scores, alpha, n_pages)[:, None, None]
        top_pos = (top_page[..., None] * G + jnp.arange(G)).reshape(T, K, -1)
        ok = jnp.repeat(page_ok, G, axis=-1)
        ok &= jnp.take_along_axis(
            jnp.broadcast_to(candidate[:, None, :], (T, K, C)), top_pos, axis=-1
        )
    else:
        top_val, top_pos = jax.lax.top_k(s, cap)  # [T, K, cap]
        ok = top_val > -jnp.inf
        if alpha is not None:
            ok &= jnp.arange(cap)[None, None] < _count(s, alpha, cap)[:, None, None]
    sink = jnp.broadcast_to(jnp.arange(n_sink, dtype=jnp.int32), (T, K, n_sink))
    sink_ok = sink <= pos[:, None, None] - n_recent  # older than the recent window
    recent = pos[:, None, None] - jnp.arange(1, n_recent, dtype=jnp.int32)  # the token: own row
    recent = jnp.broadcast_to(recent, (T, K, n_recent - 1))
    recent_ok = recent >= 0
    if window is not None:
        sink_ok &= sink > pos[:, None, None] - window
        recent_ok &= recent > pos[:, None, None] - window
    positions = jnp.concatenate([sink, recent, top_pos.astype(jnp.int32)], axis=-1)
    valid = jnp.concatenate([sink_ok, recent_ok, ok], axis=-1)
    positions = jnp.where(valid, positions, 0)
    # Sinks and recent tokens are always fetched, unless evicted (never, by the pool's rules:
    # index 0 and the newest half stay; masked anyway).
    valid &= page_of(step, seq_ids, positions, G) != RESERVED_PAGE
    return positions, valid


def _count(scores: jax.Array, alpha: float, cap: int) -> jax.Array:
    """[T, K, X] speculated logits -> [T] rows to keep per kv head: the mean over kv heads of the
    entries within `alpha` of the head's best, at most `cap` (InfiniGen's n_sel)."""
    best = scores.max(axis=-1, keepdims=True)
    within = (scores > best - alpha) & (scores > -jnp.inf)
    cnt = within.sum(axis=-1).mean(axis=-1)  # [T]
    return jnp.minimum(cnt.astype(jnp.int32), cap)

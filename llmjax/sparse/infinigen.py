"""The model step with the KV cache in a host pool: full fetches (`offload`) or InfiniGen's
speculated, selective fetches (`infinigen`), ALGORITHMS.md §11.3 and §13.2.

`sparse_forward(params, pool, partial_keys, weights, step, config, sparse, host)` runs one ragged
step like `llmjax.model.llama.forward`, but every layer's K/V pages live in `pool` (a JAX host
memory kind when `host`: gathers and writes run on the host under `compute_on('device_host')`,
and only what they return crosses to the device).

Per layer i of a step:
  - the new tokens' K/V go to their pool slots (and, for speculated layers, their skewed partial
    keys to the device-resident `partial_keys`);
  - a *dense* layer (every layer of a step that has prefill tokens, every layer in `offload`,
    the first `num_dense_layers` in `infinigen`) fetches all pages of each sequence and attends
    over them (`fetch_pages` + the jnp reference, evicted pages masked);
  - a *sparse* layer attends over the rows selected for it while the previous layer ran
    (`speculate`: the next layer's query from this layer's attention input, skewed and cut to the
    partial columns, against the partial key cache; `fetch_rows` gathers them through the page
    table), plus the new token's own K/V (decode-only steps: the pool does not hold it yet when
    the fetch is issued).
  Which of the two a step takes is decided at run time (`lax.cond` on "every sequence decodes one
  token"), so each shape bucket compiles once.

Variants (SparseKVConfig): `query_source='own_layer'` selects inside each sparse layer with its
own query against its partial keys (`_select_in_layer`, as the oracle, Quest and H2O do), so the
fetch no longer overlaps the previous layer; `page_residual` keeps, beside the partial keys, each
page's min and max of the skewed columns the cut leaves out (`write_partial`, `quest_update`)
and adds that interval's midpoint or upper end to each token's partial score
(`speculated_scores`).

Selection is per query token and *kv head* (GQA: a token is fetched for a kv head when any of its
query heads' speculated logits is within `alpha` of that head's best; with one query per kv head
this is InfiniGen's per-head rule). Fetch units are rows [H] of K and V per (token, kv head).

Letters: T tokens, S sequences, P pages per sequence, G page size, C = P * G key positions,
K kv heads, Q query heads per kv head, N = K * Q, H head dim, c partial columns, M fetched rows.

Static shapes: a decode-only step's tokens are its first S rows (one per sequence), so the fetch
buffer is [S, K, M, H] (M = sink + recent + max_num_kv) and XLA copies it whole: the bytes an
accelerator moves are bounded by `max_num_kv`; the rows actually selected (what InfiniGen
transfers) are counted and returned as `SparseStats`.

In place: layer i+1's pool pages and partial keys are read during layer i (speculation, fetch)
and written by layer i+1; optimization barriers order the writes after the reads, without which
XLA copied both every step (tests/test_sparse_infinigen.py checks the compiled HLO).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from llmjax.config import ModelConfig, SparseKVConfig
from llmjax.model.attention import paged_attention_reference, token_seq_ids
from llmjax.model.kv_cache import KVPages
from llmjax.model.layers import layer_rope, norm, rope_cos_sin
from llmjax.model.llama import attention_q, attention_qkv, embed_tokens, lm_head, mlp_block
from llmjax.model.params import Params, unstack_layers
from llmjax.model.quant import linear
from llmjax.model.step_input import RESERVED_PAGE, StepInput
from llmjax.sparse import h2o
from llmjax.sparse.select import page_of, select_rows
from llmjax.sparse.skew import partial_columns

HOST_MEMORY_KIND = "pinned_host"


class SparseStats(NamedTuple):
    """Per step, from the device: `sparse` whether the step took the sparse path; `rows` [T] the
    (token, kv head) rows each query token fetched over all speculated layers (sink, recent and
    its own row included); `page_hits` [S, P] how often each page index of each sequence was
    speculatively selected (over layers and kv heads; the counter eviction policy's input)."""

    sparse: jax.Array
    rows: jax.Array
    page_hits: jax.Array


# ---- the pool --------------------------------------------------------------------------------


def pool_memory_kind(name: str, device=None) -> str | None:
    """SparseKVConfig.pool_memory -> the memory kind of the pool's arrays (None: the device's
    default). 'auto' takes pinned_host where the device has it."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if name == "device":
        return None
    if name == "pinned_host" or (name == "auto" and HOST_MEMORY_KIND in kinds):
        if HOST_MEMORY_KIND not in kinds:
            raise ValueError(
                f"pool_memory='pinned_host' but {device.platform} device {device} has memory "
                f"kinds {sorted(kinds)}; use pool_memory='device'"
            )
        return HOST_MEMORY_KIND
    return None


def allocate_pool(
    config: ModelConfig, num_pages: int, page_size: int, dtype, memory_kind: str | None
) -> KVPages:
    """The paged KV pool [num_pages, G, K, H] per layer (K and V), in `memory_kind`."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    # device_put of a host buffer: no device memory is touched for a host pool, and the arrays'
    # types carry the memory space (jit's out_shardings gave the kind but not the type, so the
    # first step traced twice).
    zeros = lambda: jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)
    return [(zeros(), zeros()) for _ in range(config.num_layers)]


def allocate_partial_keys(
    config: ModelConfig, sparse: SparseKVConfig, num_pages: int, page_size: int, dtype
) -> list[jax.Array | None]:
    """The device-resident selection metadata of every selective layer (None for dense layers
    and other modes): 'infinigen', the skewed partial keys [num_pages, G, K, c]
    (`partial_weight_ratio` of the key cache, as in InfiniGen), with `page_residual` a pair
    (those, each page's min and max of the left-out skewed columns [num_pages, 2, K, H - c]
    float32); 'quest', each page's element-wise key min and max [num_pages, 2, K, H] float32
    (2 / G of the key cache's rows); 'h2o', each slot's accumulated attention."""
    K, H = config.num_kv_heads, config.head_dim
    c = partial_columns(np.zeros((1, 1, H)), sparse.partial_weight_ratio).shape[-1]
    shape = (num_pages, page_size, K, c)
    out = [None] * config.num_layers
    if sparse.mode == "quest":
        shape, dtype = (num_pages, 2, K, H), jnp.float32
    if sparse.mode == "h2o":
        shape, dtype = (num_pages, page_size, K), jnp.float32
    if sparse.mode in ("infinigen", "quest", "h2o"):
        # Committed to the device like the step's outputs: an uncommitted first input made the
        # second call of the same bucket compile again (same trace, other shardings).
        device = jax.devices()[0]
        zeros = lambda shape, dtype: jax.device_put(np.zeros(shape, jnp.dtype(dtype)), device)
        for i in range(sparse.num_dense_layers, config.num_layers):
            out[i] = zeros(shape, dtype)
            if sparse.mode == "infinigen" and sparse.page_residual != "none":
                # (partial keys, the left-out columns' page bounds as quest_update keeps them)
                out[i] = (out[i], zeros((num_pages, 2, K, H - c), jnp.float32))
    return out


def speculation_weights(
    skew: np.ndarray, energy: np.ndarray, config: ModelConfig, sparse: SparseKVConfig
) -> list[jax.Array | None]:
    """Per layer, the skew's kept columns A[:, :, idx] [K, H, c] (None for dense layers): q_rope
    @ it is the partial skewed query, k_rope @ it the partial skewed key. With `page_residual`
    the whole skew [K, H, H], the kept columns first and the left-out ones after them."""
    out: list[jax.Array | None] = [None] * config.num_layers
    if sparse.mode != "infinigen":
        return out
    idx = partial_columns(energy, sparse.partial_weight_ratio)  # [L, K, c]
    H = skew.shape[-1]
    for i in range(sparse.num_dense_layers, config.num_layers):
        if sparse.page_residual != "none":
            rest = np.stack([np.setdiff1d(np.arange(H), kept) for kept in idx[i]])
            order = np.concatenate([idx[i], rest], axis=-1)  # [K, H]
        else:
            order = idx[i]
        cols = np.take_along_axis(skew[i], order[:, None, :], axis=-1)  # [K, H, c or H]
        out[i] = jnp.asarray(cols, jnp.float32)
    return out


def write_partial(state, k: jax.Array, weights: jax.Array, slot_mapping: jax.Array, G: int):
    """InfiniGen's device-resident state after the step's key writes: the new keys [T, K, H]
    skewed, their kept columns into the partial key cache, and (with `page_residual`) the
    left-out columns widening their pages' bounds."""
    partial, bounds = state if isinstance(state, tuple) else (state, None)
    c = partial.shape[-1]
    skewed = jnp.einsum("tkh,khc->tkc", k.astype(jnp.float32), weights)
    slots = slot_mapping
    partial = partial.at[slots // G, slots % G].set(skewed[..., :c].astype(partial.dtype))
    if bounds is None:
        return partial
    return partial, quest_update(bounds, skewed[..., c:], slots, G)


def _on_host(fn, *args, host: bool):
    """fn(*args) run where the pool lives (host compute when `host`), result in the same space."""
    if not host:
        return fn(*args)
    args = [jax.device_put(a, jax.memory.Space.Host) for a in args]
    return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
        *args
    )


def _to_device(x, host: bool):
    return jax.device_put(x, jax.memory.Space.Device) if host else x


def write_pool(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array, host: bool) -> jax.Array:
    """Scatter the new tokens' rows [T, K, H] into pool pages [P, G, K, H] at their slots."""
    shape = pages.shape

    # Host computations take their index arrays ready-made: constants made inside one live in
    # device memory, and XLA rejects mixing the two.
    def write(pages, new, slots):
        flat = pages.reshape(-1, *shape[2:])
        return flat.at[slots].set(new.astype(pages.dtype)).reshape(shape)

    return _on_host(write, pages, new, slot_mapping, host=host)


def fetch_pages(pages: jax.Array, page_indices: jax.Array, host: bool) -> jax.Array:
    """All pages of every sequence's table [S, P] -> [S * P, G, K, H] on the device (a full
    fetch; pages of holes and padding come along and are masked by the attention)."""
    rows = _on_host(lambda p, idx: p[idx.reshape(-1)], pages, page_indices, host=host)
    return _to_device(rows, host)


def fetch_rows(pages: jax.Array, slots: jax.Array, host: bool) -> jax.Array:
    """Rows [T, K, M, H] at pool slots [T, K, M] (row (t, k, m) from kv head k) -> the device."""
    K, H = pages.shape[2:]
    rows = slots * K + jnp.arange(K, dtype=jnp.int32)[None, :, None]  # into [P * G * K, H]

    def gather(pages, rows):
        return pages.reshape(-1, H)[rows]

    return _to_device(_on_host(gather, pages, rows, host=host), host)


# ---- selection -------------------------------------------------------------------------------


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
    keys = fetch_pages(k_pages, step.page_indices[seq_ids], host).reshape(T, P * G, K, H)
    s = jnp.einsum(
        "tkqh,tjkh->tkqj",
        q.reshape(T, K, N // K, H).astype(jnp.float32),
        keys.astype(jnp.float32),
    )
    return s.max(axis=2)


def quest_update(
    bounds: jax.Array,  # [num_pages, 2, K, H] float32: each page's element-wise key min, max
    k: jax.Array,  # [T, K, H] the step's new keys (as stored in the pool)
    slot_mapping: jax.Array,  # [T]
    G: int,
) -> jax.Array:
    """Quest's page metadata after the step's key writes: a page whose first slot is written
    starts afresh (pages fill in order from their first slot, so a reused page is reset), then
    each new key widens its page's min and max."""
    page, first = slot_mapping // G, slot_mapping % G == 0
    kf = k.astype(jnp.float32)
    fresh = jnp.where(first, page, bounds.shape[0])  # out of range: dropped
    lo = bounds[:, 0].at[fresh].set(jnp.inf, mode="drop").at[page].min(kf)
    hi = bounds[:, 1].at[fresh].set(-jnp.inf, mode="drop").at[page].max(kf)
    return jnp.stack([lo, hi], axis=1)


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
    k_all = fetch_pages(pages_k, step.page_indices, host)  # [S * P, G, K, H]
    v_all = fetch_pages(pages_v, step.page_indices, host)
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


# ---- the step --------------------------------------------------------------------------------


def decode_only(step: StepInput) -> jax.Array:
    """Every sequence of the step decodes one token (no prefill chunk): the sparse path's steps."""
    n = step.num_seqs[0]
    return (step.cu_q_lens[n] == n) & (n > 0)


def sparse_forward(
    params: Params,
    pool: KVPages,
    partial_keys: list,
    weights: list,
    step: StepInput,
    config: ModelConfig,
    sparse: SparseKVConfig,
    host: bool,
    pallas: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, KVPages, list, SparseStats]:
    """One model step over the host pool -> (logits [L, V] float32, pool, partial_keys, stats).
    `weights`: `speculation_weights` (None entries for dense layers). `pallas`: attend with the
    ragged paged attention kernel `implementation` (None: the platform's) over the fetched pages
    and over the fetched rows instead of jnp; needs a pool without holes (capacity 1)."""
    L = config.num_layers
    T = step.token_ids.shape[0]
    S, P = step.page_indices.shape
    G = pool[0][0].shape[1]
    scale, cap = config.attn_scale, config.attn_logit_softcapping
    kinds = config.layer_kind_ids  # per layer: its window and RoPE (Gemma's local layers)
    seq_ids = token_seq_ids(step.cu_q_lens, T)
    # A decode-only step has one token per sequence, so its tokens are the first D = S rows
    # (S <= T): speculation, fetch buffers and sparse attention are sized for them.
    D = S
    use_sparse = decode_only(step) if sparse.selective else jnp.bool_(False)
    in_layer = sparse.selects_in_layer  # selection by the layer's own query or state
    K = config.num_kv_heads
    x = embed_tokens(params, step.token_ids, config)
    tables = rope_cos_sin(step.positions, config)  # one per attention kind
    rows = jnp.zeros(T, jnp.int32)
    hits = jnp.zeros((S, P), jnp.int32)
    fetched = None  # (k_rows, v_rows, valid) for this layer, fetched while the previous ran
    pool = list(pool)
    new_pool, new_partial = [], list(partial_keys)
    layers = unstack_layers(params)["layers"]  # either layout; this loop is unrolled
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer_{i}"):
            window = config.layer_window(i)
            h = norm(x, layer["attn_norm"], config)
            q, k, v = attention_qkv(layer, h, *layer_rope(*tables, kinds[i]), config)
            k_pages = write_pool(pool[i][0], k, step.slot_mapping, host)
            v_pages = write_pool(pool[i][1], v, step.slot_mapping, host)
            new_pool.append((k_pages, v_pages))
            if partial_keys[i] is not None and sparse.mode == "h2o":
                new_partial[i] = h2o.reset(new_partial[i], step.slot_mapping)
            elif partial_keys[i] is not None and sparse.mode == "quest":
                stored = k.astype(k_pages.dtype)  # the bounds of the keys as the pool holds them
                new_partial[i] = quest_update(new_partial[i], stored, step.slot_mapping, G)
            elif partial_keys[i] is not None:
                new_partial[i] = write_partial(new_partial[i], k, weights[i], step.slot_mapping, G)

            heavy = sparse.mode == "h2o" and i >= sparse.num_dense_layers

            def dense(
                q=q, k_pages=k_pages, v_pages=v_pages, acc=new_partial[i], heavy=heavy,
                window=window,
            ):  # fmt: skip
                if heavy:  # H2O: evicted tokens masked, every query's probabilities added
                    k_all = fetch_pages(k_pages, step.page_indices, host)
                    v_all = fetch_pages(v_pages, step.page_indices, host)
                    return h2o.dense_attention(
                        q, k_all, v_all, acc, step, seq_ids, scale, window, cap
                    )
                o = dense_attention(
                    q, k_pages, v_pages, step, host, scale, window, pallas, implementation, cap
                )
                return o, acc

            row_slots = None
            if in_layer and i >= sparse.num_dense_layers:
                fetched, n_rows, top, new_partial[i], row_slots = _select_in_layer(
                    q, k_pages, v_pages, new_partial[i], step, seq_ids, sparse, host, use_sparse,
                    scale, window, D, G, config.num_kv_heads, weights[i],
                )  # fmt: skip
                rows = rows.at[:D].add(n_rows)
                hits = hits.at[seq_ids[:D, None, None], top[0] // G].add(top[1])
            if fetched is None:
                o, new_partial[i] = dense()
            else:
                k_rows, v_rows, valid = fetched

                def sparse_path(
                    q=q, k=k, v=v, k_rows=k_rows, v_rows=v_rows, valid=valid,
                    acc=new_partial[i], heavy=heavy, row_slots=row_slots,
                ):  # fmt: skip
                    args = (q[:D], k_rows, v_rows, valid, k[:D], v[:D], scale, cap)
                    if heavy:
                        o, probs = sparse_attention(*args, with_probs=True)
                        own = jnp.broadcast_to(step.slot_mapping[:D, None, None], (D, K, 1))
                        slots = jnp.concatenate([row_slots, own], axis=-1)
                        acc = h2o.accumulate(acc, probs, slots, seq_ids[:D] < step.num_seqs[0])
                    elif pallas:
                        o = sparse_attention_pallas(*args, implementation=implementation)
                    else:
                        o = sparse_attention(*args)
                    return jnp.concatenate([o, jnp.zeros((T - D, *o.shape[1:]), o.dtype)]), acc

                o, new_partial[i] = jax.lax.cond(use_sparse, sparse_path, dense)
            x = x + norm(linear(o, layer["wo"]), layer.get("attn_post_norm"), config)
            fetched = None
            if i + 1 < L and weights[i + 1] is not None and not in_layer:
                # Speculate layer i+1 from this layer's attention input and issue its fetch
                # now, so the copy can overlap the rest of this layer. Only the selection is
                # conditional: a fetch inside lax.cond made XLA copy the whole pool layer to
                # keep it for the read before layer i+1 writes it; outside, a dense step
                # fetches D x K x M rows of the reserved page (all masked).
                nxt = layers[i + 1]
                a_part, partial_next = weights[i + 1], new_partial[i + 1]

                def spec(h=h, nxt=nxt, a_part=a_part, partial_next=partial_next, j=i + 1):
                    cos, sin = layer_rope(*tables, kinds[j])  # layer j's norm, RoPE, window
                    q_next = attention_q(nxt, h[:D], cos[:D], sin[:D], config)
                    return speculate(
                        q_next, partial_next, a_part, step, seq_ids[:D], sparse, scale,
                        config.layer_window(j),
                    )  # fmt: skip

                def no_spec():
                    shape = (D, config.num_kv_heads, fetch_buffer_rows(sparse, P * G, G))
                    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool)

                positions, valid = jax.lax.cond(use_sparse, spec, no_spec)
                positions, valid, new_partial[i + 1] = jax.lax.optimization_barrier(
                    (positions, valid, partial_next)
                )  # as for the pool below: layer i+1's partial-key write waits for this read
                slots = page_of(step, seq_ids[:D], positions, G) * G + positions % G
                slots = jnp.where(valid, slots, 0)
                pool_next = pool[i + 1]
                k_rows = fetch_rows(pool_next[0], slots, host)
                v_rows = fetch_rows(pool_next[1], slots, host)
                # Layer i+1 writes its pages in place only after these reads: the barrier makes
                # the write depend on them (without it XLA copied the pool layer every step).
                k_rows, v_rows, pool_next = jax.lax.optimization_barrier(
                    (k_rows, v_rows, pool_next)
                )
                pool[i + 1] = pool_next
                fetched = (k_rows, v_rows, valid)
                real = seq_ids[:D] < step.num_seqs[0]
                valid_real = valid & real[:, None, None]
                own = real * k.shape[1]  # each token's own rows (from the step, not the pool)
                rows = rows.at[:D].add(jnp.where(use_sparse, valid_real.sum(axis=(1, 2)) + own, 0))
                top = valid_real.at[:, :, : sparse.num_sink_tokens + sparse.num_recent_tokens - 1]
                top = top.set(False)
                hits = hits.at[seq_ids[:D, None, None], positions // G].add(top.astype(jnp.int32))
        with jax.named_scope("mlp"):
            x = mlp_block(layer, x, config)
    with jax.named_scope("lm_head"):
        logits = lm_head(params, x[step.logits_indices], config)
    return logits, new_pool, new_partial, SparseStats(use_sparse, rows, hits)


def _select_in_layer(
    q, k_pages, v_pages, bounds, step, seq_ids, sparse, host, use_sparse, scale, window, D, G, K,
    weights=None,
):  # fmt: skip
    """Oracle, Quest, H2O and InfiniGen with query_source='own_layer': the rows this layer's
    decode tokens attend to, chosen with the layer's own query (exact scores over every key,
    Quest's page bounds, InfiniGen's partial keys) or its accumulated attention (H2O, which
    evicts the rest) and fetched from the pool -> ((k_rows, v_rows, valid),
    rows fetched per token [D], (positions, selected [D, K, M]) for the page-hit counts, the
    layer's state (bounds or accumulated attention), the rows' slots). The fetch runs outside
    the condition, as speculate's does."""
    P = step.page_indices.shape[1]

    def select(q=q):
        if sparse.mode == "oracle":
            s = oracle_scores(q[:D], k_pages, step, seq_ids[:D], host) * scale
            return (
                *select_rows(s, None, step, seq_ids[:D], sparse, G, window, alpha=None),
                bounds,
            )
        if sparse.mode == "h2o":
            return h2o.select(bounds, step, seq_ids[:D], sparse, window)
        if sparse.mode == "infinigen":
            return (
                *speculate(q[:D], bounds, weights, step, seq_ids[:D], sparse, scale, window),
                bounds,
            )
        pages = quest_page_scores(q[:D], bounds, step, seq_ids[:D])
        return (
            *select_rows(None, pages, step, seq_ids[:D], sparse, G, window, alpha=None),
            bounds,
        )

    def none():
        shape = (D, K, fetch_buffer_rows(sparse, P * G, G))
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool), bounds

    positions, valid, bounds = jax.lax.cond(use_sparse, select, none)
    slots = page_of(step, seq_ids[:D], positions, G) * G + positions % G
    slots = jnp.where(valid, slots, 0)
    k_rows = fetch_rows(k_pages, slots, host)
    v_rows = fetch_rows(v_pages, slots, host)
    real = seq_ids[:D] < step.num_seqs[0]
    valid_real = valid & real[:, None, None]
    n_rows = jnp.where(use_sparse, valid_real.sum(axis=(1, 2)) + real * K, 0)
    top = valid_real.at[:, :, : sparse.num_sink_tokens + sparse.num_recent_tokens - 1].set(False)
    return (k_rows, v_rows, valid), n_rows, (positions, top.astype(jnp.int32)), bounds, slots


def fetch_buffer_rows(sparse: SparseKVConfig, C: int, G: int) -> int:
    """M: the fetch buffer's rows per (token, kv head): sinks, recent tokens but the token
    itself, and the speculated ones (`cap` tokens, or `cap // G` whole pages)."""
    cap = C if sparse.max_num_kv is None else min(sparse.max_num_kv, C)
    if sparse.granularity == "page" or sparse.mode == "quest":
        cap = max(cap // G, 1) * G
    return sparse.num_sink_tokens + sparse.num_recent_tokens - 1 + cap

"""The sparse KV's pool: every layer's K/V pages in a host memory kind (or on the device), the
device-resident partial keys InfiniGen speculates with and the speculation weights, and the
gathers and writes that move rows between them (under `compute_on('device_host')` when the pool
is on the host, so that only what they return crosses to the device). infinigen.py's step uses
them (its module doc gives the letters).

A quantized cache (`CacheConfig.kv_cache_dtype`): each pool layer is `QuantizedPages` (codes and
a float32 scale per row, llmjax/model/kv_cache.py) in the same memory kind. The step's rows are
quantized on the device, so only codes and scales cross to the pool, and a fetch gathers codes
and scales where the pool lives, moves them and dequantizes them on the device into the model's
dtype: what crosses is 1 byte an element and 4 a row. The selection metadata (partial keys, page
bounds) is computed from the keys as the pool stores them (`stored_rows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from llmjax.config import ModelConfig, SparseKVConfig
from llmjax.model.kv_cache import (
    SCALE_DTYPE,
    KVPages,
    Pages,
    QuantizedPages,
    as_stored,
    dequantize,
    quantize,
    storage_dtype,
)
from llmjax.sparse.skew import partial_columns

HOST_MEMORY_KIND = "pinned_host"


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
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype,
    memory_kind: str | None,
    kv_cache_dtype: str = "auto",
) -> KVPages:
    """The paged KV pool [num_pages, G, K, H] per layer (K and V), in `memory_kind`; of a
    quantized `kv_cache_dtype`, `QuantizedPages` (both arrays in that kind) whose scales are
    [num_pages, G, K], the pool's own layout (`fetch_*` hand the attention [..., 1])."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    # device_put of a host buffer: no device memory is touched for a host pool, and the arrays'
    # types carry the memory space (jit's out_shardings gave the kind but not the type, so the
    # first step traced twice).
    zeros = lambda shape, dtype: jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)
    if kv_cache_dtype == "auto":
        return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(config.num_layers)]

    def pages():  # scales [num_pages, G, K]: a trailing 1 made XLA copy them between layouts
        codes = zeros(shape, storage_dtype(kv_cache_dtype))
        return QuantizedPages(codes, zeros(shape[:-1], SCALE_DTYPE), kv_cache_dtype)

    return [(pages(), pages()) for _ in range(config.num_layers)]


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


def write_pool(pages: Pages, new: jax.Array, slot_mapping: jax.Array, host: bool) -> Pages:
    """Scatter the new tokens' rows [T, K, H] into pool pages [P, G, K, H] at their slots
    (`QuantizedPages`: quantized here, on the device; codes and scales written)."""
    if isinstance(pages, QuantizedPages):
        codes, scales = quantize(new, pages.kv_cache_dtype)
        return QuantizedPages(
            write_pool(pages.values, codes, slot_mapping, host),
            write_pool(pages.scales, scales[..., 0], slot_mapping, host),  # [P, G, K]
            pages.kv_cache_dtype,
        )
    shape = pages.shape

    # Host computations take their index arrays ready-made: constants made inside one live in
    # device memory, and XLA rejects mixing the two.
    def write(pages, new, slots):
        flat = pages.reshape(-1, *shape[2:])
        return flat.at[slots].set(new.astype(pages.dtype)).reshape(shape)

    return _on_host(write, pages, new, slot_mapping, host=host)


def stored_rows(x: jax.Array, pages: Pages) -> jax.Array:
    """The step's rows x [T, K, H] as the pool `pages` holds them, read back: cast to the pages'
    dtype, or (`QuantizedPages`) quantized and dequantized in x's dtype."""
    if isinstance(pages, QuantizedPages):
        return as_stored(x, pages)
    return x.astype(pages.dtype)


def _dequantized(fetch, pages: Pages, index, host: bool, dtype) -> jax.Array:
    """fetch(array, index, host) of plain pages; of `QuantizedPages`, of their codes and scales,
    dequantized on the device into `dtype`."""
    if not isinstance(pages, QuantizedPages):
        return fetch(pages, index, host)
    if dtype is None:
        raise ValueError("a quantized pool's rows are fetched into a dtype: pass dtype=")
    scales = fetch(pages.scales, index, host)[..., None]  # the pool's [P, G, K] -> [..., 1]
    return dequantize(fetch(pages.values, index, host), scales, dtype, pages.kv_cache_dtype)


def fetch_pages(pages: Pages, page_indices: jax.Array, host: bool, dtype=None) -> jax.Array:
    """All pages of every sequence's table [S, P] -> [S * P, G, K, H] on the device (a full
    fetch; pages of holes and padding come along and are masked by the attention); a quantized
    pool's in `dtype`."""

    def fetch(pages, page_indices, host):
        rows = _on_host(lambda p, idx: p[idx.reshape(-1)], pages, page_indices, host=host)
        return _to_device(rows, host)

    return _dequantized(fetch, pages, page_indices, host, dtype)


def fetch_rows(pages: Pages, slots: jax.Array, host: bool, dtype=None) -> jax.Array:
    """Rows [T, K, M, H] at pool slots [T, K, M] (row (t, k, m) from kv head k) -> the device;
    a quantized pool's in `dtype`."""

    def fetch(pages, slots, host):  # pages [P, G, K, H], or a quantized pool's scales [P, G, K]
        K, rest = pages.shape[2], pages.shape[3:]
        rows = slots * K + jnp.arange(K, dtype=jnp.int32)[None, :, None]  # into [P * G * K, ...]

        def gather(pages, rows):
            return pages.reshape(-1, *rest)[rows]

        return _to_device(_on_host(gather, pages, rows, host=host), host)

    return _dequantized(fetch, pages, slots, host, dtype)

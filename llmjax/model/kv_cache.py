"""The paged KV cache on the device.

For every layer, K and V live in pages: `[num_pages, page_size, K, H]`, as a list of (k, v) per
layer for the unrolled layer loop, or stacked for the scanned one (`stacked=True`: one (k, v) of
`[L * num_pages, page_size, K, H]`, layer i's page p at row `i * num_pages + p`; flat, not
`[L, num_pages, ...]`, because viewing that as flat inside the step made XLA (CPU) copy the whole
cache when an axis has size 1, e.g. one kv head per device). A token's KV goes to one
slot, `slot = page * page_size + offset`; the host-side block manager decides which pages a
request owns (its row of `page_indices`) and hands the step a `slot_mapping` per new token.
Page 0 is reserved: padded tokens write there, and no request reads it.

The pages are donated to the jitted step, and `write_kv` scatters into them, so the update happens
in place (no copy of the cache per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import ModelConfig

# per layer: (k_pages, v_pages); stacked: one (k_pages, v_pages) holding every layer's pages
KVPages = list[tuple[jax.Array, jax.Array]] | tuple[jax.Array, jax.Array]


def kv_page_shape(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (num_pages, page_size, config.num_kv_heads, config.head_dim)


def allocate_kv_pages(
    config: ModelConfig, num_pages: int, page_size: int, dtype, stacked: bool = False
) -> KVPages:
    """Zero pages for every layer: a list of (k, v), or with `stacked` one (k, v) of
    [L * num_pages, page_size, K, H] (see the module doc)."""
    shape = kv_page_shape(config, num_pages, page_size)
    if stacked:
        shape = (config.num_layers * num_pages, *shape[1:])
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]


def kv_cache_bytes(config: ModelConfig, num_pages: int, page_size: int, dtype) -> int:
    per_page = page_size * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * num_pages * per_page


def write_kv(
    k_pages: jax.Array,  # [P, page_size, K, H]
    v_pages: jax.Array,  # [P, page_size, K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # [T] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K/V into their slots (in place when the pages are donated).

    Indexing the 4-D pages by (page, offset) matters: scattering into a flattened
    [num_pages * page_size, K, H] view made XLA (CPU) copy the whole cache when T == 1.
    """
    page_size = k_pages.shape[1]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pages = k_pages.at[page, offset].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[page, offset].set(v.astype(v_pages.dtype))
    return k_pages, v_pages

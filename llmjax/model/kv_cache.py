"""The paged KV cache on the device.

For every layer, K and V live in pages: `[num_pages, page_size, K, H]`, as a list of (k, v) per
layer for the unrolled layer loop, or stacked for the scanned one (`stacked=True`: one (k, v) of
`[L * num_pages, page_size, K, H]`, layer i's page p at row `i * num_pages + p`; flat, not
`[L, num_pages, ...]`, because viewing that as flat inside the step made XLA (CPU) copy the whole
cache when an axis has size 1, e.g. one kv head per device). In the hybrid KV layout
(`KVGroups`, llmjax/config/cache.py) a page holds `num_slots` layers rather than L: the list has
`num_slots` entries, the stacked cache `[num_slots * num_pages, ...]`. A token's KV goes to one
slot, `slot = page * page_size + offset`; the host-side block manager decides which pages a
request owns (its row of `page_indices`) and hands the step a `slot_mapping` per new token.
Page 0 is reserved: padded tokens write there, and no request reads it.

The pages are donated to the jitted step, and `write_kv` scatters into them, so the update happens
in place (no copy of the cache per step).

A quantized cache (`CacheConfig.kv_cache_dtype` 'int8', 'fp8_e4m3', 'fp8_e5m2') keeps each of K and
V as `QuantizedPages`: `values` [num_pages, G, K, H] in the storage dtype and `scales` [num_pages,
G, K, 1] float32 beside them, one per token and kv head (a token's row of head k is `values *
scales`; the trailing 1 gives the scales the values' rank and sharding). The scale is the row's
absmax over H / the dtype's largest value (127, 448, 57344), so every row uses the whole range
whatever its magnitude; K and V are quantized as the step writes them (`write_kv`), and every reader
dequantizes what it reads (`take_pages`; the step's own tokens attend over their stored values too,
`as_stored`, so a token's output does not depend on whether its keys were written in this step or an
earlier one). Per token rather than per page: a page fills over many steps, and a per-page scale
would have to requantize the tokens already in it when a larger one arrives. The scales cost 4 / H
of the values' bytes (6 % at H = 64). A transfer or a lower tier moves a page as one byte array with
each row's scale appended (`pack_pages`: [..., H + 4] uint8), so they need no second array."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# the codes' element and storage dtypes and `dequantize` are the kernels' (one definition for the
# reference, the Pallas kernels and this module)
from kernels_pallas.kv_quant import KV_CACHE_DTYPES as KV_CODES
from kernels_pallas.kv_quant import dequantize
from llmjax.config import KV_SCALE_BYTES, KVGroups, ModelConfig, kv_row_bytes


def _largest(element) -> float:
    info = jnp.iinfo(element) if jnp.issubdtype(element, jnp.integer) else jnp.finfo(element)
    return float(info.max)


# kv_cache_dtype -> (element dtype, its largest finite value: the absmax a row is scaled to;
# int8 127, fp8_e4m3 448, fp8_e5m2 57344)
QUANTIZED_KV = {name: (element, _largest(element)) for name, (element, _) in KV_CODES.items()}
SCALE_DTYPE = jnp.float32
assert jnp.dtype(SCALE_DTYPE).itemsize == KV_SCALE_BYTES


def storage_dtype(kv_cache_dtype: str):
    """What the pages' array holds: int8 itself; an fp8 element's bits as uint8 (XLA on the CPU
    copied float8 pages at every one-token update; as bytes they update in place)."""
    return KV_CODES[kv_cache_dtype][1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["values", "scales"],
    meta_fields=["kv_cache_dtype"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """K or V pages of a quantized cache: `values` [P, G, K, H] (`storage_dtype`) and `scales`
    [P, G, K, 1] float32, of `kv_cache_dtype`. Indexing the first axes indexes both
    (`pages[idx]`)."""

    values: jax.Array
    scales: jax.Array
    kv_cache_dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def __getitem__(self, idx) -> QuantizedPages:
        return QuantizedPages(self.values[idx], self.scales[idx], self.kv_cache_dtype)

    def dequantize(self, dtype) -> jax.Array:
        """The stored rows in `dtype` ([..., H])."""
        return dequantize(self.values, self.scales, dtype, self.kv_cache_dtype)


Pages = jax.Array | QuantizedPages
# per layer: (k_pages, v_pages); stacked: one (k_pages, v_pages) holding every layer's pages
KVPages = list[tuple[Pages, Pages]] | tuple[Pages, Pages]


def quantize(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (values [..., H] in `storage_dtype`, scales [..., 1] float32): each row
    scaled by its absmax to the dtype's largest value (a zero row: scale 0, values 0)."""
    dtype, qmax = QUANTIZED_KV[kv_cache_dtype]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / qmax
    y = x / jnp.where(scale > 0, scale, 1.0)
    y = jnp.clip(y, -qmax, qmax)
    if kv_cache_dtype == "int8":
        return jnp.round(y).astype(dtype), scale.astype(SCALE_DTYPE)
    bits = jax.lax.bitcast_convert_type(y.astype(dtype), jnp.uint8)
    return bits, scale.astype(SCALE_DTYPE)


def fake_quantize(x: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """x as a cache of `kv_cache_dtype` stores it, read back in x's dtype ('auto': x)."""
    if kv_cache_dtype == "auto":
        return x
    return dequantize(*quantize(x, kv_cache_dtype), x.dtype, kv_cache_dtype)


def as_stored(x: jax.Array, pages: Pages) -> jax.Array:
    """The step's new rows x [T, K, H] as `pages` hold them, in x's dtype (what a later step
    reads back): quantized and dequantized for `QuantizedPages`, x itself otherwise."""
    if isinstance(pages, QuantizedPages):
        return fake_quantize(x, pages.kv_cache_dtype)
    return x


def take_pages(pages: Pages, idx, dtype) -> jax.Array:
    """`pages[idx]`: for `QuantizedPages` dequantized into `dtype`, plain pages as stored."""
    if isinstance(pages, QuantizedPages):
        return pages[idx].dequantize(dtype)
    return pages[idx]


def kv_page_shape(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (num_pages, page_size, config.num_kv_heads, config.head_dim)


def zero_pages(shape, dtype, kv_cache_dtype: str = "auto") -> Pages:
    """Zero pages of `shape` [..., H]: an array of `dtype`, or `QuantizedPages`."""
    if kv_cache_dtype == "auto":
        return jnp.zeros(shape, dtype)
    return QuantizedPages(
        jnp.zeros(shape, storage_dtype(kv_cache_dtype)),
        jnp.zeros((*shape[:-1], 1), SCALE_DTYPE),
        kv_cache_dtype,
    )


def allocate_kv_pages(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype,
    stacked: bool = False,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> KVPages:
    """Zero pages for every layer slot (`groups.num_slots`, L without groups): a list of (k, v),
    or with `stacked` one (k, v) of [slots * num_pages, page_size, K, H] (see the module doc);
    `QuantizedPages` for a quantized `kv_cache_dtype`."""
    slots = config.num_layers if groups is None else groups.num_slots
    shape = kv_page_shape(config, num_pages, page_size)
    if stacked:
        shape = (slots * num_pages, *shape[1:])
        return zero_pages(shape, dtype, kv_cache_dtype), zero_pages(shape, dtype, kv_cache_dtype)
    return [
        (zero_pages(shape, dtype, kv_cache_dtype), zero_pages(shape, dtype, kv_cache_dtype))
        for _ in range(slots)
    ]


def kv_cache_bytes(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype,
    kv_cache_dtype: str = "auto",
    groups: KVGroups | None = None,
) -> int:
    """Bytes of `num_pages` pages of every layer slot's K and V (L slots, or `groups.num_slots`;
    a quantized cache's scales included)."""
    slots = config.num_layers if groups is None else groups.num_slots
    row = kv_row_bytes(config.head_dim, jnp.dtype(dtype).itemsize, kv_cache_dtype)
    return 2 * slots * num_pages * page_size * config.num_kv_heads * row


def pack_pages(pages: Pages) -> jax.Array:
    """Pages [..., H] -> the array a transfer or a tier moves: the pages themselves, or for
    `QuantizedPages` one uint8 array [..., H + 4] of each row's values' bytes then its float32
    scale's (bitwise: `unpack_pages` gives back the same values and scales)."""
    if not isinstance(pages, QuantizedPages):
        return pages
    values = jax.lax.bitcast_convert_type(pages.values, jnp.uint8)  # int8's bytes; fp8's already
    scales = jax.lax.bitcast_convert_type(pages.scales[..., 0], jnp.uint8)  # [..., 4]
    return jnp.concatenate([values, scales], axis=-1)


def unpack_pages(data: jax.Array, kv_cache_dtype: str) -> Pages:
    """`pack_pages`' inverse for a cache of `kv_cache_dtype` ('auto': `data` itself)."""
    if kv_cache_dtype == "auto":
        return data
    data = data.astype(jnp.uint8)
    values = jax.lax.bitcast_convert_type(data[..., :-4], storage_dtype(kv_cache_dtype))
    scales = jax.lax.bitcast_convert_type(data[..., -4:], SCALE_DTYPE)
    return QuantizedPages(values, scales[..., None], kv_cache_dtype)


def packed_row(head_dim: int, dtype, kv_cache_dtype: str) -> tuple[int, np.dtype]:
    """(last dim, dtype) of `pack_pages`' array for a cache of `kv_cache_dtype`."""
    if kv_cache_dtype == "auto":
        return head_dim, np.dtype(jnp.dtype(dtype))
    return kv_row_bytes(head_dim, 1, kv_cache_dtype), np.dtype(np.uint8)


def _write(pages: Pages, page, offset, x: jax.Array) -> Pages:
    if isinstance(pages, QuantizedPages):
        values, scales = quantize(x, pages.kv_cache_dtype)
        new = QuantizedPages(
            pages.values.at[page, offset].set(values),
            jax.lax.optimization_barrier(pages.scales.at[page, offset].set(scales)),
            pages.kv_cache_dtype,
        )
        # Without the barrier XLA (CPU) fuses a one-token update of the scales into the
        # attention's gather of them, which then reads the old scales while the new ones are
        # written: a copy of every layer's scales per decode (tests/test_model.py checks).
        return new
    return pages.at[page, offset].set(x.astype(pages.dtype))


def write_kv(
    k_pages: Pages,  # [P, page_size, K, H]
    v_pages: Pages,  # [P, page_size, K, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # [T] int32
) -> tuple[Pages, Pages]:
    """Scatter the new tokens' K/V into their slots (in place when the pages are donated),
    quantized first for `QuantizedPages`.

    Indexing the 4-D pages by (page, offset) matters: scattering into a flattened
    [num_pages * page_size, K, H] view made XLA (CPU) copy the whole cache when T == 1.
    """
    page_size = k_pages.shape[1]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    return _write(k_pages, page, offset, k), _write(v_pages, page, offset, v)

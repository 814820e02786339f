"""A quantized KV cache as the ragged paged attention kernels read it (llmjax's
`CacheConfig.kv_cache_dtype`; layout: llmjax/model/kv_cache.py).

    k_pages, v_pages   [num_pages, G, K, H]  int8 codes (int8), or an fp8 element's bits as uint8
    k_scales, v_scales [num_pages, G, K, 1]  float32, one per token and kv head

A row reads back as `dequantize(codes, scales, dtype, kv_cache_dtype)` = codes * scale computed in
float32, then cast to the query's dtype: the reference dequantizes the gathered pages this way and
the kernels do the same to each page block after its copy (DMA or load), so the HBM traffic is the
codes' bytes plus 4 bytes per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# kv_cache_dtype -> (the element type the codes stand for, the pages' storage dtype)
KV_CACHE_DTYPES = {
    "int8": (jnp.int8, jnp.int8),
    "fp8_e4m3": (jnp.float8_e4m3fn, jnp.uint8),
    "fp8_e5m2": (jnp.float8_e5m2, jnp.uint8),
}


def dequantize(codes: jax.Array, scales: jax.Array, dtype, kv_cache_dtype: str) -> jax.Array:
    """codes [..., H] and scales [..., 1] (or broadcastable) -> codes * scales in `dtype`."""
    element = KV_CACHE_DTYPES[kv_cache_dtype][0]
    if codes.dtype != element:
        codes = jax.lax.bitcast_convert_type(codes, element)
    return (codes.astype(jnp.float32) * scales.astype(jnp.float32)).astype(dtype)


def check_quantized(k_pages, v_pages, k_scales, v_scales, kv_cache_dtype: str | None) -> bool:
    """-> whether the cache is quantized; raises a ValueError naming what disagrees."""
    if kv_cache_dtype in (None, "auto"):
        if k_scales is not None or v_scales is not None:
            raise ValueError("k_scales/v_scales given without a quantized kv_cache_dtype")
        return False
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown {kv_cache_dtype=}; choose 'auto' or one of {list(KV_CACHE_DTYPES)}"
        )
    storage = jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype][1])
    if k_pages.dtype != storage or v_pages.dtype != storage:
        raise ValueError(
            f"a {kv_cache_dtype} cache's pages hold {storage} codes: "
            f"{k_pages.dtype=} {v_pages.dtype=}"
        )
    want = (*k_pages.shape[:-1], 1)
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s is None or tuple(s.shape) != want or s.dtype != jnp.float32:
            got = None if s is None else (tuple(s.shape), s.dtype)
            raise ValueError(f"a {kv_cache_dtype} cache needs {name} float32 {want}, got {got}")
    return True

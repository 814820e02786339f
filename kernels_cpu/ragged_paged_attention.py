"""Ragged paged attention on the CPU (csrc/ragged_paged_attention.cc): the arguments and result
of kernels_pallas/ragged_paged_attention/reference.py, float32 or bfloat16; the pages in q's
dtype, or a quantized cache's (llmjax/model/kv_cache.py: int8, or fp8 bits as uint8, with a
float32 scale per row and kv head). With an int8 cache, `int8_scores` (the default) computes the
scores as int8 dot products where the CPU has AVX-512 VNNI (`kernels_cpu.build.engines()`'s
'avx512_vnni'): each query vector is quantized to int8 at its own scale first (see the C++
header); elsewhere, or with int8_scores=False, they are float32 dots of the dequantized keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.build import load

TARGET = "llmjax_cpu_ragged_paged_attention"
DTYPES = (jnp.float32, jnp.bfloat16)
# kv_cache_dtype -> (the kernel's kv_format, the pages' dtype)
KV_FORMATS = {"int8": (1, jnp.int8), "fp8_e4m3": (2, jnp.uint8), "fp8_e5m2": (3, jnp.uint8)}
# The kernel's options (EngineConfig.kernel_options with attention_backend='cpu').
KERNEL_OPTIONS = ("int8_scores",)


def check_kernel_options(options: dict) -> None:
    """Raises ValueError for an option the CPU kernel does not take."""
    unknown = sorted(set(options) - set(KERNEL_OPTIONS))
    if unknown:
        raise ValueError(
            f"kernel_options {unknown} are not the CPU attention kernel's; "
            f"it takes {KERNEL_OPTIONS}"
        )


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,  # [num_pages, G, K, H]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [num_pages, G, K, 1] float32: a quantized cache
    v_scales: jax.Array | None = None,
    kv_cache_dtype: str = "auto",
    int8_scores: bool = True,
) -> jax.Array:
    """-> [T, N, H] in q's dtype (see the reference for the contract; a quantized cache's rows
    are values * scales). Raises ValueError for shapes or dtypes it does not take,
    KernelsUnavailable where the kernels do not build."""
    load()
    _, N, H = q.shape
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or k_pages.shape[3] != H:
        raise ValueError(
            f"want k/v pages [num_pages, G, K, {H}]: {k_pages.shape=} {v_pages.shape=}"
        )
    K = k_pages.shape[2]
    if N % K:
        raise ValueError(f"{N=} query heads must be a multiple of {K=} kv heads")
    if kv_cache_dtype == "auto":
        kv_format, kv_dtype = 0, q.dtype
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)  # not read
    elif kv_cache_dtype in KV_FORMATS:
        kv_format, kv_dtype = KV_FORMATS[kv_cache_dtype]
        want = (*k_pages.shape[:3], 1)
        if k_scales is None or k_scales.shape != want or v_scales.shape != want:
            raise ValueError(f"a {kv_cache_dtype} cache needs k/v scales of shape {want}")
        k_scales, v_scales = (jnp.asarray(x, jnp.float32) for x in (k_scales, v_scales))
    else:
        raise ValueError(f"unknown {kv_cache_dtype=}; choose auto or one of {list(KV_FORMATS)}")
    if q.dtype not in DTYPES or k_pages.dtype != kv_dtype or v_pages.dtype != kv_dtype:
        want = "q and the pages need one dtype" if kv_format == 0 else "q needs a dtype"
        raise ValueError(
            f"{want} of {DTYPES} (a {kv_cache_dtype} cache's pages: "
            f"{jnp.dtype(kv_dtype).name}): {q.dtype=} {k_pages.dtype=} {v_pages.dtype=}"
        )
    S = kv_lens.shape[0]
    if page_indices.shape[0] != S or cu_q_lens.shape != (S + 1,) or num_seqs.shape != (1,):
        raise ValueError(
            f"want kv_lens [S], page_indices [S, P], cu_q_lens [S+1], num_seqs [1]: "
            f"{kv_lens.shape=} {page_indices.shape=} {cu_q_lens.shape=} {num_seqs.shape=}"
        )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return call(
        q,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        i32(kv_lens),
        i32(page_indices),
        i32(cu_q_lens),
        i32(num_seqs),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        kv_format=np.int64(kv_format),
        int8_scores=np.int64(bool(int8_scores) and kv_cache_dtype == "int8"),
    )

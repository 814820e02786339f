"""Ragged paged attention: one call attends a flat batch of decodes and prefill chunks, each
sequence reading its KV through its page table (specification: `reference.py`).

    out = ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sm_scale=head_dim ** -0.5)

Implementations, chosen by name (`implementation=`) or by the platform (None):
  tpu        Pallas Mosaic TPU kernel (kernel_tpu.py): scalar-prefetched page tables, KV pages
             copied from HBM with double-buffered async DMAs. The default on TPU, and on the CPU
             (interpret mode) for checking.
  gpu        Pallas GPU kernel on the Triton lowering (kernel_gpu.py). The default on CUDA.
  mgpu       Pallas Mosaic GPU kernel for Hopper (kernel_mgpu.py): TMA page copies, wgmma;
             bf16/f16, head_dim % 64 == 0, page_size % 8 == 0. By name only (timed on an H200:
             level with Triton on decodes, ahead on mixed batches; tuning.py); on the CPU it
             runs in Mosaic GPU's interpreter.
  reference  the plain-jnp specification.
A kernel asked for by name on a platform it cannot run on raises; nothing silently falls back.
On the CPU, kernels run in interpret mode (slow; for tests).

A quantized KV cache (`kv_cache_dtype` 'int8', 'fp8_e4m3', 'fp8_e5m2'; kv_quant.py): the pages hold
codes and `k_scales`/`v_scales` [num_pages, G, K, 1] float32 a scale per row; 'tpu', 'gpu' and the
reference read them (the kernels dequantize each page block after its copy); 'mgpu' refuses.
"""

from __future__ import annotations

import jax
import numpy as np

from kernels_pallas.kv_quant import check_quantized
from kernels_pallas.platforms import IMPLEMENTATIONS, choose_implementation, default_implementation
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = [
    "IMPLEMENTATIONS",
    "check_inputs",
    "default_implementation",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]


def check_inputs(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, quantized=False
) -> None:
    """Shape and dtype checks with errors that print the values (static shapes only); with
    `quantized`, the pages hold codes (checked by kv_quant.check_quantized)."""
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(
            f"need q [T, N, H] and k_pages [pages, G, K, H]: {q.shape=} {k_pages.shape=}"
        )
    _, N, H = q.shape
    _, _, K, Hk = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{k_pages.shape=} != {v_pages.shape=}")
    if Hk != H:
        raise ValueError(f"head dims differ: {q.shape=} {k_pages.shape=}")
    if N % K:
        raise ValueError(f"query heads {N=} must be a multiple of kv heads {K=}")
    if not quantized and not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(f"dtypes differ: {q.dtype=} {k_pages.dtype=} {v_pages.dtype=}")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [S, P]: {page_indices.shape=}")
    S = page_indices.shape[0]
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,) or num_seqs.shape != (1,):
        raise ValueError(
            f"metadata shapes disagree with {S=} sequences: {kv_lens.shape=} (want ({S},)), "
            f"{cu_q_lens.shape=} (want ({S + 1},)), {num_seqs.shape=} (want (1,))"
        )
    for name, a in [
        ("kv_lens", kv_lens),
        ("page_indices", page_indices),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ]:
        if a.dtype != np.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")


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
    implementation: str | None = None,
    interpret: bool | None = None,
    k_scales: jax.Array | None = None,  # [num_pages, G, K, 1] float32: a quantized cache
    v_scales: jax.Array | None = None,
    kv_cache_dtype: str | None = None,  # None/'auto': pages in q's dtype
    **kernel_options,
) -> jax.Array:
    """-> [T, N, H]; see reference.py for the contract. `interpret` defaults to True on the CPU
    (where no kernel compiles) and False elsewhere. `kernel_options` go to the implementation's
    kernel function (block sizes, stages, variants: see `kernel_function`). A quantized cache:
    its codes as the pages, with `k_scales`, `v_scales` and `kv_cache_dtype` (kv_quant.py)."""
    quantized = check_quantized(k_pages, v_pages, k_scales, v_scales, kv_cache_dtype)
    check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, quantized)
    impl, interpret = choose_implementation("ragged paged attention", implementation, interpret)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if quantized:
        if impl == "mgpu":
            raise ValueError(
                f"the 'mgpu' ragged paged attention kernel does not read a {kv_cache_dtype} KV "
                "cache; use implementation 'gpu' (Triton) or 'reference'"
            )
        kwargs.update(k_scales=k_scales, v_scales=v_scales, kv_cache_dtype=kv_cache_dtype)
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        if kernel_options:
            raise ValueError(f"the reference takes no kernel options, got {kernel_options}")
        return ragged_paged_attention_reference(*args, **kwargs)
    return kernel_function(impl)(*args, **kwargs, interpret=interpret, **kernel_options)


def kernel_function(implementation: str):
    """The kernel function of implementation 'tpu', 'gpu' or 'mgpu' (its keyword arguments past
    the contract's are its block sizes, stages and variants)."""
    if implementation == "tpu":
        from kernels_pallas.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu
    if implementation == "mgpu":
        from kernels_pallas.ragged_paged_attention.kernel_mgpu import ragged_paged_attention_mgpu

        return ragged_paged_attention_mgpu
    if implementation == "gpu":
        from kernels_pallas.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu
    raise ValueError(f"no kernel function for {implementation=}")


def check_kernel_options(implementation: str, options: dict) -> None:
    """Raise a ValueError naming the accepted ones if `options` are not keyword arguments of the
    kernel function of `implementation` (beyond the contract's)."""
    import inspect

    params = inspect.signature(kernel_function(implementation)).parameters
    contract = {"sm_scale", "sliding_window", "soft_cap", "interpret"}
    contract |= {"k_scales", "v_scales", "kv_cache_dtype"}
    accepted = sorted(
        n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in contract
    )
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"kernel options {unknown} are not arguments of the {implementation!r} ragged paged "
            f"attention kernel; it takes {accepted}"
        )

"""Flash-attention prefill: causal self-attention of one long prompt with no prefix-cache hit
(specification: `reference.py`).

    out = flash_prefill_attention(q, k, v, seq_len, sm_scale=head_dim ** -0.5)

For a prompt with nothing cached, K/V are the new tokens' own projections, so a dense blocked
flash attention over them avoids the ragged kernel's per-page gathers and page-table metadata.
The engine uses it (llmjax/model/attention.py `pallas_attention`, `EngineConfig.flash_prefill`)
for a step that is one fresh prompt, in token buckets where it was measured faster than the ragged
kernel: on an H200, 1.55x at 2048 tokens and 1.53x at 8192 (tuning.py ENGINE_MIN_TOKENS); on TPU
it is not measured, so not used unless asked for.

Implementations, chosen by name (`implementation=`) or by the platform (None):
  tpu        Pallas Mosaic TPU kernel (kernel_tpu.py): blocked online softmax, GQA heads of a kv
             head processed together, causal block skipping. The default on TPU, and on the CPU
             (interpret mode) for checking.
  gpu        Pallas GPU kernel on the Triton lowering (kernel_gpu.py). The default on CUDA.
  mgpu       Pallas Mosaic GPU kernel for Hopper (kernel_mgpu.py): warp-specialized (a TMA
             producer warpgroup, two consumer warpgroups taking turns on the tensor cores),
             bfloat16/float16, head_dim % 64 == 0. Chosen by name.
  reference  the plain-jnp specification.
A kernel asked for by name on a platform it cannot run on raises; nothing silently falls back.
On the CPU, kernels run in interpret mode (slow; for tests).
"""

from __future__ import annotations

import jax
import numpy as np

from kernels_pallas.flash_prefill.reference import flash_prefill_reference
from kernels_pallas.platforms import IMPLEMENTATIONS, choose_implementation, default_implementation

__all__ = [
    "IMPLEMENTATIONS",
    "check_inputs",
    "default_implementation",
    "flash_prefill_attention",
    "flash_prefill_reference",
]


def check_inputs(q, k, v, seq_len) -> None:
    """Shape and dtype checks with errors that print the values (static shapes only)."""
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"need q [T, N, H] and k [T, K, H]: {q.shape=} {k.shape=}")
    T, N, H = q.shape
    Tk, K, Hk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"{k.shape=} != {v.shape=}")
    if Tk != T or Hk != H:
        raise ValueError(f"q and k disagree on tokens or head dim: {q.shape=} {k.shape=}")
    if N % K:
        raise ValueError(f"query heads {N=} must be a multiple of kv heads {K=}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtypes differ: {q.dtype=} {k.dtype=} {v.dtype=}")
    if seq_len.shape != (1,) or seq_len.dtype != np.int32:
        raise ValueError(f"seq_len must be int32 [1]: {seq_len.shape=} {seq_len.dtype=}")


def flash_prefill_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    seq_len: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """-> [T, N, H]; see reference.py for the contract. `interpret` defaults to True on the CPU
    (where no kernel compiles) and False elsewhere."""
    check_inputs(q, k, v, seq_len)
    impl, interpret = choose_implementation("flash prefill", implementation, interpret)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "reference":
        return flash_prefill_reference(q, k, v, seq_len, **kwargs)
    if impl == "tpu":
        from kernels_pallas.flash_prefill.kernel_tpu import flash_prefill_tpu

        return flash_prefill_tpu(q, k, v, seq_len, **kwargs, interpret=interpret)
    if impl == "mgpu":
        from kernels_pallas.flash_prefill.kernel_mgpu import flash_prefill_mgpu

        return flash_prefill_mgpu(q, k, v, seq_len, **kwargs, interpret=interpret)
    from kernels_pallas.flash_prefill.kernel_gpu import flash_prefill_gpu

    return flash_prefill_gpu(q, k, v, seq_len, **kwargs, interpret=interpret)

"""Pallas kernels (GPU, TPU, and the CPU in interpret mode); DESIGN.md principle 8.

Each kernel folder holds `reference.py` (the plain-jnp specification), `kernel_tpu.py`,
`kernel_gpu.py`, and an `__init__.py` whose public wrapper checks its inputs and picks the
implementation for the platform.

  ragged_paged_attention/   attention of a flat batch of decodes and prefill chunks over a paged
                            KV cache (the engine's `attention_backend="pallas"`)
  kv_quant.py               a quantized KV cache's codes and scales as the kernels read them
                            (llmjax/model/kv_cache.py stores them)
"""

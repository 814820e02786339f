"""Rooflines measured in-process (JAX): read bandwidth and matmul peak, for scripts/bench_peers.py
(llmjax/bench/ itself imports no JAX)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _best_seconds(fn, repeats: int) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_read_bandwidth(num_bytes: int, repeats: int = 10) -> float:
    """Bytes/s of a jitted sum over a float32 array of `num_bytes` (best of `repeats`)."""
    x = jnp.full((num_bytes // 4,), 1.5, jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / _best_seconds(lambda: total(x).block_until_ready(), repeats)


def measure_matmul_flops(n: int, dtype: str, repeats: int = 3) -> float:
    """FLOP/s of a jitted [n, n] @ [n, n] matmul in `dtype` (best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(jnp.matmul)
    return 2 * n**3 / _best_seconds(lambda: mm(a, b).block_until_ready(), repeats)

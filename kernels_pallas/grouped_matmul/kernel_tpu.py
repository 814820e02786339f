"""The grouped matmul on TPU: the Pallas Mosaic TPU kernel JAX ships (megablox's `gmm`, the one
MaxText and tpu-inference run MoE layers with), wrapped to take any M: rows padded to a multiple
of the row tile (the padding rows belong to no group and are cut off), tiles from tuning.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from kernels_pallas.grouped_matmul import tuning


def grouped_matmul_tpu(
    rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """rows [M, K] grouped @ w [G, K, N] -> [M, N] float32 (reference.py's specification)."""
    M, K = rows.shape
    N = w.shape[2]
    tm, tk, tn = tuning.tpu_tiling(M, K, N)
    padded = -(-M // tm) * tm
    x = jnp.pad(rows, ((0, padded - M), (0, 0)))
    out = gmm(
        x,
        w.astype(rows.dtype),
        group_sizes.astype(jnp.int32),
        preferred_element_type=jnp.float32,
        tiling=(tm, tk, tn),
        interpret=interpret,
    )
    # Rows past the groups: megablox leaves them unwritten; the specification has zeros.
    valid = (jnp.arange(padded) < jnp.sum(group_sizes))[:, None]
    return jnp.where(valid, out, 0.0)[:M]

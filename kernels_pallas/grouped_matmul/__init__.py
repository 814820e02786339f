"""Grouped matmul: the rows of each group times that group's weight, as a mixture of experts
runs its experts over the (token, expert) pairs sorted by expert (specification: `reference.py`).

    out = grouped_matmul(rows, w, group_sizes)   # rows [M, K] grouped, w [G, K, N] -> [M, N] f32

Implementations, chosen by name (`implementation=`) or by the platform (None):
  tpu        megablox's Pallas Mosaic TPU kernel, which JAX ships (kernel_tpu.py). The default on
             TPU; on the CPU in interpret mode, for checking.
  tiled      a loop over row tiles in plain jnp, each tile one dense dot with its group's weight
             (tiled.py), visiting only the (tile, group) pairs that exist. The default on the
             CPU, where XLA's ragged_dot computes every group over every row (2-25x slower:
             tuning.py).
  reference  `jax.lax.ragged_dot`. The default on GPUs (XLA:GPU lowers it to a grouped GEMM; not
             yet timed against a Pallas kernel on a lent GPU).
Group sizes change from step to step; shapes never do, so each compiles once per row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul import tuning
from kernels_pallas.grouped_matmul.reference import grouped_matmul_reference
from kernels_pallas.grouped_matmul.tiled import grouped_matmul_tiled

IMPLEMENTATIONS = ("tpu", "tiled", "reference")
DTYPES = (jnp.float32, jnp.bfloat16)

__all__ = [
    "IMPLEMENTATIONS",
    "default_implementation",
    "grouped_matmul",
    "grouped_matmul_reference",
]


def default_implementation(platform: str | None = None) -> str:
    """The implementation for `platform` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return {"tpu": "tpu", "cpu": "tiled"}.get(platform, "reference")


def check_inputs(rows, w, group_sizes) -> None:
    """Raise ValueError naming the values for inputs the implementations do not take."""
    if rows.ndim != 2 or w.ndim != 3 or rows.shape[1] != w.shape[1]:
        raise ValueError(f"want rows [M, K] and w [G, K, N]: {rows.shape=} {w.shape=}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"want integer group_sizes [G={w.shape[0]}]: {group_sizes.shape=} {group_sizes.dtype=}"
        )
    for name, x in (("rows", rows), ("w", w)):
        if jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def grouped_matmul(
    rows: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """rows [M, K] (group g's group_sizes[g] rows after group g-1's) @ w [G, K, N] -> [M, N]
    float32; rows past the groups give zeros. `interpret` (the tpu kernel only): default True
    off TPU."""
    rows, w, group_sizes = jnp.asarray(rows), jnp.asarray(w), jnp.asarray(group_sizes)
    check_inputs(rows, w, group_sizes)
    impl = implementation or default_implementation()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown {implementation=}; choose one of {IMPLEMENTATIONS}")
    if rows.shape[0] == 0:
        return jnp.zeros((0, w.shape[2]), jnp.float32)
    if impl == "reference":
        return grouped_matmul_reference(rows, w, group_sizes)
    if impl == "tiled":
        tile = tuning.row_tile(rows.shape[0], *w.shape)
        return grouped_matmul_tiled(rows, w, group_sizes, tile=tile)
    from kernels_pallas.grouped_matmul.kernel_tpu import grouped_matmul_tpu

    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    return grouped_matmul_tpu(rows, w, group_sizes, interpret=interpret)

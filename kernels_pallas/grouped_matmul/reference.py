"""The specification of the grouped matmul: XLA's `jax.lax.ragged_dot`.

    out[i] = rows[i] @ w[g]   for the rows i of group g: rows [M, K] hold the groups one after
                              another (group g's group_sizes[g] rows start at sum(group_sizes[:g]))

w [G, K, N], group_sizes [G] int32 (sum <= M); rows past the last group give zeros. The product
in float32 (`preferred_element_type`), whatever the inputs' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, K] grouped @ w [G, K, N] -> [M, N] float32 (the module docstring)."""
    return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32)

"""The online softmax shared by the attention kernels (flash attention's running max and sum).

Per query row the state is (acc [M, H], m [M], denom [M]), all float32: the weighted sum of
values, the running max of the scores, and the running sum of exp(score - m). Masked scores are
MASK_VALUE, finite, so a row that has seen no visible key keeps m = MASK_VALUE, denom = 0 and
never produces NaN; `finalize` gives 0 for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot_precision(dtype) -> jax.lax.Precision:
    """Precision of a kernel matmul on `dtype` operands: float32 is computed in full float32
    (Triton's and XLA's GPU default for float32 is TF32, 10-bit mantissas: far from the
    reference), bfloat16 at the MXU/tensor-core default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def init(num_rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )


def update(state, s: jax.Array, visible: jax.Array | None, v: jax.Array):
    """Fold one block of keys in: s [M, BK] float32 scores (scaled, soft-capped), visible
    [M, BK] bool (None: every key is visible to every row), v [BK, H] values (p is rounded to v's
    dtype for p @ v, as flash kernels do)."""
    acc, m, denom = state
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=dot_precision(v.dtype),
        preferred_element_type=jnp.float32,
    )
    return alpha[:, None] * acc + pv, m_new, alpha * denom + p.sum(axis=1)


def combine_splits(
    o: jax.Array, m: jax.Array, denom: jax.Array, *, base2: bool = False
) -> jax.Array:
    """Flash decoding's merge of split-KV partials: o [C, ..., H] (each split's acc / denom), m
    and denom [C, ...] (its running max, in base 2 with `base2`, and sum) -> [..., H], weighting
    split c by denom_c * exp(m_c - max_c m). A split that saw no key has denom 0 (weight 0); a
    row no split saw gives 0."""
    exp = jnp.exp2 if base2 else jnp.exp
    w = denom * exp(m - m.max(axis=0))
    den = w.sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / jnp.where(den == 0.0, 1.0, den)[..., None]


def finalize(acc: jax.Array, denom: jax.Array) -> jax.Array:
    """acc / denom, 0 for rows that saw no key."""
    return acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]

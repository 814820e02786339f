"""The grouped matmul as a loop over row tiles in plain jnp (megablox's tiling, for the CPU).

The rows are cut into tiles of `tile` rows at fixed offsets (0, tile, 2 tile, ...); a tile that
two groups share is visited once per group, so there are at most ceil(M / tile) + G - 1 visits,
and only the visits that exist run (a `fori_loop` with a traced trip count): a decode step's few
rows read only the experts they were routed to. Each visit is one dense [tile, K] @ [K, N] dot
with its group's weight, written to the tile's rows of that group (a masked update).

XLA:CPU's ragged_dot computes every group over every row (G times the FLOPs, and every group's
weight read): 2-25x slower (kernels_pallas/grouped_matmul/tuning.py has the figures).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def grouped_matmul_tiled(
    rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int
) -> jax.Array:
    """rows [M, K] grouped @ w [G, K, N] -> [M, N] float32 (reference.py's specification)."""
    dot = lambda x, g: jnp.dot(x, w[g], preferred_element_type=jnp.float32)
    return grouped_tiles(rows, group_sizes, tile=tile, num_out=w.shape[2], dot=dot)


def grouped_tiles(
    rows: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int,
    num_out: int,
    dot: Callable[[jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """The tile loop over any weight form: `dot(x [tile, K], g)` gives the tile's rows times
    group g's matrix, [tile, num_out] float32 (g traced). -> [M, num_out] float32, zeros for
    rows past the groups. (llmjax/model/grouped_qdot.py passes packed and quantized experts.)"""
    M = rows.shape[0]
    G = group_sizes.shape[0]
    N = num_out
    num_tiles = -(-M // tile)
    # Group g's rows [starts[g], ends[g]) lie in tiles first[g] .. last[g] (none if empty).
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tile
    visits = jnp.where(group_sizes > 0, (jnp.maximum(ends, 1) - 1) // tile - first + 1, 0)
    max_visits = num_tiles + G - 1
    # Visit v: its group and tile (the groups' visits one after another).
    group_of = jnp.repeat(jnp.arange(G), visits, total_repeat_length=max_visits)
    offsets = jnp.cumsum(visits) - visits
    tile_of = first[group_of] + jnp.arange(max_visits) - offsets[group_of]
    padded = jnp.pad(rows, ((0, num_tiles * tile - M), (0, 0)))

    def visit(v, out):
        g, t = group_of[v], tile_of[v]
        x = lax.dynamic_slice_in_dim(padded, t * tile, tile)  # [tile, K]
        y = dot(x, g).astype(jnp.float32)  # [tile, N]
        r = t * tile + jnp.arange(tile)
        mine = ((r >= starts[g]) & (r < ends[g]))[:, None]
        old = lax.dynamic_slice_in_dim(out, t * tile, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), t * tile, 0)

    out = jnp.zeros((num_tiles * tile, N), jnp.float32)
    out = lax.fori_loop(0, jnp.sum(visits), visit, out)
    return out[:M]

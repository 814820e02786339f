"""Tile sizes of the grouped-matmul implementations.

`tiled` (the CPU's): each visit reads its group's whole weight and computes a whole tile, so the
tile follows the rows per group: M / G rounded up to a power of two (halved for small weights,
K x N < BIG_WEIGHT, where the wasted rows cost more than the extra visits), within [MIN_ROW_TILE,
MAX_ROW_TILE], and never more than M. Measured on this project's 2-core AVX2 CPU, float32 (ms,
the tile sizes tried; scripts/bench_moe.py has the whole MLP):
  K 1024, N 2048, 8 groups:   M 32: tile 4 43, 8 37;      M 512: tile 32 135, 64 96, 128 113
  K 1024, N 256, 64 groups:   M 128: tile 8 21, 16 25, 64 52;   M 2048: 16 39, 32 58, 64 68
against ragged_dot's 69 (M 32), 347 (512), 127 (128) and 1543 (2048).

`tpu` (megablox's gmm): (tm, tk, tn) = (TPU_TM or M rounded up to 8 if fewer, the largest of
TPU_TK_TN dividing K, likewise for N); rows padded to a multiple of tm. Not measured on a TPU
(none lent yet): megablox's defaults.
"""

from __future__ import annotations

import numpy as np

MIN_ROW_TILE = 8
MAX_ROW_TILE = 64
BIG_WEIGHT = 1 << 20  # K x N elements

TPU_TM = 128
TPU_TK_TN = (512, 256, 128)


def row_tile(num_rows: int, num_groups: int, k: int, n: int) -> int:
    """The `tiled` implementation's rows per tile for M rows in G groups of [K, N] weights."""
    per_group = num_rows / max(num_groups, 1)
    if k * n < BIG_WEIGHT:
        per_group /= 2
    tile = 1 << max(0, int(np.ceil(np.log2(max(per_group, 1)))))
    return int(min(num_rows, max(MIN_ROW_TILE, min(MAX_ROW_TILE, tile))))


def tpu_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox gmm's (tm, tk, tn) for rows [m, k] @ [G, k, n] (the rows padded to tm)."""

    def fit(d):
        return next((t for t in TPU_TK_TN if d % t == 0), d)

    return min(TPU_TM, -(-m // 8) * 8), fit(k), fit(n)

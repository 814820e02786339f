"""Dense float matmul on the CPU for small token counts (csrc/dense_matmul.cc): y[T, out] =
x[T, in] @ w.T in float32, w [out, in] float32 or bfloat16, x float32 or bfloat16.

XLA:CPU's dot runs far below the memory bandwidth at decode-sized T (1-64 rows); this kernel
streams each weight from memory once (register tiles of up to 4 tokens x 4-16 outputs,
prefetching the next tile's rows, both cores over parts of the outputs), and for bfloat16
weights from 8 tokens on uses the AMX tiles where the CPU and Linux allow them. On a CPU
without AVX-512 it runs an AVX2 engine (8-lane tiles of up to 4 tokens x 3-8 outputs; bfloat16
weights widened, no bf16 dot instruction); `kernels_cpu.build.engines()` names the engine.

What it computes (any in >= 1, out >= 1; T >= 0):
  w float32:   x widened to float32 (exact), the products and sums in float32.
  w bfloat16:  x rounded to bfloat16 first (round to nearest even, as `x.astype(bfloat16)`),
               each product exact in float32, the sums in float32 (vdpbf16ps / AMX tdpbf16ps,
               which treat bfloat16 denormals as zero and flush float32 denormals to zero). So
               against x @ w.T in exact arithmetic the error is at most
               2^-8 sum_i |x_i| |w_i|  (x's rounding: bf16 keeps 8 significant bits)
               + the float32 summation error,
               and against x.astype(bfloat16) @ w.T only the float32 summation error.
  w int8:      the codes widened to float32 (exact), x float32 (bfloat16 x widened), products
               and sums in float32: weight-only int8, whose per-output scales the caller applies
               to y (llmjax/model/quant.py's 'int8_wo'). With bfloat16 x (W8A16, quant.py's
               'int8_a16'; or float32 x with `round_x`), from 8 tokens on where the AMX tiles
               are usable and out is a multiple of 16, the codes are widened to bfloat16
               (exact) and multiplied on the tiles (tdpbf16ps): the same products, the sums in
               float32 in the tiles' order.
The summation order depends on T (tiles of 16 / 32 elements per lane, then a tree over the
lanes; AMX: 32-element steps along `in`), so results for one row can differ in the last bits
between calls with different T.

`layer`: with w stacked over layers ([L, out, in]) and `layer` a (traced) int32 scalar, the kernel
reads that layer in place, so a `lax.scan` over layers can pass the whole stack (loop-invariant)
and the index, and XLA copies no slice. Out-of-range layers are clamped to [0, L), as HLO's
DynamicSlice clamps (negative ones to 0: not wrapped from the end as `lax.dynamic_slice`'s
Python-style negative indices are).

`grouped_dense_matmul` is the grouped form a mixture of experts runs (llmjax/model/moe.py): rows
[M, in] in groups, group g's rows times group g's matrix of w [G, out, in] (or [L, G, out, in]
with `layer`), each group one product as above over its rows, reading its matrix in place: a
decode step's few rows read only the experts they were routed to. Specification:
`jax.lax.ragged_dot` with w transposed (rows past the groups give zeros).

Where it wins against XLA's own dot: scripts/bench_dense_matmul.py measures it per T;
scripts/bench_moe.py the grouped form against the tiled jnp loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.build import load

TARGET = "llmjax_cpu_dense_matmul"
GROUPED_TARGET = "llmjax_cpu_grouped_dense_matmul"
DTYPES = (jnp.float32, jnp.bfloat16)
W_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def _check_dtypes(x, w) -> None:
    if x.ndim != 2 or jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"want x [T, in] of float32 or bfloat16: {x.shape=} {x.dtype=}")
    if jnp.dtype(w.dtype) not in W_DTYPES:
        raise ValueError(f"want w of float32, bfloat16 or int8: {w.dtype=}")


def _check_round_x(round_x: bool, w) -> None:
    if round_x and jnp.dtype(w.dtype) != jnp.int8:
        raise ValueError(f"round_x (W8A16) is for int8 weights: {w.dtype=}")


def dense_matmul(x, w, *, layer=None, round_x: bool = False) -> jax.Array:
    """y[T, out] = x[T, in] @ w.T in float32 (x float32 or bfloat16, w float32, bfloat16 or int8;
    the module docstring says what each computes). `round_x` (int8 w only): take float32 x's
    bfloat16 values (W8A16), as if x were `x.astype(bfloat16)`, without that op in the graph.

    w is [out, in], or [L, out, in] with `layer` (an integer scalar, may be traced) picking one,
    clamped to [0, L). Raises ValueError for shapes or dtypes it does not take,
    KernelsUnavailable where the kernels do not build."""
    load()
    _check_dtypes(x, w)
    _check_round_x(round_x, w)
    T, n_in = x.shape
    if layer is None:
        if w.ndim != 2:
            raise ValueError(f"want w [out, in] (no layer given): {w.shape=}")
        w = w[None]  # a unit layer axis (a bitcast, no copy)
        layer = 0
    elif w.ndim != 3:
        raise ValueError(f"want w [L, out, in] (layer given): {w.shape=}")
    L, out, w_in = w.shape
    if w_in != n_in or n_in < 1:
        raise ValueError(f"w's in={w_in} must equal x's in={n_in} (>= 1): {x.shape=} {w.shape=}")
    if out < 1 or L < 1:
        raise ValueError(f"want out >= 1 and L >= 1: {w.shape=}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((T, out), jnp.float32))
    return call(x, w, _layer_index(layer), round_x=bool(round_x))


def _layer_index(layer) -> jax.Array:
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an integer scalar: {layer.shape=} {layer.dtype=}")
    return layer.astype(jnp.int32)


def grouped_dense_matmul(x, w, group_sizes, *, layer=None, round_x: bool = False) -> jax.Array:
    """y[M, out] float32: the rows of x [M, in] in groups (group g's group_sizes[g] rows after
    group g-1's) each times its group's matrix of w [G, out, in] transposed; rows past the
    groups give zeros (negative sizes count as 0; groups reaching past M are cut at M).

    w is [G, out, in], or [L, G, out, in] with `layer` (an integer scalar, may be traced) picking
    one, clamped to [0, L). Per row, the result is `dense_matmul` of that row with its group's
    matrix (the same arithmetic, `round_x` as there). Raises ValueError for shapes or dtypes it
    does not take, KernelsUnavailable where the kernels do not build."""
    load()
    _check_dtypes(x, w)
    _check_round_x(round_x, w)
    if layer is None:
        if w.ndim != 3:
            raise ValueError(f"want w [G, out, in] (no layer given): {w.shape=}")
        w, layer = w[None], 0
    elif w.ndim != 4:
        raise ValueError(f"want w [L, G, out, in] (layer given): {w.shape=}")
    M, n_in = x.shape
    _, G, out, w_in = w.shape
    if w_in != n_in or n_in < 1 or out < 1 or G < 1:
        raise ValueError(f"want w [.., G >= 1, out >= 1, in={n_in} >= 1]: {x.shape=} {w.shape=}")
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (G,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"want integer group_sizes [G={G}]: {group_sizes.shape=}")
    call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((M, out), jnp.float32))
    return call(x, w, group_sizes.astype(jnp.int32), _layer_index(layer), round_x=bool(round_x))


def grouped_dense_matmul_reference(x, w, group_sizes) -> np.ndarray:
    """What the grouped kernel computes, in float64: each group's rows by dense_matmul_reference
    with its matrix, zeros past the groups."""
    x, w = np.asarray(x), np.asarray(w)
    y = np.zeros((x.shape[0], w.shape[1]), np.float64)
    start = 0
    for g, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
        end = min(start + int(size), x.shape[0])
        if end > start:
            y[start:end] = dense_matmul_reference(x[start:end], w[g])
        start = end
    return y


def dense_matmul_reference(x, w) -> np.ndarray:
    """What the kernel computes, in float64 (not rounded): x @ w.T with x rounded to bfloat16
    first where w is bfloat16."""
    if jnp.dtype(w.dtype) == jnp.bfloat16:
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
    return np.asarray(x).astype(np.float64) @ np.asarray(w).astype(np.float64).T

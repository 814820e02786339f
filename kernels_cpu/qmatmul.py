"""Quantized matmul on the CPU (csrc/qmatmul.cc): y[T, out] = x[T, in] @ dequantize(W).T in
float32, with W [out, in] in one of four formats and the activations quantized to int8 inside the
kernel, once per call; int32 dot products on AVX-512 VNNI for a few tokens, on AMX tiles from
3-8 tokens on where the CPU has them (Sapphire Rapids on), on portable C++ elsewhere: the same
result up to float32 rounding.

Weight formats (a row is one output channel; blocks of 32 run along `in`, nb = in / 32):
  int8   per-output-channel symmetric int8 (W8A8 dynamic): values int8 [out, in], scales [out];
         W[o, i] = values[o, i] * scales[o]
  q8_0   GGUF Q8_0: values int8 [out, in], scales [out, nb]; W[o, 32b+j] = values[o, 32b+j] *
         scales[o, b]
  q4_0   GGUF Q4_0: values uint8 [out, in/2], block b of row o the bytes values[o, 16b:16b+16],
         byte j's low nibble element 32b+j, its high nibble element 32b+16+j; scales [out, nb];
         W = (nibble - 8) * scales[o, b]
  q4_1   GGUF Q4_1: packed as q4_0, scales and mins [out, nb]; W = nibble * scales[o, b] +
         mins[o, b]
Scales and mins are float32 (GGUF stores them in float16: widen them once, at load).

Activation quantization, the definition (float32 arithmetic, `qmatmul_reference` repeats it):
  int8   per token t (row of x): d[t] = max_i |x[t, i]| / 127, or 1 where that max is 0;
         q[t, i] = clip(rint(x[t, i] / d[t]), -127, 127), rint rounding ties to even.
         y[t, o] = d[t] * scales[o] * sum_i q[t, i] * values[o, i]  (the sum exact, in int32)
  blocks per token and 32-element block b, llama.cpp's Q8_0 of x (ties to even here):
         d[t, b] = max_j |x[t, 32b+j]| / 127 (or 1), q[t, 32b+j] = clip(rint(x / d[t, b]), ±127).
         y[t, o] = sum_b sum_j d[t, b] q[t, 32b+j] W[o, 32b+j], i.e. per block
           q8_0: scales[o, b] d[t, b] sum_j q values
           q4_0: scales[o, b] d[t, b] (sum_j q nibble - 8 s[t, b])
           q4_1: scales[o, b] d[t, b] sum_j q nibble + mins[o, b] d[t, b] s[t, b]
         with s[t, b] = sum_j q[t, 32b+j], the block sums computed with the quantization.
So y = x_hat @ W.T exactly (up to float32 rounding of the sums), x_hat = d * q the activations as
quantized: the error against x @ W.T is at most sum_i |x - x_hat|_i |W[o, i]| <= sum_i d_i/2 |W|.

`layer`: with the weights stacked over layers ([L, out, ...]) and `layer` a (traced) int32
scalar, the kernel reads that layer in place, so a `lax.scan` over layers can pass the whole stack
(loop-invariant) and the index, and XLA copies no slice. Out-of-range layers are clamped, as
`lax.dynamic_slice` clamps.

`grouped_qmatmul` is the grouped form a mixture of experts runs (llmjax/model/moe.py): rows
[M, in] in groups, group g's rows times group g's matrix of a stack [G, out, ...] (or [L, G, out,
...] with `layer`); each group's rows are quantized and multiplied on their own, so every row gets
exactly what `qmatmul` gives it with its group's matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.build import load

TARGET = "llmjax_cpu_qmatmul"
GROUPED_TARGET = "llmjax_cpu_grouped_qmatmul"
FORMATS = ("int8", "q8_0", "q4_0", "q4_1")
BLOCK = 32
MAX_IN = 65536  # int8's int32 sums of (values + 128) * q stay in range up to here
X_DTYPES = (jnp.float32, jnp.bfloat16)


def _weight_shapes(fmt: str, out: int, n_in: int) -> tuple[tuple, np.dtype, tuple]:
    """The (values shape, values dtype, scales shape) the format wants for a [out, in] weight."""
    if fmt == "int8":
        return (out, n_in), np.dtype(np.int8), (out,)
    if fmt == "q8_0":
        return (out, n_in), np.dtype(np.int8), (out, n_in // BLOCK)
    return (out, n_in // 2), np.dtype(np.uint8), (out, n_in // BLOCK)


def _check(x, values, scales, mins, fmt: str, lead: tuple) -> int:
    """Raise ValueError unless the arrays fit `fmt` with leading axes `lead`; returns out."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}: {fmt!r}")
    if x.ndim != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"want x [T, in] of {X_DTYPES}: {x.shape=} {x.dtype=}")
    n_in = x.shape[1]
    if n_in % BLOCK or not 0 < n_in <= MAX_IN:
        raise ValueError(f"in={n_in} must be a positive multiple of {BLOCK}, at most {MAX_IN}")
    if values.ndim != 2 + len(lead):
        raise ValueError(
            f"want values [{', '.join(['*'] * len(lead) + ['out', '*'])}]: {values.shape=}"
        )
    out = values.shape[len(lead)]
    if out % 32:
        raise ValueError(f"out={out} must be a multiple of 32")
    v_shape, v_dtype, s_shape = _weight_shapes(fmt, out, n_in)
    if values.shape != (*lead, *v_shape) or values.dtype != v_dtype:
        raise ValueError(
            f"{fmt} wants values {v_dtype} {(*lead, *v_shape)} for x {x.shape}: "
            f"{values.shape=} {values.dtype=}"
        )
    if scales.shape != (*lead, *s_shape) or scales.dtype != jnp.float32:
        raise ValueError(
            f"{fmt} wants scales float32 {(*lead, *s_shape)}: {scales.shape=} {scales.dtype=}"
        )
    if fmt == "q4_1":
        if mins is None or mins.shape != scales.shape or mins.dtype != jnp.float32:
            raise ValueError(
                f"q4_1 wants mins float32 {scales.shape}: {getattr(mins, 'shape', None)}"
            )
    elif mins is not None:
        raise ValueError(f"{fmt} takes no mins")
    return out


def _layer_index(layer) -> jax.Array:
    layer = jnp.asarray(layer, jnp.int32)
    if layer.shape != ():
        raise ValueError(f"layer must be a scalar: {layer.shape=}")
    return layer


def qmatmul(x, values, scales, mins=None, *, fmt: str, layer=None) -> jax.Array:
    """y[T, out] = x[T, in] @ dequantize(W).T  (float32 result; x float32 or bfloat16).

    values / scales / mins as the module docstring says for `fmt`, with a leading layer axis
    [L, ...] when `layer` (an int32 scalar, may be traced) is given. Raises ValueError for shapes
    or dtypes it does not take, KernelsUnavailable where the kernels do not build."""
    load()
    lead = () if layer is None else values.shape[:1]
    out = _check(x, values, scales, mins, fmt, lead)
    if layer is None:  # one layer: a unit leading axis (a bitcast, no copy)
        values, scales = values[None], scales[None]
        mins = None if mins is None else mins[None]
        layer = 0
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32))
    # the formats without mins get the scales in their place (unread)
    return call(x, values, scales, scales if mins is None else mins, _layer_index(layer), fmt=fmt)


def grouped_qmatmul(
    x, values, scales, mins=None, *, group_sizes, fmt: str, layer=None
) -> jax.Array:
    """y[M, out] float32: the rows of x [M, in] in groups (group g's group_sizes[g] rows after
    group g-1's) each times its group's dequantized matrix (transposed); rows past the groups
    give zeros (negative sizes count as 0; groups reaching past M are cut at M).

    values / scales / mins as for `qmatmul` with a leading group axis [G, ...], or [L, G, ...]
    with `layer` (an int32 scalar, may be traced; clamped). Row by row the result is `qmatmul`'s
    for that row and its group's matrix. Raises ValueError for shapes or dtypes it does not
    take, KernelsUnavailable where the kernels do not build."""
    load()
    lead = values.shape[:1] if layer is None else values.shape[:2]
    out = _check(x, values, scales, mins, fmt, lead)
    if layer is None:
        values, scales = values[None], scales[None]
        mins = None if mins is None else mins[None]
        layer = 0
    G = values.shape[1]
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (G,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"want integer group_sizes [G={G}]: {group_sizes.shape=}")
    call = jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((x.shape[0], out), jnp.float32))
    return call(
        x,
        values,
        scales,
        scales if mins is None else mins,
        group_sizes.astype(jnp.int32),
        _layer_index(layer),
        fmt=fmt,
    )


def _dequantize(values, scales, mins, fmt: str, dtype) -> np.ndarray:
    values = np.asarray(values)
    scales = np.asarray(scales).astype(dtype)
    if fmt == "int8":
        return values.astype(dtype) * scales[..., None]
    lead = values.shape[:-1]
    if fmt == "q8_0":
        w = values.astype(dtype).reshape(*lead, -1, BLOCK) * scales[..., None]
    else:
        packed = values.reshape(*lead, -1, BLOCK // 2)
        nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1)  # elements j, then 16 + j
        if fmt == "q4_0":
            w = (nibbles.astype(np.int8) - 8).astype(dtype) * scales[..., None]
        elif fmt == "q4_1":
            w = (
                nibbles.astype(dtype) * scales[..., None]
                + np.asarray(mins).astype(dtype)[..., None]
            )
        else:
            raise ValueError(f"fmt must be one of {FORMATS}: {fmt!r}")
    return w.reshape(*lead, -1)


def dequantize(values, scales, mins, fmt: str) -> np.ndarray:
    """W float32 [..., out, in] from a format's arrays (as gguf.quants.dequantize computes it,
    in float32, for the GGUF formats)."""
    return _dequantize(values, scales, mins, fmt, np.float32)


def quantize_activations(x, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization (the module docstring): q int8 [T, in] and d float32,
    [T, 1] for int8 and [T, in/32] for the block formats."""
    x = np.asarray(x).astype(np.float32)
    T, n_in = x.shape
    blocks = x.reshape(T, -1, n_in if fmt == "int8" else BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    d = np.where(amax == 0, np.float32(1), amax / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint(blocks / d[..., None]), -127, 127).astype(np.int8)
    return q.reshape(T, n_in), d


def qmatmul_reference(x, values, scales, mins, fmt: str) -> np.ndarray:
    """What the kernel computes, in float64, rounded to float32 [T, out]: x_hat @ W.T with x_hat
    the quantized activations (quantize_activations) and W the exact dequantized weights."""
    q, d = quantize_activations(x, fmt)
    T, n_in = q.shape
    x_hat = (q.astype(np.float64).reshape(T, d.shape[1], -1) * d[..., None]).reshape(T, n_in)
    w = _dequantize(values, scales, mins, fmt, np.float64)
    return (x_hat @ w.T).astype(np.float32)


def grouped_qmatmul_reference(x, values, scales, mins, group_sizes, fmt: str) -> np.ndarray:
    """What the grouped kernel computes: each group's rows by qmatmul_reference with its
    matrix, zeros past the groups."""
    x = np.asarray(x)
    y = np.zeros((x.shape[0], np.shape(values)[1]), np.float32)
    start = 0
    for g, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
        end = min(start + int(size), x.shape[0])
        if end > start:
            m = None if mins is None else np.asarray(mins)[g]
            y[start:end] = qmatmul_reference(
                x[start:end], np.asarray(values)[g], np.asarray(scales)[g], m, fmt
            )
        start = end
    return y

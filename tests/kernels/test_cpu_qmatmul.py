"""The CPU quantized matmul (kernels_cpu/qmatmul.py): `dequantize` against gguf's for the GGUF
formats (exactly), the kernel against `qmatmul_reference` (the same activation quantization, so to
float32 rounding: 1e-5 of the sum of the terms' magnitudes), and against x @ W.T within the
activation quantization's error bound (sum_i d_i / 2 |W[o, i]|); the stacked-weights `layer`
argument inside a lax.scan; the wrapper's errors."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu.qmatmul import (
    FORMATS,
    dequantize,
    qmatmul,
    qmatmul_reference,
    quantize_activations,
)
from tests.kernels.kernel_testing import no_cpu_compiler

pytestmark = pytest.mark.skipif(
    no_cpu_compiler(), reason="no C++ compiler (or LLMJAX_CPU_KERNELS=0)"
)

GGUF_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}


def gguf_split(raw: np.ndarray, fmt: str, out: int):
    """values, scales, mins from GGUF blocks [out, nb * block bytes]: Q8_0 = f16 d + 32 int8,
    Q4_0 = f16 d + 16 bytes, Q4_1 = f16 d + f16 m + 16 bytes."""
    block_bytes = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    blocks = raw.reshape(out, -1, block_bytes)
    half = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0].astype(np.float32)
    d = half(blocks[..., 0:2])
    if fmt == "q8_0":
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, -1), d, None
    if fmt == "q4_0":
        return np.ascontiguousarray(blocks[..., 2:]).reshape(out, -1), d, None
    return np.ascontiguousarray(blocks[..., 4:]).reshape(out, -1), d, half(blocks[..., 2:4])


def make_weights(rng, fmt: str, out: int, n_in: int):
    """A random weight quantized to `fmt` (GGUF's quantizers for the GGUF formats)."""
    w = rng.standard_normal((out, n_in)).astype(np.float32)
    if fmt == "int8":
        scales = (np.abs(w).max(axis=1) / 127).astype(np.float32)
        values = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
        return values, scales, None
    raw = gguf.quants.quantize(w, GGUF_TYPES[fmt])
    return gguf_split(raw, fmt, out)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_dequantize_equals_gguf(fmt):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32) * rng.random((48, 1)).astype(np.float32)
    w[3, 32:64] = 0  # a zero block
    raw = gguf.quants.quantize(w, GGUF_TYPES[fmt])
    values, scales, mins = gguf_split(raw, fmt, 48)
    got = dequantize(values, scales, mins, fmt)
    want = gguf.quants.dequantize(raw, GGUF_TYPES[fmt])
    assert got.dtype == np.float32 and got.shape == (48, 256)
    np.testing.assert_array_equal(got, want)


# a zero block, then one with d = 1 exactly whose quotients are ties (to even: 2, 4, -0)
TIES = np.array([[0.0] * 32 + [127.0, 2.5, 3.5, -0.5] + [1.0] * 28], np.float32)


def test_activation_quantization():
    q, d = quantize_activations(TIES, "q8_0")
    assert d.tolist() == [[1.0, 1.0]]  # the zero block's d is 1
    assert (q[0, :32] == 0).all() and q[0, 32:36].tolist() == [127, 2, 4, 0]
    q, d = quantize_activations(TIES, "int8")
    assert d.shape == (1, 1) and d[0, 0] == 1 and q[0, 33:36].tolist() == [2, 4, 0]


def check(fmt, T, n_in, out, *, dtype=jnp.float32, seed=0, x=None):
    rng = np.random.default_rng(seed)
    values, scales, mins = make_weights(rng, fmt, out, n_in)
    if x is None:
        x = rng.standard_normal((T, n_in)).astype(np.float32) * 3
        if T > 2:
            x[1] = 0  # a zero row
            x[2, :32] = 0  # a zero block
    x = jnp.asarray(x, dtype)
    y = jax.jit(lambda *a: qmatmul(*a, fmt=fmt))(
        x, values, scales, *([] if mins is None else [mins])
    )
    assert y.shape == (T, out) and y.dtype == jnp.float32
    y = np.asarray(y)
    assert np.isfinite(y).all()

    ref = qmatmul_reference(x, values, scales, mins, fmt)
    w = dequantize(values, scales, mins, fmt).astype(np.float64)
    q, d = quantize_activations(x, fmt)
    x_hat = (q.reshape(T, d.shape[1], -1) * d[..., None].astype(np.float64)).reshape(T, n_in)
    magnitude = np.abs(x_hat) @ np.abs(w).T  # sum_i |x_hat_i W_i|
    err = np.abs(y - ref)
    assert (err <= 1e-5 * magnitude + 1e-30).all(), f"vs reference: max {err.max()}"

    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    d_each = np.repeat(d, n_in // d.shape[1], axis=1).astype(np.float64)
    bound = 0.5 * d_each @ np.abs(w).T  # |x - x_hat| <= d / 2 elementwise
    err = np.abs(y - x64 @ w.T)
    assert (err <= bound * (1 + 1e-4) + 1e-5 * magnitude).all(), f"vs x @ W.T: max {err.max()}"
    if T > 2 and not np.asarray(x[1]).any():
        assert (y[1] == 0).all()


SHAPES = [(64, 32), (96, 64), (576, 192)]  # in = 2, 3, 18 blocks (groups of 4 with a tail)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 16, 17, 40])
@pytest.mark.parametrize("n_in, out", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_against_the_reference(fmt, n_in, out, T):
    check(fmt, T, n_in, out, seed=T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_activations_and_larger_shapes(fmt):
    check(fmt, 7, 1536, 576, dtype=jnp.bfloat16)
    check(fmt, 300, 576, 96, seed=1)  # more tokens than a work item (256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even_in_the_kernel(fmt):
    check(fmt, 3, 64, 32, x=np.concatenate([TIES, -TIES, 2 * TIES]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_layers_in_a_scan(fmt):
    """A lax.scan over layers passes the whole stack plus the index: the same results as one
    call per layer, with no slice of the stack copied (no dynamic-slice in the program)."""
    rng = np.random.default_rng(5)
    L, T, n_in, out = 3, 5, 128, 64
    layers = [make_weights(rng, fmt, out, n_in) for _ in range(L)]
    stack = [np.stack([layer[i] for layer in layers]) for i in range(2 if fmt != "q4_1" else 3)]
    x = jnp.asarray(rng.standard_normal((T, n_in)).astype(np.float32))

    def scanned(x, *stack):
        body = lambda i, _: (i + 1, qmatmul(x, *stack, fmt=fmt, layer=i))
        return jax.lax.scan(body, 0, None, length=L)[1]

    got = jax.jit(scanned)(x, *stack)
    for i, (v, s, m) in enumerate(layers):
        one = qmatmul(x, v, s, *([] if m is None else [m]), fmt=fmt)
        np.testing.assert_array_equal(got[i], one)
    hlo = jax.jit(scanned).lower(x, *stack).compile().as_text()
    assert "dynamic-slice" not in hlo and "dynamic_slice" not in hlo


def test_bad_inputs_name_what_is_wrong():
    rng = np.random.default_rng(0)
    x = jnp.zeros((4, 64), jnp.float32)
    v8, s8, _ = make_weights(rng, "int8", 32, 64)
    v4, s4, m4 = make_weights(rng, "q4_1", 32, 64)
    with pytest.raises(ValueError, match="fmt must be one of"):
        qmatmul(x, v8, s8, fmt="q5_k")
    with pytest.raises(ValueError, match="want x"):
        qmatmul(x.astype(jnp.float16), v8, s8, fmt="int8")
    with pytest.raises(ValueError, match="multiple of 32"):
        qmatmul(jnp.zeros((4, 48)), v8[:, :48], s8, fmt="int8")
    with pytest.raises(ValueError, match="wants values"):
        qmatmul(x, v4, s4, m4, fmt="q8_0")
    with pytest.raises(ValueError, match="wants scales"):
        qmatmul(x, v8, s8.astype(np.float16), fmt="int8")
    with pytest.raises(ValueError, match="q4_1 wants mins"):
        qmatmul(x, v4, s4, fmt="q4_1")
    with pytest.raises(ValueError, match="takes no mins"):
        qmatmul(x, v4, s4, m4, fmt="q4_0")
    with pytest.raises(ValueError, match="out=16 must be a multiple of 32"):
        qmatmul(x, v8[:16], s8[:16], fmt="int8")
    with pytest.raises(ValueError, match="want values"):
        qmatmul(x, v8, s8, fmt="int8", layer=0)  # no layer axis

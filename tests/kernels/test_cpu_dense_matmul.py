"""The CPU dense matmul (kernels_cpu/dense_matmul.py) against x @ w.T in float64.

Bounds, with mag = |x_k| @ |w|.T (x_k the activations as the kernel takes them: float32 for
float32 and int8 weights, rounded to bfloat16 for bfloat16 weights):
  float32 weights:   |y - x @ w.T| <= 1e-5 mag  (float32 summation: each lane sums in/16
                     terms, then a 16-lane tree: ~(in/16 + 4) 2^-24 < 1e-5 for these `in`)
  bfloat16 weights:  |y - x_bf16 @ w.T| <= 1e-5 mag (the summation, as above), and
                     |y - x @ w.T| <= 2^-8 |x| @ |w|.T + 1e-5 mag (x's rounding to bfloat16, 8
                     significant bits, to nearest: each element moves by at most half an ulp,
                     2^-8 of its magnitude).
  int8 weights:      |y - x @ w.T| <= 1e-5 mag (codes widened exactly; the float32 summation).
Shapes cover every engine (AVX-512: T = 1: 1x16 tiles, T = 2: 2x8, T >= 3: 4x4 with token tails;
bfloat16 weights from T = 8: AMX where the CPU grants it; AVX2: 1x8, 2x4, then the default tile
and, on a CPU with that engine, each of its other tiles), `in` and `out` that are not multiples
of the vector / tile sizes (masked tails, one-output tiles), the tied-embedding LM head
(49152 x 576), the stacked-layer `layer` argument in a lax.scan (no slice copied), and the
wrapper's errors."""

import ctypes
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu.build import engines, load
from kernels_cpu.dense_matmul import dense_matmul, dense_matmul_reference
from tests.kernels.kernel_testing import no_cpu_compiler

pytestmark = pytest.mark.skipif(
    no_cpu_compiler(), reason="no C++ compiler (or LLMJAX_CPU_KERNELS=0)"
)

RTOL = 1e-5  # of mag, the float32 summation
BF16_X = 2.0**-8  # bfloat16's rounding of x (half an ulp), relative to |x|

_jitted = jax.jit(dense_matmul)


def random_inputs(rng, T, n_in, out, w_dtype, x_dtype):
    """Non-zero normal x [T, in] and w [out, in], rows of different scales."""
    x = rng.standard_normal((T, n_in)).astype(np.float32) * rng.uniform(0.5, 4, (T, 1))
    if w_dtype == jnp.int8:  # weight-only int8 codes, the full range
        return jnp.asarray(x, x_dtype), jnp.asarray(rng.integers(-127, 128, (out, n_in)), jnp.int8)
    w = rng.standard_normal((out, n_in)).astype(np.float32) * rng.uniform(0.01, 0.1, (out, 1))
    return jnp.asarray(x, x_dtype), jnp.asarray(w, w_dtype)


def check(y, x, w):
    """y against x @ w.T within the module docstring's bounds."""
    T, out = x.shape[0], w.shape[0]
    y = np.asarray(y)
    assert y.shape == (T, out) and y.dtype == np.float32
    assert np.isfinite(y).all()
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref = dense_matmul_reference(x, w)  # x as the kernel takes it
    x_k = np.asarray(
        jnp.asarray(x).astype(jnp.bfloat16 if w.dtype == jnp.bfloat16 else jnp.float32)
    )
    mag = np.abs(x_k.astype(np.float64)) @ np.abs(w64).T
    err = np.abs(y - ref)
    assert (err <= RTOL * mag).all(), f"vs the reference: max {(err / mag).max():.3g} of mag"
    if w.dtype == jnp.bfloat16:
        bound = BF16_X * (np.abs(x64) @ np.abs(w64).T) + RTOL * mag
        err = np.abs(y - x64 @ w64.T)
        assert (err <= bound).all(), f"vs x @ w.T: max {(err / bound).max():.3g} of the bound"


SHAPES = [(64, 32), (576, 192), (1536, 576), (576, 1536)]  # (in, out)


W_DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8]
W_IDS = ["f32", "bf16", "i8"]


@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=W_IDS)
@pytest.mark.parametrize("n_in, out", SHAPES, ids=[f"{i}x{o}" for i, o in SHAPES])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 16, 33, 64, 200])
def test_against_float64(T, n_in, out, w_dtype):
    rng = np.random.default_rng(T * 7 + out)
    x, w = random_inputs(rng, T, n_in, out, w_dtype, jnp.float32)
    check(_jitted(x, w), x, w)


ODD = [(1, 1), (17, 37), (100, 40), (40, 48), (31, 200), (96, 17)]  # (in, out)


@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=W_IDS)
@pytest.mark.parametrize("n_in, out", ODD, ids=[f"{i}x{o}" for i, o in ODD])
@pytest.mark.parametrize("T", [1, 2, 3, 6, 9, 16, 35])
def test_tails_of_in_and_out(T, n_in, out, w_dtype):
    """in not a multiple of 16 / 32 (masked loads), out not a multiple of the tiles' 4 / 8 / 16
    outputs nor of AMX's 16 / 32 (one-output tiles; AMX's tail rows by the AVX-512 engine)."""
    rng = np.random.default_rng(T + 1000 * n_in + out)
    x, w = random_inputs(rng, T, n_in, out, w_dtype, jnp.float32)
    check(_jitted(x, w), x, w)


AVX2_TILES = (24, 42, 33, 34, 43)  # tokens * 10 + outputs (dense_matmul.cc, avx2_dots)


@pytest.mark.parametrize("tile", AVX2_TILES)
def test_every_avx2_tile(tile):
    """The AVX2 engine with each register tile it can take from 3 tokens on (the one it does not
    take by default is set through LlmjaxDenseMatmulSetAvx2Tile, for comparing them), over
    token counts and outputs that leave partial token tiles and one-output rows."""
    if engines()["dense_matmul"] != "avx2":
        pytest.skip("this CPU's dense matmul kernel is not the AVX2 engine")
    library = ctypes.CDLL(load())
    assert library.LlmjaxDenseMatmulSetAvx2Tile(tile) == 1
    try:
        for T in (3, 4, 5, 7, 13):
            for n_in, out in [(31, 37), (576, 194)]:
                for w_dtype in W_DTYPES:
                    rng = np.random.default_rng(T + 100 * out + tile)
                    x, w = random_inputs(rng, T, n_in, out, w_dtype, jnp.float32)
                    check(_jitted(x, w), x, w)
    finally:
        library.LlmjaxDenseMatmulSetAvx2Tile(0)


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 5, 16, 64])
def test_bfloat16_activations(T, w_dtype):
    rng = np.random.default_rng(T)
    x, w = random_inputs(rng, T, 576, 192, w_dtype, jnp.bfloat16)
    check(_jitted(x, w), x, w)


W8A16_SHAPES = [(576, 192), (1536, 576), (64, 40), (80, 48)]  # AMX: in % 32, out % 16 or not


@pytest.mark.parametrize("n_in, out", W8A16_SHAPES, ids=[f"{i}x{o}" for i, o in W8A16_SHAPES])
@pytest.mark.parametrize("T", [1, 7, 8, 16, 33, 200])
def test_w8a16_int8_weights_with_bfloat16_activations(T, n_in, out):
    """int8 codes with bfloat16 x (AMX from 8 tokens: the codes widened to bfloat16 on the
    tiles; the float32 engines below), and float32 x with `round_x`: both x's bfloat16 values
    times the codes, products exact, float32 sums, so within the summation's bound of
    x.astype(bfloat16) @ w.T; x's magnitudes spread over 2^-6..2^6 so the rounding matters."""
    rng = np.random.default_rng(T * 31 + n_in)
    x = rng.standard_normal((T, n_in)) * np.exp2(rng.uniform(-6, 6, (1, n_in)))
    x = jnp.asarray(x, jnp.float32)
    w = jnp.asarray(rng.integers(-128, 128, (out, n_in)), jnp.int8)  # -128 too
    xb = x.astype(jnp.bfloat16)
    y_bf16 = np.asarray(_jitted(xb, w))
    y_round = np.asarray(jax.jit(dense_matmul, static_argnames="round_x")(x, w, round_x=True))
    x64 = np.asarray(xb.astype(jnp.float32), np.float64)
    w64 = np.asarray(w, np.float64)
    mag = np.abs(x64) @ np.abs(w64).T
    for y in (y_bf16, y_round):
        assert y.shape == (T, out) and y.dtype == np.float32
        assert (np.abs(y - x64 @ w64.T) <= RTOL * mag).all()
    np.testing.assert_array_equal(y_bf16, y_round)  # the same rounding, the same engine
    # not weight-only int8 of float32 x: the rounding is there to see
    exact = np.asarray(x, np.float64) @ w64.T
    assert np.abs(y_round - exact).max() > RTOL * mag.max()


def test_round_x_is_for_int8_weights():
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="round_x"):
        dense_matmul(x, jnp.ones((32, 64), jnp.bfloat16), round_x=True)


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tied_embedding_lm_head(w_dtype):
    """x @ E.T with E the [49152, 576] embedding (the LM head of a tied model)."""
    rng = np.random.default_rng(49152)
    for T in (1, 3, 8, 16):
        x, w = random_inputs(rng, T, 576, 49152, w_dtype, jnp.float32)
        check(_jitted(x, w), x, w)


def _stack_copies(hlo: str, stack_shape: str) -> list[str]:
    """The instructions of the compiled HLO that make a value of the stack's shape other than
    by naming it (parameter, get-tuple-element, bitcast): copies or slices of the stack."""
    pattern = re.compile(r"=\s*" + re.escape(stack_shape) + r"\{[^}]*\}\s+([\w-]+)\(")
    return [
        m.group(0)
        for m in pattern.finditer(hlo)
        if m.group(1) not in ("parameter", "get-tuple-element", "bitcast")
    ]


@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=W_IDS)
@pytest.mark.parametrize("T", [1, 5, 16])
def test_stacked_layers_in_a_scan(T, w_dtype):
    """A lax.scan over layers passes the whole stack plus the index: the same results as one
    call per layer, with no slice of the stack copied (no dynamic-slice or copy of it)."""
    rng = np.random.default_rng(T)
    L, n_in, out = 3, 576, 192
    w = rng.standard_normal((L, out, n_in)).astype(np.float32)
    w = jnp.asarray(np.clip(np.rint(w * 40), -127, 127) if w_dtype == jnp.int8 else w, w_dtype)
    x = jnp.asarray(rng.standard_normal((T, n_in)).astype(np.float32))

    def scanned(x, w):
        body = lambda i, _: (i + 1, dense_matmul(x, w, layer=i))
        return jax.lax.scan(body, 0, None, length=L)[1]

    got = jax.jit(scanned)(x, w)
    for i in range(L):
        np.testing.assert_array_equal(got[i], _jitted(x, w[i]))
        check(got[i], x, w[i])
    hlo = jax.jit(scanned).lower(x, w).compile().as_text()
    assert "dynamic-slice" not in hlo and "dynamic_slice" not in hlo
    name = {jnp.float32: "f32", jnp.bfloat16: "bf16", jnp.int8: "s8"}[w_dtype]
    stack_shape = f"{name}[{L},{out},{n_in}]"
    assert stack_shape in hlo
    assert not _stack_copies(hlo, stack_shape), _stack_copies(hlo, stack_shape)


def test_layer_is_clamped_as_hlo_dynamic_slice_clamps():
    """Out-of-range layers clamp to [0, L) as HLO's DynamicSlice does (and qmatmul): negative
    ones to 0, not wrapped from the end as jax.lax.dynamic_slice's Python-style indices are."""
    rng = np.random.default_rng(1)
    L = 3
    w = jnp.asarray(rng.standard_normal((L, 32, 64)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    f = jax.jit(lambda x, w, i: dense_matmul(x, w, layer=i))
    for i in (-5, -1, 0, 1, 2, 3, 100):
        np.testing.assert_array_equal(f(x, w, jnp.int32(i)), _jitted(x, w[min(max(i, 0), L - 1)]))


def test_no_tokens():
    y = dense_matmul(jnp.zeros((0, 64), jnp.float32), jnp.ones((32, 64), jnp.bfloat16))
    assert y.shape == (0, 32) and y.dtype == jnp.float32


def test_bad_inputs_name_what_is_wrong():
    x = jnp.zeros((4, 64), jnp.float32)
    w = jnp.zeros((32, 64), jnp.float32)
    with pytest.raises(ValueError, match="want x"):
        dense_matmul(x[0], w)
    with pytest.raises(ValueError, match="want x"):
        dense_matmul(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match="want w of float32, bfloat16 or int8"):
        dense_matmul(x, w.astype(jnp.uint8))
    with pytest.raises(ValueError, match=r"want w \[out, in\] \(no layer given\)"):
        dense_matmul(x, w[None])
    with pytest.raises(ValueError, match=r"want w \[L, out, in\] \(layer given\)"):
        dense_matmul(x, w, layer=0)
    with pytest.raises(ValueError, match="must equal x's in"):
        dense_matmul(x, w[:, :48])
    with pytest.raises(ValueError, match="out >= 1"):
        dense_matmul(x, w[:0])
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        dense_matmul(x, w[None], layer=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        dense_matmul(x, w[None], layer=0.5)

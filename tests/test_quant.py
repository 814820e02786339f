"""Packed and quantized weights (llmjax/model/quant.py): GGUF blocks round-trip exactly against
gguf's own dequantization, int8 stays within half a step, every matmul form stays within the
error its activation quantization allows, the model over packed weights matches the model over
the same weights dequantized, and the other backends' form lowers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax.checkpoint.gguf import load_gguf
from llmjax.model import quant
from llmjax.model.params import init_params, stack_layers
from tests.helpers import full_logits
from tests.test_checkpoint import write_gguf

BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")


def _random_weight(rng, shape, outliers=True):
    w = rng.standard_normal(shape).astype(np.float32)
    if outliers:  # a few large entries, as real weights have
        idx = rng.integers(0, w.size, max(1, w.size // 200))
        w.flat[idx] *= 8
    return w


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_gguf_blocks_kept_quantized_round_trip_exactly(gguf_type, name, tmp_path):
    path = write_gguf(tmp_path / "q.gguf", name, quant=gguf_type)
    config, packed = load_gguf(path, quantized=True)
    _, dense = load_gguf(path)  # dequantized by gguf.quants.dequantize
    fmt = gguf_type.lower()
    wq = packed["layers"][0]["wq"]
    assert quant.is_packed(wq) and wq.fmt == fmt
    assert wq.values.dtype == (np.int8 if fmt == "q8_0" else np.uint8)
    assert wq.shape == dense["layers"][0]["wq"].shape
    head = packed["embed"] if config.tie_word_embeddings else packed["lm_head"]
    assert quant.is_packed(head) and head.fmt == ("q8_0" if config.tie_word_embeddings else fmt)
    unpacked = quant.unpack_params(packed)
    for a, b in zip(jax.tree.leaves(unpacked), jax.tree.leaves(dense), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    # The jnp dequantization (what a GPU/TPU step runs) agrees to float rounding.
    np.testing.assert_allclose(
        np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, wq))),
        dense["layers"][0]["wq"],
        rtol=1e-6,
        atol=1e-7,
    )
    # Codes + f32 block scales (+ mins): 1.125 bytes a weight for Q8_0, 0.625 / 0.75 for Q4.
    layers = lambda p: quant.weight_bytes(p["layers"])
    assert layers(packed) * {"q8_0": 3.4, "q4_0": 6.0, "q4_1": 5.0}[fmt] <= layers(dense)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("shape,in_ndim", [((64, 96), 1), ((4, 16, 32), 2), ((96, 2, 16), 1)])
def test_quantize_blocks_is_llama_cpps(fmt, shape, in_ndim):
    import gguf

    w = _random_weight(np.random.default_rng(len(shape)), shape)
    packed = quant.quantize_blocks(w, fmt, in_ndim)
    assert packed.shape == shape and packed.num_in == int(np.prod(shape[:in_ndim]))
    m = np.ascontiguousarray(quant._as_out_in(w, in_ndim, False))
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    want = gguf.quants.dequantize(gguf.quants.quantize(m, qtype), qtype)
    np.testing.assert_array_equal(quant.dequantize_matrix(packed, np.float32, np), want)
    back = quant.dequantize(packed, np.float32, np)
    assert back.shape == shape
    np.testing.assert_array_equal(quant._as_out_in(back, in_ndim, False), want)


@pytest.mark.parametrize(
    "shape,in_ndim,out_first", [((40, 24), 1, False), ((3, 8, 20), 2, False), ((50, 12), 1, True)]
)
def test_int8_per_channel_within_half_a_step(shape, in_ndim, out_first):
    w = _random_weight(np.random.default_rng(3), shape)
    m = quant._as_out_in(w, in_ndim, out_first)
    m[1] = 0.0  # an all-zero channel
    w = quant.dequantize(quant.pack_dense(w, in_ndim, out_first), np.float32, np)
    packed = quant.quantize_int8(w, in_ndim, out_first)
    assert packed.values.dtype == np.int8 and packed.scales.shape == (m.shape[0],)
    assert np.abs(packed.values.astype(np.int32)).max() <= 127
    err = np.abs(quant.dequantize(packed, np.float32, np) - w)
    step = (
        quant._as_out_in(np.broadcast_to(0, w.shape), in_ndim, out_first) + packed.scales[:, None]
    )
    assert np.all(quant._as_out_in(err, in_ndim, out_first) <= step / 2 * (1 + 1e-6))
    assert np.all(quant.dequantize_matrix(packed, np.float32, np)[1] == 0)


def _activation_error_bound(x, w_dense, fmt):
    """|y - x @ W.T| allowed by quantizing x: half a step of x's int8 grid per element, times
    |W| (per token for int8, per 32-block for the block formats), plus float rounding."""
    x = np.asarray(x, np.float64)
    a = np.abs(np.asarray(w_dense, np.float64))  # [out, in]
    if fmt == "int8":
        step = np.abs(x).max(axis=1, keepdims=True) / 127 * np.ones_like(x)
    elif fmt == "int8_a16":  # bfloat16's rounding of x: half an ulp, 2^-9 of |x|
        step = np.abs(x) * 2.0**-8
    elif fmt in BLOCK_FORMATS:
        T, n = x.shape
        blocks = np.abs(x).reshape(T, n // 32, 32).max(axis=2) / 127
        step = np.repeat(blocks, 32, axis=1)
    else:
        step = np.zeros_like(x)
    rounding = 1e-5 * (np.abs(x) @ a.T) + 1e-6
    return 0.5 * step @ a.T * (1 + 1e-3) + rounding


@pytest.mark.parametrize("fmt", ["dense", "int8", "int8_wo", "int8_a16", *BLOCK_FORMATS])
@pytest.mark.parametrize("T", [1, 2, 7, 64])
@pytest.mark.parametrize("n_in,n_out", [(64, 96), (192, 32)])
def test_qdot_within_its_activation_quantization_error(fmt, T, n_in, n_out):
    rng = np.random.default_rng(T * 7 + n_in)
    w = _random_weight(rng, (n_in, n_out))
    x = _random_weight(rng, (T, n_in))
    if fmt == "dense":
        packed = quant.pack_dense(w)
    elif fmt in ("int8", "int8_wo", "int8_a16"):
        packed = quant.quantize_int8(w, fmt=fmt)
    else:
        packed = quant.quantize_blocks(w, fmt)
    w_dense = quant.dequantize_matrix(packed, np.float32, np)  # [out, in], what was stored
    packed = jax.tree.map(jnp.asarray, packed)
    y = np.asarray(jax.jit(quant.qdot)(jnp.asarray(x), packed))
    assert y.shape == (T, n_out) and y.dtype == np.float32
    exact = x.astype(np.float64) @ w_dense.T.astype(np.float64)
    bound = _activation_error_bound(x, w_dense, fmt)
    assert np.all(np.abs(y - exact) <= bound), np.abs(y - exact).max()
    if fmt not in ("dense", "int8_wo"):  # the activations really are quantized (not vacuous)
        assert np.abs(y - exact).max() > 0


def test_int8_xla_form_is_the_integer_formula():
    rng = np.random.default_rng(0)
    w, x = _random_weight(rng, (96, 40)), _random_weight(rng, (5, 96))
    packed = quant.quantize_int8(w)
    y = np.asarray(jax.jit(quant.int8_dot_xla)(jnp.asarray(x), jax.tree.map(jnp.asarray, packed)))
    xq, sx = (np.asarray(a) for a in quant.quantize_rows_int8(jnp.asarray(x)))
    acc = xq.astype(np.int64) @ packed.values.astype(np.int64).T
    want = acc.astype(np.float32) * sx[:, None] * packed.scales[None, :]
    np.testing.assert_allclose(y, want, rtol=1e-6)
    assert np.abs(xq).max() == 127


def _model(name="tiny"):
    config = configs.get_preset(name)
    return config, jax.tree.map(np.asarray, init_params(config, jax.random.key(2)))


@pytest.mark.parametrize("method", ["dense", "int8", "w8a8", "int8_wo", *BLOCK_FORMATS])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa1"])  # untied, tied embedding
def test_model_over_packed_weights_matches_them_dequantized(method, stacked, name):
    config, params = _model(name)
    packed = quant.quantize_params(params, method)
    head = "embed" if config.tie_word_embeddings else "lm_head"
    assert quant.is_packed(packed["layers"][0]["wo"]) and quant.is_packed(packed[head])
    assert quant.is_packed(packed["embed"]) == config.tie_word_embeddings
    dequantized = quant.unpack_params(packed)
    tokens = list(np.random.default_rng(1).integers(3, config.vocab_size, 21))
    ref = full_logits(dequantized, config, tokens)
    layout = stack_layers if stacked else (lambda p: p)
    got = full_logits(jax.tree.map(jnp.asarray, layout(packed)), config, tokens)
    if method in ("dense", "int8_wo"):  # no activation quantization: float rounding alone
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        return
    # What is left is the activations' quantization (int8 grids of 1/127 of each token's or
    # block's largest value), compounded over the layers.
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 0.03, rel
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_other_backends_lower_the_dequantize_in_the_matmul_form(fmt, platform):
    w = _random_weight(np.random.default_rng(0), (64, 96))
    packed = quant.quantize_int8(w) if fmt == "int8" else quant.quantize_blocks(w, fmt)
    packed = jax.tree.map(jnp.asarray, packed)
    x = jnp.asarray(_random_weight(np.random.default_rng(1), (8, 64)))
    lower = lambda p: jax.jit(quant.qdot).trace(x, packed).lower(lowering_platforms=(p,)).as_text()
    text = lower(platform)
    assert "llmjax_cpu" not in text and "custom_call" not in text
    assert "dot_general" in text
    cpu = lower("cpu")  # the C++ kernel where it builds, else XLA's int8 dot / dequantized dot
    assert ("llmjax_cpu_qmatmul" in cpu) == (quant._cpu_kernel() is not None)


def test_packed_weight_indexes_its_layers_and_reports_its_bytes():
    config, params = _model()
    stacked = stack_layers(quant.quantize_params(params, "q4_1"))
    w = stacked["layers"]["w_up"]
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    assert w.batch_shape == (L,) and w.shape == (L, D, F)
    assert w[1].shape == (D, F) and w[1].values.shape == (F, D // 2)
    assert w.nbytes == w.values.nbytes + w.scales.nbytes + w.mins.nbytes
    assert w.values.nbytes == L * F * D // 2
    one = quant.quantize_params(params, "q4_1")["layers"][1]["w_up"]
    np.testing.assert_array_equal(w[1].values, one.values)
    with pytest.raises(IndexError):
        one[0]


def test_embedding_rows_of_a_packed_table():
    config, params = _model("tiny-gqa1")  # tied: the embedding is packed
    for method in ("int8", "w8a8", "int8_wo", "q8_0", "q4_1", "dense"):
        packed = quant.quantize_params(params, method)["embed"]
        ids = jnp.asarray([5, 0, 5, config.vocab_size - 1])
        rows = np.asarray(quant.take_rows(jax.tree.map(jnp.asarray, packed), ids))
        table = quant.dequantize(packed, np.float32, np)
        np.testing.assert_allclose(rows, table[np.asarray(ids)], rtol=1e-6)


def test_bad_shapes_are_refused_clearly():
    w = quant.quantize_int8(_random_weight(np.random.default_rng(0), (64, 32)))
    with pytest.raises(ValueError, match="features"):
        quant.qdot(jnp.ones((2, 63)), jax.tree.map(jnp.asarray, w))
    with pytest.raises(ValueError, match=r"multiple of 32|% 32"):
        quant.quantize_blocks(np.ones((40, 8), np.float32), "q4_0")
    stacked = dataclasses.replace(w, values=w.values[None], scales=w.scales[None])
    with pytest.raises(ValueError, match="one layer"):
        quant.qdot(jnp.ones((2, 64)), stacked)


def test_int8_is_w8a16_and_w8a8_is_w8a8():
    """quantization 'int8' packs every matrix as 'int8_a16' (the LM head too); 'w8a8' as
    'int8' with a weight-only LM head; both from the same codes and scales."""
    _, params = _model("tiny-gqa1")  # tied
    a16, w8a8 = quant.quantize_params(params, "int8"), quant.quantize_params(params, "w8a8")
    assert a16["layers"][0]["wq"].fmt == "int8_a16" and a16["embed"].fmt == "int8_a16"
    assert w8a8["layers"][0]["wq"].fmt == "int8" and w8a8["embed"].fmt == "int8_wo"
    np.testing.assert_array_equal(a16["layers"][1]["w_up"].values, w8a8["layers"][1]["w_up"].values)


def test_w8a16_takes_the_dense_kernel_and_rounds_x_at_every_size():
    """'int8_a16': the dense kernel with `round_x` where it takes the codes (every size with
    its AMX engine), else XLA's dot over x's bfloat16 values; either way x's bfloat16 values
    times the codes, float32 rounding apart, and the same for a row alone as in a batch up to
    that rounding."""
    w = quant.quantize_int8(_random_weight(np.random.default_rng(0), (64, 96)), fmt="int8_a16")
    w = jax.tree.map(jnp.asarray, w)
    w_dense = np.asarray(quant.dequantize_matrix(w, jnp.float32), np.float64)
    for T in (1, 8, 33, 65, 130):
        x = jnp.asarray(_random_weight(np.random.default_rng(T), (T, 64)))
        text = jax.jit(quant.qdot).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
        kernel = quant.dense_kernel_for(jnp.int8, T, "int8_a16") is not None
        assert ("llmjax_cpu_dense_matmul" in text) == kernel, T
        y = np.asarray(jax.jit(quant.qdot)(x, w))
        xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        tol = 1e-5 * (np.abs(xb) @ np.abs(w_dense).T)
        assert (np.abs(y - xb @ w_dense.T) <= tol).all(), T
        alone = np.asarray(jax.jit(quant.qdot)(x[:1], w))
        assert (np.abs(alone - y[:1]) <= tol[:1]).all(), T
    # GPU / TPU: the dequantized form over the rounded x
    x = jnp.asarray(_random_weight(np.random.default_rng(9), (4, 64)))
    y = np.asarray(jax.jit(quant.dequantized_dot)(x, w))
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(y, xb @ w_dense.T, rtol=1e-5, atol=1e-6)


def test_weight_only_int8_takes_the_dense_kernel_at_decode_sizes():
    """'int8_wo': the dense kernel on the int8 codes (then the scales) where it takes int8
    weights (AVX2: AVX2_DENSE_KERNEL_TOKENS; AVX-512: up to DENSE_KERNEL_MAX_TOKENS), XLA's dot
    over the widened codes elsewhere; the same products either way, float32 rounding apart."""
    w = quant.quantize_int8(_random_weight(np.random.default_rng(0), (64, 96)), fmt="int8_wo")
    w = jax.tree.map(jnp.asarray, w)
    lo, hi = quant.dense_kernel_tokens(jnp.int8)
    if quant._cpu_dense_kernel() is None:
        assert lo > hi
    w_dense = np.asarray(quant.dequantize_matrix(w, jnp.float32), np.float64)
    for T in (1, 2, 32, 33, 65):
        x = jnp.asarray(_random_weight(np.random.default_rng(T), (T, 64)))
        text = jax.jit(quant.qdot).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
        assert ("llmjax_cpu_dense_matmul" in text) == (lo <= T <= hi), T
        y = np.asarray(jax.jit(quant.qdot)(x, w))
        x64 = np.asarray(x, np.float64)
        tol = 1e-5 * (np.abs(x64) @ np.abs(w_dense).T)
        assert (np.abs(y - x64 @ w_dense.T) <= tol).all(), T


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_weights_take_the_cpu_kernel_at_decode_sizes_and_xla_above(dtype):
    """With AVX-512, float32: the kernel up to DENSE_KERNEL_MAX_TOKENS, XLA's GEMM above; bf16:
    the kernel at every size (its AMX path is as fast as XLA's there and reads a scanned layer
    in place). With the AVX2 engine, AVX2_DENSE_KERNEL_TOKENS, and above them bf16 weights
    widened to float32 for XLA's GEMM from AVX2_BF16_WIDEN_TOKENS; without a vector engine,
    never the kernel."""
    w = quant.pack_dense(_random_weight(np.random.default_rng(0), (64, 96)).astype(dtype))
    w = jax.tree.map(jnp.asarray, w)
    lo, hi = quant.dense_kernel_tokens(dtype)
    if quant._cpu_dense_kernel() is not None:
        from kernels_cpu import build

        if build.engines()["dense_matmul"] == "avx2":  # a narrower range (quant's table)
            assert (lo, hi) == quant.AVX2_DENSE_KERNEL_TOKENS[jnp.dtype(dtype)]
        else:
            assert (lo, hi) == (
                1,
                quant.DENSE_KERNEL_MAX_TOKENS if dtype == jnp.float32 else 1 << 62,
            )
    else:
        assert lo > hi
    for T in (1, 2, 32, 33, 64, 128, 256):
        want_kernel = lo <= T <= hi
        x = jnp.asarray(_random_weight(np.random.default_rng(T), (T, 64)), dtype)
        text = jax.jit(quant.qdot).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
        assert ("llmjax_cpu_dense_matmul" in text) == want_kernel, T
        if not want_kernel and dtype == jnp.bfloat16:  # XLA's bf16 dot, or widened (AVX2)
            dots = [line for line in text.splitlines() if "dot_general" in line]
            widened = quant._widen_bf16(dtype, T)
            assert dots and all(("bf16" in d) != widened for d in dots), (T, dots)
        y = np.asarray(jax.jit(quant.qdot)(x, w), np.float32)
        exact = np.asarray(x, np.float64) @ np.asarray(w.values, np.float64).T
        # bf16: x's rounding (2^-8 relative) and the output's (2^-9), of at most sum |x||w|.
        tol = (1.5 * 2**-8 if dtype == jnp.bfloat16 else 1e-5) * (
            np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w.values, np.float64)).T
        )
        assert np.all(np.abs(y - exact) <= tol + 1e-6)

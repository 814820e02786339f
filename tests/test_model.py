"""The model over the paged cache: chunking, batching and page layout must not change the math,
and the jitted step updates the cache in place with no copies of weights or pages."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax.model.kv_cache import QuantizedPages as QPages
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import init_params
from tests.helpers import full_logits, make_step

PAGE = 4


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa1"])
def model(request):
    config = configs.get_preset(request.param)
    return config, init_params(config, jax.random.key(1))


def _tokens(n, seed, vocab=256):
    return list(np.random.default_rng(seed).integers(3, vocab, n))


def test_chunked_prefill_then_decode_equals_one_prefill(model):
    config, params = model
    tokens = _tokens(23, 0)
    ref = full_logits(params, config, tokens, page_size=PAGE)
    kv = allocate_kv_pages(config, 12, PAGE, jnp.float32)
    table = [7, 2, 9, 4, 11, 1]  # shuffled pages
    fwd = jax.jit(forward, static_argnums=3, donate_argnums=1)
    start = 0
    for chunk in (5, 8, 1, 1, 4, 1, 3):  # chunks crossing page boundaries, then decodes
        ids = tokens[start : start + chunk]
        step = make_step([(ids, start, table)], PAGE, num_tokens=16, max_pages=8)
        logits, kv = fwd(params, kv, step, config)
        np.testing.assert_allclose(
            np.asarray(logits)[0], ref[start + chunk - 1], rtol=1e-5, atol=1e-5
        )
        start += chunk
    assert start == len(tokens)


def test_mixed_batch_equals_each_sequence_alone(model):
    config, params = model
    a, b, c = _tokens(9, 1), _tokens(17, 2), _tokens(6, 3)
    ref = {
        k: full_logits(params, config, t, page_size=PAGE)
        for k, t in zip("abc", (a, b, c), strict=True)
    }
    kv = allocate_kv_pages(config, 16, PAGE, jnp.float32)
    tables = {"a": [3, 8, 14], "b": [1, 12, 5, 10, 6], "c": [15, 2]}
    # Step 1: prefill a fully, b partly (11 tokens), c partly (1 token).
    step = make_step(
        [(a, 0, tables["a"]), (b[:11], 0, tables["b"]), (c[:1], 0, tables["c"])],
        PAGE,
        num_tokens=32,
        max_pages=8,
    )
    logits, kv = forward(params, kv, step, config)
    np.testing.assert_allclose(logits[0], ref["a"][8], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1], ref["b"][10], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[2], ref["c"][0], rtol=1e-5, atol=1e-5)
    # Step 2: decode-like rows and the rest of two prefills, in a different order.
    step = make_step(
        [(c[1:], 1, tables["c"]), (b[11:], 11, tables["b"])], PAGE, num_tokens=16, max_pages=8
    )
    logits, kv = forward(params, kv, step, config)
    np.testing.assert_allclose(logits[0], ref["c"][5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1], ref["b"][16], rtol=1e-5, atol=1e-5)


def test_padding_does_not_touch_real_pages(model):
    config, params = model
    tokens = _tokens(5, 4)
    kv = allocate_kv_pages(config, 6, PAGE, jnp.float32)
    kv = [(k + 1.0, v - 1.0) for k, v in kv]  # non-zero sentinel everywhere
    step = make_step([(tokens, 0, [3, 5])], PAGE, num_tokens=16, max_pages=4)
    _, new_kv = forward(params, kv, step, config)
    for (k0, v0), (k1, v1) in zip(kv, new_kv, strict=True):
        for untouched in (1, 2, 4):  # pages the sequence does not own stay as they were
            np.testing.assert_array_equal(k0[untouched], k1[untouched])
            np.testing.assert_array_equal(v0[untouched], v1[untouched])
        assert not np.array_equal(k0[3], k1[3])


def _compiled_step_hlo(
    config,
    num_tokens,
    num_pages=64,
    layer_loop="auto",
    attention="auto",
    quantization="none",
    dtype="float32",
    kv_cache_dtype="auto",
):
    from llmjax.config import CacheConfig, EngineConfig
    from llmjax.engine.batch import SamplingInput
    from llmjax.engine.runner import ModelRunner
    from llmjax.model.quant import quantize_params

    params = init_params(config, jax.random.key(0), dtype)
    if quantization != "none":
        params = jax.tree.map(
            jnp.asarray, quantize_params(jax.tree.map(np.asarray, params), quantization)
        )
    engine_config = EngineConfig(
        model=config,
        layer_loop=layer_loop,
        attention_backend=attention,
        compilation_cache_dir="",
        dtype=dtype,
        cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
    )
    runner = ModelRunner(engine_config, params, num_pages)
    page_size = engine_config.cache.page_size
    if num_tokens == 1:  # one decode
        seqs = [([7], 9, [2])]
    else:  # a prefill chunk and a decode
        pages = [1, 5, 6, 8, 10, 11, 12, 13][: -(-(num_tokens - 1) // page_size)]
        seqs = [(_tokens(num_tokens - 1, 0), 0, pages), ([7], 9, [2])]
    step = make_step(seqs, page_size, num_tokens=num_tokens, max_pages=max(4, len(seqs[0][2])))
    n = len(seqs)
    sampling = SamplingInput(
        np.zeros(n, np.float32),
        np.zeros(n, np.int32),
        np.ones(n, np.float32),
        np.zeros(n, np.uint32),
        np.zeros(n, np.int32),
        all_greedy=True,
    )
    return runner, runner.lower(step, sampling).compile().as_text()


def _cpu_kernels():
    import shutil

    return bool(shutil.which("c++") or shutil.which("g++"))  # a failed build then fails here


@pytest.mark.parametrize(
    "attention",
    [
        "reference",
        pytest.param(
            "cpu", marks=pytest.mark.skipif(not _cpu_kernels(), reason="no C++ compiler here")
        ),
    ],
)
@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa1"])
@pytest.mark.parametrize("num_tokens", [1, 2, 16, 64])
def test_step_copies_neither_kv_pages_nor_weights(name, num_tokens, layer_loop, attention):
    """For the jnp reference attention and the C++ CPU kernel (an FFI call, whose operands XLA
    could copy into another layout)."""
    config = configs.get_preset(name)
    runner, hlo = _compiled_step_hlo(config, num_tokens, layer_loop=layer_loop, attention=attention)
    assert ("llmjax_cpu_ragged_paged_attention" in hlo) == (attention == "cpu")
    _assert_no_copies(config, runner, hlo, layer_loop)


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "q4_1"])
@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_quantized_step_copies_neither_kv_pages_nor_weights(quantization, layer_loop, num_tokens):
    """Packed weights (llmjax/model/quant.py: codes, scales, mins), through whichever matmul
    form the CPU takes (the C++ kernels when they build, XLA's dots otherwise): 'int8' the dense
    kernel on int8 codes (W8A16), 'w8a8' and 'q4_1' the quantized matmul."""
    config = configs.get_preset("tiny-gqa1")  # tied: the packed embedding is the LM head
    runner, hlo = _compiled_step_hlo(
        config, num_tokens, layer_loop=layer_loop, quantization=quantization
    )
    _assert_no_copies(config, runner, hlo, layer_loop)


@pytest.mark.parametrize(
    "attention, kv_cache_dtype",
    [
        ("reference", "fp8_e4m3"),
        pytest.param(
            "cpu",
            "int8",
            marks=pytest.mark.skipif(not _cpu_kernels(), reason="no C++ compiler here"),
        ),
    ],
)
@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_quantized_kv_step_copies_neither_pages_nor_scales(
    kv_cache_dtype, layer_loop, num_tokens, attention
):
    """A quantized KV cache (issue 41): its values and scales are donated and written in place,
    and the CPU kernel reads them in place."""
    config = configs.get_preset("tiny")
    runner, hlo = _compiled_step_hlo(
        config, num_tokens, layer_loop=layer_loop, attention=attention,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    assert ("llmjax_cpu_ragged_paged_attention" in hlo) == (attention == "cpu")
    _assert_no_copies(config, runner, hlo, layer_loop)


@pytest.mark.skipif(not _cpu_kernels(), reason="no C++ compiler here")
@pytest.mark.parametrize("num_tokens", [8, 128])  # not 16: [16, 1, 16] is also a page
def test_bf16_step_reads_scanned_weights_in_place(num_tokens):
    """bf16 weights take the dense kernel at every step size, with the stacked layers and the
    layer index (no slice of a layer's weights, no copy), also at prefill sizes, where float32
    takes XLA's dot on a slice."""
    from llmjax.model import quant

    lo, hi = quant.dense_kernel_tokens("bfloat16")
    if not lo <= num_tokens <= hi:
        pytest.skip(f"bf16 weights take XLA's dot at {num_tokens} tokens on this CPU")
    config = configs.get_preset("tiny-gqa1")
    runner, hlo = _compiled_step_hlo(
        config, num_tokens, layer_loop="scan", quantization="dense", dtype="bfloat16"
    )
    _assert_no_copies(config, runner, hlo, "scan")
    assert "llmjax_cpu_dense_matmul" in hlo
    layer_shapes = {x.shape[1:] for x in jax.tree.leaves(runner.params["layers"]) if x.ndim > 2}
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* (dynamic-slice|fusion)\(", line)
        if m and "dynamic-slice" in line:
            shape = tuple(int(d) for d in m.group(1).split(",") if d)
            assert shape not in layer_shapes, f"a layer's weights sliced: {line.strip()}"


def _is_quantized(x):
    return isinstance(x, QPages)


def _assert_no_copies(
    config, runner, hlo, layer_loop
):  # Every KV array is donated and aliased to an output: the update happens in place.
    header = hlo.splitlines()[0]
    leaves = jax.tree.leaves(runner.kv_pages)  # K and V per layer (quantized: and their scales)
    quantized = isinstance(jax.tree.leaves(runner.kv_pages, is_leaf=_is_quantized)[0], QPages)
    num_kv_arrays = (2 if layer_loop == "scan" else 2 * config.num_layers) * (1 + quantized)
    assert len(leaves) == num_kv_arrays and header.count("-alias)") == num_kv_arrays, header[:300]
    # No weight or KV page array (or a flattened view of one; stacked: the whole cache's or one
    # layer's share; a quantized cache's scales too) is copied or transposed. A scanned step
    # reads each layer's weights as a slice of the stacked ones (what the scan hands its body).
    kv_shapes = set()
    for x in leaves:
        kv = x.shape
        kv_shapes |= {kv, (kv[0] * kv[1], *kv[2:])}
        if layer_loop == "scan":  # one layer's share of the stacked cache
            kv = (kv[0] // config.num_layers, *kv[1:])
            kv_shapes |= {kv, (kv[0] * kv[1], *kv[2:])}
    weights = jax.tree.leaves(runner.params)
    weight_shapes = {x.shape for x in weights if x.ndim > 1}
    if layer_loop == "scan":
        weight_shapes |= {x.shape[1:] for x in jax.tree.leaves(runner.params["layers"])}
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\(", line)
        if not m:
            continue
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        assert shape not in kv_shapes, f"the step copies KV pages: {line.strip()}"
        assert 'op_name="params[' not in line, f"the step copies a weight: {line.strip()}"
        if len(shape) == 2:
            assert shape not in weight_shapes, f"the step copies a weight: {line.strip()}"


def test_blocks_of_one_sequence_and_mixed_blocks_agree(model):
    """T=96 splits into query blocks of 32: one mixes a decode with a prefill's start (each token
    gathers its own pages), the others hold one sequence (its pages are gathered once)."""
    config, params = model
    c, d = _tokens(7, 3), _tokens(70, 4)
    ref_c = full_logits(params, config, c, page_size=PAGE)
    ref_d = full_logits(params, config, d, page_size=PAGE)
    kv = allocate_kv_pages(config, 40, PAGE, jnp.float32)
    table_c, table_d = [31, 5], list(range(6, 24))
    step = make_step([(c[:6], 0, table_c)], PAGE, num_tokens=8, max_pages=32)
    _, kv = forward(params, kv, step, config)
    step = make_step(
        [(c[6:], 6, table_c), (d, 0, table_d)], PAGE, num_tokens=96, max_pages=32, all_logits=True
    )
    logits, _ = forward(params, kv, step, config)
    np.testing.assert_allclose(logits[0], ref_c[6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1:71], ref_d, rtol=1e-5, atol=1e-5)

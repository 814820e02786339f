"""Packed expert weights (llmjax/model/quant.py's EXPERT_MATRICES; llmjax/model/grouped_qdot.py):
float [out, in] (a CPU's default packing), weight-only int8, W8A8 int8 and the GGUF blocks, on the
C++ grouped kernels (a decode step's few rows) and the tile loop (prefill-sized steps).

Weight-only forms must give the plain experts' result (the same weights, dequantized) up to
float32 summation order; the W8A8 forms, which quantize the activations, must give per group what
`qdot` gives on that group's rows with that expert's matrix (the same arithmetic); and a model
served with packed experts must decode a request the same whether batched or alone."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmjax.model import quant
from llmjax.model.grouped_qdot import grouped_qdot
from llmjax.model.moe import experts_mlp, route
from tests.conftest import TESTDATA
from tests.test_moe import _weights

PACK = {
    "dense": quant.pack_dense,
    "int8_wo": lambda w, i, o: quant.quantize_int8(w, i, o, fmt="int8_wo"),
    "int8_a16": lambda w, i, o: quant.quantize_int8(w, i, o, fmt="int8_a16"),
    "int8": quant.quantize_int8,
    "q8_0": lambda w, i, o: quant.quantize_blocks(w, "q8_0", i, o),
    "q4_0": lambda w, i, o: quant.quantize_blocks(w, "q4_0", i, o),
    "q4_1": lambda w, i, o: quant.quantize_blocks(w, "q4_1", i, o),
}


def _packed(ws, fmt, dtype=jnp.float32):
    out = []
    for w in ws:
        p = quant.pack_experts(np.asarray(w, np.float32), PACK[fmt])
        if fmt == "dense":
            p = jax.tree.map(lambda a: jnp.asarray(a, dtype), p)
        out.append(jax.tree.map(jnp.asarray, p))
    return out


@pytest.mark.parametrize("fmt, dtype", [("dense", jnp.float32), ("dense", jnp.bfloat16),
                                        ("int8_wo", jnp.float32)])  # fmt: skip
@pytest.mark.parametrize("T", [1, 3, 40])  # M = 2, 6 rows: the kernels; 80: the tile loop
def test_weight_only_packed_experts_equal_the_plain_ones(T, fmt, dtype):
    E, k, D, F = 8, 2, 64, 32
    keys = jax.random.split(jax.random.key(T), 3)
    x = jax.random.normal(keys[0], (T, D)).astype(dtype)
    weights, experts = route(x, jax.random.normal(keys[1], (D, E)).astype(dtype), k, True)
    packed = _packed(_weights(keys[2], E, D, F, jnp.float32), fmt, dtype)
    plain = [quant.dequantize(p, dtype) for p in packed]  # the same weights, as [E, in, out]
    got = jax.jit(experts_mlp)(x, weights, experts, *packed)
    want = jax.jit(experts_mlp)(x, weights, experts, *plain)
    assert got.shape == (T, D) and got.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bfloat16: the hidden activations are rounded to bf16 between the projections, so a float32
    # summation difference can move one of them by an ulp (2^-8); equal here on AMX
    tol = 2e-5 if dtype == jnp.float32 else 2.0**-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "int8_wo", "int8_a16", "dense"])
@pytest.mark.parametrize("M", [3, 96])  # the C++ grouped kernel; the tile loop
def test_grouped_qdot_is_qdot_per_group(M, fmt):
    """Row by row, the grouped form is qdot of that group's rows with its expert's matrix, for a
    plain expert stack and for one layer of an [L, E, ...] stack viewed in a scan."""
    rng = np.random.default_rng(M)
    E, D, F = 6, 64, 32
    stacks = [rng.standard_normal((E, D, F)).astype(np.float32) for _ in range(2)]  # 2 layers
    packed = [quant.pack_experts(w, PACK[fmt]) for w in stacks]
    sizes = (
        np.array([1, 0, 2, 0, 0, 0]) if M == 3 else np.array([30, 0, 7, 40, 0, 15])
    )  # empty experts; 96: 4 rows past the groups
    rows = jnp.asarray(rng.standard_normal((M, D)).astype(np.float32))
    gs = jnp.asarray(sizes, jnp.int32)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[jax.tree.map(jnp.asarray, p) for p in packed])

    def scanned(rows, w):
        body = lambda i, _: (i + 1, grouped_qdot(rows, w.at_layer(i), gs))
        return jax.lax.scan(body, 0, None, length=2)[1]

    layers = jax.jit(scanned)(rows, stacked)
    for li, p in enumerate(packed):
        p = jax.tree.map(jnp.asarray, p)
        got = np.asarray(jax.jit(grouped_qdot)(rows, p, gs))
        np.testing.assert_array_equal(np.asarray(layers[li]), got)
        w64 = np.asarray(quant.dequantize_matrix(p, np.float32, np), np.float64)  # [E, out, in]
        start = 0
        for g, size in enumerate(sizes):
            if size:
                block = rows[start : start + size]
                want = np.asarray(quant.qdot(block, p[g], jnp.float32))
                mag = np.abs(np.asarray(block, np.float64)) @ np.abs(w64[g]).T
                err = np.abs(got[start : start + size] - want)
                assert (err <= 2e-5 * mag).all(), f"group {g}: {(err / mag).max():.3g} of mag"
            start += size
        assert (got[start:] == 0).all()


def test_a_model_with_quantized_experts_serves_batched_as_alone():
    """quantization='int8' (W8A16: the dense kernel on the codes) and 'w8a8' (the quantized
    matmul) on a tiny Mixtral: its experts are packed, and each prompt's greedy output is the
    same in a batch as alone."""
    from llmjax import LLM, SamplingParams
    from tests.parallel_cases import prompts

    path = os.path.join(TESTDATA, "hf_tiny", "mixtral")
    work = prompts(3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for method, fmt in (("int8", "int8_a16"), ("w8a8", "int8")):
        llm = LLM(path, quantization=method, page_size=4, max_num_batched_tokens=16,
                  max_num_seqs=4, max_model_len=64, compilation_cache_dir="")  # fmt: skip
        layers = llm.engine.runner.params["layers"]
        we = layers["we_gate"] if isinstance(layers, dict) else layers[0]["we_gate"]
        assert quant.is_packed(we) and we.fmt == fmt
        batched = [o.token_ids for o in llm.generate(work, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in work]
        assert batched == alone

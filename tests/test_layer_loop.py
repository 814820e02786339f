"""The two layer loops (EngineConfig.layer_loop): `lax.scan` over stacked layers and the unrolled
Python loop give the same logits and KV pages, the scanned step holds one copy of the layer
whatever the depth, and the layouts convert wherever weights cross (LLM, with_options, orbax)."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax import LLM, SamplingParams
from llmjax.config import EngineConfig, SparseKVConfig, layer_loop_scans
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import (
    check_params,
    init_params,
    layer_params,
    layers_stacked,
    param_specs,
    stack_layers,
    unstack_layers,
)
from tests.helpers import make_step

PAGE = 4
NUM_PAGES = 20


def _tokens(n, seed, vocab=256):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


# The presets' shapes, plus QKV biases (Qwen2) and a sliding window (Mistral) on the tiny body.
CONFIGS = {
    "tiny": configs.TINY,
    "tiny-gqa1": configs.TINY_GQA1,
    "bias+window": configs.TINY.replace(name="tiny-bw", attention_bias=True, sliding_window=7),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scan_equals_unroll_step_by_step(name):
    """Three steps of a ragged batch (chunks crossing pages, decodes, padding): the scanned step
    gives the unrolled step's logits, and writes the same KV to every layer's pages."""
    config = CONFIGS[name]
    params = init_params(config, jax.random.key(3))
    stacked = stack_layers(params)
    assert layers_stacked(stacked) and not layers_stacked(params)
    kv_list = allocate_kv_pages(config, NUM_PAGES, PAGE, jnp.float32)
    kv_stacked = allocate_kv_pages(config, NUM_PAGES, PAGE, jnp.float32, stacked=True)
    chex.assert_shape(kv_stacked, (config.num_layers * NUM_PAGES, *kv_list[0][0].shape[1:]))
    fwd = jax.jit(forward, static_argnums=3)
    a, b, c = _tokens(11, 1), _tokens(9, 2), _tokens(5, 3)
    ta, tb, tc = [5, 17, 2, 9], [12, 1, 19], [3, 8]  # shuffled page tables
    steps = [
        [(a[:6], 0, ta), (b[:9], 0, tb)],
        [(a[6:11], 6, ta), ([*b[9:], 42], 9, tb), (c[:3], 0, tc)],
        [([7], 11, ta), ([8], 10, tb), (c[3:], 3, tc)],
    ]
    for seqs in steps:
        step = make_step(seqs, PAGE, num_tokens=24, max_pages=5, all_logits=True)
        want, kv_list = fwd(params, kv_list, step, config)
        got, kv_stacked = fwd(stacked, kv_stacked, step, config)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    layer_rows = lambda x, i: np.asarray(x)[i * NUM_PAGES : (i + 1) * NUM_PAGES]
    # layer i's pages at rows i * NUM_PAGES, ...
    by_layer = [tuple(layer_rows(x, i) for x in kv_stacked) for i in range(config.num_layers)]
    chex.assert_trees_all_close(by_layer, [tuple(kv) for kv in kv_list], atol=1e-6)
    # Every layer wrote its own pages: layer 0's and the last layer's keys differ.
    assert not np.allclose(layer_rows(kv_stacked[0], 0), layer_rows(kv_stacked[0], -1 % 2))


def _num_matmuls(num_layers: int, scan: bool) -> int:
    config = configs.TINY.replace(name="t", num_layers=num_layers)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if scan:
        params = jax.eval_shape(stack_layers, params)
    kv = jax.eval_shape(
        lambda: allocate_kv_pages(config, NUM_PAGES, PAGE, jnp.float32, stacked=scan)
    )
    step = make_step([(_tokens(6, 0), 0, [1, 2])], PAGE, num_tokens=8, max_pages=2)
    text = jax.jit(forward, static_argnums=3).lower(params, kv, step, config).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text))


def test_scanned_step_holds_one_layer_whatever_the_depth():
    """What makes compile time independent of depth: the scanned program has the same matmuls
    at 2 and 6 layers; the unrolled one has 3x the layers' matmuls."""
    scan2, scan6 = _num_matmuls(2, scan=True), _num_matmuls(6, scan=True)
    unroll2, unroll6 = _num_matmuls(2, scan=False), _num_matmuls(6, scan=False)
    assert scan2 == scan6 > 0
    assert unroll6 - unroll2 == 4 * (unroll2 - scan2) > 0  # 4 more layers, one layer each


def test_stacked_layout_round_trip_and_specs():
    config = configs.TINY.replace(name="tiny-b", attention_bias=True)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    stacked = stack_layers(params)
    check_params(config, stacked)  # the stacked spec: same names, [L, ...] shapes
    specs = param_specs(config, stacked=True)["layers"]
    for name, x in stacked["layers"].items():
        assert isinstance(x, np.ndarray)  # numpy stays on the host
        chex.assert_shape(x, (config.num_layers, *params["layers"][0][name].shape))
        assert specs[name].logical_axes[0] == "layers" and specs[name].shape == x.shape
    chex.assert_trees_all_equal(unstack_layers(stacked), params)
    chex.assert_trees_all_equal(
        [layer_params(stacked, i) for i in range(config.num_layers)], params["layers"]
    )
    assert stack_layers(stacked) is stacked and unstack_layers(params) is params
    bad = {**stacked, "layers": {**stacked["layers"], "wq": stacked["layers"]["wq"][:1]}}
    with pytest.raises(ValueError, match=r"'layers\.wq' has shape"):
        check_params(config, bad)


def test_layer_loop_config():
    config = configs.TINY
    assert EngineConfig(model=config).scans_layers
    assert not EngineConfig(model=config, layer_loop="unroll").scans_layers
    sparse = SparseKVConfig(mode="offload")
    assert not EngineConfig(model=config, sparse_kv=sparse).scans_layers  # auto: unrolled
    assert layer_loop_scans("auto", False, platform="cpu")
    assert layer_loop_scans("auto", False, platform="tpu")
    assert not layer_loop_scans("auto", False, platform="cuda")  # measured faster unrolled
    assert not layer_loop_scans("auto", True, platform="cpu")
    assert layer_loop_scans("scan", False, platform="cuda")
    with pytest.raises(ValueError, match="layer_loop='scan' does not run with sparse_kv"):
        EngineConfig(model=config, sparse_kv=sparse, layer_loop="scan")
    with pytest.raises(ValueError, match=r"unknown self\.layer_loop=.while."):
        EngineConfig(model=config, layer_loop="while")


def test_llm_layouts_follow_the_engine(tmp_path):
    """The LLM stacks weights for a scanning engine (before placing them) and keeps one copy in
    the layout its engine uses; with_options converts for an unrolled or sparse engine; greedy
    outputs agree throughout; orbax stores the list layout."""
    from llmjax.checkpoint import restore_params, save_params

    opts = dict(load_format="dummy", max_model_len=48, num_pages=40, compilation_cache_dir="")
    prompts = [_tokens(13, 5), _tokens(4, 6), _tokens(21, 7)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM("tiny", **opts)
    assert layers_stacked(llm.params) and llm.engine.runner.params is llm.params
    want = [o.token_ids for o in llm.generate(prompts, greedy)]
    unrolled = llm.with_options(layer_loop="unroll")
    assert not layers_stacked(unrolled.params) and unrolled.engine.runner.params is unrolled.params
    assert [o.token_ids for o in unrolled.generate(prompts, greedy)] == want
    sparse = llm.with_options(sparse_kv="offload")
    assert isinstance(sparse.engine.runner.params["layers"], list)
    assert [o.token_ids for o in sparse.generate(prompts, greedy)] == want
    direct = LLM("tiny", layer_loop="unroll", **opts)
    assert not layers_stacked(direct.params)
    assert [o.token_ids for o in direct.generate(prompts, greedy)] == want

    save_params(str(tmp_path / "ckpt"), llm.model_config, llm.params)
    _, restored = restore_params(str(tmp_path / "ckpt"))
    assert isinstance(restored["layers"], list)
    np.testing.assert_array_equal(
        np.asarray(restored["layers"][1]["w_up"]), np.asarray(llm.params["layers"]["w_up"][1])
    )

"""Tensor parallelism (llmjax/parallel/) on the 8 fake CPU devices of tests/conftest.py: config
errors, head layouts, the rules table's shardings, the collectives in the compiled step, greedy
outputs equal to one device's (chunked prefill, prefix caching), weights placed shard by shard,
and two processes under jax.distributed equal to one."""

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter

import jax
import numpy as np
import pytest

import configs
from llmjax import LLM, SamplingParams
from llmjax.config import EngineConfig, ParallelConfig
from llmjax.model.attention import reference_attention
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import init_params
from llmjax.model.step_input import StepInput
from llmjax.parallel.heads import HeadLayout, tp_head_layout, transform_params
from llmjax.parallel.mesh import make_mesh, param_shardings, place_params
from tests.parallel_cases import (
    ENGINE_OPTS,
    SMOLLM2_MAX_TOKENS,
    SMOLLM2_OPTS,
    SMOLLM2_TEXTS,
    compiled_step_hlo,
    prompts,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SMOLLM2 = configs.get_preset("smollm2-135m-instruct")


def _generate(model="tiny", **kw):
    llm = LLM(model, **ENGINE_OPTS, **kw)
    outs = llm.generate(prompts(), GREEDY)
    return llm, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def single_device():
    return {m: _generate(m)[1:] for m in ("tiny", "tiny-gqa1")}


# ---------------------------------------------------------------------------------------------
# Configuration and head layouts


def test_config_errors_name_the_values():
    with pytest.raises(ValueError, match="dp=2"):
        ParallelConfig(dp=2)
    with pytest.raises(ValueError, match="tp=0"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match=r"tp=2 cannot split num_heads=9 / num_kv_heads=3.*3 -> 4"):
        EngineConfig(model=SMOLLM2, parallel=ParallelConfig(tp=2))
    EngineConfig(model=SMOLLM2, parallel=ParallelConfig(tp=2, pad_heads=True))  # fine
    with pytest.raises(ValueError, match="pp=3 stages need at least as many layers"):
        EngineConfig(model=configs.TINY, parallel=ParallelConfig(pp=3))
    with pytest.raises(ValueError, match=r"needs 16 devices; 8 cpu device\(s\) are available"):
        make_mesh(ParallelConfig(tp=16))


@pytest.mark.parametrize(
    "K, Q, tp, pad, want",
    [
        (2, 2, 2, False, HeadLayout("as_is", 2, 4)),
        (2, 2, 4, False, HeadLayout("replicate", 4, 4, kv_repeats=2)),
        (1, 4, 4, False, HeadLayout("replicate", 4, 4, kv_repeats=4)),
        (3, 3, 3, False, HeadLayout("as_is", 3, 9)),
        (3, 3, 2, True, HeadLayout("pad", 4, 12, num_pad_kv_heads=1)),
        (3, 3, 4, True, HeadLayout("pad", 4, 12, num_pad_kv_heads=1)),
        (1, 4, 8, True, HeadLayout("pad", 8, 32, num_pad_kv_heads=7)),  # 4 % 8: no replication
    ],
)
def test_head_layouts(K, Q, tp, pad, want):
    config = configs.TINY.replace(num_kv_heads=K, num_heads=K * Q, head_dim=16)
    assert tp_head_layout(config, tp, pad) == want


@pytest.mark.parametrize("tp", [2, 4])
def test_repeated_and_padded_heads_leave_the_model_unchanged(tp):
    """On one device: the model with kv heads repeated (tiny, tp=4) or padded with zero heads (3
    kv heads, tp=2/4) computes the same logits as the original."""
    cases = [configs.TINY, configs.TINY.replace(num_heads=6, num_kv_heads=3, head_dim=16)]
    for config in cases:
        layout = tp_head_layout(config, tp, pad_heads=True)
        params = init_params(config, jax.random.key(1))
        step = _prefill_step(T=12, page_size=4)
        logits = _logits(config, params, step)
        wide = layout.model_config(config)
        assert wide.num_kv_heads % tp == 0 and wide.head_dim == config.head_dim
        got = _logits(wide, transform_params(params, config, layout), step)
        np.testing.assert_allclose(got, logits, rtol=2e-5, atol=2e-5)


def _prefill_step(T, page_size):
    pages = (T + page_size - 1) // page_size
    return StepInput(
        token_ids=np.arange(3, 3 + T, dtype=np.int32),
        positions=np.arange(T, dtype=np.int32),
        slot_mapping=np.arange(page_size, page_size + T, dtype=np.int32),
        cu_q_lens=np.array([0, T], np.int32),
        kv_lens=np.array([T], np.int32),
        page_indices=np.arange(1, 1 + pages, dtype=np.int32)[None],
        num_seqs=np.array([1], np.int32),
        logits_indices=np.array([T - 1], np.int32),
    )


def _logits(config, params, step):
    kv = allocate_kv_pages(config, 8, 4, np.float32)
    return np.asarray(forward(params, kv, step, config, reference_attention)[0])


# ---------------------------------------------------------------------------------------------
# The engine, sharded


@pytest.mark.parametrize(
    "model, tp",
    [("tiny", 2), ("tiny", 4), ("tiny-gqa1", 4)],  # as is; kv heads repeated x2; x4 (MQA)
)
def test_greedy_outputs_equal_one_device(single_device, model, tp):
    want, cached = single_device[model]
    assert sum(cached) > 0  # the workload does hit the prefix cache
    llm, got, got_cached = _generate(model, tp=tp)
    assert got == want
    assert got_cached == cached
    assert llm.engine.runner.mesh.shape == {"pp": 1, "ep": 1, "tp": tp}


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_each_array_has_its_intended_sharding(layer_loop):
    llm = LLM("tiny", tp=4, layer_loop=layer_loop, **ENGINE_OPTS)  # 2 kv heads -> repeated to 4
    runner = llm.engine.runner
    want = {
        "embed": ("tp", None),
        "final_norm": (None,),
        "lm_head": (None, "tp"),
    }
    for name, spec in want.items():
        assert tuple(runner.params[name].sharding.spec) == spec, name
    layer = {
        "attn_norm": (None,),
        "wq": (None, "tp", None),
        "wk": (None, "tp", None),
        "wv": (None, "tp", None),
        "wo": ("tp", None, None),
        "mlp_norm": (None,),
        "w_gate": (None, "tp"),
        "w_up": (None, "tp"),
        "w_down": ("tp", None),
    }
    if layer_loop == "scan":  # stacked [L, ...]: the layer axis is never split
        stacked = runner.params["layers"]
        for name, spec in layer.items():
            assert tuple(stacked[name].sharding.spec) == (None, *spec), name
        # each device holds a quarter of the (repeated) kv heads of every layer: one
        assert stacked["wk"].addressable_shards[0].data.shape == (2, 64, 1, 16)
        for pages in runner.kv_pages:  # [L * num_pages, G, K, H]
            assert tuple(pages.sharding.spec) == (None, None, "tp", None)
            assert pages.addressable_shards[0].data.shape[2] == 1
        return
    for params in runner.params["layers"]:
        for name, spec in layer.items():
            assert tuple(params[name].sharding.spec) == spec, name
        assert params["wk"].addressable_shards[0].data.shape == (64, 1, 16)
    for k, v in runner.kv_pages:
        for pages in (k, v):
            assert tuple(pages.sharding.spec) == (None, None, "tp", None)
            assert pages.addressable_shards[0].data.shape[2] == 1


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_compiled_step_has_megatrons_collectives_and_gathers_no_weights(layer_loop):
    """Per layer one all-reduce of [T, D] after attention and one after the MLP (scanned: the
    program holds one layer's), one for the vocab-split embedding lookup; the sampler's
    collectives move logits-sized values ([S, ...]); no weight is ever gathered."""
    llm = LLM("tiny", tp=2, layer_loop=layer_loop, **ENGINE_OPTS)
    T, S = 16, 4
    hlo = compiled_step_hlo(llm, T, S)
    collectives = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather)\(", hlo)
    D, L = configs.TINY.hidden_size, configs.TINY.num_layers
    activations = [c for c in collectives if c[2] == "all-reduce" and c[1] == f"{T},{D}"]
    assert len(activations) == 2 * (1 if layer_loop == "scan" else L) + 1, collectives
    gathers = Counter(c[1].split(",")[0] for c in collectives if c[2] == "all-gather")
    assert set(gathers) <= {str(S)}, collectives  # sampling over the vocab-split logits
    # The sampler's top-k / top-p sort over the vocab-split logits moves them with all-to-alls:
    # logits-sized, never a weight.
    V = configs.TINY.vocab_size
    for shape in re.findall(r"\((\w+\[[\d,]+\])[^=]*\) all-to-all\(", hlo):
        assert np.prod([int(d) for d in shape.split("[")[1][:-1].split(",")]) <= S * V, shape
    assert "reduce-scatter(" not in hlo


def test_weights_are_loaded_one_at_a_time_and_each_device_gets_its_shard():
    """place_params calls each thunk once, in turn, and leaves each device its slice only."""
    config = configs.TINY
    params = init_params(config, jax.random.key(0))
    calls = []

    def thunk(path, x):
        def load():
            calls.append(jax.tree_util.keystr(path))
            return np.asarray(x)

        return load

    lazy = jax.tree_util.tree_map_with_path(thunk, params)
    mesh = make_mesh(ParallelConfig(tp=2))
    layout = tp_head_layout(config, 2)
    placed = place_params(lazy, config, layout, mesh)
    assert len(calls) == len(set(calls)) == len(jax.tree.leaves(params))
    shardings = param_shardings(config, mesh)
    for x, want, s in zip(
        jax.tree.leaves(placed), jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True
    ):
        assert x.sharding == s
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(shard.data, np.asarray(want)[shard.index])


def test_sharded_orbax_restore(tmp_path):
    from llmjax.checkpoint import restore_params, save_params

    config = configs.TINY
    params = init_params(config, jax.random.key(0))
    save_params(str(tmp_path / "ckpt"), config, params)
    _, restored = restore_params(str(tmp_path / "ckpt"), np.float32, ParallelConfig(tp=2))
    assert tuple(restored["layers"][0]["wq"].sharding.spec) == (None, "tp", None)
    assert restored["layers"][0]["wq"].addressable_shards[0].data.shape == (64, 2, 16)
    np.testing.assert_array_equal(restored["embed"], params["embed"])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_smollm2_greedy_outputs_equal_one_device(smollm2_single_device, tp):
    """SmolLM2 (9 query / 3 kv heads: padded to 12 / 4), loaded shard by shard from the GGUF."""
    llm = LLM(tp=tp, pad_heads=True, **SMOLLM2_OPTS)
    outs = llm.generate(SMOLLM2_TEXTS, SamplingParams(max_tokens=SMOLLM2_MAX_TOKENS))
    assert [o.token_ids for o in outs] == smollm2_single_device


# ---------------------------------------------------------------------------------------------
# Two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (1, 2, 1), (2, 1, 2)])
def test_two_processes_equal_one(single_device, tmp_path, tp, pp, ep):
    """tp=2, or pp=2 (a pipeline stage per process), or tp=2 with ep=2 on the tiny Mixtral
    (each process holds half the experts; the all-to-alls cross processes), across two
    processes with one CPU device each (gloo collectives), lockstep check on: both produce the
    single-device outputs."""
    model = "tiny" if ep == 1 else os.path.join(ROOT, "tests", "testdata", "hf_tiny", "mixtral")
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "tests/multihost_worker.py",
                *(address, "2", str(i), str(tp), str(pp), str(out), model, str(ep)),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate([tmp_path / "p0.json", tmp_path / "p1.json"])
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    if ep == 1:
        want, cached = single_device["tiny"]
    else:
        opts = {k: v for k, v in ENGINE_OPTS.items() if k != "load_format"}
        outs = LLM(model, **opts).generate(prompts(), SamplingParams(max_tokens=8, ignore_eos=True))
        want, cached = [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]
    for i in range(2):
        got = json.loads((tmp_path / f"p{i}.json").read_text())
        assert got["process_index"] == i and got["process_count"] == 2
        assert got["global_devices"] == 2
        assert got["token_ids"] == want
        if pp == 1:  # (a pipeline delays cache insertions, so its hits differ)
            assert got["num_cached_tokens"] == cached


def test_lockstep_check_raises_when_processes_disagree(monkeypatch):
    from jax.experimental import multihost_utils

    from llmjax.parallel import distributed

    tokens = np.array([5, 7, 9], np.int32)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    same = np.array([[distributed.digest(tokens)]] * 2, np.uint32)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: same)
    distributed.check_lockstep(tokens, step=3)  # agree: nothing happens
    other = np.array([[distributed.digest(tokens)], [distributed.digest(tokens + 1)]], np.uint32)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: other)
    with pytest.raises(RuntimeError, match="step 3: processes sampled different tokens"):
        distributed.check_lockstep(tokens, step=3)

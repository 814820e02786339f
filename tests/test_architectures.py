"""Qwen3, Gemma 2 and Gemma 3 through what reads the model beyond one forward pass (the logits
and a single request's greedy decode against HF are tests/test_hf_parity.py): a continuous batch
with chunked prefill across the sliding window, prefix-cache hits and preemption, the layers
unrolled and scanned, tensor and pipeline parallelism on fake devices, bounded compiles. The
invariant: each request's greedy output is HF's (the golden prompt) and does not depend on how
it was batched, cached, laid out or split."""

import os

import numpy as np
import pytest

from llmjax import LLM, SamplingParams
from tests.conftest import TESTDATA
from tests.parallel_cases import prompts

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
OPTS = dict(
    page_size=4,
    max_num_batched_tokens=16,  # chunks of 16 cross the 8-token window
    max_num_seqs=4,
    max_model_len=128,
    scheduler_policy="sarathi",
    prefix_cache="radix",
    compilation_cache_dir="",
)


def _path(name):
    return os.path.join(TESTDATA, "hf_tiny", name)


def _workload(name):
    golden = np.load(os.path.join(_path(name), "golden.npz"))
    n = golden["lengths"][0]
    return [golden["input_ids"][0][:n].tolist(), *prompts(5)], golden["greedy_ids"].tolist()


def _generate(name, num_prompts=None, params=GREEDY, **kw):
    work, _ = _workload(name)
    llm = LLM(_path(name), **{**OPTS, **kw})
    outs = llm.generate(work[:num_prompts], params)
    return llm, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def baseline():
    return {name: _generate(name) for name in ("gemma2", "gemma3")}


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_batched_greedy_equals_hf_and_hits_the_prefix_cache(baseline, name):
    llm, got, cached = baseline[name]
    _, hf = _workload(name)
    assert got[0] == hf  # the golden prompt, in a mixed batch, decodes as HF does
    assert sum(cached) > 0  # shared prefixes hit the radix cache
    assert llm.engine.stats.num_steps > len(got)
    # One compile per bucket the run reached, whatever the layer pattern.
    assert llm.engine.num_compiles <= len(llm.engine.buckets.shapes())


@pytest.mark.parametrize(
    "name, opts",
    [
        ("gemma3", dict(layer_loop="unroll")),
        # preempts (pages of every layer: tests/test_hybrid_kv.py preempts the hybrid layout)
        ("gemma3", dict(prefix_cache="none", num_pages=24, hybrid_kv_cache="off")),
        ("gemma3", dict(tp=2)),
        ("gemma3", dict(pp=2)),
        ("gemma3", dict(pp=3)),  # stages of 2, 1 and 1 layers: padding layers
        ("gemma2", dict(tp=2, pp=2)),
    ],
    ids=["unroll", "preempt", "tp2", "pp2", "pp3", "tp2pp2"],
)
def test_outputs_do_not_depend_on_layout_cache_or_preemption(baseline, name, opts):
    _, want, _ = baseline[name]
    llm, got, _ = _generate(name, **opts)
    assert got == want
    if "num_pages" in opts:
        assert llm.engine.stats.num_preemptions > 0
    # the hybrid KV layout (per stage under pp, where the layers are scanned) unless 'off'
    config = llm.engine.config
    hybrid = "hybrid_kv_cache" not in opts and (config.parallel.pp == 1 or config.scans_layers)
    assert (llm.engine.block_manager.num_groups > 1) == hybrid


def test_precompiled_buckets_are_all_the_compiles():
    """With every bucket compiled at start, serving the mixed workload compiles nothing more:
    the per-layer table is data, not a new program per layer pattern."""
    work, _ = _workload("gemma3")
    llm = LLM(_path("gemma3"), **{**OPTS, "max_model_len": 64}, precompile=True)
    before = llm.engine.num_compiles
    assert before == len(llm.engine.buckets.shapes())
    llm.generate([p[:40] for p in work], SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.engine.num_compiles == before


@pytest.mark.parametrize(
    "name, mode",
    [("gemma3", "infinigen"), ("gemma2", "h2o")],  # quest selects as the two (test_sparse_modes)
)
def test_sparse_kv_selecting_everything_equals_dense(baseline, name, mode):
    """Sparse KV over local and global layers, query/key norms, post norms (Gemma 3) and the
    attention soft cap (Gemma 2, in H2O's dense prefill and in the selected rows): each layer
    selects within its own window with its own RoPE, and InfiniGen speculates layer i+1's query
    with that layer's norm and RoPE. Selecting every token decodes as the dense engine does, in
    sparse steps."""
    from llmjax.config import SparseKVConfig

    alpha = dict(alpha=1e9) if mode == "infinigen" else {}
    sparse = SparseKVConfig(mode=mode, max_num_kv=None, num_dense_layers=1, **alpha)
    extra = dict(prefix_cache="none") if mode == "h2o" else {}
    # three of the six requests, 8 tokens each (the sparse step compiles per bucket, unrolled):
    # greedy outputs do not depend on the batch, so each is the baseline's first 8 tokens
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm, got, _ = _generate(name, 3, params, sparse_kv=sparse, calibration_tokens=32, **extra)
    assert got == [t[:8] for t in baseline[name][1][:3]]
    assert llm.engine.stats.num_sparse_steps > 0

"""The engine with `attention_backend="pallas"` (the TPU kernel, interpreted on the CPU) gives the
reference backend's greedy outputs, on mixed chunked-prefill batches of the tiny model and on
SmolLM2 (slow)."""

import numpy as np
import pytest

from llmjax import LLM, SamplingParams


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny", "tiny-gqa1"])
def test_tiny_model_greedy_outputs_equal_the_reference_backend(model):
    opts = dict(
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,  # prompts are chunked beside running decodes
        max_num_seqs=8,
        max_model_len=96,
        compilation_cache_dir="",
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(5)
    ref = LLM(model, attention_backend="reference", **opts)
    pallas = LLM(model, attention_backend="pallas", **opts)
    assert pallas.engine.runner.attention_backend == "pallas"
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in pallas.generate(prompts, params)]
    assert got == want
    assert pallas.engine.stats.num_steps > len(prompts)  # several mixed steps ran


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_the_reference_backend(smollm2_path):
    opts = dict(max_model_len=128, max_num_batched_tokens=16, compilation_cache_dir="")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    want = [
        o.token_ids for o in LLM(attention_backend="reference", **opts).generate(prompts, params)
    ]
    got = [o.token_ids for o in LLM(attention_backend="pallas", **opts).generate(prompts, params)]
    assert got == want

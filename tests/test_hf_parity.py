"""Our model against HF transformers on the same weights (golden files from
scripts/golden/make_model_golden.py): every position's logits, and greedy decoding through the
engine."""

import os

import numpy as np
import pytest

from llmjax.checkpoint import load_hf
from tests.conftest import TESTDATA
from tests.helpers import full_logits

CHECKPOINTS = ["llama", "llama_tied", "llama3_rope", "qwen2", "mistral", "llama_sharded"]


def _golden(name):
    path = os.path.join(TESTDATA, "hf_tiny", name)
    return path, np.load(os.path.join(path, "golden.npz"))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_hf(name):
    path, golden = _golden(name)
    config, params = load_hf(path)
    for ids, n, want in zip(golden["input_ids"], golden["lengths"], golden["logits"], strict=True):
        got = full_logits(params, config, ids[:n].tolist(), page_size=8)
        scale = np.abs(want[:n]).max()
        np.testing.assert_allclose(got, want[:n], rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_greedy_decoding_matches_hf(name):
    from llmjax import LLM, SamplingParams

    path, golden = _golden(name)
    n = golden["lengths"][0]
    prompt = golden["input_ids"][0][:n].tolist()
    llm = LLM(path, page_size=4, max_num_batched_tokens=16, compilation_cache_dir="")
    params = SamplingParams(max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == golden["greedy_ids"].tolist()

"""SamplingParams.n (issue 24): n samples of one prompt, each its own seed stream, sharing the
prompt's KV pages through the prefix cache; one RequestOutput with n CompletionOutputs."""

from __future__ import annotations

import pytest

from llmjax import SamplingParams
from tests.helpers import tiny_llm


def _llm():
    return tiny_llm(96)


PROMPT = list(range(10, 50))  # 40 tokens: 10 full pages


def test_n_samples_equal_n_separately_seeded_requests_and_share_the_prompt():
    llm = _llm().with_options()
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6, logprobs=1)
    out = llm.generate([PROMPT], params)[0]
    assert out.finished and len(out.outputs) == 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    # The prompt was computed once; the other samples took its full pages from the cache.
    assert llm.engine.stats.num_prefill_tokens < len(PROMPT) + 2 * 8
    separate = _llm().with_options()
    for i, c in enumerate(out.outputs):
        one = SamplingParams(seed=7 + i, temperature=1.0, max_tokens=6, logprobs=1)
        alone = separate.generate([PROMPT], one)[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
        assert len(c.logprobs) == 6 and c.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # different streams


def test_n_in_a_mixed_batch_and_without_a_prefix_cache():
    prompts = [PROMPT, [5, 6, 7], PROMPT[:17]]
    params = [
        SamplingParams(n=2, max_tokens=5, ignore_eos=True),  # greedy: equal samples
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(n=4, seed=1, temperature=0.8, max_tokens=5, ignore_eos=True),
    ]
    for options in ({}, {"prefix_cache": "none"}, {"async_scheduling": True}):
        llm = _llm().with_options(**options)
        outs = llm.generate(prompts, params)
        assert [len(o.outputs) for o in outs] == [2, 1, 4]
        assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
        alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        got = [[c.token_ids for c in o.outputs] for o in outs]
        assert got == [[c.token_ids for c in o.outputs] for o in alone]
        bm = llm.engine.block_manager
        assert not llm.engine.has_unfinished_requests()
        assert bm.num_available_pages == bm.num_usable_pages


def test_aborting_a_request_aborts_every_sample_and_frees_their_pages():
    llm = _llm().with_options()
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=40, ignore_eos=True), "r")
    engine.add_request([5] * 8, SamplingParams(max_tokens=4), "other")
    for _ in range(4):
        engine.step()
    assert any(rid.startswith("r#") for rid in engine._live)
    assert engine.abort_request("r")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["other"]
    bm = engine.block_manager
    assert bm.num_available_pages == bm.num_usable_pages and not engine._live
    # abort_all counts a request once, whatever its n
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=9), "s")
    engine.step()
    assert engine.abort_all() == ["s"]


def test_what_n_cannot_do():
    llm = _llm()
    with pytest.raises(ValueError, match="n=2 needs generate"):
        next(llm.stream(PROMPT, SamplingParams(n=2)))
    prefill = llm.with_options(role="prefill")
    out = prefill.generate([PROMPT], SamplingParams(n=2, max_tokens=2))[0]
    assert out.finish_reason == "error" and "n=2" in out.error

"""Property tests of the whole engine (scheduler, block manager, radix cache, the pipelined step
path) on the simulated device: random arrivals, aborts and preemptions, invariants after every
step, and outputs that do not depend on what a request was batched with."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs.tiny import TINY_DEEP as TINY  # 4+ layers: room for 3 pipeline stages
from llmjax.config import (
    SCHEDULER_POLICIES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import SimConfig

MAX_MODEL_LEN = 96


def _config(policy, pp, page_size, budget, prefix_cache, num_pages) -> EngineConfig:
    chunked = SchedulerConfig(policy=policy).chunks_prefills
    return EngineConfig(
        model=TINY,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(page_size=page_size, num_pages=num_pages, prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(
            policy=policy,
            max_num_seqs=6,
            max_num_batched_tokens=budget if chunked else MAX_MODEL_LEN,
        ),
        parallel=ParallelConfig(pp=pp),
        device="sim",
        sim=SimConfig(hardware="a40"),
    )


@st.composite
def scenarios(draw):
    policy = draw(st.sampled_from(SCHEDULER_POLICIES))
    pp = draw(st.sampled_from([1, 2, 3]))
    page_size = draw(st.sampled_from([4, 8]))
    budget = draw(st.sampled_from([8, 16, 40]))
    prefix_cache = draw(st.sampled_from(["none", "radix"]))
    # small caches: requests preempt each other (each fits alone)
    num_pages = draw(st.integers(MAX_MODEL_LEN // page_size + 2, 3 * MAX_MODEL_LEN // page_size))
    shared = draw(st.lists(st.integers(3, 250), min_size=0, max_size=20))
    requests = draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(3, 250), min_size=1, max_size=40),  # own prompt tokens
                st.booleans(),  # starts with the shared prefix
                st.integers(1, 30),  # max_tokens
                st.integers(0, 12),  # arrival step
                st.one_of(st.none(), st.integers(0, 20)),  # abort at step
            ),
            min_size=1,
            max_size=10,
        )
    )
    return (policy, pp, page_size, budget, prefix_cache, num_pages), shared, requests


def _alone(config, prompt, max_tokens) -> list[int]:
    engine = LLMEngine(config, None, None)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    return outs[0].token_ids


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_the_engine_on_a_simulated_device_keeps_its_invariants(scenario):
    options, shared, requests = scenario
    config = _config(*options)
    engine = LLMEngine(config, None, None)
    bm = engine.block_manager
    prompts = [(shared if s else []) + own for own, s, *_ in requests]
    finished, aborted, last_now = {}, set(), engine.clock.now()
    for step in range(2000):
        for i, (_, _, max_tokens, arrival, _) in enumerate(requests):
            if arrival == step:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(prompts[i], params, request_id=str(i))
        for i, (*_, abort_at) in enumerate(requests):
            if abort_at == step and str(i) not in finished and engine.abort_request(str(i)):
                aborted.add(str(i))
        # (an aborted request's micro-batch may still be in the pipeline: drain it too)
        if not engine.has_unfinished_requests() and not engine.runner.num_in_flight and step > 12:
            break
        for out in engine.step():
            assert out.request_id not in finished, "an output after the request finished"
            if out.finished:
                finished[out.request_id] = out
        # after every step
        bm.check_invariants()
        now = engine.clock.now()
        assert now >= last_now  # the virtual clock never goes back
        last_now = now
        running = engine.scheduler.running
        assert len(running) <= config.scheduler.max_num_seqs
        for req in running:
            assert len(bm.page_tables[req.request_id]) * bm.page_size >= req.num_computed_tokens
        assert engine.runner.num_in_flight <= options[1]
    else:
        raise AssertionError("the engine did not drain (livelock)")
    # every request finished or was aborted; all pages are free again
    assert set(finished) | aborted == {str(i) for i in range(len(requests))}
    assert bm.num_available_pages == bm.num_usable_pages
    assert not engine.scheduler.in_flight
    big_cache = dataclasses.replace(config.cache, num_pages=4 * MAX_MODEL_LEN // bm.page_size)
    alone_config = dataclasses.replace(config, cache=big_cache)
    for rid, out in finished.items():
        i = int(rid)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert list(m.token_times) == sorted(m.token_times)
        assert len(out.token_ids) == requests[i][2]
        # batch invariance: the tokens it gets alone, on one stage, in a big cache
        alone = dataclasses.replace(alone_config, parallel=ParallelConfig())
        assert out.token_ids == _alone(alone, prompts[i], requests[i][2])
    if options[1] > 1 and engine.stats.num_pipeline_ticks:
        assert 0 <= engine.stats.pipeline_time_bubble_fraction <= 1


def test_the_simulated_engine_preempts_in_a_small_cache_and_still_agrees():
    """A fixed case that must preempt (hypothesis may or may not find one)."""
    config = _config("sarathi", 2, 4, 16, "radix", MAX_MODEL_LEN // 4 + 2)
    engine = LLMEngine(config, None, None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, int(rng.integers(10, 40))).tolist() for _ in range(8)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True), request_id=str(i))
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert engine.stats.num_preemptions > 0
    big = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, num_pages=200), parallel=ParallelConfig()
    )
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == _alone(big, p, 30)

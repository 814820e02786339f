"""Async scheduling (llmjax/engine/overlap.py): the host schedules step N + 1 while step N runs.

The property test drives `LLMEngine` with async scheduling on, over the fake paged model
(`tests/fake_model.FakeRunner`, which fills pending tokens from the last step's ids as the
device does), through the scheduler property tests' random scenarios: arrivals, aborts,
preemptions in small caches, stop tokens, EOS, prefix caching, every policy. After every step
the block manager's invariants hold, only running requests own pages (covering their computed
tokens), a request has at most one pending token and only while its step is in flight, and at
the end every page is free and every request's output is the one it generates alone (an
aborted one's a prefix of it). The model tests check that async outputs are bit-identical to
synchronous ones on the tiny model (greedy, seeded sampling, logprobs, n, stop strings,
structured outputs, penalties, preemption, prefix caching, aborts), that the features that need
the host's tokens land their step first (and say so), and that the pending-token input adds no
step compile.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmjax.config import SCHEDULER_POLICIES
from llmjax.engine.block_manager import pages_needed
from llmjax.engine.engine import LLMEngine
from llmjax.engine.request import RequestStatus
from llmjax.sampling_params import SamplingParams
from tests.fake_model import FakeRunner
from tests.test_scheduler_properties import (
    PROPERTY_SETTINGS,
    cache_pages,
    max_steps,
    scenarios,
)


@pytest.fixture
def fake_runner(monkeypatch):
    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = FakeRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)


def _check_engine(engine: LLMEngine, sc) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    bm.check_invariants()
    running = {r.request_id: r for r in sched.running}
    assert set(bm.page_tables) <= set(running), "a request that is not running owns pages"
    in_flight = engine._overlap.in_flight
    flying = set() if in_flight is None else {s.request.request_id for s in in_flight.batch.seqs}
    assert set(sched.unsettled) <= flying, "a request counted in flight that is not"
    for rid, req in running.items():
        assert req.status is RequestStatus.RUNNING
        table = bm.page_tables.get(rid, [])
        assert len(table) >= pages_needed(req.num_computed_tokens, sc.page_size)
        assert req.num_pending_tokens <= (rid in flying), f"{rid}: a pending token not in flight"
        assert req.num_tokens <= sc.max_model_len
    for req in sched.waiting:
        assert req.num_computed_tokens == 0 and req.num_pending_tokens == 0
    n = sum(len(t) - bm.num_shared_pages(rid) for rid, t in bm.page_tables.items())
    assert bm.num_free_pages + n + len(cache_pages(bm)) == bm.num_usable_pages


def run_engine(sc, async_scheduling: bool) -> tuple[dict, LLMEngine, int]:
    """Serve `sc` through an LLMEngine over the fake model; (final outputs by request id, the
    engine, steps that had a pending token)."""
    config = sc.config().replace(async_scheduling=async_scheduling)
    engine = LLMEngine(config, params=None, num_pages=sc.num_pages)
    assert engine.async_scheduling == async_scheduling
    outputs: dict = {}
    order = sorted(range(len(sc.requests)), key=lambda i: (sc.requests[i].arrival, i))
    overlapped = 0
    last_arrival = max(r.arrival for r in sc.requests)
    for step in range(2 * max_steps(sc)):
        for i in order:
            spec = sc.requests[i]
            if spec.arrival == step:
                params = SamplingParams(
                    max_tokens=spec.max_tokens,
                    stop_token_ids=list(spec.stop_token_ids),
                    ignore_eos=spec.ignore_eos,
                )
                engine.add_request(list(spec.prompt), params, request_id=str(i))
        for i, spec in enumerate(sc.requests):
            if spec.abort_at == step:
                engine.abort_request(str(i))
        if step > last_arrival and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            prev = outputs.get(out.request_id)
            assert prev is None or not prev.finished, "an output after the request finished"
            outputs[out.request_id] = out
        overlapped += any(r.num_pending_tokens for r in engine.scheduler.running)
        _check_engine(engine, sc)
    else:
        pytest.fail(f"livelock: {sc}")
    bm = engine.block_manager
    assert bm.num_available_pages == bm.num_usable_pages, "pages still held at the end"
    assert not engine.scheduler.unsettled and engine._overlap.in_flight is None
    return outputs, engine, overlapped


@pytest.mark.parametrize("prefix_cache", ["none", "radix"])
@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
@settings(
    PROPERTY_SETTINGS,
    max_examples=40,
    suppress_health_check=[
        *PROPERTY_SETTINGS.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(data=st.data())
def test_async_engine_keeps_invariants_and_outputs_equal_alone(
    fake_runner, policy, prefix_cache, data
):  # (the fixture only swaps the runner module: nothing to reset between examples)
    sc = data.draw(scenarios(policy, prefix_cache), label="scenario")
    sc = dataclasses.replace(
        sc,
        pipeline_depth=1,
        balance_micro_batches=False,
        num_speculative_tokens=0,
        max_loras=None,  # (LoRA's scheduling: the scheduler property tests)
        requests=tuple(dataclasses.replace(r, lora=0) for r in sc.requests),
    )
    outputs, engine, overlapped = run_engine(sc, async_scheduling=True)
    for i, spec in enumerate(sc.requests):
        out = outputs.get(str(i))
        want, reason = sc.expected(spec)
        if not sc.is_valid(spec):
            assert out is not None and out.finish_reason == "error" and not out.token_ids
        elif spec.abort_at is not None and (out is None or out.finish_reason != reason):
            got = [] if out is None else out.token_ids
            assert got == want[: len(got)], f"request {i}: aborted output is not a prefix"
        else:
            assert out is not None and out.finished, f"request {i} never finished"
            assert out.token_ids == want, f"request {i}: output differs from alone"
            assert out.finish_reason == reason
    event("overlapped" if overlapped else "never overlapped")
    event("preempted" if engine.stats.num_preemptions else "no preemption")


def test_async_and_sync_engines_equal_on_a_crowded_workload(fake_runner):
    from tests.test_scheduler_properties import _workload

    for policy in SCHEDULER_POLICIES:
        sc = _workload(policy)
        sync, _, _ = run_engine(sc, async_scheduling=False)
        out, engine, overlapped = run_engine(sc, async_scheduling=True)
        assert {k: v.token_ids for k, v in out.items()} == {k: v.token_ids for k, v in sync.items()}
        assert overlapped > 0 and engine.stats.num_preemptions > 0, policy


# ---- the tiny model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from llmjax import LLM

    return LLM(
        "tiny",
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=64,
        num_pages=14,
        compilation_cache_dir="",
        async_scheduling=False,
    )


def _mixed_workload(vocab: int, n: int = 10):
    rng = np.random.default_rng(1)
    shared = rng.integers(3, vocab, 12).tolist()
    prompts, params = [], []
    for i in range(n):
        prompt = rng.integers(3, vocab, int(rng.integers(2, 24))).tolist()
        if i % 3 == 0:
            prompt = shared + prompt[:6]  # prefix-cache hits
        prompts.append(prompt)
        kind = i % 5
        params.append(
            SamplingParams(
                max_tokens=int(rng.integers(1, 14)),
                temperature=0.0 if kind in (0, 3) else 0.9,
                top_k=8 if kind == 2 else 0,
                top_p=0.8 if kind == 4 else 1.0,
                seed=100 + i if kind else None,
                logprobs=2 if kind == 3 else None,
                n=2 if kind == 4 else 1,
                stop_token_ids=[int(prompt[-1])] if kind == 1 else [],
                ignore_eos=bool(i % 2),
            )
        )
    return prompts, params


def _outputs(llm, prompts, params, abort_after: int | None = None):
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort_request(ids[0])
    return [[_completion(c) for c in got[rid].outputs] if rid in got else None for rid in ids]


def _completion(c):
    """A sample's tokens and finish reason, exactly; its logprobs rounded (a step's batch
    changes the matmuls' shapes, and with them the last bits of a logit, as in any engine)."""
    logprobs = None
    if c.logprobs is not None:
        logprobs = [{t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()} for e in c.logprobs]
    return c.token_ids, c.finish_reason, logprobs


def test_async_outputs_equal_sync_on_the_tiny_model(tiny):
    prompts, params = _mixed_workload(tiny.config.model.vocab_size)
    sync = _outputs(tiny, prompts, params)
    llm = tiny.with_options(async_scheduling=True)
    assert llm.engine.async_scheduling
    assert _outputs(llm, prompts, params) == sync
    assert llm.engine.stats.num_preemptions > 0, "the workload should preempt"
    assert llm.engine.stats.num_cached_prefill_tokens > 0, "and hit the prefix cache"
    # once more: every step shape (pending tokens or not) is compiled; nothing recompiles
    compiles = llm.engine.runner.num_compiles
    pending = llm.engine.runner.num_pending_compiles
    assert 0 < pending <= 2 * len(llm.engine.buckets.token_buckets)
    llm.reset_prefix_cache()
    assert _outputs(llm, prompts, params) == sync
    assert llm.engine.runner.num_compiles == compiles
    assert llm.engine.runner.num_pending_compiles == pending


def test_async_abort_between_steps_keeps_the_others(tiny):
    prompts, params = _mixed_workload(tiny.config.model.vocab_size, n=6)
    params = [dataclasses.replace(p, max_tokens=12, ignore_eos=True) for p in params]
    sync = _outputs(tiny, prompts, params, abort_after=4)
    llm = tiny.with_options(async_scheduling=True)
    out = _outputs(llm, prompts, params, abort_after=4)
    assert out[1:] == sync[1:]
    ((tokens, reason, _),) = out[0]  # its last output before the abort
    assert reason is None and 0 < len(tokens) < 12 and tokens == sync[0][0][0][: len(tokens)]
    assert llm.engine.block_manager.page_tables.keys() == set()
    bm = llm.engine.block_manager
    assert bm.num_available_pages == bm.num_usable_pages


def test_engines_that_need_host_tokens_run_synchronous_steps(tiny):
    from llmjax.config import ParallelConfig, SpeculativeConfig
    from llmjax.sim import SimConfig

    spec = tiny.with_options(
        async_scheduling=True, speculative_config=SpeculativeConfig(method="ngram")
    )
    assert not spec.engine.async_scheduling  # proposals come from the newest tokens
    prefill = tiny.with_options(async_scheduling=True, role="prefill")
    assert not prefill.engine.async_scheduling  # parks on the first token
    sparse = tiny.with_options(async_scheduling=True, sparse_kv="offload")
    assert not sparse.engine.async_scheduling  # its accounting reads each step's pages
    decode = tiny.with_options(async_scheduling=True, role="decode")
    assert decode.engine.async_scheduling  # imports join the running batch between steps
    pp = dataclasses.replace(
        tiny.config, device="sim", sim=SimConfig(), async_scheduling=True
    ).replace(parallel=ParallelConfig(pp=2))
    assert not LLMEngine(pp, params=None, num_pages=26).async_scheduling  # ticks overlap
    # penalties: the step after a penalized request's waits for its token (and says so)
    llm = tiny.with_options(async_scheduling=True)
    prompts, _ = _mixed_workload(tiny.config.model.vocab_size, n=4)
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, seed=i, presence_penalty=0.5 * (i % 2))
        for i in range(4)
    ]
    sync = _outputs(tiny, prompts, params)
    assert _outputs(llm, prompts, params) == sync
    assert llm.engine._overlap.num_sync_steps > 0


def test_simulated_async_steps_cost_the_larger_of_host_and_device():
    import configs
    from llmjax.config import EngineConfig, SchedulerConfig
    from llmjax.sim import SimConfig

    model = configs.PRESETS["mistral-7b-instruct-v0.2"]
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        device="sim",
        sim=SimConfig(),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        max_model_len=1024,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 30000, int(rng.integers(20, 300))).tolist() for _ in range(12)]
    runs = {}
    for mode in (False, True):
        engine = LLMEngine(config.replace(async_scheduling=mode), params=None, num_pages=None)
        assert engine.async_scheduling == mode and engine.runner.overlapped == mode
        host = engine.runner.cost_model.host_overhead_s
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts
        ]
        outs, charged = {}, []
        collect = engine.runner.collect

        def charging(launched, collect=collect, charged=charged, runner=engine.runner):
            out = collect(launched)
            charged.append(runner.last_seconds)
            return out

        engine.runner.collect = charging
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o
        runs[mode] = ([outs[i].token_ids for i in ids], engine.clock.now(), charged, host)
    (sync_out, sync_t, sync_charged, host), (out, t, charged, _) = runs[False], runs[True]
    assert out == sync_out and host > 0
    # each step costs max(device, host) instead of device + host: here the device's share
    # always exceeds the host's 2 ms, so every step is the host's seconds shorter (the pages a
    # step frees reach admission a step later, which may add a step)
    assert min(charged) > host and t == pytest.approx(sum(charged))
    assert sync_t == pytest.approx(sum(sync_charged))
    assert len(sync_charged) <= len(charged) <= len(sync_charged) + 2
    assert t < sync_t - host * len(sync_charged) * 0.8


def test_async_with_a_tokenizer_stop_strings_and_structured_outputs(smollm2_path):
    """SmolLM2's tokenizer on a random 2-layer body: stop strings and structured outputs (a
    regex and a choice; the step after a constrained request's lands it first) equal the
    synchronous engine's."""
    from llmjax import LLM
    from llmjax.sampling_params import StructuredOutputsParams as SO

    sync = LLM(
        "smollm2-tiny",
        load_format="dummy",
        tokenizer=smollm2_path,
        max_model_len=128,
        num_pages=64,
        max_num_batched_tokens=64,
        compilation_cache_dir="",
        async_scheduling=False,
    )
    tok = sync.get_tokenizer()
    prompts = [tok.encode(t) for t in ("Answer:", "The cat", "Numbers: 1, 2,", "Hello there")]
    free = [o.text for o in sync.generate(prompts, SamplingParams(max_tokens=12, seed=3))]
    stop = free[1][3:6] or "e"  # a string the free run writes
    params = [
        SamplingParams(max_tokens=12, temperature=0.7, seed=1, stop=[stop]),
        SamplingParams(max_tokens=12, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(max_tokens=10, structured_outputs=SO(regex=r"[0-9]{2,5}")),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=2, stop=[stop]),
    ]
    params.append(SamplingParams(max_tokens=6, structured_outputs=SO(choice=["yes", "no"])))
    prompts.append(prompts[0])
    llm = sync.with_options(async_scheduling=True)
    want = sync.generate(prompts, params)
    got = llm.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert [(c.text, c.token_ids, c.finish_reason) for c in a.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in b.outputs
        ]
    assert llm.engine._overlap.num_sync_steps > 0
    assert want[4].outputs[0].text in ("yes", "no")
    assert any(o.finish_reason == "stop" for o in want)


def test_pending_tokens_add_no_step_compile(tiny):
    """The same decode batches run as the same compiled steps, the pending ids a device array
    instead of a host one; filling them in compiles once per sequence and token bucket."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 4
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sync = tiny.with_options(async_scheduling=False)
    llm = tiny.with_options(async_scheduling=True)
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.runner.num_compiles == sync.engine.runner.num_compiles == 2
    assert llm.engine.runner.num_pending_compiles == 2  # keep [S=4] and fill [T=4]

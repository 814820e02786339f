"""Prefix caching in the engine (issue 4): greedy outputs identical with the radix cache on and
off under every policy and admission order on the three prefix-sharing workloads with a cache
small enough to evict; hits reported per request and in the engine counters; a shared prompt
computed once; reset; and the longest-prefix-match admission order with SGLang's guards.

The property tests with random arrivals, aborts, preemptions and shared prefixes are in
test_scheduler_properties.py; the radix tree alone in test_radix_cache.py."""

import functools

import pytest

from configs.tiny import TINY
from llmjax import LLM, SamplingParams
from llmjax.bench import replay, workloads
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.block_manager import BlockManager
from llmjax.engine.policies import make_scheduler
from llmjax.engine.radix_cache import RadixCache
from llmjax.engine.request import Request, RequestStatus

POLICIES = ["sarathi", "prefill_first", "decode_first", "splitfuse"]
MAX_MODEL_LEN = 96
PAGE_SIZE = 4


@functools.cache
def _base_llm():
    """The tiny model's random weights, loaded once per process (engines: `LLM.with_options`)."""
    return LLM(
        "tiny",
        load_format="dummy",
        page_size=PAGE_SIZE,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        compilation_cache_dir="",
    )


def _llm(policy="sarathi", **kw):
    chunked = policy in ("sarathi", "splitfuse")
    opts = dict(
        max_num_batched_tokens=32 if chunked else MAX_MODEL_LEN,
        scheduler_policy=policy,
    )
    return _base_llm().with_options(**(opts | kw))


def _workloads() -> dict[str, list]:
    common = dict(vocab_size=TINY.vocab_size, max_model_len=MAX_MODEL_LEN, seed=3)
    return {
        "shared_system_prompt": workloads.shared_system_prompt(
            8, system_prompt_len=40, question_len=10, output_len=6, **common
        ),
        "few_shot": workloads.few_shot(
            8, num_tasks=3, num_shots=3, shot_len=10, question_len=6, output_len=4, **common
        ),
        "multi_turn_chat": workloads.multi_turn_chat(
            9, num_turns=3, first_prompt_len=20, user_turn_len=8, output_len=6, **common
        ),
    }


@pytest.fixture(scope="module")
def reference_outputs():
    """Each workload with the cache off: the token ids every variant must reproduce."""
    llm = _llm(prefix_cache="none")
    return {
        name: [o.token_ids for o in replay(llm.engine, specs, realtime=False)]
        for name, specs in _workloads().items()
    }


@pytest.mark.parametrize("admission_order", ["fcfs", "lpm"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_outputs_equal_with_the_cache_on_and_off(policy, admission_order, reference_outputs):
    # 40 usable pages of 4 tokens: the workloads' distinct prefixes do not all fit, so the cache
    # evicts while requests run (and some requests are preempted).
    llm = _llm(policy, num_pages=41, prefix_cache="radix", admission_order=admission_order)
    engine = llm.engine
    for name, specs in _workloads().items():
        outs = replay(engine, specs, realtime=False)
        assert all(o.error is None for o in outs), name
        assert [o.token_ids for o in outs] == reference_outputs[name], f"{name} differs"
        assert sum(o.num_cached_tokens for o in outs) > 0, f"{name}: no cache hit"
        for o in outs:
            assert 0 <= o.num_cached_tokens < len(o.prompt_token_ids)
            assert o.num_cached_tokens % PAGE_SIZE == 0
        engine.block_manager.check_invariants()
    stats = engine.stats
    assert stats.num_evicted_pages > 0, "the cache never had to evict"
    assert 0 < stats.prefix_cache_hit_rate < 1
    bm = engine.block_manager
    assert bm.num_available_pages == bm.num_usable_pages
    assert bm.prefix_cache.num_locked_pages == 0


def test_a_repeated_prompt_is_served_from_the_cache_but_computes_its_last_token():
    llm = _llm()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for start, n in [(10, 17), (100, 20)]:  # a partial last page, and a prompt of whole pages
        prompt = list(range(start, start + n))
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == (n - 1) // PAGE_SIZE * PAGE_SIZE  # >= 1 computed
        assert again.token_ids == first.token_ids
    # A turn that extends the first one's prompt and output reuses both.
    turn2 = prompt + first.token_ids + [7, 8, 9]
    out = llm.generate([turn2], params)[0]
    assert out.num_cached_tokens == (n + 4) // PAGE_SIZE * PAGE_SIZE  # the last output token has
    # no KV (it was sampled, never fed back), so the cached run ends before it


def test_a_shared_system_prompt_is_computed_once():
    system_len, question_len, n = 64, 8, 6
    specs = workloads.shared_system_prompt(
        n,
        system_prompt_len=system_len,
        question_len=question_len,
        p90_ratio=1,
        output_len=4,
        vocab_size=TINY.vocab_size,
    )
    for order in ("fcfs", "lpm"):
        llm = _llm(admission_order=order)
        outs = replay(llm.engine, specs, realtime=False)  # all at once
        stats = llm.engine.stats
        # Everything after the first request's system prompt is computed once: only each
        # question (and the partial page it starts in) is computed again.
        computed = stats.num_prefill_tokens
        assert computed <= system_len + n * (question_len + PAGE_SIZE), (order, computed)
        assert sum(o.num_cached_tokens for o in outs) >= (n - 1) * system_len - n * PAGE_SIZE


def test_reset_prefix_cache_and_stats():
    llm = _llm()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = list(range(20, 50))
    llm.generate([prompt], params)
    stats = llm.engine.stats.as_dict()
    assert stats["num_cached_pages"] > 0 and stats["num_evicted_pages"] == 0
    assert stats["prefix_cache_hit_rate"] == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 28
    assert llm.engine.stats.prefix_cache_hit_rate > 0
    assert llm.reset_prefix_cache()
    assert llm.engine.block_manager.prefix_cache.num_cached_pages == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0
    # While a request runs, its pages stay (and reset says so); the rest go.
    engine = llm.engine
    engine.add_request(list(range(60, 90)), SamplingParams(max_tokens=20), request_id="r")
    engine.step()
    engine.step()
    assert not llm.reset_prefix_cache()
    cache = engine.block_manager.prefix_cache
    assert cache.num_cached_pages == cache.num_locked_pages > 0
    engine.abort_request("r")
    assert llm.reset_prefix_cache()


def test_prefix_cache_off_caches_nothing():
    llm = _llm(prefix_cache="none")
    prompt = list(range(20, 50))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([prompt], params)
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0
    assert llm.engine.block_manager.prefix_cache.num_cached_pages == 0
    assert llm.engine.stats.num_cached_prefill_tokens == 0


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="prefix_cache='lru'"):
        CacheConfig(prefix_cache="lru")
    with pytest.raises(ValueError, match="admission_order='sjf'"):
        SchedulerConfig(admission_order="sjf")


# ---- admission order (host only) -----------------------------------------------------------------


def _scheduler(admission_order, *, num_pages=64, budget=16, **sched_kw):
    config = EngineConfig(
        model=TINY,
        cache=CacheConfig(page_size=PAGE_SIZE, num_pages=num_pages),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, admission_order=admission_order, **sched_kw
        ),
        max_model_len=MAX_MODEL_LEN,
        compilation_cache_dir="",
    )
    bm = BlockManager(num_pages, PAGE_SIZE, RadixCache(PAGE_SIZE))
    return make_scheduler(config, bm), bm


def _request(rid, tokens, arrival):
    req = Request(rid, list(tokens), SamplingParams(max_tokens=4), frozenset(), seed=0)
    req.metrics.arrival_time = arrival
    return req


def _cache(bm, tokens):
    """Put `tokens`' full pages in the cache as a finished request would."""
    bm.allocate("warm", len(tokens))
    bm.free("warm", tokens)


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_does_not():
    shared = list(range(100, 124))  # 6 pages
    for order, first in [("fcfs", "x"), ("lpm", "y")]:
        sched, bm = _scheduler(order, budget=16)
        _cache(bm, [*shared, 1])
        sched.add(_request("x", range(30, 46), 0.0))  # no hit
        sched.add(_request("y", [*shared, 2, 3], 1.0))  # 24 cached tokens
        batch = sched.schedule()
        assert batch.seqs[0].request.request_id == first
        y = next(r for r in sched.running + list(sched.waiting) if r.request_id == "y")
        if y.status is RequestStatus.RUNNING:
            assert y.num_cached_tokens == 24 and y.num_computed_tokens == 24


def test_lpm_falls_back_to_fcfs_when_the_queue_is_long():
    shared = list(range(100, 124))
    sched, bm = _scheduler("lpm", budget=16, lpm_max_queue_len=2)
    _cache(bm, [*shared, 1])
    sched.add(_request("x", range(30, 46), 0.0))
    sched.add(_request("y", [*shared, 2, 3], 1.0))
    assert [r.request_id for r in sched._admission_order()] == ["y", "x"]
    sched.add(_request("z", range(50, 60), 2.0))  # 3 > lpm_max_queue_len waiting: FCFS
    assert [r.request_id for r in sched._admission_order()] == ["x", "y", "z"]


def test_lpm_defers_a_request_sharing_an_uncached_prefix_with_an_earlier_one():
    common = list(range(100, 140))  # 40 tokens, nothing cached
    sched, _ = _scheduler("lpm", in_batch_prefix_len=32)
    sched.add(_request("a", [*common, 1, 2], 0.0))
    sched.add(_request("b", [*common, 3, 4], 1.0))  # shares 40 >= 32 tokens with a: last
    sched.add(_request("c", range(10, 30), 2.0))
    sched.add(_request("d", common[:20] + [5] * 20, 3.0))  # shares only 20 tokens: not deferred
    assert [r.request_id for r in sched._admission_order()] == ["a", "c", "d", "b"]


def test_preempted_requests_keep_their_place_before_lpm_order():
    sched, bm = _scheduler("lpm")
    shared = list(range(100, 124))
    _cache(bm, [*shared, 1])
    old = _request("old", range(30, 40), 0.0)
    old.num_preemptions = 1
    sched.waiting.append(old)
    sched.add(_request("y", [*shared, 2], 1.0))
    assert [r.request_id for r in sched._admission_order()] == ["old", "y"]


def test_eviction_comes_before_preemption():
    # 8 usable pages; a finished request leaves 6 cached. A new 7-page request evicts them
    # instead of failing admission, and nothing is preempted.
    sched, bm = _scheduler("fcfs", num_pages=9, budget=64)
    _cache(bm, [*range(100, 124), 1])
    assert bm.prefix_cache.num_cached_pages == 6 and bm.num_free_pages == 2
    sched.add(_request("n", range(30, 58), 0.0))  # 28 tokens: 7 pages
    batch = sched.schedule()
    assert [s.request.request_id for s in batch.seqs] == ["n"] and not batch.preempted
    assert bm.prefix_cache.num_evictions >= 5
    bm.check_invariants()


def test_lpm_defers_a_request_whose_next_tokens_a_running_prefill_is_computing():
    common = list(range(100, 160))  # 60 tokens
    sched, bm = _scheduler("lpm", budget=16, in_batch_prefix_len=32)
    sched.add(_request("r", [*common, 1], 0.0))
    batch = sched.schedule()  # r's first 16-token chunk
    sched.update(batch, [0] * len(batch.seqs))
    assert bm.prefix_cache.num_cached_pages == 4  # the chunk is cached at once
    sched.add(_request("w", [*common, 2], 1.0))  # 16 cached; r computes its next 32 now
    sched.add(_request("x", range(10, 30), 2.0))
    assert [r.request_id for r in sched._admission_order()] == ["x", "w"]
    # Once r has computed them, w has the longest hit and goes first.
    for _ in range(2):
        batch = sched.schedule()  # r's chunk takes the whole budget
        assert [s.request.request_id for s in batch.seqs] == ["r"]
        sched.update(batch, [0] * len(batch.seqs))
    assert sched.running[0].num_computed_tokens == 48
    assert [r.request_id for r in sched._admission_order()] == ["w", "x"]

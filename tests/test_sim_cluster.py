"""Many simulated instances on one virtual timeline (llmjax/sim/cluster.py)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs import PRESETS
from llmjax.bench.capacity import capacity_search
from llmjax.bench.metrics import summarize
from llmjax.bench.replay import replay
from llmjax.bench.workloads import RequestSpec, with_poisson_arrivals
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimConfig
from llmjax.sim.cluster import (
    ROUTERS,
    LeastOutstanding,
    RoundRobin,
    SimCluster,
    make_router,
)

TINY = PRESETS["tiny"]
# 10 ms a step + 1 ms a new token + 2 ms a decoding sequence (FEATURES' order)
COST = LinearCostModel((0.01, 0.001, 0.0, 0.002, 0.0))
PAGE_SIZE = 4
MAX_MODEL_LEN = 64


def _engine(num_pages=24, max_num_seqs=4, cost=COST):
    config = EngineConfig(
        model=TINY,
        device="sim",
        sim=SimConfig(cost_model=cost),
        cache=CacheConfig(page_size=PAGE_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
        max_model_len=MAX_MODEL_LEN,
    )
    return LLMEngine(config, params=None, num_pages=num_pages)


def _cluster(n, router="round_robin", **engine_kw):
    return SimCluster([_engine(**engine_kw) for _ in range(n)], router)


def _workload(seed=0, n=30, qps=25.0):
    """Poisson arrivals with an idle gap in the middle, prompts half of which share a 12-token
    prefix (cache hits), lengths that preempt in a 24-page cache, and two dependent turns."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, 12).tolist()
    t = np.cumsum(rng.exponential(1 / qps, n))
    t[n // 2 :] += 2.0  # every instance goes idle, then a second burst
    specs = [
        RequestSpec(
            arrival_time=float(t[i]),
            output_len=int(rng.integers(2, 24)),
            prompt_token_ids=(system if i % 2 else [])
            + rng.integers(3, 250, int(rng.integers(3, 24))).tolist(),
        )
        for i in range(n)
    ]
    specs.append(RequestSpec(arrival_time=0.05, output_len=5, prompt_token_ids=(7, 8), parent=1))
    specs.append(RequestSpec(arrival_time=0.0, output_len=3, prompt_token_ids=(9,), parent=n))
    return specs


def _arrivals_during_a_last_step():
    """A one-step request at 0 (its step ends at 13 ms) and two that arrive during that step, at
    5 and 10 ms: its instance has no work then but is not free before 13 ms, when a step must
    take both of them."""
    return [
        RequestSpec(arrival_time=a, output_len=n, prompt_token_ids=(3 + k, 4, 5))
        for k, (a, n) in enumerate([(0.0, 1), (0.005, 4), (0.010, 4)])
    ]


def _key(out):
    """Everything a request's output says about its run."""
    m = out.metrics
    times = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
    return (out.request_id, tuple(out.token_ids), times, tuple(m.token_times),
            out.num_cached_tokens, out.finish_reason)  # fmt: skip


@pytest.mark.parametrize("realtime", [True, False])
def test_one_instance_is_the_bare_engine(realtime):
    tail = _arrivals_during_a_last_step()
    bare, cluster = _engine(), _cluster(1)
    assert [_key(o) for o in replay(cluster, tail)] == [_key(o) for o in replay(bare, tail)]
    assert bare.stats.num_steps == 1 + 4  # the two late ones share their steps
    specs = _workload()
    bare, cluster = _engine(), _cluster(1)
    expected = replay(bare, specs, realtime=realtime)
    got = replay(cluster, specs, realtime=realtime)
    assert [_key(o) for o in got] == [_key(o) for o in expected]
    assert bare.stats.num_preemptions > 0 and any(o.num_cached_tokens for o in got)
    assert cluster.stats[0].num_preemptions == bare.stats.num_preemptions
    assert cluster.stats[0].num_steps == bare.stats.num_steps
    assert cluster.instances[0].clock.now() == bare.clock.now()
    assert {cluster.instance_of(o.request_id) for o in got} == {0}


def test_outputs_do_not_depend_on_where_a_request_ran():
    specs = _workload(seed=1)
    runs = {}
    preemptions = 0
    for n in (1, 3):
        for router in sorted(ROUTERS):
            cluster = _cluster(n, router, num_pages=16)
            outs = replay(cluster, specs)
            runs[n, router] = tuple(tuple(o.token_ids) for o in outs)
            preemptions += sum(s.num_preemptions for s in cluster.stats)
            if n == 3:
                assert len({cluster.instance_of(o.request_id) for o in outs}) == 3
    assert len(set(runs.values())) == 1, "greedy tokens must not depend on the placement"
    assert [len(t) for t in runs[1, "round_robin"]] == [s.output_len for s in specs]
    assert preemptions > 0


def _record(cluster):
    """Wrap the cluster's add_request and every instance's scheduler.schedule: per scheduled
    step (instance, time, arrivals it scheduled, arrivals present on the instance, ids and
    arrivals added to the cluster by then)."""
    added = []
    steps = []
    add = cluster.add_request

    def add_request(*args, **kwargs):
        rid = add(*args, **kwargs)
        added.append((rid, kwargs["arrival_time"]))
        return rid

    cluster.add_request = add_request
    for i, engine in enumerate(cluster.instances):

        def schedule(i=i, engine=engine, inner=engine.scheduler.schedule):
            t = engine.clock.now()
            sched = engine.scheduler
            present = [r.metrics.arrival_time for r in (*sched.waiting, *sched.running)]
            batch = inner()
            scheduled = [s.request.metrics.arrival_time for s in batch.seqs]
            steps.append((i, t, scheduled, present, list(added)))
            return batch

        engine.scheduler.schedule = schedule
    return steps


def _burst_during_a_long_step():
    """Instance 0 prefills 60 tokens (2 chunks of 32 tokens: ~42 ms each) from t=0; requests
    arrive every 5 ms meanwhile. A cluster that routed them all when the replay adds them (at
    now = 42 ms) would hand instance 1 (idle since 0) the arrivals at 5, 15, 25, 35 ms and
    schedule all four in its step at 5 ms."""
    long = RequestSpec(arrival_time=0.0, output_len=2, prompt_token_ids=tuple(range(3, 63)))
    short = [
        RequestSpec(arrival_time=0.005 * k, output_len=3, prompt_token_ids=(5 + k, 6, 7))
        for k in range(1, 12)
    ]
    return [long, *short]


@pytest.mark.parametrize(
    "n, router, specs",
    [
        (1, "round_robin", _arrivals_during_a_last_step()),
        (2, "round_robin", _burst_during_a_long_step()),
        (3, "least_outstanding", _burst_during_a_long_step()),
        (3, "round_robin", _workload(seed=2, qps=60)),
        (2, "least_outstanding", _workload(seed=3, qps=60)),
    ],
)
def test_a_step_at_t_sees_exactly_the_arrivals_up_to_t(n, router, specs):
    cluster = _cluster(n, router)
    steps = _record(cluster)
    outs = replay(cluster, specs)
    roots = [s.arrival_time for s in specs if s.parent is None]  # replay starts at 0
    for i, t, scheduled, present, added in steps:
        assert all(a <= t for a in scheduled) and all(a <= t for a in present), (i, t)
        # every workload request arrived by t was added, and routed, before this step
        assert sum(a <= t for a in roots) <= sum(a <= t for _, a in added)
        assert all(cluster.instance_of(rid) is not None for rid, a in added if a <= t)
    assert all(o.metrics.scheduling_delay >= 0 and o.metrics.ttft > 0 for o in outs)
    if specs[0].prompt_token_ids == tuple(range(3, 63)) and n == 2:
        first_on_1 = next((t, s) for i, t, s, _, _ in steps if i == 1)
        assert first_on_1 == (0.005, [0.005])  # alone, at its arrival


class Recording:
    """A router that records what it saw (and delegates the choice)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.log = []

    def route(self, request, instances, now):
        i = self.inner.route(request, instances, now)
        seen = [(v.num_outstanding, v.num_waiting, v.num_running) for v in instances]
        self.log.append((request.request_id, request.arrival_time, now, seen, i))
        return i


@pytest.mark.parametrize("router", [RoundRobin(), LeastOutstanding()])
def test_the_router_sees_each_instance_as_of_the_arrival(router):
    """Outstanding at a = routed there earlier and finished_time > a (not 'finished by the time
    the cluster simulated its step'): checked against the finished times afterwards."""
    rec = Recording(router)
    cluster = SimCluster([_engine() for _ in range(3)], rec)
    outs = replay(cluster, _workload(seed=4, qps=80))
    finished = {o.request_id: o.metrics.finished_time for o in outs}
    ahead = 0
    for j, (rid, arrival, now, seen, _) in enumerate(rec.log):
        assert now == arrival and cluster.instance_of(rid) == rec.log[j][4]
        for k, (outstanding, waiting, running) in enumerate(seen):
            expected = sum(finished[r] > now for r, *_, i in rec.log[:j] if i == k)
            assert outstanding == expected == waiting + running, (rid, k)
            ahead += cluster.instances[k].clock.now() > now
    assert ahead, "some routings should happen while an instance is mid-step"


def test_least_outstanding_balances_what_round_robin_does_not():
    """Long and short requests alternate: round robin puts every long one on instance 0;
    least-outstanding sends the next one where the short ones have already finished."""
    specs = [
        RequestSpec(arrival_time=0.1 * k, output_len=48 if k % 2 == 0 else 2, prompt_len=8)
        for k in range(16)
    ]
    results = {}
    for router in ("round_robin", "least_outstanding"):
        rec = Recording(make_router(router))
        cluster = SimCluster([_engine(num_pages=64) for _ in range(2)], rec)
        outs = replay(cluster, specs)
        longs = [cluster.instance_of(o.request_id) for o in outs[::2]]
        peak = max(max(o for o, _, _ in seen) for *_, seen, _ in rec.log)
        results[router] = (longs.count(0), peak, summarize(outs).e2e_latency.p99)
    rr, lor = results["round_robin"], results["least_outstanding"]
    assert rr[0] == 8 and 3 <= lor[0] <= 5, results
    assert lor[1] < rr[1] and lor[2] < 0.8 * rr[2], results


# ---- the property test -----------------------------------------------------------------------

_request = st.tuples(
    st.floats(0.0, 0.03),  # gap to the previous arrival, s
    st.integers(1, 20),  # prompt tokens
    st.integers(1, 16),  # output tokens
    st.one_of(st.none(), st.integers(0, 12)),  # abort this many cluster steps after adding
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_instances=st.integers(1, 4),
    router=st.sampled_from(sorted(ROUTERS)),
    num_pages=st.integers(7, 14),
    requests=st.lists(_request, min_size=2, max_size=30),
)
def test_cluster_invariants(num_instances, router, num_pages, requests):
    """Random arrivals, lengths and aborts (between steps) in small caches (preemption; a few
    requests too long for the whole cache are rejected): after every cluster step each clock
    and the cluster's time are non-decreasing, every open request is in exactly one place
    (queued for routing, or on the instance `instance_of` names, and on no other), the views'
    outstanding counts match; at the end each request finished or was aborted, once."""
    cluster = _cluster(num_instances, router, num_pages=num_pages)
    steps = _record(cluster)
    arrivals = np.cumsum([r[0] for r in requests])
    added: dict[str, tuple[float, int]] = {}  # id -> (arrival, max_tokens)
    abort_at: dict[str, int] = {}
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    last_now, last_clocks = -math.inf, [e.clock.now() for e in cluster.instances]
    i = num_steps = 0
    while i < len(requests) or cluster.has_unfinished_requests():
        now = cluster.clock.now()
        while i < len(requests) and arrivals[i] <= now:
            _, prompt_len, output_len, abort_after = requests[i]
            sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
            rid = cluster.add_request(
                list(range(3, 3 + prompt_len)), sp, arrival_time=float(arrivals[i])
            )
            added[rid] = (float(arrivals[i]), output_len)
            if abort_after is not None:
                abort_at[rid] = num_steps + abort_after
            i += 1
        for rid in [r for r, k in abort_at.items() if k <= num_steps]:
            del abort_at[rid]
            if cluster.abort_request(rid):
                assert rid not in finished
                aborted.add(rid)
        if cluster.has_unfinished_requests():
            for out in cluster.step():
                if out.finished:
                    assert out.request_id not in finished and out.request_id not in aborted
                    finished[out.request_id] = out
            num_steps += 1
        elif i < len(requests):
            cluster.clock.advance_to(arrivals[i])
        # invariants
        clocks = [e.clock.now() for e in cluster.instances]
        assert all(c >= p for c, p in zip(clocks, last_clocks, strict=True))
        now = cluster.clock.now()
        assert now >= last_now
        last_now, last_clocks = now, clocks
        open_ids = set(added) - set(finished) - aborted
        places = [
            {r.request_id for r in (*e.scheduler.waiting, *e.scheduler.running, *e._rejected)}
            for e in cluster.instances
        ]
        assert sum(map(len, places)) == len(set().union(*places)), "a request on two instances"
        for rid in open_ids:
            k = cluster.instance_of(rid)
            assert k is None or rid in places[k]
        assert set().union(*places) == {r for r in open_ids if cluster.instance_of(r) is not None}
        views = cluster.views()
        for k, v in enumerate(views):
            on_k = [o for r, o in finished.items() if cluster.instance_of(r) == k]
            late = sum(o.metrics.finished_time > v.now for o in on_k)
            assert v.num_outstanding == len(places[k]) + late
            assert v.num_waiting + v.num_running <= v.num_outstanding
        assert all(
            v.num_outstanding == len(p)
            for v, p in zip(cluster.views(math.inf), places, strict=True)
        )
    assert set(finished) | aborted == set(added) and not set(finished) & aborted
    for rid, out in finished.items():
        arrival, max_tokens = added[rid]
        assert out.metrics.arrival_time == arrival
        if out.error is None:
            assert len(out.token_ids) == max_tokens
            assert out.metrics.first_scheduled_time >= arrival
    for _, t, scheduled, present, added_then in steps:  # causal steps, as in replay
        assert max(scheduled + present, default=t) <= t
        assert sum(arrivals <= t) == sum(a <= t for _, a in added_then)
    preempted = sum(s.num_preemptions for s in cluster.stats)
    event(f"preempted: {preempted > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"rejected: {any(o.error for o in finished.values())}")


# ---- the benchmark harness on a cluster ---------------------------------------------------------


def test_replay_summarize_progress_and_capacity_search_run_on_a_cluster():
    specs = _workload(seed=5, qps=40)
    one = summarize(replay(_cluster(1), specs, realtime=True, progress="1 instance"), tbt_slo=1.0)
    outs = replay(_cluster(3, "least_outstanding"), specs, realtime=True, progress="3 instances")
    three = summarize(outs, tbt_slo=1.0)
    assert one.num_finished == three.num_finished == len(specs) and three.meets_capacity
    assert three.e2e_latency.p50 < one.e2e_latency.p50
    assert three.duration_s > 2.0  # simulated seconds, the idle gap included

    # Sarathi-Serve's capacity, here with a 50 ms P50 scheduling-delay limit (2 s in the paper)
    rng = np.random.default_rng(6)
    base = [
        RequestSpec(0.0, int(rng.integers(4, 24)), prompt_len=int(rng.integers(4, 24)))
        for _ in range(60)
    ]

    def capacity(n):
        def run_at_qps(qps):
            cluster = _cluster(n, "least_outstanding", num_pages=64)
            outs = replay(cluster, with_poisson_arrivals(base, qps))
            return summarize(outs, tbt_slo=0.1, max_scheduling_delay=0.05)

        result = capacity_search(run_at_qps, 0.1, hi=8.0, max_iters=8, max_scheduling_delay=0.05)
        return result.capacity_qps

    c1, c3 = capacity(1), capacity(3)
    assert 0 < 2 * c1 < c3, (c1, c3)  # 9.5 and 38.6 requests/s
    assert 0 < c1 < c3, (c1, c3)


# ---- bad input -------------------------------------------------------------------------------


def test_bad_input_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"unknown router 'fastest'.*least_outstanding"):
        make_router("fastest")
    with pytest.raises(ValueError, match="unknown router"):
        SimCluster([_engine()], "fastest")
    with pytest.raises(ValueError, match="at least one engine"):
        SimCluster([], "round_robin")
    real = types.SimpleNamespace(config=EngineConfig(model=TINY))  # device='jax'
    with pytest.raises(ValueError, match=r"device='jax'.*simulated engines only"):
        SimCluster([_engine(), real])
    other = LLMEngine(
        EngineConfig(model=TINY.replace(vocab_size=300), device="sim", sim=SimConfig(COST)),
        params=None,
        num_pages=8,
    )
    with pytest.raises(ValueError, match="vocab_size"):
        SimCluster([_engine(), other])
    e = _engine()
    with pytest.raises(ValueError, match="its own"):
        SimCluster([e, e])
    busy = _engine()
    busy.add_request([3, 4])
    with pytest.raises(ValueError, match="unfinished"):
        SimCluster([busy])
    with pytest.raises(ValueError, match="route"):
        SimCluster([_engine()], router=object())

    class Bad:
        name = "bad"

        def route(self, request, instances, now):
            return len(instances)

    cluster = SimCluster([_engine()], Bad())
    cluster.add_request([3, 4, 5])
    with pytest.raises(ValueError, match=r"returned 1 .*\[0, 1\)"):
        cluster.step()
    cluster = _cluster(2)
    rid = cluster.add_request([3, 4, 5], request_id="x")
    with pytest.raises(ValueError, match="already"):
        cluster.add_request([3], request_id="x")
    assert cluster.instance_of(rid) is None and cluster.abort_request("x")
    assert not cluster.abort_request("x") and not cluster.has_unfinished_requests()
    with pytest.raises(KeyError):
        cluster.instance_of("never")


def test_cached_prefix_tokens_peeks_without_touching_the_lru():
    cluster = _cluster(2, "round_robin")
    prompt = list(range(3, 23))  # 20 tokens: 4 whole pages of the first 19
    cluster.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while cluster.has_unfinished_requests():
        cluster.step()
    cache = cluster.instances[0].block_manager.prefix_cache
    before = [(n.node_id, n.last_access) for n in cache.nodes()]
    v0, v1 = cluster.views()
    assert v0.cached_prefix_tokens(prompt) == 16 and v1.cached_prefix_tokens(prompt) == 0
    assert v0.cached_prefix_tokens([*prompt[:9], 1, 2, 3]) == 8
    assert [(n.node_id, n.last_access) for n in cache.nodes()] == before
    assert v0.num_available_pages == v0._engine.block_manager.num_usable_pages
    # as of the routing at 0 the request was still running (it finished at the clock's 43 ms)
    assert v0.now == 0.0 and v0.num_outstanding == v0.num_running == 1 and v0.num_waiting == 0
    later = cluster.views(cluster.instances[0].clock.now())[0]
    assert later.num_outstanding == later.num_running == 0 and v1.num_outstanding == 0


def test_a_cluster_imports_no_jax():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from configs.tiny import TINY\n"
        "from llmjax.config import EngineConfig\n"
        "from llmjax.engine.engine import LLMEngine\n"
        "from llmjax.sim import LinearCostModel, SimConfig\n"
        "from llmjax.sim.cluster import SimCluster\n"
        "cost = LinearCostModel((1e-3, 0, 0, 0, 0))\n"
        "config = EngineConfig(model=TINY, device='sim', sim=SimConfig(cost))\n"
        "c = SimCluster([LLMEngine(config, None, 32) for _ in range(2)], 'least_outstanding')\n"
        "c.add_request([3, 4]); c.add_request([5, 6])\n"
        "while c.has_unfinished_requests(): c.step()\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]\n"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)

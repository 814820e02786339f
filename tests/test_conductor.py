"""Mooncake's Conductor (llmjax/cluster/conductor.py): Algorithm 1 on fake instances, its two
early-rejection modes, an oracle check of predicted rejection on a simulated run, a hypothesis
property test of the SimCluster under it, and a real tiny-model Cluster (prefix fetch through
the KV transport, rejection, greedy outputs equal to one engine's)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs import PRESETS
from llmjax.bench.metrics import summarize
from llmjax.bench.replay import replay
from llmjax.bench.workloads import RequestSpec
from llmjax.cluster import (
    ROUTERS,
    Conductor,
    MeasuredCostModel,
    RouteRequest,
    SimCostModel,
    make_router,
)
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimCluster, SimConfig

# prefill: 1 ms a token; decode step: 10 ms + 1 ms a sequence; transfer: 0.1 ms a token
COST = MeasuredCostModel(
    prefill_s_per_token=1e-3, decode_step_s=0.01, decode_s_per_seq=1e-3, transfer_s_per_token=1e-4
)


@dataclasses.dataclass
class Fake:
    """An instance as the Conductor reads it (`ConductorLoad`)."""

    index: int
    cached: int = 0
    queued: list = dataclasses.field(default_factory=list)  # (id, tokens, computed)
    decoding: list = dataclasses.field(default_factory=list)  # (id, context, output tokens)
    kv_capacity_tokens: int = 10**9
    num_outstanding: int = 0

    @property
    def instance_id(self) -> int:
        return self.index

    def cached_prefix_tokens(self, prompt) -> int:
        return min(self.cached, len(prompt) - 1)

    def queued_prefills(self):
        return self.queued

    def decode_requests(self):
        return self.decoding


def _request(n=1000, rid="r"):
    return RouteRequest(rid, tuple(range(n)), 0.0, SamplingParams(max_tokens=8))


def _queue(seconds: float) -> list:
    """Queued prefills that take `seconds` under COST."""
    return [("q", int(seconds * 1000), 0)]


def _schedule(conductor, prefill, decode=None, n=1000, rid="r"):
    return conductor.schedule(_request(n, rid), prefill, decode or [Fake(0)], 0.0)


def test_registered_and_a_plain_router_over_colocated_instances():
    assert ROUTERS["mooncake"] is Conductor and make_router("mooncake").name == "mooncake"
    c = Conductor(COST)
    # the plain Router: Algorithm 1's TTFT choice (cached 900 tokens beats an idle empty one)
    assert c.route(_request(), [Fake(0), Fake(1, cached=900)], 0.0) == 1


def test_the_cache_rich_busy_instance_against_the_idle_empty_one():
    no_fetch = Conductor(COST, kvcache_balancing_threshold=float("inf"))
    rich_busy = Fake(0, cached=900, queued=_queue(2.0))  # TTFT 2.0 + 0.1
    idle = Fake(1)  # TTFT 1.0 (all 1000 tokens)
    d = _schedule(no_fetch, [rich_busy, idle])
    assert (d.prefill, d.fetch_from) == (1, None)
    assert d.ttft == pytest.approx(1.0)
    rich_busy.queued = _queue(0.5)  # now 0.5 + 0.1 < 1.0
    d = _schedule(no_fetch, [rich_busy, idle], rid="s")
    assert d.prefill == 0 and d.ttft == pytest.approx(0.6)
    # fetching allowed: the idle one takes the 900 tokens over the network (0.09 s) instead
    rich_busy.queued = _queue(2.0)
    d = _schedule(Conductor(COST), [rich_busy, idle], rid="t")
    assert (d.prefill, d.fetch_from, d.fetch_tokens, d.local_tokens) == (1, 0, 900, 0)
    assert d.ttft == pytest.approx(0.09 + 0.1) and d.transfer_s == pytest.approx(0.09)


def test_the_threshold_switches_the_transfer_on_and_off():
    # local 400 on 0 (idle), 800 on 1 (1 s of queue): best / local = 2
    views = [Fake(0, cached=400), Fake(1, cached=800, queued=_queue(1.0))]
    d = _schedule(Conductor(COST, kvcache_balancing_threshold=1.5), views)
    assert (d.prefill, d.fetch_from, d.fetch_tokens) == (0, 1, 800)
    assert d.ttft == pytest.approx(0.04 + 0.2)  # transfer 400 tokens, prefill the last 200
    d = _schedule(Conductor(COST, kvcache_balancing_threshold=2.5), views, rid="s")
    assert (d.prefill, d.fetch_from) == (0, None)
    assert d.ttft == pytest.approx(0.6)  # recompute 600 locally: still beats 1 s of queue
    # the best instance itself never fetches, whatever the threshold
    d = _schedule(Conductor(COST, kvcache_balancing_threshold=0.0), views[::-1], rid="u")
    assert d.fetch_from in (None, 0) and (d.prefill == 1) == (d.fetch_from is not None)


def test_local_zero_and_nothing_cached_anywhere():
    conductor = Conductor(COST, kvcache_balancing_threshold=1e9)
    views = [Fake(0), Fake(1, cached=500, queued=_queue(3.0))]
    d = _schedule(conductor, views)  # best / 0 is infinite: any threshold fetches
    assert (d.prefill, d.fetch_from, d.fetch_tokens) == (0, 1, 500)
    d = _schedule(conductor, [Fake(0), Fake(1)], rid="s")  # 0 / 0: no fetch, no error
    assert (d.prefill, d.fetch_from, d.ttft) == (0, None, pytest.approx(1.0))


def test_queued_requests_cost_what_the_conductor_expected_of_them():
    c = Conductor(COST, kvcache_balancing_threshold=float("inf"))
    p = Fake(0, cached=900)
    d = _schedule(c, [p], rid="a")
    assert d.ttft == pytest.approx(0.1)
    p.queued = [("a", 1000, 0)]  # queued, not admitted yet: it will reuse its 900 cached tokens
    assert _schedule(c, [p], rid="b").ttft == pytest.approx(0.1 + 0.1)
    c.finished("a")
    assert _schedule(c, [p], rid="c").ttft == pytest.approx(1.0 + 0.1)  # forgotten: all 1000


def test_rejection_on_the_ttft_slo_in_each_mode():
    for mode, rejected in (("none", False), ("current", True), ("predicted", True)):
        c = Conductor(COST, ttft_slo=0.5, tbt_slo=1.0, rejection=mode)
        d = _schedule(c, [Fake(0)])  # 1000 tokens: 1.0 s
        assert (d.rejected is not None) == rejected, mode
        if rejected:
            assert "TTFT 1.000 s > ttft_slo 0.5 s (by 0.500 s)" in d.rejected
        assert _schedule(c, [Fake(0)], n=400, rid="s").rejected is None  # 0.4 s


def test_current_rejects_on_a_load_about_to_leave_and_predicted_does_not():
    # 100 requests decode now, all past the uniform length (8 tokens): they finish before the
    # new one starts decoding (after its 1 s prefill). Current TBT 10 + 101 ms > 100 ms.
    busy = Fake(0, decoding=[(f"x{k}", 100, 50) for k in range(100)])
    for mode, rejected in (("current", True), ("predicted", False)):
        c = Conductor(COST, tbt_slo=0.1, rejection=mode, expected_output_tokens=8)
        d = _schedule(c, [Fake(0)], [busy])
        assert (d.rejected is not None) == rejected, (mode, d)
        if rejected:
            assert "predicted TBT 111.0 ms (current decode load) > tbt_slo 100 ms" in d.rejected
    # but a load that stays: predicted rejects too (output 0 of 1000)
    staying = Fake(0, decoding=[(f"x{k}", 100, 0) for k in range(100)])
    c = Conductor(COST, tbt_slo=0.1, rejection="predicted", expected_output_tokens=1000)
    assert "(predicted decode load)" in _schedule(c, [Fake(0)], [staying]).rejected


def test_predicted_counts_the_requests_pinned_to_a_decode_instance():
    """A burst routed before any of it decodes: 'current' sees an empty decode instance each
    time; 'predicted' counts those pinned there and rejects once they would overload it."""
    for mode in ("current", "predicted"):
        c = Conductor(COST, tbt_slo=0.05, rejection=mode, expected_output_tokens=10_000)
        decisions = [_schedule(c, [Fake(0)], [Fake(0)], n=10, rid=str(k)) for k in range(60)]
        rejected = [d.rejected is not None for d in decisions]
        if mode == "current":
            assert not any(rejected)
        else:  # 10 + 1 ms x batch > 50 ms from the 40th on (39 pinned before it)
            assert rejected.index(True) == 40 and all(rejected[40:])


def test_the_decode_instance_with_the_least_predicted_tbt_and_room_wins():
    c = Conductor(COST, expected_output_tokens=100)
    busy = Fake(0, decoding=[("x", 100, 0)] * 5)
    assert _schedule(c, [Fake(0)], [busy, Fake(1)]).decode == 1
    # the pins spread a burst over the decode instances
    picks = [_schedule(c, [Fake(0)], [Fake(0), Fake(1)], n=10, rid=str(k)).decode for k in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1]
    small = Fake(1, kv_capacity_tokens=500)  # idle but too small for 1000 + 100 tokens
    assert _schedule(c, [Fake(0)], [busy, small], rid="big").decode == 0


def test_measured_cost_model_from_engine_stats():
    from llmjax.engine.stats import EngineStats

    prefill = EngineStats(num_pages=8, num_prefill_tokens=2000, device_time_s=4.0)
    decode = EngineStats(num_pages=8, num_steps=50, device_time_s=1.5)
    m = MeasuredCostModel.from_stats(prefill, decode, transfer_s_per_token=0.0)
    assert m.prefill_seconds(1000, 200) == pytest.approx(800 * 2e-3)
    assert m.decode_step_seconds(7, 999) == pytest.approx(0.03)
    assert m.transfer_seconds(100) == 0.0 and m.prefill_seconds(10, 10) > 0  # >= 1 token


def test_sim_cost_model_follows_the_simulator():
    from llmjax.sim.cost import StepFeatures

    config = _engine("prefill").config
    m = SimCostModel(config)
    assert m.prefill_seconds(100, 0) == pytest.approx(4 * 0.01 + 100 * 0.001)  # chunks of 32
    assert m.prefill_seconds(100, 64) == pytest.approx(2 * 0.01 + 36 * 0.001)
    assert m.prefill_seconds(100, 100) == pytest.approx(0.011)  # the last token is computed
    f = StepFeatures(tokens=5, prefill_attention=0, decodes=5, decode_context=50, seqs=5)
    assert m.decode_step_seconds(5, 50) == pytest.approx(STEP.step_seconds(f))
    hw = config.sim.hardware
    assert m.transfer_seconds(0) == 0.0
    assert m.transfer_seconds(64) > hw.network_latency_s
    # the hybrid KV layout (tiny Gemma 3): its expected transfer is what the simulator moves
    from configs.tiny import TINY_GEMMA3
    from llmjax.sim.transfers import kv_bytes_per_device

    gemma = config.replace(model=TINY_GEMMA3)
    assert gemma.kv_groups.hybrid
    g = SimCostModel(gemma)
    for n in (16, 64, 100):
        want = hw.network_latency_s + kv_bytes_per_device(gemma, n) / hw.network_bandwidth
        assert g.transfer_seconds(n) == pytest.approx(want)
    assert g.transfer_seconds(100) < SimCostModel(
        gemma.replace(cache=dataclasses.replace(gemma.cache, hybrid_kv_cache="off"))
    ).transfer_seconds(100)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rejection='later'"):
        Conductor(rejection="later")
    with pytest.raises(ValueError, match="ttft_slo=0"):
        Conductor(ttft_slo=0)
    with pytest.raises(ValueError, match="needs prefill and decode"):
        Conductor(COST).schedule(_request(), [Fake(0)], [], 0.0)


# ---- on the simulator ----------------------------------------------------------------------------

TINY = PRESETS["tiny"]
STEP = LinearCostModel((0.01, 0.001, 0.0, 0.002, 0.0))  # 10 ms + 1 ms a token + 2 ms a decode
PAGE_SIZE = 4


def _engine(role, num_pages=64, max_num_seqs=4):
    config = EngineConfig(
        model=TINY,
        device="sim",
        sim=SimConfig(cost_model=STEP),
        cache=CacheConfig(page_size=PAGE_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
        max_model_len=128,
    )
    return LLMEngine(config, params=None, num_pages=num_pages, role=role)


def _cluster(conductor, num_prefill=2, num_decode=2, num_pages=64, max_num_seqs=4):
    engines = [_engine("prefill", num_pages, max_num_seqs) for _ in range(num_prefill)]
    engines += [_engine("decode", num_pages, max_num_seqs) for _ in range(num_decode)]
    return SimCluster(engines, conductor)


def _workload(seed=0, n=60, qps=30.0, max_output=20, num_prefixes=3):
    rng = np.random.default_rng(seed)
    shared = [rng.integers(3, 250, 24).tolist() for _ in range(num_prefixes)]
    t = np.cumsum(rng.exponential(1 / qps, n))
    return [
        RequestSpec(
            arrival_time=float(t[i]),
            output_len=int(rng.integers(1, max_output)),
            prompt_token_ids=shared[i % num_prefixes]
            + rng.integers(3, 250, int(rng.integers(2, 20))).tolist(),
        )
        for i in range(n)
    ]


def _record_decisions(conductor) -> list:
    decisions, schedule = [], conductor.schedule

    def recorded(*args):
        decisions.append(schedule(*args))
        return decisions[-1]

    conductor.schedule = recorded
    return decisions


def test_sim_cluster_places_pins_fetches_and_rejects():
    specs = _workload()
    reference = replay(SimCluster([_engine("colocated", 512)], "round_robin"), specs)
    for mode in ("none", "current", "predicted"):
        conductor = Conductor(ttft_slo=0.3, tbt_slo=0.02, rejection=mode)
        cluster = _cluster(conductor)
        assert conductor.cost_model is not None  # the simulator's own (SimCostModel)
        decisions = _record_decisions(conductor)
        outs = replay(cluster, specs)
        st_ = cluster.conductor_stats
        rejected = [o for o in outs if o.finish_reason == "rejected"]
        assert len(rejected) == st_.num_rejected == sum(d.rejected is not None for d in decisions)
        assert (st_.num_rejected > 0) == (mode != "none")
        assert all(o.token_ids == [] and "predicted" in o.error for o in rejected)
        assert summarize(outs).num_errors == len(rejected)  # rejected: not served
        for o, ref, d in zip(outs, reference, decisions, strict=True):
            if o.finish_reason == "rejected":
                assert cluster.path_of(o.request_id) == ()
                continue
            assert o.error is None and o.token_ids == ref.token_ids
            if len(o.token_ids) > 1:  # it decoded where the Conductor pinned it
                assert cluster.path_of(o.request_id) == (d.prefill, 2 + d.decode)
        assert st_.num_fetches > 0 and st_.fetched_tokens > 0
        for e in cluster.instances:
            e.block_manager.check_invariants()
            assert e.block_manager.num_used_pages == 0
        assert not conductor._pins and not conductor._cached  # every request reported back


def test_a_fetched_prefix_delays_the_prefill_and_replicates():
    """Instance 0 caches a prefix and gets busy; a request sharing the prefix goes to instance
    1 with a fetch: it joins there after the modeled transfer, and the prefix is cached on both
    instances afterwards."""
    prefix = list(range(3, 3 + 48))
    conductor = Conductor(MeasuredCostModel(prefill_s_per_token=1e-3, transfer_s_per_token=0))
    cluster = _cluster(conductor, num_pages=128)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    cluster.add_request([*prefix, 7], one, request_id="warm", arrival_time=0.0)
    while cluster.has_unfinished_requests():
        cluster.step()
    cluster.add_request(list(range(100, 132)), one, request_id="busy", arrival_time=1.0)
    cluster.add_request([*prefix, 9, 9], one, request_id="hit", arrival_time=1.0)
    seen = set()
    while cluster.has_unfinished_requests():
        seen.add(cluster.state_of("hit"))
        cluster.step()
    assert cluster.path_of("busy")[0] == 0 and cluster.path_of("hit")[0] == 1
    assert "fetching" in seen and cluster.conductor_stats.num_fetches == 1
    seconds, _ = cluster.kv_transfer_seconds(0, 1, 48)
    assert cluster.conductor_stats.fetch_seconds == pytest.approx(seconds)
    p1 = cluster.instances[1]
    assert p1.stats.num_cached_prefill_tokens == 48  # it prefilled only the 2 new tokens
    for e in cluster.instances[:2]:
        assert e.block_manager.peek_prefix(prefix).num_tokens == 48


def test_oracle_predicted_rejection_rarely_rejects_what_would_be_served():
    """The oracle: the same run with no rejection, where every request runs its true output
    length. A request predicted-mode rejects that the oracle served with TTFT and TPOT both
    within MARGIN x their SLOs is a false rejection: none allowed. The share of rejected
    requests that the oracle served within the SLOs at all is measured (printed) and bounded."""
    MARGIN = 0.5
    ttft_slo, tbt_slo = 0.4, 0.06
    specs = _workload(seed=3, n=150, qps=60.0, max_output=30)  # the oracle attains ~40 %
    oracle = replay(_cluster(Conductor(), max_num_seqs=16), specs)
    conductor = Conductor(ttft_slo=ttft_slo, tbt_slo=tbt_slo, rejection="predicted")
    outs = replay(_cluster(conductor, max_num_seqs=16), specs)
    rejected = [k for k, o in enumerate(outs) if o.finish_reason == "rejected"]
    assert rejected, "the load should be high enough to reject"

    def served_within(o, f):
        m = o.metrics
        return o.error is None and m.ttft <= f * ttft_slo and m.tpot <= f * tbt_slo

    false_margin = [k for k in rejected if served_within(oracle[k], MARGIN)]
    false_any = [k for k in rejected if served_within(oracle[k], 1.0)]
    rate = len(false_any) / len(rejected)
    print(f"rejected {len(rejected)}/{len(specs)}; oracle served within SLOs {len(false_any)} "
          f"({rate:.0%}), within {MARGIN:g} x SLOs {len(false_margin)}")  # fmt: skip
    assert not false_margin
    assert rate <= 0.25


_arrival = st.tuples(
    st.floats(0.0, 0.05),  # gap to the previous arrival, s
    st.integers(0, 2),  # which shared prefix (2: none)
    st.integers(1, 16),  # own prompt tokens
    st.integers(1, 12),  # output tokens
    st.one_of(st.none(), st.integers(0, 15)),  # abort this many cluster steps after adding
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    roles=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    num_pages=st.integers(16, 40),
    mode=st.sampled_from(["none", "current", "predicted"]),
    slos=st.sampled_from([(0.05, 0.015), (0.1, 0.02), (1.0, 1.0)]),
    threshold=st.sampled_from([0.0, 1.0, 2.0]),
    arrivals=st.lists(_arrival, min_size=2, max_size=25),
)
def test_sim_cluster_invariants_under_the_conductor(
    roles, num_pages, mode, slos, threshold, arrivals
):
    """Random arrivals (shared prefixes, so fetches happen) and aborts: after every step every
    block manager's invariants hold; at the end each request finished, was rejected or aborted
    exactly once, no page is held, the Conductor forgot everyone, and each finished request's
    tokens equal a single engine's (the simulator's tokens depend on the tokens only)."""
    conductor = Conductor(
        ttft_slo=slos[0], tbt_slo=slos[1], rejection=mode, kvcache_balancing_threshold=threshold
    )
    cluster = _cluster(conductor, roles[0], roles[1], num_pages=num_pages)
    prefixes = [list(range(3, 19)), list(range(40, 52))]
    t, i, num_steps = 0.0, 0, 0
    added, abort_at, ended = {}, {}, {}
    while i < len(arrivals) or cluster.has_unfinished_requests():
        now = cluster.clock.now()
        while i < len(arrivals) and t + arrivals[i][0] <= now:
            gap, which, own, out_len, abort_after = arrivals[i]
            t += gap
            prompt = (prefixes[which] if which < 2 else []) + [200 + i] * own
            rid = cluster.add_request(
                prompt, SamplingParams(max_tokens=out_len, ignore_eos=True), arrival_time=t
            )
            added[rid] = (prompt, out_len)
            if abort_after is not None:
                abort_at[rid] = num_steps + abort_after
            i += 1
        if i < len(arrivals) and not cluster.has_unfinished_requests():
            cluster.clock.advance_to(t + arrivals[i][0])
        for rid in [r for r, k in abort_at.items() if k <= num_steps]:
            del abort_at[rid]
            if cluster.abort_request(rid):
                assert rid not in ended
                ended[rid] = "abort"
        for out in cluster.step():
            if out.finished:
                assert out.request_id not in ended
                ended[out.request_id] = out
        num_steps += 1
        for e in cluster.instances:
            e.block_manager.check_invariants()
    assert set(ended) == set(added)
    for e in cluster.instances:
        assert e.block_manager.num_used_pages == 0 and not e.has_unfinished_requests()
    assert not conductor._pins and not conductor._cached
    done = {r: o for r, o in ended.items() if o != "abort" and o.finish_reason != "rejected"}
    event(f"rejected: {cluster.conductor_stats.num_rejected > 0}")
    event(f"fetches {cluster.conductor_stats.num_fetches > 0}")
    if done:
        ids = sorted(done)
        ref = SimCluster([_engine("colocated", 512)], "round_robin")
        for r in ids:
            prompt, out_len = added[r]
            ref.add_request(
                prompt, SamplingParams(max_tokens=out_len, ignore_eos=True), r, None, 0.0
            )
        want = {}
        while ref.has_unfinished_requests():
            want |= {o.request_id: o.token_ids for o in ref.step() if o.finished}
        assert all(done[r].token_ids == want[r] for r in ids)
        assert all(len(done[r].token_ids) == added[r][1] for r in ids)


# ---- the real engine -----------------------------------------------------------------------------


def test_real_cluster_fetches_rejects_and_matches_one_engine():
    """Tiny model, two prefill instances and one decode instance (tp 1 each, local transport):
    a request sharing a prefix with a busy instance's cache goes to the idle one with a real KV
    fetch (pages gathered, moved, scattered and inserted into its radix tree) and reuses it; a
    request whose predicted TTFT misses the SLO is rejected; every other greedy output equals a
    single engine's."""
    import jax

    from llmjax import LLM
    from llmjax.cluster import Cluster, InstanceSpec, LocalInstance
    from llmjax.cluster.launch import split_devices
    from llmjax.cluster.transfer import LocalTransport
    from tests.parallel_cases import ENGINE_OPTS

    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 256, 32).tolist()
    warm = prefix + rng.integers(3, 256, 5).tolist()
    busy = rng.integers(3, 256, 40).tolist()
    hit = prefix + rng.integers(3, 256, 9).tolist()
    long = rng.integers(3, 256, 100).tolist()
    single = LLM("tiny", **ENGINE_OPTS)
    want = [o.token_ids for o in single.generate([warm, busy, hit], greedy)]

    specs = [InstanceSpec("prefill"), InstanceSpec("prefill"), InstanceSpec("decode")]
    transport = LocalTransport()
    instances = []
    for spec, devs in zip(specs, split_devices(jax.devices(), specs), strict=True):
        llm = LLM("tiny", role=spec.role, devices=devs, **ENGINE_OPTS)
        instances.append(LocalInstance(llm.engine, transport, spec.role))
    conductor = Conductor(
        MeasuredCostModel(prefill_s_per_token=0.01, transfer_s_per_token=1e-4),
        ttft_slo=0.9,
        rejection="predicted",
    )
    cluster = Cluster(instances, conductor)
    got = {}
    (out,) = cluster.generate([warm], greedy)  # cached on prefill instance 0 afterwards
    got["warm"] = out.token_ids
    ids = {
        "busy": cluster.add_request(busy, greedy),  # 0.4 s, to instance 0 (tie: lowest)
        "hit": cluster.add_request(hit, greedy),  # 1: fetch 32 tokens, prefill 9
        "long": cluster.add_request(long, greedy),  # 1 s > 0.9 s anywhere: rejected
    }
    outs = {}
    while cluster.has_unfinished_requests():
        outs |= {o.request_id: o for o in cluster.step() if o.finished}
    by_name = {name: outs[rid] for name, rid in ids.items()}
    assert by_name["long"].finish_reason == "rejected" and by_name["long"].token_ids == []
    assert "predicted TTFT" in by_name["long"].error
    assert [got["warm"], by_name["busy"].token_ids, by_name["hit"].token_ids] == want
    st_ = cluster.conductor_stats
    assert (st_.num_rejected, st_.num_fetches, st_.fetched_tokens) == (1, 1, 32)
    assert st_.num_fetches_recomputed == 0 and st_.fetch_bytes > 0
    assert instances[1].engine.stats.num_cached_prefill_tokens == 32  # the fetched prefix
    assert transport.num_offers == 0
    for inst in instances:
        inst.engine.block_manager.check_invariants()
        assert inst.engine.block_manager.num_used_pages == 0


_TRACES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "mooncake"
)


@pytest.mark.skipif(
    not os.path.exists(os.path.join(_TRACES, "conversation_trace.jsonl")),
    reason="../shared/data/mooncake not present",
)
def test_capacity_script_runs_and_writes_its_json(tmp_path):
    """scripts/mooncake_capacity.py on a dozen requests, one bisection step."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "capacity.json"
    args = ["--max_requests", "12", "--bisections", "1", "--tbt_slos", "0.1"]
    args += ["--routers", "vllm,mooncake+predicted", "--output_json", str(out)]
    run = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "mooncake_capacity.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SIMULATED" in run.stdout and "+59% .. +498%" in run.stdout
    doc = json.loads(out.read_text())
    assert doc["simulated"] and doc["settings"]["num_requests"] == 12
    trial = doc["results"]["mooncake+predicted"]["0.1"]["trials"][0]
    assert trial["rate"] == 3.0 and 0 <= trial["attainment"] <= 1
    assert trial["conductor"]["num_scheduled"] == 12

"""Disaggregated serving on the simulator: prefill and decode instances with DistServe's pull-based
KV migration in `llmjax.sim.SimCluster` (llmjax/sim/cluster.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs import PRESETS
from configs.tiny import TINY_GEMMA3
from llmjax.bench.metrics import summarize
from llmjax.bench.replay import replay
from llmjax.bench.workloads import RequestSpec
from llmjax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimConfig
from llmjax.sim.cluster import SimCluster, pack_nodes
from llmjax.sim.roofline import kv_page_bytes_per_device

TINY = PRESETS["tiny"]

# 10 ms a step + 1 ms a new token + 2 ms a decoding sequence (FEATURES' order)
COST = LinearCostModel((0.01, 0.001, 0.0, 0.002, 0.0))
PAGE_SIZE = 4


def _engine(role="colocated", num_pages=48, max_num_seqs=4, tp=1, model=TINY):
    config = EngineConfig(
        model=model,
        device="sim",
        sim=SimConfig(cost_model=COST),  # hardware a100-80gb: its links for the transfers
        cache=CacheConfig(page_size=PAGE_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
        parallel=ParallelConfig(tp=tp),
        max_model_len=64,
    )
    # the same memory whatever the layout (the hybrid one's pages hold num_slots layers)
    num_pages = num_pages * model.num_layers // config.kv_groups.num_slots
    return LLMEngine(config, params=None, num_pages=num_pages, role=role)


def _disagg(num_prefill=1, num_decode=2, prefill_pages=48, decode_pages=48, model=TINY, **kw):
    engines = [_engine("prefill", prefill_pages, model=model) for _ in range(num_prefill)]
    engines += [_engine("decode", decode_pages, model=model) for _ in range(num_decode)]
    return SimCluster(engines, "round_robin", **kw)


def _workload(seed=0, n=40, qps=40.0, max_output=20):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / qps, n))
    return [
        RequestSpec(
            arrival_time=float(t[i]),
            output_len=int(rng.integers(1, max_output)),
            prompt_token_ids=rng.integers(3, 250, int(rng.integers(3, 30))).tolist(),
        )
        for i in range(n)
    ]


def _assert_no_pages_held(cluster):
    for i, e in enumerate(cluster.instances):
        e.block_manager.check_invariants()
        assert e.block_manager.num_used_pages == 0, (i, e.role)
        assert not e.parked and not e._receiving and not e.has_unfinished_requests()
    assert not cluster.has_unfinished_requests()


def _record_steps(cluster):
    """Per scheduled step: (instance, start time, end time, ids scheduled)."""
    steps = []
    for i, engine in enumerate(cluster.instances):

        def step(i=i, engine=engine, inner=engine.step):
            t = engine.clock.now()
            sched = engine.scheduler
            present = [r.request_id for r in (*sched.waiting, *sched.running)]
            outs = inner()
            if engine.clock.now() > t:
                steps.append((i, t, engine.clock.now(), present, outs))
            return outs

        engine.step = step
    return steps


def _record_transfers(cluster):
    """Every finished transfer: (request id, source, dest, start, end)."""
    log = []
    inner = cluster._finish_transfer

    def finish(move):
        log.append((move.request_id, move.source, move.dest, move.start, move.end))
        return inner(move)

    cluster._finish_transfer = finish
    return log


@pytest.mark.parametrize("model", [TINY, TINY_GEMMA3], ids=["tiny", "gemma3-hybrid-kv"])
def test_every_request_finishes_with_the_colocated_tokens_and_no_page_is_left(model):
    """(Tiny Gemma 3: the hybrid KV layout on both sides, its windows moved.)"""
    specs = _workload()
    colocated = replay(SimCluster([_engine(model=model), _engine(model=model)]), specs)
    cluster = _disagg(model=model)
    assert cluster.instances[0].block_manager.num_groups == (5 if model is TINY_GEMMA3 else 1)
    steps = _record_steps(cluster)
    outs = replay(cluster, specs)
    assert [len(o.token_ids) for o in outs] == [s.output_len for s in specs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
    assert all(o.finished and o.error is None for o in outs)
    _assert_no_pages_held(cluster)
    # the first token comes from the prefill instance, the others from a decode instance
    prefill, *decode = cluster.stats
    assert prefill.num_decode_tokens == 0 and prefill.num_prefill_tokens > 0
    assert all(s.num_prefill_tokens == 0 and s.num_preemptions == 0 for s in decode)
    assert sum(s.num_decode_tokens for s in decode) == sum(s.output_len - 1 for s in specs)
    ends = {i: {end for k, _, end, _, _ in steps if k == i} for i in range(3)}
    moved = 0
    for o, s in zip(outs, specs, strict=True):
        path = cluster.path_of(o.request_id)
        assert o.metrics.first_token_time in ends[0]
        if s.output_len == 1:  # done at its first token: never parks, never moves
            assert path == (0,)
            continue
        moved += 1
        assert path[0] == 0 and path[1] in (1, 2) and len(path) == 2
        assert all(t in ends[path[1]] for t in o.metrics.token_times[1:])
    assert cluster.transfer_stats.num_transfers == moved
    assert {cluster.path_of(o.request_id)[-1] for o in outs} == {0, 1, 2}
    summary = summarize(outs, slo_ttft=1.0, slo_tpot=1.0)
    assert summary.num_finished == len(specs) and summary.slo_attainment > 0


def test_the_transfer_lies_between_the_first_token_and_the_second():
    specs = _workload(seed=1, n=12, qps=10.0)
    bandwidth = 2e5  # bytes/s: a 16-token prompt's KV (4 pages x 2 KiB) takes ~40 ms
    cluster = _disagg(num_decode=1, transfer_bandwidth=bandwidth, transfer_latency_s=0.003)
    transfers = _record_transfers(cluster)
    outs = replay(cluster, specs)
    by_id = {rid: (start, end) for rid, _, _, start, end in transfers}
    page = kv_page_bytes_per_device(TINY, PAGE_SIZE, "float32", 1, 1)
    assert page == 2048  # K and V x 2 layers x 4 tokens x 2 kv heads x 16 dims x 4 bytes
    for o in outs:
        if len(o.token_ids) < 2:
            continue
        start, end = by_id[o.request_id]
        pages = -(-len(o.prompt_token_ids) // PAGE_SIZE)
        assert end - start == pytest.approx(0.003 + pages * page / bandwidth)
        first, second = o.metrics.token_times[:2]
        assert first <= start and end < second  # then at least one decode step
    st_ = cluster.transfer_stats
    assert st_.num_transfers == len(transfers) and st_.bytes == sum(
        -(-len(o.prompt_token_ids) // PAGE_SIZE) * page for o in outs if len(o.token_ids) > 1
    )
    assert st_.as_dict()["bandwidth_gb_s"] < bandwidth / 1e9  # the latency is in the time


def test_nvlink_within_a_node_the_network_across_and_the_layouts():
    hw = _engine().config.sim.hardware
    p2 = _engine("prefill", tp=2)
    engines = [p2, _engine("decode"), _engine("decode")]
    cluster = SimCluster(engines, node_of=[0, 0, 1])
    m = type("M", (), {"num_kv_tokens": 5 * PAGE_SIZE})()
    local, nbytes = cluster.transfer_seconds(0, 1, m)
    remote, _ = cluster.transfer_seconds(0, 2, m)
    full = 5 * kv_page_bytes_per_device(TINY, PAGE_SIZE, "float32", 1, 1)  # the decode side's
    assert nbytes == full
    assert local == pytest.approx(hw.link_latency_s + full / hw.link_bandwidth)
    assert remote == pytest.approx(hw.network_latency_s + full / hw.network_bandwidth)
    fast = SimCluster(
        [_engine("prefill"), _engine("decode")], transfer_bandwidth=1e12, transfer_latency_s=0
    )
    assert fast.transfer_seconds(0, 1, m)[0] == pytest.approx(full / 1e12)
    # the hybrid KV layout (tiny Gemma 3: 5 layers, 4 with a window of W tokens): group 0's 5
    # pages of 1 layer and each windowed group's window, not 5 pages of 5 layers
    gemma = [_engine("prefill", model=TINY_GEMMA3), _engine("decode", model=TINY_GEMMA3)]
    assert gemma[0].block_manager.num_groups == 5
    _, nbytes = SimCluster(gemma).transfer_seconds(0, 1, m)
    layer_page = kv_page_bytes_per_device(TINY_GEMMA3, PAGE_SIZE, "float32", 1, 1) // 5
    n, w = 5 * PAGE_SIZE, TINY_GEMMA3.sliding_window
    window = 5 - max(0, (n - w + 1) // PAGE_SIZE)  # pages from the window's start
    assert 0 < window < 5 and nbytes == (5 + 4 * window) * layer_page

    def sized(tp):
        return type("E", (), {"config": _engine(tp=tp).config})()

    assert pack_nodes([sized(2)] * 4 + [sized(1)]) == [0, 0, 0, 0, 1]
    assert pack_nodes([sized(1), sized(4), sized(4), sized(2)]) == [0, 0, 1, 1]


def test_the_pull_condition_keeps_requests_parked_on_the_prefill_side():
    """A decode instance with room for about one request: the others wait on the prefill
    instance, KV held there (its used pages grow), and move one by one, oldest first."""
    specs = [
        RequestSpec(
            0.001 * k, output_len=12, prompt_token_ids=tuple(range(3 + 20 * k, 19 + 20 * k))
        )
        for k in range(8)
    ]  # 16 + 12 tokens = 7 pages each, no prefix shared
    cluster = _disagg(num_decode=1, decode_pages=9)
    transfers = _record_transfers(cluster)
    reserved = []
    decode = cluster.instances[1]
    inner = decode.reserve_import

    def reserve(m):
        assert decode.can_accept(m)
        reserved.append((m.metrics.first_token_time, m.request_id))
        return inner(m)

    decode.reserve_import = reserve
    max_parked = 0
    max_running = 0
    outs = {}
    i = 0
    while i < len(specs) or cluster.has_unfinished_requests():
        now = cluster.clock.now()
        while i < len(specs) and specs[i].arrival_time <= now:
            sp = SamplingParams(max_tokens=specs[i].output_len, ignore_eos=True)
            cluster.add_request(
                list(specs[i].prompt_token_ids), sp, str(i), None, specs[i].arrival_time
            )
            i += 1
        if not cluster.has_unfinished_requests():
            cluster.clock.advance_to(specs[i].arrival_time)
            continue
        for o in cluster.step():
            if o.finished:
                outs[o.request_id] = o
        max_parked = max(max_parked, len(cluster.instances[0].parked))
        max_running = max(max_running, len(decode.scheduler.running) + len(decode._receiving))
        assert decode.block_manager.num_used_pages <= decode.block_manager.num_usable_pages
    assert len(outs) == len(specs)
    assert max_parked >= 5 and max_running == 1
    assert cluster.stats[0].peak_used_pages >= 5 * 4  # the parked prompts' pages
    assert [t for t, _ in reserved] == sorted(t for t, _ in reserved)  # FIFO
    # each pull waited for the previous request to leave the decode instance
    ends = {o.request_id: o.metrics.finished_time for o in outs.values()}
    order = [rid for _, rid in reserved]
    starts = {rid: start for rid, _, _, start, _ in transfers}
    for a, b in itertools.pairwise(order):
        assert starts[b] >= ends[a]
    _assert_no_pages_held(cluster)


@pytest.mark.parametrize("state", ["queued", "running", "parked", "transfer", "decoding"])
def test_an_abort_in_each_state_leaks_no_page(state):
    specs = _workload(seed=2, n=16, qps=200.0, max_output=12)
    specs = [RequestSpec(s.arrival_time, max(s.output_len, 3), prompt_token_ids=s.prompt_token_ids)
             for s in specs]  # fmt: skip
    cluster = _disagg(num_decode=1, decode_pages=16, transfer_bandwidth=2e4)
    added, outs, aborted = [], {}, []
    i = 0
    while i < len(specs) or cluster.has_unfinished_requests():
        now = cluster.clock.now()
        while i < len(specs) and specs[i].arrival_time <= now:
            sp = SamplingParams(max_tokens=specs[i].output_len, ignore_eos=True)
            ids = list(specs[i].prompt_token_ids)
            added.append(cluster.add_request(ids, sp, arrival_time=specs[i].arrival_time))
            i += 1
        hit = [r for r in added if cluster.state_of(r) == state and r not in aborted]
        if hit and len(aborted) < 2:
            assert cluster.abort_request(hit[0]) and cluster.state_of(hit[0]) == "done"
            assert not cluster.abort_request(hit[0])
            aborted.append(hit[0])
        if cluster.has_unfinished_requests():
            for o in cluster.step():
                if o.finished:
                    assert o.request_id not in aborted
                    outs[o.request_id] = o
        elif i < len(specs):
            cluster.clock.advance_to(specs[i].arrival_time)
    assert len(aborted) == 2, f"never saw a request {state}"
    assert set(outs) | set(aborted) == set(added) and not set(outs) & set(aborted)
    assert all(len(outs[r].token_ids) == specs[int(r)].output_len for r in outs)
    _assert_no_pages_held(cluster)


def test_roles_are_checked_and_an_undecodable_request_fails_with_a_reason():
    with pytest.raises(ValueError, match="decode instance"):
        SimCluster([_engine("prefill")])
    with pytest.raises(ValueError, match="takes arrivals"):
        SimCluster([_engine("decode")])
    with pytest.raises(ValueError, match="waiting_page_fraction"):
        _disagg(waiting_page_fraction=0)
    cluster = _disagg(num_decode=1, decode_pages=6)  # 5 usable pages: 20 tokens
    specs = [
        RequestSpec(0.0, 20, prompt_token_ids=tuple(range(3, 33))),  # 50 tokens: never fits
        RequestSpec(0.01, 4, prompt_token_ids=(3, 4, 5)),
    ]
    bad, good = replay(cluster, specs)
    assert bad.finished and bad.finish_reason == "error" and "decode instance 1" in bad.error
    assert good.error is None and len(good.token_ids) == 4
    assert cluster.state_of(bad.request_id) == "done"
    _assert_no_pages_held(cluster)


def test_an_ideal_prefill_feeds_a_decode_instance_at_the_arrival_times():
    """The placement search's decode phase: a zero-time prefill and instant transfers, so each
    request's first token is at its arrival and its decode starts at once when there is room."""
    zero = LinearCostModel((0.0, 0.0, 0.0, 0.0, 0.0))
    ideal = LLMEngine(
        EngineConfig(model=TINY, device="sim", sim=SimConfig(cost_model=zero),
                     cache=CacheConfig(page_size=PAGE_SIZE), max_model_len=64,
                     scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024)),
        None, 512, role="prefill",
    )  # fmt: skip
    cluster = SimCluster([ideal, _engine("decode")], transfer_bandwidth=math.inf,
                         transfer_latency_s=0.0)  # fmt: skip
    specs = _workload(seed=3, n=10, qps=5.0)
    outs = replay(cluster, specs)
    for o in outs:
        assert o.metrics.first_token_time == o.metrics.arrival_time
    assert cluster.transfer_stats.seconds == 0
    _assert_no_pages_held(cluster)


# ---- the property test -----------------------------------------------------------------------

_request = st.tuples(
    st.floats(0.0, 0.03),  # gap to the previous arrival, s
    st.integers(1, 20),  # prompt tokens
    st.integers(1, 16),  # output tokens
    st.one_of(st.none(), st.integers(0, 12)),  # abort this many cluster steps after adding
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_prefill=st.integers(1, 2),
    num_decode=st.integers(1, 2),
    prefill_pages=st.integers(8, 16),
    decode_pages=st.integers(8, 16),
    bandwidth=st.sampled_from([None, 1e4, 1e5]),
    requests=st.lists(_request, min_size=2, max_size=25),
    model=st.sampled_from([TINY, TINY_GEMMA3]),  # (Gemma 3: the hybrid KV layout)
)
def test_disaggregated_invariants(
    num_prefill, num_decode, prefill_pages, decode_pages, bandwidth, requests, model
):
    """Random arrivals, lengths, aborts, small caches (preemption on the decode side, requests
    parked for lack of room, some too long for a decode cache), slow or fast transfers: after
    every step each clock and the cluster's time are non-decreasing and every open request is
    in exactly one place; every step on an instance sees only arrivals and commits up to its
    start; at the end each request finished or was aborted, once, and no page is held."""
    cluster = _disagg(num_prefill, num_decode, prefill_pages, decode_pages, model=model,
                      transfer_bandwidth=bandwidth)  # fmt: skip
    steps = _record_steps(cluster)
    transfers = _record_transfers(cluster)
    arrivals = np.cumsum([r[0] for r in requests])
    added, abort_at, finished, aborted = {}, {}, {}, set()
    last_now, last_clocks = -math.inf, [e.clock.now() for e in cluster.instances]
    i = num_steps = 0
    states, blocked = set(), False
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
            states.add(cluster.state_of(rid))
            if cluster.abort_request(rid):
                assert rid not in finished
                aborted.add(rid)
        if cluster.has_unfinished_requests():
            blocked |= bool(cluster._blocked)
            for out in cluster.step():
                if out.finished:
                    assert out.request_id not in finished and out.request_id not in aborted
                    finished[out.request_id] = out
            num_steps += 1
        elif i < len(requests):
            cluster.clock.advance_to(arrivals[i])
        clocks = [e.clock.now() for e in cluster.instances]
        assert all(c >= p for c, p in zip(clocks, last_clocks, strict=True))
        now = cluster.clock.now()
        assert now >= last_now
        last_now, last_clocks = now, clocks
        places = []
        for e in cluster.instances:
            ids = [r.request_id for r in (*e.scheduler.waiting, *e.scheduler.running)]
            ids += [r for r in e.parked if r not in cluster._moving]  # moved: counted at dest
            ids += list(e._receiving)
            places.append(ids)
        flat = [r for p in places for r in p]
        assert len(flat) == len(set(flat)), "a request in two places"
        open_ids = set(added) - set(finished) - aborted
        assert set(flat) <= open_ids
        for rid in set(flat):
            assert rid in places[cluster.instance_of(rid)]
    assert set(finished) | aborted == set(added) and not set(finished) & aborted
    for rid, out in finished.items():
        arrival, max_tokens = added[rid]
        assert out.metrics.arrival_time == arrival
        if out.error is None:
            assert len(out.token_ids) == max_tokens
    commits = {rid: end for rid, _, _, _, end in transfers}
    for k, t, _, present, _ in steps:
        for rid in present:
            if cluster.roles[k] == "decode" and rid in commits:
                assert commits[rid] <= t, (k, t, rid)
            assert added[rid][0] <= t
    for rid, src, dst, start, end in transfers:
        assert cluster.roles[src] == "prefill" and cluster.roles[dst] == "decode"
        assert start <= end
        if rid in finished and finished[rid].error is None:
            assert finished[rid].metrics.first_token_time <= start
    _assert_no_pages_held(cluster)
    event(f"blocked: {blocked}")
    event(f"decode preempted: {any(s.num_preemptions for s in cluster.stats[num_prefill:])}")
    event(f"failed: {any(o.error for o in finished.values())}")
    for state in sorted(states):
        event(f"aborted while {state}")


def test_simulate_script_runs_roles_on_one_timeline(tmp_path):
    """scripts/benchmark.py --device sim --instances: a disaggregated SimCluster behind the
    benchmark harness, with its KV transfers reported."""
    import json

    from tests.helpers import run_benchmark_script

    out = tmp_path / "sim.json"
    run_benchmark_script(
        [
            "--device=sim", "--model=llama2-13b", "--instances=2xprefill:tp=2,decode",
            "--num_requests=24", "--qps=2", "--policies=sarathi", "--tbt_slo=0.1",
            "--warmup=0", "--norehearse", f"--json_out={out}",
        ]
    )  # fmt: skip
    v = json.loads(out.read_text())["variants"]["sarathi"]
    assert v["summary"]["num_finished"] == 24
    assert v["transfer_stats"]["num_transfers"] == 24 and v["transfer_stats"]["bytes"] > 0
    assert [d["role"] for d in v["engine"]["instances"]] == ["prefill", "prefill", "decode"]
    prefill, _, decode = v["instance_stats"]
    assert prefill["num_decode_tokens"] == 0 and decode["num_prefill_tokens"] == 0

"""Parrot's global scheduler (llmjax/program/scheduler.py) on hand-made tasks and slots, and the
engine side of Parrot's criteria (SchedulerConfig.latency_token_budget, app-level FIFO) on a
simulated engine. No jax."""

from __future__ import annotations

import dataclasses

import pytest
from program_helpers import sim_engine

from llmjax.config import ProgramConfig
from llmjax.engine.request import ProgramHints
from llmjax.program.scheduler import UNBOUNDED, EngineSlot, GlobalScheduler
from llmjax.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class FakeTask:
    id: str
    depth: int = 1
    criteria: str | None = "throughput"
    prompt_ids: list = dataclasses.field(default_factory=lambda: [5] * 10)
    consumers: frozenset = frozenset()


def _gs(n=2, tasks_capacity=UNBOUNDED, tokens_capacity=1 << 20, cached=None, **cfg):
    slots = [EngineSlot(i, tasks_capacity, tokens_capacity) for i in range(n)]
    return GlobalScheduler(ProgramConfig(**cfg), slots, cached)


def _place(gs, tasks):
    for t in tasks:
        gs.submit(t)
    return [(t.id, i) for t, i in gs.schedule()]


def test_app_fifo_dispatches_the_deepest_first_and_fifo_among_equals():
    tasks = [FakeTask("a", 1), FakeTask("b", 3), FakeTask("c", 2), FakeTask("d", 3)]
    order = [tid for tid, _ in _place(_gs(1, graph_group=False, ctx_group=False), tasks)]
    assert order == ["b", "d", "c", "a"]
    order = [tid for tid, _ in _place(_gs(1, app_fifo=False, graph_group=False), tasks)]
    assert order == ["a", "b", "c", "d"]


def test_graph_group_admits_a_map_stage_together_on_one_engine():
    maps = [
        FakeTask(f"m{i}", criteria="latency", consumers=frozenset({"reduce"})) for i in range(8)
    ]
    # Grouped: 8 LATENCY tasks count as one task against the cap of 4, all on one engine.
    placed = _place(_gs(2), maps)
    assert len(placed) == 8 and len({i for _, i in placed}) == 1
    # Ungrouped: the cap of 4 LATENCY tasks per engine spreads them, and 0 are left over.
    gs = _gs(2, graph_group=False, ctx_group=False)
    placed = _place(gs, maps)
    counts = [sum(i == k for _, i in placed) for k in range(2)]
    assert counts == [4, 4] and len(gs.queue) == 0
    # A third engine-load of them waits for a slot to free.
    gs = _gs(1, graph_group=False, ctx_group=False)
    assert len(_place(gs, maps)) == 4 and len(gs.queue) == 4
    gs.finish("m0", 0)
    assert [t.id for t, _ in gs.schedule()] == ["m4"]


def test_latency_caps_bound_an_engine_either_way():
    # A LATENCY task waits while an engine holds 4 or more tasks...
    gs = _gs(1, graph_group=False, ctx_group=False)
    _place(gs, [FakeTask(f"t{i}") for i in range(4)])
    assert _place(gs, [FakeTask("chat", criteria="latency")]) == []
    gs.finish("t0", 0)
    assert [t.id for t, _ in gs.schedule()] == ["chat"]
    # ...and an engine holding a LATENCY task takes at most 3 more of any kind.
    gs = _gs(1, graph_group=False, ctx_group=False)
    _place(gs, [FakeTask("chat", criteria="latency")])
    assert len(_place(gs, [FakeTask(f"t{i}") for i in range(6)])) == 3
    # The token cap (off by default, as in Parrot's code): a LATENCY task joins no engine
    # holding more than 4096 prompt tokens.
    gs = _gs(1, graph_group=False, ctx_group=False)
    _place(gs, [FakeTask("big", prompt_ids=[1] * 5000)])
    assert _place(gs, [FakeTask("chat", criteria="latency")]) == [("chat", 0)]
    gs = _gs(1, graph_group=False, ctx_group=False, latency_tokens_num_upperbound=4096)
    _place(gs, [FakeTask("big", prompt_ids=[1] * 5000)])
    assert _place(gs, [FakeTask("chat", criteria="latency")]) == []
    # An empty engine takes any single task, whatever its size.
    gs = _gs(1, tokens_capacity=100)
    assert _place(gs, [FakeTask("huge", prompt_ids=[1] * 1000)]) == [("huge", 0)]


def test_a_group_no_engine_takes_whole_is_split():
    gs = _gs(2, tasks_capacity=3)
    maps = [FakeTask(f"m{i}", consumers=frozenset({"r"})) for i in range(5)]
    placed = _place(gs, maps)
    assert len(placed) == 5
    assert sorted(sum(i == k for _, i in placed) for k in range(2)) == [2, 3]


def test_ctx_aware_prefers_the_engine_holding_the_prefix():
    system = list(range(3, 203))  # a 200-token shared prefix
    cached = {1: system}

    def cached_prefix(i, ids):
        held = cached.get(i, [])
        n = 0
        while n < min(len(held), len(ids)) and held[n] == ids[n]:
            n += 1
        return n

    def agent(k):
        return FakeTask(f"a{k}", prompt_ids=system + [300 + k] * 20)

    # Without ctx_aware, best fit puts it on engine 0 (ties: the lower index).
    assert _place(_gs(2, ctx_aware=False, cached=cached_prefix), [agent(0)]) == [("a0", 0)]
    assert _place(_gs(2, cached=cached_prefix), [agent(0)]) == [("a0", 1)]
    # A prefix dispatched there (not yet computed) counts too.
    gs = _gs(2, ctx_group=False)
    first = _place(gs, [agent(0)])[0][1]
    assert _place(gs, [agent(1)]) == [("a1", first)]
    # A short shared prefix (under ctx_min_tokens) does not bind calls to an engine.
    gs = _gs(2, ctx_group=False, ctx_min_tokens=512)
    _place(gs, [agent(0)])
    assert _place(gs, [agent(1)])[0][1] == 0  # best fit again


def test_ctx_group_dispatches_calls_sharing_a_prefix_together():
    system = list(range(3, 203))
    tasks = [FakeTask(f"a{k}", prompt_ids=system + [k] * 10) for k in range(3)]
    tasks.insert(1, FakeTask("other", prompt_ids=[9] * 300))
    gs = _gs(2, graph_group=False, app_fifo=False)
    placed = dict(_place(gs, tasks))
    assert placed["a0"] == placed["a1"] == placed["a2"]


def test_queue_bound():
    gs = _gs(1, max_queue_size=2)
    gs.submit(FakeTask("a"))
    gs.submit(FakeTask("b"))
    with pytest.raises(OverflowError, match="max_queue_size"):
        gs.submit(FakeTask("c"))


# ---- the engine side ---------------------------------------------------------------------------


def _steps(engine):
    """Run to completion; per step, the (request id, tokens) scheduled."""
    trace = []
    sched = engine.scheduler
    real = sched.schedule

    def spy():
        batch = real()
        trace.append({s.request.request_id: s.num_new_tokens for s in batch.seqs})
        return batch

    sched.schedule = spy
    while engine.has_unfinished_requests():
        engine.step()
    return trace


def test_latency_token_budget_puts_latency_first_and_caps_the_rest():
    engine = sim_engine(latency_token_budget=8, max_num_batched_tokens=64)
    bg = ProgramHints("job", "throughput")
    for i in range(3):
        engine.add_request([5 + i] * 100, SamplingParams(max_tokens=20, ignore_eos=True), f"bg{i}",
                           hints=bg)  # fmt: skip
    engine.step()  # the job alone: its prefill takes the whole budget
    engine.add_request([9] * 30, SamplingParams(max_tokens=10, ignore_eos=True), "chat",
                       hints=ProgramHints("chat", "latency"))  # fmt: skip
    trace = _steps(engine)
    chat_steps = [s for s in trace if "chat" in s]
    assert chat_steps[0]["chat"] == 30  # its whole prompt at once, ahead of the job
    for s in chat_steps:
        assert sum(n for rid, n in s.items() if rid != "chat") <= 8
    after = [s for s in trace[len(chat_steps) :] if s]
    assert any(sum(s.values()) > 8 for s in after)  # the job gets the whole budget back
    # Without hints, the same requests are scheduled as always (no cap).
    engine = sim_engine(latency_token_budget=8, max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request([5 + i] * 100, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request([9] * 30, SamplingParams(max_tokens=10, ignore_eos=True))
    assert max(sum(s.values()) for s in _steps(engine)) == 64


def test_a_zero_budget_pauses_the_rest_while_latency_requests_run():
    engine = sim_engine(latency_token_budget=0)
    engine.add_request([5] * 20, SamplingParams(max_tokens=30, ignore_eos=True), "bg",
                       hints=ProgramHints("job", "throughput"))  # fmt: skip
    engine.step()
    engine.add_request([9] * 10, SamplingParams(max_tokens=5, ignore_eos=True), "chat",
                       hints=ProgramHints("chat", "latency"))  # fmt: skip
    trace = _steps(engine)
    while_chat = [s for s in trace if "chat" in s]
    assert len(while_chat) == 5 and all("bg" not in s for s in while_chat)
    assert len(engine.scheduler.running) == 0


def test_app_fifo_orders_admission_and_preemption_by_application_arrival():
    # A tight cache: the youngest application's request is the preemption victim, whatever
    # the requests' own arrival order.
    engine = sim_engine(num_pages=24, max_num_seqs=4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request([5] * 20, params, "young", arrival_time=0.0,
                       hints=ProgramHints("B", app_arrival_time=5.0))  # fmt: skip
    engine.add_request([6] * 20, params, "old", arrival_time=1.0,
                       hints=ProgramHints("A", app_arrival_time=0.0))  # fmt: skip
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["old", "young"]
    while engine.has_unfinished_requests() and not engine.stats.num_preemptions:
        engine.step()
    assert engine.stats.num_preemptions
    assert [r.request_id for r in engine.scheduler.waiting] == ["young"]


def test_placement_packs_or_spreads():
    tasks = [FakeTask(f"t{i}") for i in range(4)]
    pack = _gs(3, graph_group=False, ctx_group=False)
    assert {i for _, i in _place(pack, tasks)} == {0}  # best fit: all on the fullest
    spread = _gs(3, graph_group=False, ctx_group=False, placement="spread")
    assert sorted(i for _, i in _place(spread, tasks)) == [0, 0, 1, 2]
    # Packing puts LATENCY tasks where the cap already binds (least impact on the others).
    pack = _gs(2, graph_group=False, ctx_group=False)
    _place(pack, [FakeTask("chat0", criteria="latency")])
    assert _place(pack, [FakeTask("chat1", criteria="latency")]) == [("chat1", 0)]

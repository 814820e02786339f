"""Property test of the program executor on random DAGs (hypothesis): several programs on one
simulated engine or a simulated cluster, random gets (criteria) arriving between steps, random
cancellations, calls that fail, random Parrot switches and caps, small KV caches (preemption).

After every step: a running task's inputs are all computed and finished before it was
dispatched; no task is dispatched twice; the scheduler's per-engine accounting equals the
running tasks; each variable resolves at most once; the engine's block manager is consistent.
At the end: nothing is left running or queued, every page is free, every task someone asked for
is done or failed (failures only where the cause is a too-long prompt upstream), and every value
equals the reference (the same calls one by one)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from program_helpers import ByteTokenizer, sim_engine

from llmjax.config import ProgramConfig
from llmjax.program import ProgramExecutor, SemanticFunction
from llmjax.program.graph import FINAL, RUNNING, CallSpec
from llmjax.program.reference import run_sequential
from llmjax.sampling_params import SamplingParams

FUNCTIONS = [
    SemanticFunction("one", "One: {{x}} ->{{y}}", {"y": SamplingParams(max_tokens=3)}),
    SemanticFunction(
        "two", "A {{a}} B {{b}} ->{{y}}", {"y": SamplingParams(max_tokens=20, ignore_eos=True)}
    ),
    SemanticFunction(
        "split",
        "Split {{x}}:{{p}} and{{q}}",
        {"p": SamplingParams(max_tokens=2), "q": SamplingParams(max_tokens=4)},
    ),
    SemanticFunction("none", "Say something long:{{y}}", {"y": SamplingParams(max_tokens=16)}),
]
BY_NAME = {f.name: f for f in FUNCTIONS}


@st.composite
def programs(draw):
    """[(constants, calls, gets)] per program; gets = [(step, var ids, criteria)]."""
    progs = []
    for _ in range(draw(st.integers(1, 3))):
        constants = {}
        for k in range(draw(st.integers(1, 3))):
            n = draw(st.sampled_from([3, 10, 40, 300]))  # 300 > max_model_len: it fails
            constants[f"k{k}"] = "w" * n
        var_ids = list(constants)
        calls = []
        for c in range(draw(st.integers(1, 10))):
            fn = BY_NAME[draw(st.sampled_from(sorted(BY_NAME)))]
            inputs = {name: draw(st.sampled_from(var_ids)) for name in fn.inputs}
            outputs = {o: f"c{c}.{o}" for o in fn.output_names}
            calls.append(CallSpec(f"c{c}", fn.name, inputs, outputs))
            var_ids += outputs.values()
        produced = [v for c in calls for v in c.outputs.values()]
        gets = [
            (
                draw(st.sampled_from([0, 0, 1, 3, 8, 12])),
                draw(st.lists(st.sampled_from(produced), min_size=1, max_size=3)),
                draw(st.sampled_from(["latency", "throughput"])),
            )
            for _ in range(draw(st.integers(1, 3)))
        ]
        cancel = draw(st.one_of(st.none(), st.integers(0, 15)))
        progs.append((constants, calls, gets, cancel))
    return progs


@st.composite
def configs(draw):
    return ProgramConfig(
        mode=draw(st.sampled_from(["parrot", "parrot", "request"])),
        app_fifo=draw(st.booleans()),
        graph_group=draw(st.booleans()),
        ctx_group=draw(st.booleans()),
        ctx_aware=draw(st.booleans()),
        latency_tasks_num_upperbound=draw(st.integers(1, 4)),
        latency_tokens_num_upperbound=draw(st.sampled_from([64, 4096])),
        tasks_capacity=draw(st.sampled_from([None, 2, 5])),
        tokens_capacity=draw(st.sampled_from([None, 1 << 20])),  # the KV's, or oversubscribed
        ctx_min_tokens=draw(st.sampled_from([4, 128])),
        client_rtt_s=draw(st.sampled_from([0.0, 0.01])),
    )


def _target(num_instances, num_pages, policy, budget):
    kw = dict(num_pages=num_pages, policy=policy, latency_token_budget=budget)
    if policy == "prefill_first":
        kw["max_num_batched_tokens"] = 256
    if num_instances == 1:
        return sim_engine(**kw)
    from llmjax.sim import SimCluster

    return SimCluster([sim_engine(**kw) for _ in range(num_instances)], "round_robin")


def _engines(target):
    return target.instances if hasattr(target, "instances") else [target]


def _call(i, fn, **inputs):
    return CallSpec(f"c{i}", fn, inputs, {o: f"c{i}.{o}" for o in BY_NAME[fn].output_names})


# Found by this test: a preempted THROUGHPUT request at the front of the waiting queue, capped at
# latency_token_budget=0 while a LATENCY request waited behind it, stalled admission for good.
STALLED_BEHIND_A_PREEMPTED_REQUEST = dict(
    progs=[
        (
            {"k0": "w" * 3, "k1": "w" * 40},
            [
                _call(0, "split", x="k0"),
                _call(1, "one", x="c0.p"),
                _call(2, "split", x="c0.q"),
                _call(3, "two", a="c0.q", b="c0.q"),
                _call(4, "two", a="c1.y", b="k1"),
                _call(5, "two", a="c4.y", b="c0.q"),
                _call(6, "one", x="c4.y"),
                _call(7, "none"),
                _call(8, "one", x="c4.y"),
                _call(9, "one", x="c1.y"),
            ],
            [
                (8, ["c3.y", "c0.p", "c9.y"], "throughput"),
                (1, ["c2.q"], "latency"),
                (0, ["c5.y", "c5.y", "c6.y"], "throughput"),
            ],
            None,
        ),
        ({"k0": "w" * 40}, [_call(0, "two", a="k0", b="k0")], [(0, ["c0.y"], "latency")], None),
    ],
    config=ProgramConfig(
        mode="parrot",
        latency_tasks_num_upperbound=4,
        latency_tokens_num_upperbound=64,
        ctx_min_tokens=4,
    ),
    num_instances=1,
    num_pages=20,
    policy="sarathi",
    budget=0,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    progs=programs(),
    config=configs(),
    num_instances=st.sampled_from([1, 1, 2]),
    num_pages=st.sampled_from([20, 40, 512]),
    policy=st.sampled_from(["sarathi", "prefill_first", "splitfuse"]),
    budget=st.sampled_from([None, 0, 4]),
)
@example(**STALLED_BEHIND_A_PREEMPTED_REQUEST)
def test_random_programs(progs, config, num_instances, num_pages, policy, budget):
    target = _target(num_instances, num_pages, policy, budget)
    ex = ProgramExecutor(target, config, tokenizer=ByteTokenizer())
    sent: list[str] = []
    add = ex.target.add
    ex.target.add = lambda *a: (sent.append(a[3]), add(*a))[1]
    resolved: list[tuple[str, str]] = []
    ex.on_var_done = lambda app, var: resolved.append((app.id, var.id))
    apps = []
    for constants, calls, _, _ in progs:
        app = ex.open()
        ex.submit(app, FUNCTIONS, constants, calls)
        apps.append(app)
    step = 0
    while True:
        for app, (_, _, gets, cancel) in zip(apps, progs, strict=True):
            for at, var_ids, criteria in gets:
                if at == step:
                    ex.activate(app, var_ids, criteria)
            if cancel == step:
                ex.cancel(app)
        if step > 15 and not ex.has_unfinished():
            break
        if ex.has_unfinished():
            ex.step()
        _check(ex, sent, resolved)
        step += 1
        assert step < 5000, "no progress"
    # The end.
    assert not ex.scheduler.queue and not any(s.tasks for s in ex.scheduler.slots)
    for engine in _engines(target):
        bm = engine.block_manager
        bm.check_invariants()
        assert bm.num_available_pages == bm.num_usable_pages
        assert not engine.has_unfinished_requests()
    for app, (constants, calls, _, _) in zip(apps, progs, strict=True):
        state = ex.apps[app]
        asked = {t for t in state.tasks.values() if t.state != "pending"}
        assert all(t.state in FINAL for t in asked)
        if state.cancelled:
            continue
        ref = run_sequential(sim_engine(num_pages), FUNCTIONS, constants, calls, ByteTokenizer())
        for task in asked:
            content, error = ref[task.var.id]
            assert task.var.content == content
            assert (task.var.error is None) == (error is None)


def _check(ex, sent, resolved):
    assert len(sent) == len(set(sent)), "a task was dispatched twice"
    assert len(resolved) == len(set(resolved)), "a variable resolved twice"
    running = {}
    for app in ex.apps.values():
        for task in app.tasks.values():
            if task.state != RUNNING:
                continue
            assert all(d.content is not None for d in task.deps)
            finishes = [d.producer.finish_time for d in task.deps if d.producer is not None]
            assert task.dispatch_time >= max(finishes, default=float("-inf")) - 1e-9
            if task.instance is not None:
                running.setdefault(task.instance, set()).add(task.id)
    for slot in ex.scheduler.slots:
        assert set(slot.tasks) == running.get(slot.index, set())
    for engine in _engines(
        ex.target.cluster if hasattr(ex.target, "cluster") else ex.target.engine
    ):
        engine.block_manager.check_invariants()

"""Semantic-variable programs (llmjax/program/): templates, semantics against the sequential
reference on the tiny model, failures, cancellation, laziness, the request-level baseline's
round trips, placement on a simulated cluster."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from program_helpers import ByteTokenizer, sim_engine, tiny_llm

from llmjax.config import ProgramConfig
from llmjax.program import (
    Input,
    Output,
    Program,
    ProgramError,
    ProgramExecutor,
    SemanticFunction,
    TemplateError,
    semantic_function,
)
from llmjax.program.reference import run_sequential
from llmjax.sampling_params import SamplingParams

P = SamplingParams(max_tokens=6, ignore_eos=True)


# ---- templates -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, outputs, inputs, match",
    [
        ("Hi {{x}} {{y}}", {"y": P}, ["z"], r"'f', placeholder \{\{z\}\}: is a declared input"),
        ("Hi {{x}} {{y}}", {"y": P}, [], r"placeholder \{\{x\}\}: is neither"),
        ("{{y}} hi {{x}}", {"y": P}, None, r"placeholder \{\{y\}\}: an output needs a prompt"),
        ("Hi {{x}}", {"y": P}, None, r"placeholder \{\{y\}\}: an output must appear exactly"),
        ("Hi {{y}} {{y}}", {"y": P}, None, r"exactly once \(found 2\)"),
        ("Hi {{x}}", {}, None, "has no output placeholder"),
        ("Hi {{y}} and {{x}}", {"y": P}, None, r"\{\{x\}\}: comes after the last output \{\{y"),
        ("Hi {{y}} then more", {"y": P}, None, "'then more' after the last output"),
        ("Hi {{ 2x }} {{y}}", {"y": P}, None, r"placeholder \{\{2x\}\}: .*identifier"),
        ("Hi {{x} {{y}}", {"y": P}, None, "unbalanced braces"),
    ],
)
def test_bad_templates_name_the_function_and_placeholder(template, outputs, inputs, match):
    with pytest.raises(TemplateError, match=match):
        SemanticFunction("f", template, outputs, inputs)


def test_declared_functions_and_their_json_round_trip():
    @semantic_function
    def qa(question: Input, context: Input, answer: Output(max_tokens=9, stop=["\n"])):
        """Context: {{context}}
        Q: {{question}}
        A:{{answer}}
        """

    assert qa.inputs == ("question", "context")  # parameter order, for positional arguments
    assert qa.output_names == ("answer",)
    assert qa.outputs["answer"].stop == ("\n",)
    assert SemanticFunction.from_dict(qa.to_dict()) == qa
    with pytest.raises(TemplateError, match="annotate each parameter"):

        @semantic_function
        def bad(x, y: Output):
            """{{x}}{{y}}"""

    with pytest.raises(TemplateError, match="one output, at the end"):
        SemanticFunction("c", "{{x}}: {{a}} and {{b}}", {"a": P, "b": P}, chat=True)
    with pytest.raises(RuntimeError, match=r"inside `with llmjax\.program\.Program"):
        qa("q", "c")


# ---- semantics ---------------------------------------------------------------------------------

MAP = SemanticFunction(
    "summarize", "Summarize this text. {{chunk}} Summary:{{summary}}", {"summary": P}
)
REFINE = SemanticFunction(
    "refine", "Summary so far: {{prev}} New text: {{chunk}} Better summary:{{out}}", {"out": P}
)
TWO = SemanticFunction(
    "two", "Combine {{a}} + {{b}} -> {{first}}; again:{{second}}", {"first": P, "second": P}
)


def build(program: Program, seed: int = 0) -> list:
    """A map-reduce beside a chain, sharing inputs: every variable it makes (inside `with
    program`)."""
    rng = np.random.default_rng(seed)
    chunks = [
        "".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(5, 40))) for _ in range(5)
    ]
    maps = [MAP(chunk=c) for c in chunks]
    first, second = TWO(a=maps[0], b=maps[1])
    final, _ = TWO(a=first, b=maps[2])
    prev = program.variable("nothing yet")
    for c in chunks[:3]:
        prev = REFINE(prev=prev, chunk=c)
    extra = MAP(chunk=second)  # reads the second output of a two-output call
    return [*maps, first, second, final, prev, extra]


def _executor(llm, **cfg):
    return ProgramExecutor(llm, ProgramConfig(**cfg), tokenizer=ByteTokenizer())


@pytest.fixture(scope="module")
def reference():
    llm = tiny_llm()
    with Program(_executor(llm)) as program:
        build(program)
    return run_sequential(llm, program.functions, program.constants, program.calls, ByteTokenizer())


@pytest.mark.parametrize(
    "options, cfg",
    [
        ({}, {}),  # Parrot, every policy on
        ({}, dict(app_fifo=False, graph_group=False, ctx_group=False, ctx_aware=False)),
        ({}, dict(mode="request")),
        (dict(scheduler_policy="prefill_first", max_num_batched_tokens=256), {}),
        (dict(latency_token_budget=4), dict(latency_tasks_num_upperbound=2)),
    ],
)
def test_outputs_equal_the_calls_run_one_by_one(reference, options, cfg):
    llm = tiny_llm()
    overrides = {"scheduler.latency_token_budget": options.pop("latency_token_budget", None)}
    llm = llm.with_options(overrides=overrides, **options)
    ex = _executor(llm, **cfg)
    with Program(ex) as program:
        variables = build(program)
        texts = program.get(variables[:-2], criteria="throughput")
        texts += program.get(variables[-2:], criteria="latency")  # a second get, later
    assert texts == [reference[v.id][0] for v in variables]
    assert all(t for t in texts)
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages
    assert not ex.has_unfinished() and not any(s.tasks for s in ex.scheduler.slots)


def test_preemption_inside_a_program_loses_nothing():
    long = SemanticFunction(
        "long", "Tell me about {{x}}:{{y}}", {"y": SamplingParams(max_tokens=40, ignore_eos=True)}
    )
    small = tiny_llm().with_options(num_pages=32)  # 31 usable pages of 4 tokens
    with Program(_executor(small)) as program:
        outs = [long(x=f"topic {i} " * 3) for i in range(6)]
        outs.append(long(x=outs[0]))
        texts = program.get(outs, criteria="throughput")
    assert small.engine.stats.num_preemptions > 0
    ref = run_sequential(
        tiny_llm(), program.functions, program.constants, program.calls, ByteTokenizer()
    )
    assert texts == [ref[v.id][0] for v in outs]


def test_nothing_runs_that_no_get_needs_and_each_variable_resolves_once():
    engine = sim_engine()
    ex = ProgramExecutor(engine, tokenizer=ByteTokenizer())
    seen = []
    ex.on_var_done = lambda app, var: seen.append(var.id)
    with Program(ex) as program:
        a = MAP(chunk="alpha")
        b = MAP(chunk="beta")
        c = REFINE(prev=a, chunk="gamma")
        assert c.get()
        served = {v.id: ex.var(program.id, v.id).done for v in (a, b, c)}
        assert served == {a.id: True, b.id: False, c.id: True}
        assert not a.done  # the client got what it asked for, and nothing else
        assert ex.num_dispatched == 2
        assert c.get() == c.get()  # cached: nothing sent again
        b.get()
        assert ex.num_dispatched == 3
    assert sorted(seen) == sorted({*seen}) and len(seen) == 3


def test_a_failed_call_fails_what_reads_it_and_nothing_else():
    llm = tiny_llm()
    with Program(_executor(llm)) as program:
        ok = MAP(chunk="short")
        bad = MAP(chunk="x" * 300)  # longer than max_model_len (256)
        both = TWO(a=ok, b=bad)
        after = REFINE(prev=both[1], chunk="more")
        assert ok.get()
        with pytest.raises(ProgramError) as e:
            after.get()
        with pytest.raises(ProgramError, match="'summarize', output"):
            program.get(bad)
    err = e.value
    assert (err.function, err.placeholder) == ("refine", "prev")
    assert "input {{prev}}" in str(err) and "input {{b}}" in str(err)
    assert "output {{summary}}" in str(err) and "max_model_len=256" in str(err)


def test_cancel_aborts_running_calls_and_frees_their_pages():
    llm = tiny_llm().with_options()
    ex = _executor(llm)
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    slow = SemanticFunction("slow", "Write a lot about {{topic}}:{{text}}", {"text": long})
    with Program(ex) as program:
        outs = [slow(topic=t) for t in ("cats", "dogs", "owls")]
        tail = REFINE(prev=outs[0], chunk="and")
        ex.submit(program.id, program.functions.values(), program.constants, program.calls)
        ex.activate(program.id, [tail.id, *(o.id for o in outs)], "latency")
        for _ in range(5):
            ex.step()
        running = [t for t in ex.apps[program.id].tasks.values() if t.state == "running"]
        assert running
        assert ex.cancel(program.id) == len(running)
        bm = llm.engine.block_manager
        assert bm.num_available_pages == bm.num_usable_pages
        assert all(ex.var(program.id, v.id).error is not None for v in [*outs, tail])
        assert not llm.engine.has_unfinished_requests() and not ex.has_unfinished()
    # The executor serves the next program.
    with Program(ex):
        assert MAP(chunk="again").get()


def test_request_mode_pays_a_round_trip_per_dependent_call():
    def chain_times(mode):
        engine = sim_engine()
        ex = ProgramExecutor(
            engine, ProgramConfig(mode=mode, client_rtt_s=0.5), tokenizer=ByteTokenizer()
        )
        with Program(ex):
            prev = "start"
            for c in ("a", "b", "c"):
                prev = REFINE(prev=prev, chunk=c)
            prev.get()
        rows = sorted(ex.records, key=lambda r: r["finish"])
        gaps = [b["dispatch"] - a["finish"] for a, b in itertools.pairwise(rows)]
        return rows[-1]["finish"], gaps

    end_parrot, gaps_parrot = chain_times("parrot")
    end_request, gaps_request = chain_times("request")
    assert gaps_parrot == [0.0, 0.0]
    assert gaps_request == pytest.approx([0.5, 0.5])
    assert end_request == pytest.approx(end_parrot + 1.0)


def test_chat_functions_need_a_chat_template():
    ask = SemanticFunction("ask", "{{q}}{{a}}", {"a": P}, chat=True)
    with Program(_executor(tiny_llm())), pytest.raises(ValueError, match="no chat"):
        ask(q="hi").get()


def test_placement_on_a_simulated_cluster_keeps_the_outputs(reference):
    from llmjax.sim import SimCluster

    def cluster():
        return SimCluster([sim_engine(), sim_engine()], "round_robin")

    results = []
    for cfg in (ProgramConfig(ctx_min_tokens=16), ProgramConfig(mode="request")):
        target = cluster()
        ex = ProgramExecutor(target, cfg, tokenizer=ByteTokenizer())
        with Program(ex) as program:
            variables = build(program)
            results.append(program.get(variables))
        assert {r["instance"] for r in ex.records} <= {0, 1, None}
    ref = run_sequential(sim_engine(), program.functions, program.constants, program.calls,
                         ByteTokenizer())  # fmt: skip
    assert results[0] == results[1] == [ref[v.id][0] for v in variables]


def test_placement_on_a_real_cluster_keeps_the_outputs(reference):
    """Two local instances of the tiny model on fake devices 0 and 1, placed by Parrot's
    scheduler (spread, so both serve) and by the router in request mode."""
    from llmjax.cluster import InstanceSpec, launch

    opts = dict(
        load_format="dummy", page_size=4, max_num_batched_tokens=64, max_num_seqs=8,
        max_model_len=256, num_pages=256, compilation_cache_dir="",
    )  # fmt: skip
    # (tiny_llm's engine options, so the reference holds)
    for cfg in (ProgramConfig(placement="spread"), ProgramConfig(mode="request")):
        cluster = launch("tiny", InstanceSpec.parse("2xcolocated"), **opts)
        ex = ProgramExecutor(cluster, cfg, tokenizer=ByteTokenizer())
        with Program(ex) as program:
            variables = build(program)
            texts = program.get(variables)
        assert texts == [reference[v.id][0] for v in variables]
        if cfg.mode == "parrot":
            assert {r["instance"] for r in ex.records} == {0, 1}
            assert all(s.num_prefill_tokens > 0 for s in cluster.stats)
        cluster.shutdown()

"""The benchmark harness: workload statistics, arrivals, traces, the prefix-sharing workloads'
token ids, replay of dependent requests on a host-only fake engine, metrics with known answers,
the capacity search on a synthetic system, and an end-to-end run on the tiny model."""

import ast
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from llmjax.bench import capacity_search, format_side_by_side, replay, summarize, warm_up, workloads
from llmjax.bench.workloads import RequestSpec
from llmjax.engine.request import RequestMetrics, RequestOutput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "llmjax", "bench")


def test_bench_imports_no_jax():
    for name in os.listdir(BENCH_DIR):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(BENCH_DIR, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    mods = (
                        [a.name for a in node.names]
                        if isinstance(node, ast.Import)
                        else [node.module]
                    )
                    assert not any(m and m.split(".")[0] in ("jax", "jaxlib") for m in mods), name
    code = "import sys, llmjax.bench; assert 'jax' not in sys.modules, 'llmjax.bench imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------------------
# Workloads.


@pytest.mark.parametrize("name", ["sharegpt", "arxiv"])
def test_lengths_match_published_statistics_after_scaling(name):
    stats = {"sharegpt": workloads.SHAREGPT, "arxiv": workloads.ARXIV}[name]
    scale = 1 / 16
    specs = workloads.make_workload(name, 4000, scale=scale, seed=1)
    prompt = np.array([s.prompt_len for s in specs])
    output = np.array([s.output_len for s in specs])
    for values, median, p90 in [
        (prompt, stats.prompt_median, stats.prompt_p90),
        (output, stats.output_median, stats.output_p90),
    ]:
        assert np.median(values) == pytest.approx(median * scale, rel=0.08)
        assert np.percentile(values, 90) == pytest.approx(p90 * scale, rel=0.08)
    assert (prompt + output).max() <= stats.max_total_len * scale + 1
    assert all(s.arrival_time == 0 for s in specs)  # qps=inf by default


def test_workloads_are_seeded_and_lengths_do_not_depend_on_qps():
    a = workloads.sharegpt(50, qps=2.0, seed=3)
    assert a == workloads.sharegpt(50, qps=2.0, seed=3)
    assert a != workloads.sharegpt(50, qps=2.0, seed=4)
    b = workloads.sharegpt(50, qps=8.0, seed=3)
    assert [(s.prompt_len, s.output_len) for s in a] == [(s.prompt_len, s.output_len) for s in b]
    assert [s.arrival_time for s in a] != [s.arrival_time for s in b]


def test_lengths_are_clipped_to_max_model_len():
    specs = workloads.arxiv(500, scale=1.0, max_model_len=300)
    assert max(s.prompt_len + s.output_len for s in specs) <= 300
    assert min(s.prompt_len for s in specs) >= 1 and min(s.output_len for s in specs) >= 1


def test_poisson_arrivals_mean_gap():
    specs = workloads.fixed(5000, qps=4.0, seed=0)
    arrivals = np.array([s.arrival_time for s in specs])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert np.diff(arrivals).mean() == pytest.approx(0.25, rel=0.05)
    with pytest.raises(ValueError, match="qps"):
        workloads.fixed(3, qps=0.0)


def test_long_prompt_interference_shape():
    specs = workloads.long_prompt_interference(16, qps=2.0, max_model_len=512)
    short, long = specs[:12], specs[12:]
    assert all(s.arrival_time == 0 and s.output_len > s.prompt_len for s in short)
    assert len(long) == 4 and all(s.arrival_time > 0 and s.prompt_len > 400 for s in long)
    assert all(s.prompt_len + s.output_len <= 512 for s in specs)


def test_with_token_ids_random_and_text():
    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    specs = [RequestSpec(0.0, 4, prompt_len=50), RequestSpec(0.0, 4, prompt="hi!")]
    out = workloads.with_token_ids(specs, vocab_size=256, tokenizer=Tok(), seed=7)
    assert len(out[0].prompt_token_ids) == 50
    assert all(100 <= t < 256 for t in out[0].prompt_token_ids)
    assert out[1].prompt_token_ids == (104, 105, 33) and out[1].prompt_len == 3
    assert out == workloads.with_token_ids(specs, vocab_size=256, tokenizer=Tok(), seed=7)
    with pytest.raises(ValueError, match="no tokenizer"):
        workloads.with_token_ids(specs, vocab_size=256)


def test_trace_round_trip_and_errors(tmp_path):
    specs = [
        RequestSpec(0.0, 8, prompt_len=30),
        RequestSpec(0.25, 16, prompt="Tell me a story", prompt_len=4),
        RequestSpec(1.5, 2, prompt_token_ids=(5, 6, 7)),
        RequestSpec(0.5, 3, prompt_len=6, parent=2),
        RequestSpec(0.0, 3, prompt_token_ids=(9, 9), parent=0),
    ]
    path = str(tmp_path / "trace.jsonl")
    workloads.save_trace(path, specs, with_token_ids=True)
    assert workloads.load_trace(path) == specs

    def error_for(lines):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError) as e:
            workloads.load_trace(str(bad))
        return str(e.value)

    good = '{"arrival_time": 0, "prompt_len": 3, "output_len": 2}'
    assert "bad.jsonl:2: not valid JSON" in error_for([good, "{oops"])
    assert "bad.jsonl:3: missing 'output_len'" in error_for(
        [good, "", '{"arrival_time": 1, "prompt_len": 3}']
    )
    assert "needs 'prompt'" in error_for(['{"arrival_time": 0, "output_len": 2}'])
    assert "unknown field(s) ['promt']" in error_for(
        ['{"arrival_time": 0, "promt": "x", "output_len": 2}']
    )
    assert "arrival_time=-1" in error_for(
        ['{"arrival_time": -1, "prompt_len": 3, "output_len": 2}']
    )
    assert "output_len=2.5" in error_for(
        ['{"arrival_time": 0, "prompt_len": 3, "output_len": 2.5}']
    )
    assert "no requests" in error_for([""])
    child = '{"arrival_time": 0, "prompt_len": 3, "output_len": 2, "parent": %s}'
    assert workloads.load_trace(str(tmp_path / "trace.jsonl"))[3].parent == 2
    err = error_for([good, "", good, child % 2])  # blank lines are not requests
    assert "bad.jsonl:4: parent=2 must be the 0-based index of an earlier request" in err
    assert "[0, 2)" in err
    assert "bad.jsonl:1: parent=0" in error_for([child % 0])
    assert "bad.jsonl:2: parent='0'" in error_for([good, child % '"0"'])
    assert "bad.jsonl:2: parent=-1" in error_for([good, child % -1])


# ------------------------------------------------------------------------------------------------
# Prefix-sharing workloads.


def _common_prefix_len(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _full_prompt_lens(specs):
    """The length of the prompt each spec runs with (a dependent one after its parent's prompt and
    output_len generated tokens)."""
    full = []
    for s in specs:
        base = 0 if s.parent is None else full[s.parent] + specs[s.parent].output_len
        full.append(base + s.prompt_len)
    return full


@pytest.mark.parametrize("name", ["shared_system_prompt", "few_shot", "multi_turn_chat"])
def test_prefix_workloads_registered_seeded_and_qps_independent(name):
    kw = dict(max_model_len=4096, scale=1 / 16, vocab_size=1000)  # as scripts/benchmark.py passes
    a = workloads.make_workload(name, 24, qps=2.0, seed=5, **kw)
    assert len(a) == 24
    assert a == workloads.make_workload(name, 24, qps=2.0, seed=5, **kw)
    assert a != workloads.make_workload(name, 24, qps=2.0, seed=6, **kw)
    b = workloads.make_workload(name, 24, qps=8.0, seed=5, **kw)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    roots = [
        (x.arrival_time, y.arrival_time) for x, y in zip(a, b, strict=True) if x.parent is None
    ]
    assert all(x > y for x, y in roots[1:]) and roots[0] == (0.0, 0.0)
    # `scale` is ignored: the lengths are set by the generators' own arguments.
    assert a == workloads.make_workload(name, 24, qps=2.0, seed=5, **(kw | dict(scale=1.0)))
    assert all(100 <= t < 1000 for s in a for t in s.prompt_token_ids)
    with pytest.raises(ValueError, match="vocab_size=100"):
        workloads.make_workload(name, 4, vocab_size=100)


def test_shared_system_prompt_shares_exactly_the_system_prompt():
    specs = workloads.shared_system_prompt(40, system_prompt_len=300, question_len=20, seed=2)
    ids = [s.prompt_token_ids for s in specs]
    assert all(ids[0][:300] == p[:300] for p in ids)
    assert len({p[300] for p in ids}) > 30  # the questions start apart
    assert min(_common_prefix_len(ids[0], p) for p in ids[1:]) == 300
    questions = np.array([s.prompt_len - 300 for s in specs])
    assert questions.min() >= 1 and len(set(questions)) > 10  # lognormal, median 20
    assert 12 <= np.median(questions) <= 30
    assert all(s.output_len == 32 and s.arrival_time == 0 for s in specs)
    exact = workloads.shared_system_prompt(5, system_prompt_len=8, question_len=3, p90_ratio=1)
    assert [s.prompt_len for s in exact] == [11] * 5
    # Clipped: the (shortened) system prompt is still shared, and every request fits.
    clipped = workloads.shared_system_prompt(
        40, system_prompt_len=300, question_len=20, output_len=32, max_model_len=100, seed=2
    )
    assert all(s.prompt_len + s.output_len <= 100 for s in clipped)
    assert all(c.prompt_token_ids[:67] == ids[0][:67] for c in clipped)  # one question token left
    assert [c.prompt_token_ids[67] for c in clipped] == [p[300] for p in ids]
    assert [c.prompt_len for c in clipped] == [100 - 32] * 40
    tiny = workloads.shared_system_prompt(3, output_len=32, max_model_len=4)
    assert [(s.prompt_len, s.output_len) for s in tiny] == [(2, 2)] * 3


def test_few_shot_tasks_share_their_examples_and_interleave():
    n, tasks, shots, shot_len, header = 30, 3, 4, 10, 5
    specs = workloads.few_shot(
        n, num_tasks=tasks, num_shots=shots, shot_len=shot_len, question_len=6, header_len=header,
        p90_ratio=1, seed=4,
    )  # fmt: skip
    prefix_len = header + shots * shot_len
    assert all(s.prompt_len == prefix_len + 6 and s.output_len == 16 for s in specs)
    ids = [s.prompt_token_ids for s in specs]
    task = [p[header] for p in ids]  # tasks' first example tokens are distinct
    assert len(set(task)) == tasks
    for i in range(n):
        for j in range(i):
            common = _common_prefix_len(ids[i], ids[j])
            if task[i] == task[j]:
                assert common >= prefix_len
            else:
                assert common == header  # only the common header
    for block in range(0, n, tasks):  # every round has each task once: they interleave
        assert len(set(task[block : block + tasks])) == tasks
    # Without a header, different tasks differ at the first token; lengths vary by default.
    varied = workloads.few_shot(40, seed=4, qps=3.0)
    assert len({s.prompt_token_ids[0] for s in varied}) == 4
    assert len({s.prompt_len for s in varied}) > 10
    # max_model_len cuts each task's examples as a prefix: a task's prompts still share it.
    clipped = workloads.few_shot(40, seed=4, max_model_len=200)
    assert all(s.prompt_len + s.output_len <= 200 for s in clipped)
    for c, v in zip(clipped, varied, strict=True):
        assert c.prompt_token_ids[: 200 - 16 - 1] == v.prompt_token_ids[: 200 - 16 - 1]


def test_multi_turn_chat_sessions_and_parents():
    specs = workloads.multi_turn_chat(
        10, num_turns=4, first_prompt_len=30, user_turn_len=8, output_len=5, think_time=0.5,
        qps=2.0, seed=1,
    )  # fmt: skip
    assert len(specs) == 10
    # ceil(10 / 4) = 3 sessions, listed session by session, the last one shorter.
    assert [s.parent for s in specs] == [None, 0, 1, 2, None, 4, 5, 6, None, 8]
    starts = [s.arrival_time for s in specs if s.parent is None]
    assert starts[0] == 0 and starts == sorted(starts) and starts[1] > 0
    thinks = [s.arrival_time for s in specs if s.parent is not None]
    assert all(t >= 0 for t in thinks) and len(set(thinks)) == len(thinks)  # exponential
    assert all(s.output_len == 5 for s in specs)
    assert _full_prompt_lens(specs)[:4] == list(
        np.cumsum([specs[0].prompt_len] + [5 + s.prompt_len for s in specs[1:4]])
    )
    instant = workloads.multi_turn_chat(8, num_turns=2, think_time=0, seed=1)
    assert [s.arrival_time for s in instant if s.parent is not None] == [0.0] * 4
    many = workloads.multi_turn_chat(4000, num_turns=2, think_time=0.5, seed=1)
    thinks = [s.arrival_time for s in many if s.parent is not None]
    assert np.mean(thinks) == pytest.approx(0.5, rel=0.08)
    with pytest.raises(ValueError, match="think_time=-1"):
        workloads.multi_turn_chat(4, think_time=-1)


def test_multi_turn_chat_fits_max_model_len():
    kw = dict(num_turns=6, first_prompt_len=60, user_turn_len=20, output_len=16, seed=3)
    free = workloads.multi_turn_chat(60, **kw)
    assert max(f + s.output_len for f, s in zip(_full_prompt_lens(free), free, strict=True)) > 200
    specs = workloads.multi_turn_chat(60, max_model_len=200, **kw)
    assert len(specs) == 60
    assert all(
        f + s.output_len <= 200 for f, s in zip(_full_prompt_lens(specs), specs, strict=True)
    )
    sessions = sum(s.parent is None for s in specs)
    assert sessions > 10  # sessions ended early, more were started
    assert all(s.parent in (None, i - 1) for i, s in enumerate(specs))
    assert specs[0].prompt_token_ids == free[0].prompt_token_ids[: specs[0].prompt_len]


def test_dependent_spec_validation_and_retiming():
    with pytest.raises(ValueError, match="parent=-1"):
        RequestSpec(0.0, 4, prompt_len=3, parent=-1)
    with pytest.raises(ValueError, match="parent=True"):
        RequestSpec(0.0, 4, prompt_len=3, parent=True)
    specs = [RequestSpec(0.0, 4, prompt_len=3), RequestSpec(0.3, 4, prompt_len=3, parent=1)]
    with pytest.raises(ValueError, match=r"request 1: parent=1 must be the index of an earlier"):
        workloads.check_parents(specs)
    chat = workloads.multi_turn_chat(12, num_turns=3, think_time=0.5, seed=0)
    retimed = workloads.with_poisson_arrivals(chat, qps=100.0, seed=9)
    for before, after in zip(chat, retimed, strict=True):
        if before.parent is None:
            assert after.arrival_time < 0.2
        else:
            assert after == before  # a dependent keeps its delay after the parent


# ------------------------------------------------------------------------------------------------
# Replay with dependent requests, on a host-only fake engine.

REJECT = 4242  # a prompt holding this id is rejected by the fake engine
ABORT = 4343  # ... or aborted at its first step


class FakeEngine:
    """The part of `LLMEngine` that `replay` uses, without a model: every unfinished request gets
    one token per step (id 1000 + 10 x request number + its position), rejected requests come out
    (finished, 'error') at the next step like the engine's."""

    def __init__(self, vocab_size=5000):
        self.config = SimpleNamespace(model=SimpleNamespace(vocab_size=vocab_size))
        self.tokenizer = None
        self.live = {}  # request id -> (prompt ids, max_tokens, metrics, tokens, prompt text)
        self.done = []  # outputs due at the next step
        self.added = {}  # request id -> (steps run before it was added, perf_counter, prompt ids)
        self.finished_at = {}  # request id -> the step count when it finished
        self.num_steps = 0

    def has_unfinished_requests(self):
        return bool(self.live or self.done)

    def add_request(self, prompt_token_ids, sampling_params, prompt=None, arrival_time=None):
        assert sampling_params.ignore_eos
        rid = str(len(self.added))
        ids = list(prompt_token_ids)
        self.added[rid] = (self.num_steps, time.perf_counter(), ids)
        metrics = RequestMetrics(arrival_time=arrival_time)
        if REJECT in ids:
            metrics.finished_time = time.perf_counter()
            self.done.append(self._out(rid, ids, [], metrics, prompt, "error", "bad prompt"))
        else:
            self.live[rid] = (ids, sampling_params.max_tokens, metrics, [], prompt)
        return rid

    def _out(self, rid, ids, tokens, metrics, prompt, reason, error=None):
        return RequestOutput(
            request_id=rid, prompt=prompt, prompt_token_ids=ids, token_ids=list(tokens), text="",
            finished=reason is not None, finish_reason=reason, metrics=metrics, error=error,
        )  # fmt: skip

    def step(self):
        self.num_steps += 1
        outputs, self.done = self.done, []
        now = time.perf_counter()
        for rid, (ids, max_tokens, metrics, tokens, prompt) in list(self.live.items()):
            tokens.append(1000 + 10 * int(rid) + len(tokens))
            metrics.token_times.append(now)
            reason = "abort" if ABORT in ids else "length" if len(tokens) == max_tokens else None
            if reason:
                metrics.finished_time = now
                self.finished_at[rid] = self.num_steps
                del self.live[rid]
            outputs.append(self._out(rid, ids, tokens, metrics, prompt, reason))
        return outputs


def _spec(ids, output_len=2, arrival=0.0, parent=None):
    return RequestSpec(arrival, output_len, prompt_token_ids=tuple(ids), parent=parent)


def test_replay_runs_a_dependent_after_its_parent_on_its_output():
    specs = [
        _spec([101, 102, 103], output_len=3),
        _spec([201], output_len=1),
        _spec([301, 302], parent=0),
        _spec([401], output_len=2, parent=2),  # a grandchild
        _spec([501], parent=0),  # a second child of 0
    ]
    engine = FakeEngine()
    outputs = replay(engine, specs, realtime=False)
    assert all(o.finished and o.error is None for o in outputs)
    assert [len(o.token_ids) for o in outputs] == [s.output_len for s in specs]  # spec order
    a, b, child, grandchild, second = outputs
    assert a.prompt_token_ids == [101, 102, 103] and b.prompt_token_ids == [201]
    assert child.prompt_token_ids == [101, 102, 103, *a.token_ids, 301, 302]
    assert grandchild.prompt_token_ids == [*child.prompt_token_ids, *child.token_ids, 401]
    assert second.prompt_token_ids == [101, 102, 103, *a.token_ids, 501]
    rid = {tuple(ids): r for r, (_, _, ids) in engine.added.items()}

    def added_step(out):
        return engine.added[rid[tuple(out.prompt_token_ids)]][0]

    def finished_step(out):
        return engine.finished_at[rid[tuple(out.prompt_token_ids)]]

    assert added_step(a) == added_step(b) == 0
    assert added_step(child) == added_step(second) == finished_step(a)  # at once, not before
    assert added_step(grandchild) == finished_step(child)
    # Not real time: a dependent arrives when its parent finished.
    assert child.metrics.arrival_time == a.metrics.finished_time
    assert grandchild.metrics.arrival_time == child.metrics.finished_time
    assert summarize(outputs).num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)


def test_replay_realtime_dependent_arrives_its_delay_after_the_parent():
    specs = [_spec([101], output_len=2), _spec([201], arrival=0.03, parent=0), _spec([301])]
    engine = FakeEngine()
    parent, child, other = replay(engine, specs, realtime=True)
    assert child.metrics.arrival_time == pytest.approx(parent.metrics.finished_time + 0.03)
    added_at = engine.added["2"][1]  # request ids are handed out in order of adding
    assert engine.added["2"][2] == [101, *parent.token_ids, 201]
    assert added_at >= child.metrics.arrival_time
    assert other.metrics.arrival_time == parent.metrics.arrival_time  # both at the start


def test_replay_skips_the_dependents_of_a_failed_parent():
    specs = [
        _spec([101, REJECT]),
        _spec([201], parent=0),
        _spec([301], parent=1),
        _spec([401, ABORT]),
        _spec([501], parent=3),
        _spec([601]),
        _spec([701], parent=5),
    ]
    engine = FakeEngine()
    outputs = replay(engine, specs, realtime=False)
    assert all(o.finished for o in outputs)
    assert [o.finish_reason for o in outputs] == [
        "error", "error", "error", "abort", "error", "length", "length",
    ]  # fmt: skip
    assert outputs[1].error == "not run: its parent (request 0) failed: bad prompt"
    assert outputs[2].error.startswith("not run: its parent (request 1) failed: not run:")
    assert outputs[4].error == "not run: its parent (request 3) failed: finish_reason='abort'"
    assert outputs[1].request_id == "not-run-1" and outputs[1].token_ids == []
    assert outputs[1].prompt_token_ids == [101, REJECT, 201]
    assert outputs[6].error is None
    assert len(engine.added) == 4  # the skipped ones never reached the engine
    s = summarize(outputs)
    assert (s.num_finished, s.num_errors) == (3, 4)  # summarize counts the abort as finished


def test_replay_rejects_bad_parents_and_warm_up_handles_dependents():
    with pytest.raises(ValueError, match="request 1: parent=1"):
        replay(FakeEngine(), [_spec([101]), _spec([201], parent=1)])
    chat = workloads.multi_turn_chat(
        9, num_turns=3, first_prompt_len=6, user_turn_len=3, output_len=4, think_time=5.0,
        vocab_size=1000, max_model_len=40, seed=0,
    )  # fmt: skip
    outputs = warm_up(FakeEngine(), chat, max_output_len=3)  # think times become 0: quick
    assert all(o.error is None for o in outputs)
    outputs = replay(FakeEngine(), chat, realtime=False)
    for spec, out in zip(chat, outputs, strict=True):
        assert len(out.token_ids) == spec.output_len
        assert len(out.prompt_token_ids) + len(out.token_ids) <= 40
        if spec.parent is not None:
            parent = outputs[spec.parent]
            own = list(spec.prompt_token_ids)
            assert out.prompt_token_ids == parent.prompt_token_ids + parent.token_ids + own


# ------------------------------------------------------------------------------------------------
# Metrics.


def _output(ttft, delay, gaps, prompt_len=10, error=None, num_cached_tokens=0):
    """A finished request arriving at t=0: scheduled at `delay`, first token at `ttft`, then one
    token after each of `gaps`."""
    times = list(ttft + np.concatenate([[0.0], np.cumsum(gaps)])) if error is None else []
    m = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=None if error else delay,
        first_token_time=times[0] if times else None,
        finished_time=times[-1] if times else 0.0,
        token_times=times,
    )
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1] * prompt_len,
        token_ids=[7] * len(times),
        text="",
        finished=True,
        finish_reason="error" if error else "length",
        metrics=m,
        num_cached_tokens=num_cached_tokens,
        error=error,
    )


@pytest.fixture
def outputs():
    return [
        _output(0.2, 0.1, [0.01] * 100),  # A: 101 tokens, TPOT 0.01
        _output(0.5, 0.2, [1.0]),  # B: 2 tokens, TPOT 1.0
        _output(0.1, 0.3, [0.5] * 10),  # C: 11 tokens, TPOT 0.5, finishes last at 5.1 s
        _output(2.0, 1.5, []),  # D: 1 token, TPOT 0
        _output(0, 0, [], error="prompt too long"),  # E: rejected
    ]


def test_metrics_known_answers(outputs):
    s = summarize(outputs, tbt_slo=0.51, slo_ttft=0.3, slo_tpot=0.6)
    assert (s.num_requests, s.num_finished, s.num_errors) == (5, 4, 1)
    # TBT pools 111 decode gaps: 100 x 0.01, 10 x 0.5, 1 x 1.0. Token-level P99 is 0.5 (index
    # 108.9 of 110), although request B's only gap is 1.0.
    assert s.tbt.count == 111
    assert s.tbt.p50 == pytest.approx(0.01) and s.tbt.p90 == pytest.approx(0.01)
    assert s.tbt.p99 == pytest.approx(0.5) and s.tbt.max == pytest.approx(1.0)
    assert s.tpot.count == 4 and s.tpot.p50 == pytest.approx((0.01 + 0.5) / 2)
    assert s.tpot.max == pytest.approx(1.0)
    assert s.ttft.p50 == pytest.approx(0.35)
    assert s.scheduling_delay.p50 == pytest.approx(0.25)
    assert s.e2e_latency.max == pytest.approx(5.1)
    # Makespan 0 -> 5.1 s; 115 output tokens; 4 x 10 prompt tokens.
    assert s.duration_s == pytest.approx(5.1)
    assert s.request_throughput == pytest.approx(4 / 5.1)
    assert s.output_token_throughput == pytest.approx(115 / 5.1)
    assert s.total_token_throughput == pytest.approx(155 / 5.1)
    # A (0.2, 0.01) and C (0.1, 0.5) meet TTFT <= 0.3 and TPOT <= 0.6; B, D and rejected E miss.
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.meets_capacity is True
    assert summarize(outputs, tbt_slo=0.4).meets_capacity is False
    assert summarize(outputs, tbt_slo=0.51, max_scheduling_delay=0.2).meets_capacity is False
    assert summarize(outputs).meets_capacity is None and s.as_dict()["tbt"]["count"] == 111
    table = format_side_by_side({"sarathi": s, "prefill_first": summarize(outputs[:2])})
    assert "sarathi" in table.splitlines()[0] and "prefill_first" in table.splitlines()[0]
    assert any(line.startswith("TBT P99 ms") and "500.0" in line for line in table.splitlines())
    assert (s.num_prompt_tokens, s.num_cached_tokens, s.prefix_cache_hit_rate) == (40, 0, 0.0)


def test_prefix_cache_hit_rate():
    outputs = [
        _output(0.1, 0.0, [0.01], prompt_len=100, num_cached_tokens=0),
        _output(0.1, 0.0, [0.01], prompt_len=100, num_cached_tokens=96),
        _output(0.1, 0.0, [0.01], prompt_len=40, num_cached_tokens=32),
        _output(0, 0, [], prompt_len=50, error="rejected", num_cached_tokens=48),  # not counted
    ]
    s = summarize(outputs)
    assert (s.num_prompt_tokens, s.num_cached_tokens) == (240, 128)
    assert s.prefix_cache_hit_rate == pytest.approx(128 / 240)
    assert s.as_dict()["prefix_cache_hit_rate"] == pytest.approx(0.5333333)
    assert summarize(outputs[3:]).prefix_cache_hit_rate is None  # no prompt tokens
    lines = format_side_by_side({"off": summarize(outputs[:1]), "lpm": s}).splitlines()
    for label, cells in [
        ("prefix cache hit rate", ["0.0%", "53.3%"]),
        ("prompt tokens (cached/all)", ["0/100", "128/240"]),
    ]:
        assert [line[len(label) :].split() for line in lines if line.startswith(label)] == [cells]


# ------------------------------------------------------------------------------------------------
# Capacity search.


def _synthetic_system(capacity):
    """P99 TBT grows with load and crosses 0.5 s at `capacity`; scheduling delay is small."""
    calls = []

    def run_at_qps(qps):
        calls.append(qps)
        return SimpleNamespace(
            tbt=SimpleNamespace(p99=0.5 * qps / capacity),
            scheduling_delay=SimpleNamespace(p50=0.3 * qps / capacity),
        )

    return run_at_qps, calls


@pytest.mark.parametrize("capacity", [0.37, 7.3, 95.0])
def test_capacity_search_finds_the_threshold(capacity):
    run, calls = _synthetic_system(capacity)
    result = capacity_search(run, tbt_slo=0.5, lo=0.0, hi=2.0)
    assert capacity * (1 - 0.05) <= result.capacity_qps <= capacity
    assert len(result.trials) == len(calls) <= 20
    assert all(ok == (q <= capacity) for q, _, ok in result.trials)


def test_capacity_search_when_nothing_passes():
    run = lambda qps: SimpleNamespace(
        tbt=SimpleNamespace(p99=1.0), scheduling_delay=SimpleNamespace(p50=0.0)
    )
    result = capacity_search(run, tbt_slo=0.5, hi=1.0, max_iters=6)
    assert result.capacity_qps == 0.0 and len(result.trials) == 6


# ------------------------------------------------------------------------------------------------
# End to end on the tiny model.


@pytest.fixture(scope="module")
def tiny_llm():
    from llmjax import LLM

    return LLM(
        "tiny",
        load_format="dummy",
        max_model_len=64,
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        compilation_cache_dir="",
    )


def test_replay_realtime_on_tiny(tiny_llm):
    specs = workloads.fixed(4, prompt_len=8, output_len=3, qps=40.0, seed=0)
    replay(tiny_llm.engine, specs, realtime=False)  # compile
    t0 = time.perf_counter()
    outputs = replay(tiny_llm.engine, specs, realtime=True)
    assert [len(o.token_ids) for o in outputs] == [3] * 4
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)
    arrivals = np.array([o.metrics.arrival_time for o in outputs]) - t0
    expected = np.array([s.arrival_time for s in specs])
    np.testing.assert_allclose(arrivals - arrivals[0], expected - expected[0], atol=1e-6)
    s = summarize(outputs)
    assert s.num_finished == 4 and s.tbt.count == 4 * 2 and s.output_token_throughput > 0


def test_measure_decode_step_on_tiny(tiny_llm):
    from llmjax.bench import measure_decode_step

    engine = tiny_llm.engine
    ref = measure_decode_step(engine, num_requests=3, num_steps=4, prompt_len=6)
    assert ref["num_steps"] == 4 and ref["decodes_per_step"] == 3 and ref["num_running"] == 3
    assert ref["host_ms_per_step"] > 0 and ref["device_ms_per_step"] > 0
    assert ref["wall_ms_per_step"] >= ref["device_ms_per_step"]
    assert not engine.has_unfinished_requests()  # its requests were aborted, pages freed
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_benchmark_script_in_process(tmp_path, capsys):
    from tests.helpers import run_benchmark_script

    out = str(tmp_path / "bench.json")
    run_benchmark_script(
        [
            "--model=tiny",
            "--load_format=dummy",
            "--policies=sarathi,prefill_first",
            "--workload=fixed",
            "--num_requests=4",
            "--prompt_len=8",
            "--output_len=3",
            "--qps=inf",
            "--max_model_len=64",
            "--max_num_seqs=4",
            "--max_num_batched_tokens=32",
            "--page_size=4",
            "--warmup=4",
            "--tbt_slo=10",
            f"--json_out={out}",
            f"--plot_dir={tmp_path / 'plots'}",
            f"--profile_dir={tmp_path / 'profiles'}",
            "--batch_sizes=2",
            "--capacity_search",
            "--capacity_start_qps=50",
            "--capacity_max_iters=2",
        ]
    )
    table = capsys.readouterr().out
    for name in [
        "timeline_sarathi",
        "timeline_prefill_first",
        "tbt_cdf",
        "capacity",
        "throughput_vs_batch",
    ]:
        png = (tmp_path / "plots" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000, name
    assert "capacity qps" in table and "throughput at batch N" in table
    header = next(line for line in table.splitlines() if line.startswith("metric"))
    assert "sarathi" in header and "prefill_first" in header
    assert "TBT P99 ms" in table and "host ms/step" in table
    doc = json.load(open(out))
    assert set(doc["variants"]) == {"sarathi", "prefill_first"}
    for result in doc["variants"].values():
        assert result["summary"]["num_finished"] == 4
    for variant in ("sarathi", "prefill_first"):  # each measured run profiled on its own
        profile = tmp_path / "profiles" / variant / "plugins" / "profile"
        [xplane] = profile.glob("*/*.xplane.pb")
        assert b"llmjax_step" in xplane.read_bytes()
        assert result["engine_stats"]["num_steps"] > 0
        assert result["summary"]["meets_capacity"] is True
    assert math.isclose(doc["tbt_slo"], 10.0)

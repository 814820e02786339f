"""The benchmark harness: workload statistics, arrivals, traces, metrics with known answers, the
capacity search on a synthetic system, and an end-to-end run on the tiny model."""

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from llmjax.bench import capacity_search, format_side_by_side, replay, summarize, workloads
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


# ------------------------------------------------------------------------------------------------
# Metrics.


def _output(ttft, delay, gaps, prompt_len=10, error=None):
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


def test_benchmark_script_in_process(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "benchmark_script", os.path.join(ROOT, "scripts", "benchmark.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = str(tmp_path / "bench.json")
    bench.FLAGS(
        [
            "benchmark.py",
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
        ]
    )
    try:
        bench.main([])
    finally:
        bench.FLAGS.unparse_flags()
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("metric"))
    assert "sarathi" in header and "prefill_first" in header
    assert "TBT P99 ms" in table and "host ms/step" in table
    doc = json.load(open(out))
    assert set(doc["policies"]) == {"sarathi", "prefill_first"}
    for result in doc["policies"].values():
        assert result["summary"]["num_finished"] == 4
        assert result["engine_stats"]["num_steps"] > 0
        assert result["summary"]["meets_capacity"] is True
    assert math.isclose(doc["tbt_slo"], 10.0)

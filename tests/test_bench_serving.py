"""The serving load generator (llmjax/bench/serving.py), the Mooncake trace loader
(llmjax/bench/mooncake.py), and scripts/serve.py + scripts/bench_serving.py end to end (a real
server process on 127.0.0.1, stopped at the end)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from llmjax.bench.mooncake import block_token_ids, is_mooncake_trace, load_mooncake_trace
from llmjax.bench.serving import (
    RequestResult,
    arrival_schedule,
    parse_goodput,
    summarize_serving,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOONCAKE = os.path.join(ROOT, "..", "shared", "data", "mooncake", "conversation_trace.jsonl")


def test_arrival_schedule_rate_and_burstiness():
    assert arrival_schedule(5, float("inf")).tolist() == [0.0] * 5
    poisson = arrival_schedule(20000, 4.0, 1.0, seed=1)
    gaps = np.diff(poisson)
    assert poisson[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    smooth = np.diff(arrival_schedule(20000, 4.0, 8.0, seed=1))
    assert smooth.mean() == pytest.approx(0.25, rel=0.03) and smooth.std() < 0.5 * gaps.std()
    with pytest.raises(ValueError, match="request_rate"):
        arrival_schedule(3, 0.0)


def test_goodput_and_attainment():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttft", "speed:5", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])

    def result(ttft, latency, n, itl=()):
        return RequestResult(10, True, "", n, ttft, list(itl), latency)

    results = [
        result(0.1, 1.1, 11, [0.1] * 10),  # TPOT 0.1
        result(0.6, 1.6, 11, [0.1] * 10),  # TTFT misses
        result(0.2, 4.2, 11, [0.4] * 10),  # TPOT 0.4 misses
        result(0.3, 0.3, 1),  # one token: TPOT 0
        RequestResult(10, False, "HTTP 503"),
    ]
    s = summarize_serving(results, 2.0, goodput={"ttft": 0.5, "tpot": 0.2})
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["request_goodput"] == 2 / 2.0  # requests 0 and 3
    assert s["slo_attainment"] == 2 / 5  # failed ones miss (DistServe)
    assert s["output_throughput"] == 34 / 2.0 and s["total_input_tokens"] == 40
    assert s["mean_tpot_ms"] == pytest.approx(200.0)  # over requests with > 1 token
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p99_itl_ms"] == pytest.approx(400.0)
    assert summarize_serving(results, 2.0)["request_goodput"] is None


def _mooncake_lines(path, rows):
    with open(path, "w") as f:
        for t, n_in, n_out, ids in rows:
            f.write(
                json.dumps(
                    {"timestamp": t, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
                )
                + "\n"
            )


def test_mooncake_trace_shares_prefix_blocks(tmp_path):
    path = tmp_path / "trace.jsonl"
    _mooncake_lines(
        path,
        [
            (1000, 1100, 30, [0, 1, 2]),  # 2 whole blocks + 76 tokens
            (1500, 600, 10, [0, 3]),  # shares block 0
            (4000, 512, 5, [7]),
        ],
    )
    assert is_mooncake_trace(str(path))
    specs = load_mooncake_trace(str(path), vocab_size=1000, block_tokens=16)
    assert [s.arrival_time for s in specs] == [0.0, 0.5, 3.0]
    assert [s.prompt_len for s in specs] == [35, 19, 16]  # ceil(n * 16 / 512)
    assert [s.output_len for s in specs] == [30, 10, 5]
    a, b, c = (list(s.prompt_token_ids) for s in specs)
    assert a[:16] == b[:16] == block_token_ids(0, 16, 1000)  # the shared first block
    assert a[16:32] != b[16:32] and c == block_token_ids(7, 16, 1000)
    assert all(100 <= t < 1000 for t in a)
    fast = load_mooncake_trace(str(path), vocab_size=1000, block_tokens=16, time_scale=0.5)
    assert [s.arrival_time for s in fast] == [0.0, 0.25, 1.5]
    clipped = load_mooncake_trace(
        str(path), vocab_size=1000, block_tokens=512, max_model_len=200, num_requests=2
    )
    assert len(clipped) == 2 and all(s.prompt_len + s.output_len <= 200 for s in clipped)
    bad = tmp_path / "bad.jsonl"
    _mooncake_lines(bad, [(0, 600, 5, [1])])  # one block for 600 tokens
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 1 hash_ids cover fewer"):
        load_mooncake_trace(str(bad), vocab_size=1000)
    bad.write_text('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: input_length=0 must be"):
        load_mooncake_trace(str(bad), vocab_size=1000)


@pytest.mark.skipif(not os.path.exists(MOONCAKE), reason="../shared/data/mooncake not present")
def test_the_real_conversation_trace_starts_with_its_shared_system_block():
    specs = load_mooncake_trace(MOONCAKE, vocab_size=49152, block_tokens=8, num_requests=50)
    first = block_token_ids(0, 8, 49152)
    assert all(list(s.prompt_token_ids[:8]) == first for s in specs)  # hash id 0 in every line
    assert specs[0].output_len == 500 and specs[0].prompt_len == -(-6758 * 8 // 512)


# ------------------------------------------------------------------------------------------------
# The scripts, against a real server process.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process(smollm2_path):
    """scripts/serve.py on a free loopback port (SmolLM2's tokenizer, random 2-layer body), with
    engine flags through --config.*; yields (url, process); stopped with SIGINT at the end."""
    port = _free_port()
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "serve.py"),
        "--model=smollm2-tiny",
        "--load_format=dummy",
        f"--tokenizer={smollm2_path}",
        "--max_model_len=256",
        "--num_pages=96",
        "--max_num_seqs=8",
        "--config.scheduler.policy=prefill_first",
        "--config.cache.watermark=0.02",
        "--metrics_prefix=vllm",
        "--api_key=k3y",
        f"--port={port}",
        "--log_level=warning",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "scripts/serve.py did not start"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_serve_script_then_bench_serving_against_it(serve_process, smollm2_path, tmp_path):
    """The server script with engine flags, the openai client against it, then the load
    generator on a Mooncake-format trace (server, and the same requests offline)."""
    url, proc = serve_process
    auth = {"authorization": "Bearer k3y"}
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "vllm:engine_config_info{" in metrics and 'scheduler_policy="prefill_first"' in metrics
    assert 'watermark="0.02"' in metrics  # the --config.* flags reached the engine
    client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="smollm2-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert reply.usage.completion_tokens == 5 or reply.choices[0].finish_reason == "stop"

    trace = tmp_path / "mooncake.jsonl"
    _mooncake_lines(trace, [(i * 50, 700 + 10 * i, 6, [0, 10 + i]) for i in range(8)])
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_serving.py"),
            f"--base_url={url}",
            "--api_key=k3y",
            "--dataset=trace",
            f"--trace={trace}",
            "--mooncake_block_tokens=16",
            "--max_concurrency=1",  # one at a time: each finds the shared block cached
            "--goodput=ttft:60000,tpot:60000",
            "--warmup=0",
            "--disable_tqdm",
            "--offline",  # the same engine in the bench process, after the server run
            "--model=smollm2-tiny",
            "--load_format=dummy",
            f"--tokenizer={smollm2_path}",
            "--max_model_len=256",
            "--num_pages=96",
            f"--json_out={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert run.returncode == 0, run.stderr
    assert "output throughput (tok/s)" in run.stdout and "server /metrics mean TTFT" in run.stdout
    runs = json.loads(out.read_text())["runs"]
    assert "server / offline output throughput" in run.stdout
    offline, server = runs["offline"], runs["server"]
    assert offline["completed"] == 8 and offline["total_output_tokens"] == 8 * 6
    assert server["completed"] == 8 and server["failed"] == 0
    assert server["total_output_tokens"] == 8 * 6
    assert server["slo_attainment"] == 1.0 and server["request_goodput"] > 0
    assert server["mean_ttft_ms"] > 0 and server["server_mean_ttft_ms"] > 0
    # the trace's shared first block became prefix-cache hits on the server (7 requests x 16)
    metrics = httpx.get(url + "/metrics", headers=auth, timeout=30).text
    hits = [
        line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")
    ]
    assert hits and float(hits[0].split()[-1]) >= 7 * 16

    proc.send_signal(signal.SIGINT)  # stops cleanly
    assert proc.wait(30) == 0


def test_server_means_from_llmjax_and_vllm_metrics():
    """The server's own means between two /metrics reads; vLLM's server counts its steps'
    tokens but has no step durations or padding: those stay None instead of failing."""
    from llmjax.bench.serving import server_means

    before = {"time_to_first_token_seconds": (1.0, 2.0), "iteration_tokens_total": (100.0, 4.0)}
    vllm = {"time_to_first_token_seconds": (4.0, 5.0), "iteration_tokens_total": (460.0, 14.0)}
    means = server_means(before, vllm)
    assert means["server_mean_ttft_ms"] == pytest.approx(1000.0)
    assert means["server_num_steps"] == 10 and means["server_tokens_per_step"] == 36.0
    assert means["server_ms_per_step"] is None and means["server_padded_tokens_per_step"] is None
    llmjax = vllm | {"step_duration_seconds": (0.5, 10.0), "padded_tokens": (400.0, 0.0)}
    means = server_means(before, llmjax)
    assert means["server_ms_per_step"] == pytest.approx(50.0)
    assert means["server_padded_tokens_per_step"] == 40.0

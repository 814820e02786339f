r"""Load-test an OpenAI-compatible server with `vllm bench serve`'s semantics (llmjax/bench/
serving.py): Poisson (gamma) arrivals at --request_rate or all at once, at most --max_concurrency
in flight, streamed responses timed at every text-bearing chunk. Prints a table, writes JSON.

    # a running server (scripts/serve.py, or any OpenAI-compatible one)
    python scripts/bench_serving.py --base_url http://127.0.0.1:8000 --dataset random \
        --num_prompts 64 --random_input_len 128 --random_output_len 64 --max_concurrency 16
    # start scripts/serve.py with the engine flags given here, then run the same requests
    # through LLM.generate in this process: the server's overhead, measured in one run
    python scripts/bench_serving.py --launch_server --offline --max_num_seqs 16 \
        --num_prompts 64 --random_input_len 128 --random_output_len 64 --max_concurrency 16
    # Mooncake's conversation trace at 1/32 of its lengths, at its own arrival times
    python scripts/bench_serving.py --launch_server --dataset trace --num_prompts 200 \
        --trace ../shared/data/mooncake/conversation_trace.jsonl --mooncake_block_tokens 16
    # SLOs: vLLM's goodput (good requests/s) and DistServe's attainment
    python scripts/bench_serving.py --goodput ttft:500,tpot:50

Datasets: `random` (uniform lengths within --random_range_ratio of --random_input_len /
--random_output_len, random token ids), `sharegpt` (ShareGPT-shaped lognormal lengths from
llmjax/bench/length_workloads.py, times --sharegpt_scale), `trace` (--trace: llmjax's JSONL
trace, or a Mooncake trace, recognized by its hash_ids, whose blocks become shared token runs: see
llmjax/bench/mooncake.py). A trace keeps its arrival times unless --request_rate is given.
Token-id prompts go to /v1/completions; with --endpoint chat they are detokenized first (by the
server's /detokenize). --warmup passes over a same-shaped workload of other prompts run first,
unmeasured (so compilation is excluded and the measured prompts meet a cold prefix cache).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
from absl import app, flags

from llmjax import engine_flags
from llmjax.bench.serving import HISTOGRAMS, server_means, stop_server

engine_flags.define_flags()  # for --launch_server and --offline: the engine to build
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "The server (without /v1).")
flags.DEFINE_bool(
    "launch_server",
    False,
    "Start scripts/serve.py on a free local port with this command's engine flags, benchmark "
    "it, and stop it (instead of --base_url).",
)
flags.DEFINE_bool(
    "offline",
    False,
    "Also run the same requests through LLM.generate in this process (same engine flags), "
    "after the server run, and report the server's overhead.",
)
flags.DEFINE_enum("endpoint", "completions", ["completions", "chat"], "Which API to call.")
flags.DEFINE_enum("dataset", "random", ["random", "sharegpt", "trace"], "Where prompts come from.")
flags.DEFINE_integer("num_prompts", 64, "Requests to send (a trace's first ones).")
flags.DEFINE_integer("random_input_len", 128, "random: prompt tokens.")
flags.DEFINE_integer("random_output_len", 64, "random: output tokens.")
flags.DEFINE_float(
    "random_range_ratio", 0.0, "random: lengths uniform in [len * (1 - r), len * (1 + r)]."
)
flags.DEFINE_float("sharegpt_scale", 1 / 16, "sharegpt: length scale (1/16: ~100-token prompts).")
flags.DEFINE_string("trace", None, "trace: a JSONL trace (llmjax's or Mooncake's).")
flags.DEFINE_integer(
    "mooncake_block_tokens", 512, "Mooncake traces: tokens per hash block (512: as recorded)."
)
flags.DEFINE_float("mooncake_output_scale", 1.0, "Mooncake traces: output length scale.")
flags.DEFINE_float("trace_time_scale", 1.0, "trace: arrival times scale (0.5: twice the rate).")
flags.DEFINE_string(
    "request_rate", "inf", "Requests/s (gamma arrivals), or 'inf': all at once (a trace: its own)."
)
flags.DEFINE_float("burstiness", 1.0, "Gamma shape of the arrivals (1: Poisson).")
flags.DEFINE_integer("max_concurrency", None, "At most this many requests in flight.")
flags.DEFINE_integer("seed", 0, "Seed of lengths, token ids and arrivals.")
flags.DEFINE_list("goodput", [], "SLOs in ms as KEY:MS (ttft, tpot, e2el), e.g. ttft:500,tpot:50.")
flags.DEFINE_list("percentiles", ["50", "90", "99"], "Percentiles to report.")
flags.DEFINE_bool("ignore_eos", True, "Generate exactly the output lengths (as vLLM's random).")
flags.DEFINE_integer("warmup", 1, "Unmeasured passes over a same-shaped workload first.")
flags.DEFINE_integer(
    "vocab_size", None, "For random token ids (default: the server's /v1/models vocab_size)."
)
flags.DEFINE_string("api_key", None, "Sent as 'Authorization: Bearer <key>'.")
flags.DEFINE_bool("disable_tqdm", False, "No progress bar.")
flags.DEFINE_integer("server_startup_timeout", 900, "Seconds to wait for --launch_server.")
flags.DEFINE_string("json_out", "out/bench_serving.json", "Where to write the results ('': none).")

FLAGS = flags.FLAGS
SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")


def _log(msg: str) -> None:
    print(f"[bench_serving] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Requests.


def build_requests(vocab_size: int, max_model_len: int, seed: int):
    """(ServingRequests, send times or None for the --request_rate schedule)."""
    from llmjax.bench import workloads
    from llmjax.bench.mooncake import is_mooncake_trace, load_mooncake_trace
    from llmjax.bench.serving import ServingRequest

    n = FLAGS.num_prompts
    times = None
    if FLAGS.dataset == "random":
        import numpy as np

        rng = np.random.default_rng([seed, 7])
        r = FLAGS.random_range_ratio

        def lengths(mean):
            lo, hi = max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r)))
            return rng.integers(lo, hi + 1, n).tolist()

        specs = []
        for p, o in zip(
            lengths(FLAGS.random_input_len), lengths(FLAGS.random_output_len), strict=True
        ):
            p, o = workloads.clip_to_context(p, o, max_model_len)
            specs.append(workloads.RequestSpec(arrival_time=0.0, prompt_len=p, output_len=o))
    elif FLAGS.dataset == "sharegpt":
        specs = workloads.sharegpt(
            n, scale=FLAGS.sharegpt_scale, max_model_len=max_model_len, seed=seed
        )
    elif not FLAGS.trace:
        raise app.UsageError("--dataset trace needs --trace PATH")
    elif is_mooncake_trace(FLAGS.trace):
        specs = load_mooncake_trace(
            FLAGS.trace,
            vocab_size=vocab_size,
            block_tokens=FLAGS.mooncake_block_tokens,
            output_scale=FLAGS.mooncake_output_scale,
            time_scale=FLAGS.trace_time_scale,
            max_model_len=max_model_len,
            num_requests=n,
            seed=seed,
        )
        times = [s.arrival_time for s in specs]
    else:
        specs = workloads.load_trace(FLAGS.trace)[:n]
        if any(s.parent is not None for s in specs):
            raise app.UsageError("dependent requests (parent) are not supported over HTTP")
        times = [s.arrival_time * FLAGS.trace_time_scale for s in specs]
    specs = workloads.with_token_ids(specs, vocab_size, seed=seed)
    requests = [
        ServingRequest(list(s.prompt_token_ids), len(s.prompt_token_ids), s.output_len)
        for s in specs
    ]
    return requests, times


def send_times(count: int, trace_times, seed: int):
    from llmjax.bench.serving import arrival_schedule

    rate = float(FLAGS.request_rate)
    if trace_times is not None and not FLAGS["request_rate"].present:
        return trace_times
    return arrival_schedule(count, rate, FLAGS.burstiness, seed).tolist()


def _as_text(base_url: str, requests, headers):
    """Token-id prompts -> text through the server's /detokenize (for the chat endpoint)."""
    import dataclasses

    out = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for r in requests:
            text = client.post("/detokenize", json={"tokens": r.prompt}).json()["prompt"]
            out.append(dataclasses.replace(r, prompt=text))
    return out


# ------------------------------------------------------------------------------------------------
# The server.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server():
    port = _free_port()
    cmd = [sys.executable, SERVE, *engine_flags.argv(FLAGS), "--host=127.0.0.1", f"--port={port}"]
    cmd.append("--log_level=warning")
    _log(f"starting {' '.join(cmd)}")
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + FLAGS.server_startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"scripts/serve.py exited with {proc.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(
                f"the server did not answer /health in {FLAGS.server_startup_timeout} s"
            )
        time.sleep(0.5)


# llmjax's step histograms and counters (other servers have none: their rows stay empty)
STEP_HISTOGRAMS = ("iteration_tokens_total", "step_duration_seconds")
STEP_COUNTERS = ("padded_tokens",)


def server_latency(base_url: str, headers) -> dict:
    """{histogram: (sum, count)} of the server's own TTFT, ITL and (llmjax) step histograms,
    {counter: (value, 0)} of its padded-token counter (GET /metrics, any prefix)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers, timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        name = next((h for h in (*HISTOGRAMS, *STEP_HISTOGRAMS) if family.name.endswith(h)), None)
        if name is not None:
            values = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples}
            out[name] = (values.get("sum", 0.0), values.get("count", 0.0))
        elif family.type == "counter" and family.name.endswith(STEP_COUNTERS):
            out[family.name.rsplit(":", 1)[-1]] = (sum(s.value for s in family.samples), 0.0)
    return out


def _passes():
    """(name, seed) of the warm-up passes (other prompts, same shapes) and the measured one."""
    warmups = [("warmup", FLAGS.seed + 1000 + i) for i in range(FLAGS.warmup)]
    return [*warmups, ("measured", FLAGS.seed)]


def bench_server(base_url: str, percentiles, goodput) -> dict:
    from llmjax.bench.serving import run_benchmark, summarize_serving

    headers = {"Authorization": f"Bearer {FLAGS.api_key}"} if FLAGS.api_key else {}
    card = httpx.get(base_url + "/v1/models", headers=headers, timeout=60).json()["data"][0]
    vocab = FLAGS.vocab_size or card.get("vocab_size")
    if not vocab:
        raise app.UsageError("the server does not say its vocab_size: pass --vocab_size")
    max_len = card.get("max_model_len")
    runs = {}
    for name, seed in _passes():
        requests, trace_times = build_requests(vocab, max_len, seed)
        if FLAGS.endpoint == "chat":
            requests = _as_text(base_url, requests, headers)
        times = send_times(len(requests), trace_times, seed)
        before = server_latency(base_url, headers)
        results, duration = asyncio.run(
            run_benchmark(
                base_url,
                requests,
                model=card["id"],
                send_times=times,
                endpoint=FLAGS.endpoint,
                max_concurrency=FLAGS.max_concurrency,
                api_key=FLAGS.api_key,
                ignore_eos=FLAGS.ignore_eos,
                show_progress=not FLAGS.disable_tqdm,
            )
        )
        _log(f"{name} pass: {len(results)} requests in {duration:.1f} s")
        if name == "measured":
            summary = summarize_serving(results, duration, goodput=goodput, percentiles=percentiles)
            summary |= server_means(before, server_latency(base_url, headers))
            summary["model"] = card["id"]
            runs["server"] = summary
    return runs["server"]


# ------------------------------------------------------------------------------------------------
# The same requests offline, through LLM.generate.


def bench_offline(percentiles, goodput) -> dict:
    from llmjax import LLM, SamplingParams
    from llmjax.bench.serving import RequestResult, summarize_serving

    llm = LLM(FLAGS.model, **engine_flags.llm_kwargs(FLAGS))
    vocab, max_len = llm.model_config.vocab_size, llm.config.max_model_len
    summary = None
    for name, seed in _passes():
        requests, _ = build_requests(vocab, max_len, seed)
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=FLAGS.ignore_eos) for r in requests
        ]
        start = time.perf_counter()
        outputs = llm.generate(
            [r.prompt for r in requests], params, use_tqdm=not FLAGS.disable_tqdm
        )
        duration = max(o.metrics.finished_time for o in outputs) - start
        _log(f"offline {name} pass: {len(outputs)} requests in {duration:.1f} s")
        if name == "measured":
            results = [
                RequestResult(
                    prompt_len=len(o.prompt_token_ids),
                    success=o.error is None,
                    output_tokens=len(o.token_ids),
                    ttft=o.metrics.ttft or 0.0,
                    itl=o.metrics.tbt,
                    latency=o.metrics.e2e_latency or 0.0,
                )
                for o in outputs
            ]
            summary = summarize_serving(results, duration, goodput=goodput, percentiles=percentiles)
    return summary


# ------------------------------------------------------------------------------------------------


ROWS = [
    ("completed", "completed requests", "{:.0f}"),
    ("failed", "failed requests", "{:.0f}"),
    ("duration", "duration (s)", "{:.2f}"),
    ("request_throughput", "request throughput (req/s)", "{:.2f}"),
    ("output_throughput", "output throughput (tok/s)", "{:.1f}"),
    ("total_token_throughput", "total throughput (tok/s)", "{:.1f}"),
    ("request_goodput", "goodput (good req/s, vLLM)", "{:.2f}"),
    ("slo_attainment", "SLO attainment (DistServe)", "{:.3f}"),
]


def table(runs: dict, percentiles) -> str:
    from llmjax.bench.metrics import format_table

    rows = list(ROWS)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"mean_{metric}_ms", f"mean {metric.upper()} (ms)", "{:.2f}")]
        rows += [(f"median_{metric}_ms", f"median {metric.upper()} (ms)", "{:.2f}")]
        rows += [
            (f"p{p:g}_{metric}_ms", f"P{p:g} {metric.upper()} (ms)", "{:.2f}")
            for p in percentiles
            if p != 50
        ]
    rows += [
        ("server_mean_ttft_ms", "server /metrics mean TTFT (ms)", "{:.2f}"),
        ("server_mean_itl_ms", "server /metrics mean ITL (ms)", "{:.2f}"),
        ("server_num_steps", "server steps", "{}"),
        ("server_tokens_per_step", "server tokens per step", "{:.1f}"),
        ("server_padded_tokens_per_step", "server padded tokens per step", "{:.1f}"),
        ("server_ms_per_step", "server ms per step", "{:.1f}"),
    ]
    names = list(runs)
    body = []
    for key, label, fmt in rows:
        values = [runs[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        body.append([label, *("-" if v is None else fmt.format(v) for v in values)])
    if "offline" in runs and "server" in runs:
        s, o = runs["server"], runs["offline"]
        body.append(
            [
                "server / offline output throughput",
                f"{s['output_throughput'] / o['output_throughput']:.3f}",
                "",
            ]
        )
        body.append(
            [
                "server - offline median ITL (ms)",
                f"{s['median_itl_ms'] - o['median_itl_ms']:+.2f}",
                "",
            ]
        )
    return format_table(["metric", *names], body)


def main(argv):
    del argv
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    percentiles = [float(p) for p in FLAGS.percentiles]
    from llmjax.bench.serving import parse_goodput

    try:
        goodput = parse_goodput(FLAGS.goodput)
        float(FLAGS.request_rate)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    runs = {}
    if FLAGS.launch_server:
        proc, url = launch_server()
        try:
            runs["server"] = bench_server(url, percentiles, goodput)
        finally:
            stop_server(proc)
    elif not FLAGS.offline or FLAGS["base_url"].present:
        runs["server"] = bench_server(FLAGS.base_url, percentiles, goodput)
    if FLAGS.offline:
        runs["offline"] = bench_offline(percentiles, goodput)
    print(table(runs, percentiles), flush=True)
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        doc = {
            "flags": {
                f.name: f.value
                for module in (sys.argv[0], engine_flags.__name__)
                for f in FLAGS.get_flags_for_module(module)
                if f.name != engine_flags.CONFIG_FLAG
            }
            | {"config_overrides": engine_flags.config_overrides(FLAGS)},
            "runs": runs,
        }
        with open(FLAGS.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

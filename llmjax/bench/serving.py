"""An asynchronous load generator for an OpenAI-compatible server, with `vllm bench serve`'s
semantics (scripts/bench_serving.py is its command line):

- requests are sent on an arrival schedule: every inter-arrival gap drawn from a gamma
  distribution with shape `burstiness` and mean 1 / request_rate (burstiness 1: Poisson), or all
  at once for an infinite rate; at most `max_concurrency` are in flight (a semaphore; the wait
  for it is not counted in the request's latencies);
- each request streams (`stream_options.include_usage`), and its clock starts when it is sent:
  TTFT at the first chunk that carries text, ITL the gaps between text-bearing chunks, E2E at
  the last chunk, the output tokens from the usage chunk, TPOT = (E2E - TTFT) / (tokens - 1);
- goodput: vLLM's good requests per second (a request is good when it meets every given SLO of
  ttft, tpot, e2el), and DistServe's SLO attainment (the fraction of all requests, failed ones
  included, that are good).

httpx only; no jax.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Sequence

import httpx
import numpy as np

from llmjax.progress import progress_bar

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it (seconds, from when it was sent)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    text: str = ""

    @property
    def tpot(self) -> float:
        return (
            (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0
        )


@dataclasses.dataclass(frozen=True)
class ServingRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int
    output_len: int


def arrival_schedule(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send times [n] in seconds from the start: cumulative gamma gaps (shape burstiness, mean
    1 / request_rate), the first at 0; all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"need {request_rate=} > 0 (or inf) and {burstiness=} > 0")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] (milliseconds, vLLM's --goodput) -> {'ttft': 0.5, 'tpot': 0.05}."""
    slos = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput {item!r}: want KEY:MS with KEY in {GOODPUT_KEYS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"goodput {item!r}: {value!r} is not a number of milliseconds"
            ) from None
        if ms < 0:
            raise ValueError(f"goodput {item!r}: the SLO must be >= 0 ms")
        slos[key] = ms / 1000.0
    return slos


async def _send(
    client: httpx.AsyncClient,
    endpoint: str,
    model: str,
    request: ServingRequest,
    ignore_eos: bool,
    extra_body: dict,
) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    body = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        **extra_body,
    }
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body |= {
            "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.output_len,
        }
    else:
        path = "/v1/completions"
        body |= {"prompt": request.prompt, "max_tokens": request.output_len}
    start = time.perf_counter()
    last = None
    pieces = []
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage") and not chunk.get("choices"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    continue
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if not text and not choice.get("token_ids"):  # (a server without a tokenizer)
                    continue
                pieces.append(text)
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = (last or time.perf_counter()) - start
        result.text = "".join(pieces)
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(
    base_url: str,
    requests: Sequence[ServingRequest],
    *,
    model: str,
    send_times: Sequence[float],
    endpoint: str = "completions",
    max_concurrency: int | None = None,
    api_key: str | None = None,
    ignore_eos: bool = True,
    extra_body: dict | None = None,
    show_progress: bool | None = True,
    timeout: float = 6 * 3600,
) -> tuple[list[RequestResult], float]:
    """Send `requests` at `send_times`; returns their results (in order) and the duration (first
    send to last completion, seconds)."""
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"{endpoint=} must be 'completions' or 'chat'")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    bar = progress_bar(len(requests), "requests", unit="req", show=show_progress)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        start = time.perf_counter()

        async def one(request: ServingRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with semaphore:
                result = await _send(client, endpoint, model, request, ignore_eos, extra_body or {})
            bar.update(1)
            return result

        results = await asyncio.gather(
            *[one(r, float(t)) for r, t in zip(requests, send_times, strict=True)]
        )
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _stats(values_s: Sequence[float], percentiles: Sequence[float], name: str) -> dict:
    """vLLM's keys: mean_/median_/std_/pXX_<name>_ms."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0 if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(a.mean()),
        f"median_{name}_ms": float(np.median(a)),
        f"std_{name}_ms": float(a.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return out


def summarize_serving(
    results: Sequence[RequestResult],
    duration: float,
    *,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict:
    """The run's metrics under vLLM's result keys, plus DistServe's `slo_attainment`."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    summary = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
    }
    summary |= _stats([r.ttft for r in ok], percentiles, "ttft")
    summary |= _stats([r.tpot for r in ok if r.output_tokens > 1], percentiles, "tpot")
    summary |= _stats([g for r in ok for g in r.itl], percentiles, "itl")
    summary |= _stats([r.latency for r in ok], percentiles, "e2el")
    summary["request_goodput"] = summary["slo_attainment"] = None
    if goodput:
        measured = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency"}
        good = sum(all(getattr(r, measured[k]) <= slo for k, slo in goodput.items()) for r in ok)
        summary["request_goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(results) if results else None
        summary["goodput_slos_ms"] = {k: v * 1000.0 for k, v in goodput.items()}
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


# The servers' latency histograms scripts/bench_serving.py reads from /metrics (any prefix).
HISTOGRAMS = {"time_to_first_token_seconds": "ttft", "inter_token_latency_seconds": "itl"}


def server_means(before: dict, after: dict) -> dict:
    """What the server measured between two /metrics reads: mean TTFT / ITL, and llmjax's
    steps (count, real and padded tokens per step, ms per step)."""
    means = {}
    delta = {
        name: tuple(b - a for a, b in zip(before.get(name, (0.0, 0.0)), after[name], strict=True))
        for name in after
    }
    for name, key in HISTOGRAMS.items():
        s, n = delta.get(name, (0.0, 0.0))
        means[f"server_mean_{key}_ms"] = 1000 * s / n if n else None
    tokens, steps = delta.get("iteration_tokens_total", (0.0, 0.0))
    if steps:
        means["server_num_steps"] = int(steps)
        means["server_tokens_per_step"] = tokens / steps
        duration = delta.get("step_duration_seconds")  # llmjax's; vLLM's server has none
        means["server_ms_per_step"] = 1000 * duration[0] / steps if duration else None
        padded = delta.get("padded_tokens", (0.0, 0.0))[0]
        means["server_padded_tokens_per_step"] = padded / steps if padded else None
    return means


def stop_server(proc, timeout: float = 60) -> None:
    """Stop a server process as a user would (SIGINT: it drains and exits), killing it only if
    it has not exited after `timeout` seconds."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

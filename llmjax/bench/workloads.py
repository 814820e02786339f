"""Workloads: what requests arrive when, with how many prompt and output tokens.

A workload is a list of `RequestSpec`s: lengths (or a prompt) plus an arrival time in seconds from
the start of the run. Lengths and arrivals are drawn from separate seeded streams, so the same
`seed` gives the same requests at every QPS (what a capacity search needs).

Generators (ALGORITHMS.md §3.4 for the length statistics):
  sharegpt   chat: lognormal lengths fitted to ShareGPT4's median and P90 (prompt 1730 / 5696,
             output 415 / 834 tokens), filtered like the source trace to <= 8192 tokens in all.
  arxiv      summarization: arXiv-summarization's (prompt 2730 / 3702, output 167 / 372), <= 4096.
  long_prompt_interference
             decode-heavy short requests at t=0, then long prompts arriving while they decode:
             whole-prompt policies (prefill_first) stall every decode, stall-free ones (sarathi)
             do not.
  fixed      every request the same lengths (throughput at batch N, with qps=inf).
Lengths are then multiplied by `scale` (default 1/16, so a CPU serves them: ShareGPT medians become
~108 prompt and ~26 output tokens) and clipped so prompt + output <= max_model_len.

Arrivals: Poisson at `qps` requests/s (seeded exponential gaps, first at t=0), or all at t=0 when
`qps` is inf.

Trace files are JSONL, one request per line:
    {"arrival_time": 0.0, "prompt": "Tell me a story", "output_len": 64}
    {"arrival_time": 0.5, "prompt_len": 812, "output_len": 128}
(`prompt_token_ids` may replace `prompt`/`prompt_len`.) Requests given by length get seeded random
token ids in [100, vocab_size) when they are run (`with_token_ids`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import numpy as np

Z90 = 1.2815515655446004  # the standard normal's 90th percentile
MIN_RANDOM_TOKEN_ID = 100  # random prompts avoid the low ids where special tokens live
DEFAULT_SCALE = 1 / 16


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. The prompt is `prompt_token_ids`, else `prompt` (text, tokenized
    when run), else `prompt_len` random token ids."""

    arrival_time: float  # seconds from the start of the run
    output_len: int  # tokens to generate (ignore_eos, so exactly this many)
    prompt_len: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    def __post_init__(self):
        if self.prompt_token_ids is not None:
            ids = tuple(int(t) for t in self.prompt_token_ids)
            object.__setattr__(self, "prompt_token_ids", ids)
            if self.prompt_len is None:
                object.__setattr__(self, "prompt_len", len(ids))
            elif self.prompt_len != len(ids):
                raise ValueError(f"{self.prompt_len=} != len(prompt_token_ids)={len(ids)}")
        if self.prompt_len is None and self.prompt is None:
            raise ValueError("a RequestSpec needs prompt_token_ids, prompt or prompt_len")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise ValueError(f"{self.prompt_len=} must be >= 1")
        if self.output_len < 1:
            raise ValueError(f"{self.output_len=} must be >= 1")
        if not self.arrival_time >= 0:
            raise ValueError(f"{self.arrival_time=} must be >= 0 seconds")


# ------------------------------------------------------------------------------------------------
# Length distributions and arrivals.


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Published token-length statistics of a trace; `max_total_len` is its length filter."""

    prompt_median: float
    prompt_p90: float
    output_median: float
    output_p90: float
    max_total_len: int


SHAREGPT = LengthStats(1730, 5696, 415, 834, max_total_len=8192)
ARXIV = LengthStats(2730, 3702, 167, 372, max_total_len=4096)


def lognormal_lengths(median: float, p90: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` lengths from the lognormal with this median and 90th percentile (float, unclipped)."""
    if not 0 < median < p90:
        raise ValueError(f"need 0 < {median=} < {p90=}")
    sigma = math.log(p90 / median) / Z90
    return rng.lognormal(math.log(median), sigma, n)


def arrival_times(n: int, qps: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `qps` (first at t=0), or all at t=0 if qps is inf. [n] seconds."""
    if math.isinf(qps):
        return np.zeros(n)
    if not qps > 0:
        raise ValueError(f"{qps=} must be > 0 (or inf for all at once)")
    gaps = rng.exponential(1.0 / qps, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:n]


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (lengths, arrivals) streams: the lengths do not depend on the QPS."""
    return np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])


def _clip_to_context(prompt_len: int, output_len: int, max_model_len: int | None):
    if max_model_len is None:
        return prompt_len, output_len
    if max_model_len < 2:
        raise ValueError(f"{max_model_len=} must be >= 2")
    output_len = min(output_len, max_model_len - 1)
    return min(prompt_len, max_model_len - output_len), output_len


def _specs(prompt_lens, output_lens, arrivals, max_model_len) -> list[RequestSpec]:
    specs = []
    for p, o, t in zip(prompt_lens, output_lens, arrivals, strict=True):
        p, o = _clip_to_context(int(p), int(o), max_model_len)
        specs.append(RequestSpec(arrival_time=float(t), prompt_len=p, output_len=o))
    return specs


def from_length_stats(
    stats: LengthStats,
    num_requests: int,
    *,
    qps: float = math.inf,
    scale: float = DEFAULT_SCALE,
    max_model_len: int | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """Lognormal prompt and output lengths matching `stats`, filtered like the source trace
    (prompt + output <= max_total_len, by shortening the prompt), then scaled and clipped."""
    if not scale > 0:
        raise ValueError(f"{scale=} must be > 0")
    length_rng, arrival_rng = _streams(seed)
    prompt = lognormal_lengths(stats.prompt_median, stats.prompt_p90, num_requests, length_rng)
    output = lognormal_lengths(stats.output_median, stats.output_p90, num_requests, length_rng)
    output = np.clip(np.rint(output), 1, stats.max_total_len - 1)
    prompt = np.clip(np.rint(prompt), 1, stats.max_total_len - output)
    prompt = np.maximum(np.rint(prompt * scale), 1)
    output = np.maximum(np.rint(output * scale), 1)
    return _specs(prompt, output, arrival_times(num_requests, qps, arrival_rng), max_model_len)


def sharegpt(num_requests: int, **kwargs) -> list[RequestSpec]:
    """Chat-shaped requests (ShareGPT4 statistics); see `from_length_stats` for the options."""
    return from_length_stats(SHAREGPT, num_requests, **kwargs)


def arxiv(num_requests: int, **kwargs) -> list[RequestSpec]:
    """Summarization-shaped requests (arXiv-summarization statistics)."""
    return from_length_stats(ARXIV, num_requests, **kwargs)


def fixed(
    num_requests: int,
    *,
    prompt_len: int = 128,
    output_len: int = 64,
    qps: float = math.inf,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """`num_requests` identical-length requests (all at t=0 by default: throughput at batch N)."""
    del scale
    _, arrival_rng = _streams(seed)
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    return _specs([prompt_len] * num_requests, [output_len] * num_requests, arrivals, max_model_len)


def long_prompt_interference(
    num_requests: int,
    *,
    qps: float = math.inf,
    long_fraction: float = 0.25,
    decode_prompt_len: int = 32,
    decode_output_len: int = 128,
    long_prompt_len: int | None = None,
    long_output_len: int = 8,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """Decode-heavy short requests, all at t=0, then long prompts arriving while they decode.

    round(num_requests * long_fraction) long prompts (default length 2048, or max_model_len minus
    their output if less) arrive as a Poisson process at `qps` starting one gap after t=0 (all at
    t=0, after the short ones, if qps is inf). Under a whole-prompt policy each long prompt is a
    prefill-only step that stalls every running decode, so the decodes' P99 TBT grows to a whole
    prefill; a stall-free policy cuts the prompt into token-budget chunks beside the decodes.
    Pick qps so the long prompts arrive within the decodes' lifetime (decode_output_len steps),
    each separately: num_long / qps below that lifetime.
    """
    del scale
    num_long = max(1, round(num_requests * long_fraction)) if num_requests > 1 else 0
    num_decode = num_requests - num_long
    if long_prompt_len is None:
        long_prompt_len = min(2048, max_model_len - long_output_len) if max_model_len else 2048
    _, arrival_rng = _streams(seed)
    if math.isinf(qps):
        long_arrivals = np.zeros(num_long)
    else:
        long_arrivals = arrival_times(num_long + 1, qps, arrival_rng)[1:]
    prompt = [decode_prompt_len] * num_decode + [long_prompt_len] * num_long
    output = [decode_output_len] * num_decode + [long_output_len] * num_long
    arrivals = np.concatenate([np.zeros(num_decode), long_arrivals])
    return _specs(prompt, output, arrivals, max_model_len)


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "sharegpt": sharegpt,
    "arxiv": arxiv,
    "long_prompt_interference": long_prompt_interference,
    "fixed": fixed,
}


def make_workload(name: str, num_requests: int, **kwargs) -> list[RequestSpec]:
    """A synthetic workload by name (`WORKLOADS`); kwargs go to its generator."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"{num_requests=} must be >= 1")
    return WORKLOADS[name](num_requests, **kwargs)


# ------------------------------------------------------------------------------------------------
# Preparing specs to run.


def with_poisson_arrivals(specs: Sequence[RequestSpec], qps: float, seed: int = 0):
    """The same requests, re-timed as Poisson arrivals at `qps` (e.g. a length-only trace)."""
    arrivals = arrival_times(len(specs), qps, _streams(seed)[1])
    return [
        dataclasses.replace(s, arrival_time=float(t)) for s, t in zip(specs, arrivals, strict=True)
    ]


def with_token_ids(
    specs: Sequence[RequestSpec], vocab_size: int, *, tokenizer=None, seed: int = 0
) -> list[RequestSpec]:
    """Every spec with `prompt_token_ids` set: text prompts are tokenized with `tokenizer`
    (anything with `.encode(str) -> list[int]`), length-only ones get seeded random ids in
    [100, vocab_size) (request i's ids depend only on seed and i)."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"{vocab_size=} must be > {MIN_RANDOM_TOKEN_ID} for random prompts")
    out = []
    for i, spec in enumerate(specs):
        if spec.prompt_token_ids is not None:
            out.append(spec)
            continue
        if spec.prompt is not None:
            if tokenizer is None:
                raise ValueError(f"request {i} has a text prompt but there is no tokenizer")
            ids = tokenizer.encode(spec.prompt)
        else:
            rng = np.random.default_rng([seed, 2, i])
            ids = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, spec.prompt_len).tolist()
        out.append(dataclasses.replace(spec, prompt_token_ids=tuple(ids), prompt_len=len(ids)))
    return out


# ------------------------------------------------------------------------------------------------
# Trace files (JSONL).

TRACE_KEYS = ("arrival_time", "prompt", "prompt_len", "prompt_token_ids", "output_len")


def save_trace(path: str, specs: Sequence[RequestSpec], *, with_token_ids: bool = False) -> None:
    """Write `specs` as JSONL: arrival_time, output_len, and prompt and/or prompt_len (plus
    prompt_token_ids if asked)."""
    with open(path, "w") as f:
        for spec in specs:
            row: dict = {"arrival_time": spec.arrival_time}
            if spec.prompt is not None:
                row["prompt"] = spec.prompt
            if spec.prompt_len is not None:
                row["prompt_len"] = spec.prompt_len
            if with_token_ids and spec.prompt_token_ids is not None:
                row["prompt_token_ids"] = list(spec.prompt_token_ids)
            row["output_len"] = spec.output_len
            f.write(json.dumps(row) + "\n")


def load_trace(path: str) -> list[RequestSpec]:
    """Read a JSONL trace; errors name the file, the line and the field. Blank lines are skipped.
    If a line has both `prompt` and `prompt_len`, the text is what runs (the length is kept as
    information)."""
    specs = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                specs.append(_parse_trace_line(line, f"{path}:{lineno}"))
    if not specs:
        raise ValueError(f"{path}: the trace has no requests")
    return specs


def _parse_trace_line(line: str, where: str) -> RequestSpec:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}): {line.strip()[:80]!r}") from e
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(TRACE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {list(TRACE_KEYS)}")

    def number(key, kind, minimum, required=True):
        value = row.get(key)
        if value is None:
            if required:
                raise ValueError(f"{where}: missing {key!r}")
            return None
        ok_type = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type or not value >= minimum:
            want = "a number" if kind is float else "an integer"
            raise ValueError(f"{where}: {key}={value!r} must be {want} >= {minimum}")
        return kind(value)

    prompt = row.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt={prompt!r} must be a non-empty string")
    ids = row.get("prompt_token_ids")
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids)
    ):
        raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids >= 0")
    prompt_len = number("prompt_len", int, 1, required=False)
    if prompt is None and prompt_len is None and ids is None:
        raise ValueError(f"{where}: needs 'prompt', 'prompt_len' or 'prompt_token_ids'")
    if ids is not None and prompt_len is not None and prompt_len != len(ids):
        raise ValueError(f"{where}: prompt_len={prompt_len} but prompt_token_ids has {len(ids)}")
    return RequestSpec(
        arrival_time=number("arrival_time", float, 0),
        output_len=number("output_len", int, 1),
        prompt_len=prompt_len,
        prompt_token_ids=tuple(ids) if ids is not None else None,
        prompt=prompt,
    )

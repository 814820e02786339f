"""Workloads drawn from published length statistics (ALGORITHMS.md §3.4; the list is in
llmjax/bench/workloads.py): ShareGPT- and arXiv-shaped chat and summarization, fixed lengths, and
long prompts arriving among decodes. Lengths are multiplied by `scale` and clipped to
max_model_len.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from llmjax.bench.specs import (
    DEFAULT_SCALE,
    RequestSpec,
    arrival_times,
    clip_to_context,
    lognormal_lengths,
    streams,
)


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


def _specs(prompt_lens, output_lens, arrivals, max_model_len) -> list[RequestSpec]:
    specs = []
    for p, o, t in zip(prompt_lens, output_lens, arrivals, strict=True):
        p, o = clip_to_context(int(p), int(o), max_model_len)
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
    length_rng, arrival_rng = streams(seed)
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
    _, arrival_rng = streams(seed)
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
    _, arrival_rng = streams(seed)
    if math.isinf(qps):
        long_arrivals = np.zeros(num_long)
    else:
        long_arrivals = arrival_times(num_long + 1, qps, arrival_rng)[1:]
    prompt = [decode_prompt_len] * num_decode + [long_prompt_len] * num_long
    output = [decode_output_len] * num_decode + [long_output_len] * num_long
    arrivals = np.concatenate([np.zeros(num_decode), long_arrivals])
    return _specs(prompt, output, arrivals, max_model_len)

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
For these, lengths are multiplied by `scale` (default 1/16, so a CPU serves them: ShareGPT medians
become ~108 prompt and ~26 output tokens) and clipped so prompt + output <= max_model_len.

Prefix-sharing generators (ALGORITHMS.md §8, SGLang's RadixAttention workloads) give explicit,
seeded token ids, so `vocab_size` must be the served model's (default 49152, SmolLM2's); their
lengths are set by their own arguments and NOT scaled (`scale` is accepted and ignored):
  shared_system_prompt
             one system prompt, then a different question per request.
  few_shot   MMLU-style k-shot: a few tasks, each with its own fixed examples; a request is its
             task's examples + a new question; tasks interleave in arrival order.
  multi_turn_chat
             sessions whose turn k+1 is turn k's prompt + the tokens the model generated for it +
             a new user message: dependent requests (`RequestSpec.parent`).
Random lengths there are lognormal with the given median and P90 = `p90_ratio` x median
(`p90_ratio=1` makes them exact).

Arrivals: Poisson at `qps` requests/s (seeded exponential gaps, first at t=0), or all at t=0 when
`qps` is inf. A dependent request (`parent` set) instead arrives `arrival_time` seconds after its
parent finishes (see `RequestSpec` and `replay`).

Trace files are JSONL, one request per line:
    {"arrival_time": 0.0, "prompt": "Tell me a story", "output_len": 64}
    {"arrival_time": 0.5, "prompt_len": 812, "output_len": 128}
    {"arrival_time": 2.0, "prompt_len": 40, "output_len": 64, "parent": 1}
(`prompt_token_ids` may replace `prompt`/`prompt_len`; `parent` is the 0-based index of an earlier
request of the file.) Requests given by length get seeded random token ids in [100, vocab_size)
when they are run (`with_token_ids`).

The code, by family (everything named here is importable from this module):
    specs.py             RequestSpec, check_parents; seeded lengths and arrivals, clip_to_context;
                         with_poisson_arrivals, with_token_ids
    length_workloads.py  sharegpt, arxiv (from_length_stats, SHAREGPT, ARXIV), fixed,
                         long_prompt_interference
    prefix_workloads.py  shared_system_prompt, few_shot, multi_turn_chat; long_context
    traces.py            save_trace, load_trace, read_json_object
    workloads.py         WORKLOADS by name, make_workload
"""

from __future__ import annotations

from collections.abc import Callable

from llmjax.bench.length_workloads import (
    ARXIV,
    SHAREGPT,
    LengthStats,
    arxiv,
    fixed,
    from_length_stats,
    long_prompt_interference,
    sharegpt,
)
from llmjax.bench.prefix_workloads import (
    DEFAULT_P90_RATIO,
    DEFAULT_VOCAB_SIZE,
    few_shot,
    long_context,
    multi_turn_chat,
    shared_system_prompt,
)
from llmjax.bench.specs import (
    DEFAULT_SCALE,
    MIN_RANDOM_TOKEN_ID,
    Z90,
    RequestSpec,
    arrival_times,
    check_parents,
    clip_to_context,
    lognormal_lengths,
    with_poisson_arrivals,
    with_token_ids,
)
from llmjax.bench.traces import TRACE_KEYS, load_trace, read_json_object, save_trace

__all__ = [
    "ARXIV",
    "DEFAULT_P90_RATIO",
    "DEFAULT_SCALE",
    "DEFAULT_VOCAB_SIZE",
    "MIN_RANDOM_TOKEN_ID",
    "SHAREGPT",
    "TRACE_KEYS",
    "WORKLOADS",
    "Z90",
    "LengthStats",
    "RequestSpec",
    "arrival_times",
    "arxiv",
    "check_parents",
    "clip_to_context",
    "few_shot",
    "fixed",
    "from_length_stats",
    "load_trace",
    "lognormal_lengths",
    "long_context",
    "long_prompt_interference",
    "make_workload",
    "multi_turn_chat",
    "read_json_object",
    "save_trace",
    "shared_system_prompt",
    "sharegpt",
    "with_poisson_arrivals",
    "with_token_ids",
]

WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "long_context": long_context,
    "sharegpt": sharegpt,
    "arxiv": arxiv,
    "long_prompt_interference": long_prompt_interference,
    "fixed": fixed,
    "shared_system_prompt": shared_system_prompt,
    "few_shot": few_shot,
    "multi_turn_chat": multi_turn_chat,
}


def make_workload(name: str, num_requests: int, **kwargs) -> list[RequestSpec]:
    """A synthetic workload by name (`WORKLOADS`); kwargs go to its generator."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"{num_requests=} must be >= 1")
    return WORKLOADS[name](num_requests, **kwargs)

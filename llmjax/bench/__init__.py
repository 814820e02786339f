"""The benchmark harness: workloads, real-time replay against an `LLMEngine`, serving metrics and
Sarathi-Serve's capacity search and DistServe's goodput search. Plain Python and numpy (no jax),
so it is testable on its own; `scripts/benchmark.py` is the command line over it.

    specs = workloads.sharegpt(64, qps=2.0, vocab_size=llm.model_config.vocab_size)
    outputs = replay(llm.engine, specs)
    print(summarize(outputs, tbt_slo=0.1).as_dict())

Prefix-cache workloads (`shared_system_prompt`, `few_shot`, `multi_turn_chat`) give explicit token
ids: pass `vocab_size=llm.model_config.vocab_size`. `multi_turn_chat` makes dependent requests
(`RequestSpec.parent`), which `replay` adds once their parent has finished; `summarize` reports the
prefix cache hit rate from `RequestOutput.num_cached_tokens`. `measure_decode_step` times a
decode-only step on a live engine (Sarathi-Serve's TBT SLO is a multiple of it).

    workloads.py         the workloads by name (`make_workload`), and every name of the four below
    specs.py             RequestSpec; seeded lengths and arrivals; re-timing, token ids
    length_workloads.py  sharegpt, arxiv, fixed, long_prompt_interference (length statistics)
    prefix_workloads.py  shared_system_prompt, few_shot, multi_turn_chat, long_context (token ids)
    traces.py            JSONL trace files; mooncake.py: Mooncake's released traces
    replay.py            replay, warm_up: a workload through an engine (or a cluster)
    metrics.py           summarize, Summary, the side-by-side tables
    step_time.py         measure_decode_step
    capacity.py          Sarathi-Serve's capacity search; goodput.py: DistServe's goodput search
    variants.py          scripts/benchmark.py's variants and the engines they run on (its flags)
    workload_flags.py    scripts/benchmark.py's requests from its flags
    harness.py           scripts/benchmark.py's measurements of one variant
    report.py            scripts/benchmark.py's report: tables, plots, JSON values
    serving.py           the HTTP load generator (scripts/bench_serving.py)
    peers.py             llmjax against peer engines (scripts/bench_peers.py), with
                         peer_engines.py (their configurations) and peer_serving.py (their servers)
"""

from llmjax.bench.capacity import CapacityResult, capacity_search
from llmjax.bench.goodput import GoodputResult, goodput_search
from llmjax.bench.metrics import (
    Percentiles,
    Summary,
    format_side_by_side,
    meets_capacity,
    summarize,
)
from llmjax.bench.replay import replay, warm_up
from llmjax.bench.specs import RequestSpec
from llmjax.bench.step_time import measure_decode_step
from llmjax.bench.traces import load_trace, save_trace
from llmjax.bench.workloads import make_workload

__all__ = [
    "CapacityResult",
    "GoodputResult",
    "Percentiles",
    "RequestSpec",
    "Summary",
    "capacity_search",
    "format_side_by_side",
    "goodput_search",
    "load_trace",
    "make_workload",
    "measure_decode_step",
    "meets_capacity",
    "replay",
    "save_trace",
    "summarize",
    "warm_up",
]

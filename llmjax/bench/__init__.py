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
from llmjax.bench.step_time import measure_decode_step
from llmjax.bench.workloads import RequestSpec, load_trace, make_workload, save_trace

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

"""Prometheus metrics of a serving engine, named, typed, labelled and bucketed as vLLM's (so its
Grafana dashboards read them with `--metrics_prefix vllm`), fed from what the engine already
measures: its `EngineStats` counters (deltas per step) and each request's `RequestMetrics`
timestamps. Nothing is timed again in the HTTP layer.

| metric (prefix `llmjax:` by default)        | type      | from                                   |
|---------------------------------------------|-----------|----------------------------------------|
| num_requests_running / _waiting             | gauge     | the scheduler's queues (+ adds queued) |
| kv_cache_usage_perc                         | gauge     | EngineStats.page_usage (0..1)          |
| prompt_tokens_total                         | counter   | prompt length, at a request's 1st token|
| generation_tokens_total                     | counter   | tokens in the step's outputs           |
| prefix_cache_queries_total / _hits_total    | counter   | prefill tokens needed / taken cached   |
| num_preemptions_total                       | counter   | EngineStats.num_preemptions            |
| request_success_total{finished_reason}      | counter   | stop, length, abort, error             |
| time_to_first_token_seconds                 | histogram | first token - arrival                  |
| inter_token_latency_seconds                 | histogram | gaps between a request's tokens        |
| request_time_per_output_token_seconds       | histogram | RequestMetrics.tpot                    |
| e2e_request_latency_seconds                 | histogram | finish - arrival                       |
| request_queue_time_seconds                  | histogram | first scheduled - arrival              |
| request_prefill_time_seconds                | histogram | first token - first scheduled          |
| request_decode_time_seconds                 | histogram | last token - first token               |
| request_inference_time_seconds              | histogram | last token - first scheduled           |
| request_prompt_tokens / _generation_tokens  | histogram | lengths of finished requests           |
| iteration_tokens_total                      | histogram | tokens per engine step                 |
| step_duration_seconds (llmjax only)         | histogram | wall time of one `LLMEngine.step`      |
| spec_decode_num_drafts_total                | counter   | EngineStats.num_spec_drafts            |
| spec_decode_num_draft_tokens_total          | counter   | EngineStats.num_spec_draft_tokens      |
| spec_decode_num_accepted_tokens_total       | counter   | EngineStats.num_spec_accepted_tokens   |
| request_spec_tokens_per_decode_step (llmjax)| histogram | SpecState.tokens_per_decode_step       |
| program_calls_total (llmjax only)           | counter   | calls submitted to /v1/programs        |
| program_tasks_total{state} (llmjax only)    | counter   | tasks ended: done, failed, cancelled   |
| engine_config_info (llmjax), cache_config_info | gauge = 1 | policy, cache, budget as labels |
| lora_requests_info (with LoRA)             | gauge     | vLLM's: the time, and as labels the   |
|                                             |           | adapters running / waiting, max_lora  |

A program's tasks are engine requests: the request metrics count them too. Every metric has the
label `model_name`. Counters are declared without `_total` (prometheus-client appends it, as
vLLM's are). Buckets are vLLM's (vllm/v1/metrics).
`record_*` are called by the engine thread only; prometheus-client makes `exposition` safe from
any thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from llmjax.config import EngineConfig
from llmjax.engine.request import RequestOutput
from llmjax.engine.stats import EngineStats

TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_DURATION_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0,
    10.0,
]  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")
PROGRAM_TASK_STATES = ("done", "failed", "cancelled")
CONTENT_TYPE = CONTENT_TYPE_LATEST


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets).
    In/Out: 100 -> [1, 2, 5, 10, 20, 50, 100]."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def _counts(stats: EngineStats) -> tuple[int, ...]:
    """The EngineStats counters the metrics take deltas of."""
    return (
        stats.num_preemptions,
        stats.num_batched_tokens,
        stats.num_cached_prefill_tokens,
        stats.num_prefill_tokens,
        stats.num_spec_drafts,
        stats.num_spec_draft_tokens,
        stats.num_spec_accepted_tokens,
        stats.num_padded_tokens,
    )


_NO_COUNTS = (0,) * 8


def metric_prefix(prefix: str) -> str:
    """'vllm' -> 'vllm:'; a prefix ending in ':' or '_' (or empty) is kept."""
    return prefix if not prefix or prefix.endswith((":", "_")) else prefix + ":"


class ServingMetrics:
    """The engine's metrics in a prometheus-client registry of their own (several servers may
    live in one process, e.g. in tests)."""

    def __init__(
        self,
        model_name: str,
        config: EngineConfig,
        num_pages: int,
        prefix: str = "llmjax:",
        registry: CollectorRegistry | None = None,
        stats: EngineStats | None = None,
    ):
        """`stats`: the engine's counters now (they are counted from here on)."""
        disable_created_metrics()  # as vLLM: no *_created series
        self.registry = registry or CollectorRegistry()
        p, labels = metric_prefix(prefix), ["model_name"]
        self._labels = {"model_name": model_name}
        reg = dict(registry=self.registry)

        def gauge(name, doc):
            return Gauge(p + name, doc, labels, **reg).labels(**self._labels)

        def counter(name, doc):
            return Counter(p + name, doc, labels, **reg).labels(**self._labels)

        def histogram(name, doc, buckets):
            return Histogram(p + name, doc, labels, buckets=buckets, **reg).labels(**self._labels)

        self.num_requests_running = gauge("num_requests_running", "Requests running.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "KV-cache usage: pages held by running requests (1 = 100%)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefill tokens needed (computed or taken from the cache)."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefill tokens taken from the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions (by recomputation).")
        self.batched_tokens = counter("batched_tokens", "Tokens the steps computed.")
        self.padded_tokens = counter(
            "padded_tokens",
            "Tokens the steps ran as: their shape buckets, padding included (padding share = "
            "1 - batched_tokens / padded_tokens).",
        )
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: decodes that verified proposals."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
        )
        self.lora_info = None
        if config.lora is not None:  # vLLM's: the value is the time, the adapters are labels
            self._max_lora = str(config.lora.max_loras)
            self.lora_info = Gauge(
                p + "lora_requests_info",
                "Running stats on LoRA requests: adapters running and waiting (comma-separated "
                "names), max_lora; the value is the time of the update.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                **reg,
            )
        self.spec_tokens_per_step = histogram(
            "request_spec_tokens_per_decode_step",
            "Per request with speculative decoding: generated tokens per decode step.",
            [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0],
        )
        success = Counter(
            p + "request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            **reg,
        )
        self.request_success = {
            r: success.labels(finished_reason=r, **self._labels) for r in FINISHED_REASONS
        }
        max_len = config.max_model_len
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency (s).", ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1) (s).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency (s).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (s).", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token (s).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token (s).", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduled to last token (s).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", build_1_2_5_buckets(max_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens per request.",
            build_1_2_5_buckets(max_len),
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKEN_BUCKETS
        )
        self.step_duration = histogram(
            "step_duration_seconds",
            "Wall time of one engine step: schedule, pack, run, update (s).",
            STEP_DURATION_BUCKETS,
        )
        self.program_calls = counter(
            "program_calls", "Semantic-function calls submitted to /v1/programs."
        )
        tasks = Counter(
            p + "program_tasks",
            "Program tasks (one output of one call) that ended, by state.",
            [*labels, "state"],
            **reg,
        )
        self.program_tasks = {s: tasks.labels(state=s, **self._labels) for s in PROGRAM_TASK_STATES}
        sched, cache = config.scheduler, config.cache
        info = {
            "scheduler_policy": sched.policy,
            "admission_order": sched.admission_order,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": max_len,
            "dtype": config.dtype,
            "tp": config.parallel.tp,
            "pp": config.parallel.pp,
            "sparse_kv": config.sparse_kv.mode,
        }
        engine_info = Gauge(
            p + "engine_config_info", "The engine's configuration.", [*labels, *info], **reg
        )
        engine_info.labels(**self._labels, **{k: str(v) for k, v in info.items()}).set(1)
        cache_info = {
            "block_size": cache.page_size,
            "num_gpu_blocks": num_pages,
            "enable_prefix_caching": cache.prefix_cache != "none",
            "prefix_cache": cache.prefix_cache,
            "watermark": cache.watermark,
            "cache_dtype": cache.kv_cache_dtype,  # vLLM's label
        }
        Gauge(
            p + "cache_config_info", "The KV cache's configuration.", list(cache_info), **reg
        ).labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        self._stats = stats
        self._last = _counts(stats) if stats is not None else _NO_COUNTS
        self._num_seen: dict[str, int] = {}  # tokens already counted, per unfinished request

    # ------------------------------------------------------------------------------------------
    # Engine thread.

    def record_loras(self, running: Sequence[str], waiting: Sequence[str]) -> None:
        """The adapters of the running and of the waiting requests (names), after a step."""
        if self.lora_info is None:
            return
        self.lora_info.clear()
        self.lora_info.labels(
            max_lora=self._max_lora,
            waiting_lora_adapters=",".join(sorted(set(waiting))),
            running_lora_adapters=",".join(sorted(set(running))),
        ).set(time.time())

    def record_step(
        self,
        stats: EngineStats,
        outputs: Sequence[RequestOutput],
        step_seconds: float,
        num_running: int,
        num_waiting: int,
    ) -> None:
        """One `LLMEngine.step` that returned `outputs`, and took `step_seconds`."""
        if stats is not self._stats:  # a new stats object (reset_stats): count from zero
            self._stats, self._last = stats, _NO_COUNTS
        now = _counts(stats)
        preempted, batched, cached, computed, drafts, drafted, accepted, padded = (
            a - b for a, b in zip(now, self._last, strict=True)
        )
        self._last = now
        if drafts:
            self.spec_drafts.inc(drafts)
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted_tokens.inc(accepted)
        if preempted:
            self.num_preemptions.inc(preempted)
        if cached or computed:
            self.prefix_cache_queries.inc(cached + computed)
            self.prefix_cache_hits.inc(cached)
        if batched:
            self.iteration_tokens.observe(batched)
            self.batched_tokens.inc(batched)
            self.padded_tokens.inc(padded)
        self.step_duration.observe(step_seconds)
        for out in outputs:
            self._record_output(out)
        self.set_queues(num_running, num_waiting, stats.page_usage)

    def set_queues(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_usage)

    def _record_output(self, out: RequestOutput) -> None:
        m = out.metrics
        seen = self._num_seen.get(out.request_id, 0)
        n = len(out.token_ids)
        if n > seen:
            self.generation_tokens.inc(n - seen)
            if seen == 0 and m.first_token_time is not None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(m.ttft)
            times = m.token_times
            for i in range(max(seen, 1), min(n, len(times))):
                self.itl.observe(times[i] - times[i - 1])
        if not out.finished:
            self._num_seen[out.request_id] = n
            return
        self._num_seen.pop(out.request_id, None)
        self.request_success[out.finish_reason or "error"].inc()
        if m.finished_time is None or not out.token_ids:  # rejected: nothing ran
            return
        self.e2e.observe(m.e2e_latency)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(n)
        last = m.token_times[-1]
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            self.inference_time.observe(last - m.first_scheduled_time)
        self.decode_time.observe(last - m.first_token_time)
        self.tpot.observe(m.tpot)
        spec = m.spec_decode
        if spec is not None and spec.tokens_per_decode_step is not None:
            self.spec_tokens_per_step.observe(spec.tokens_per_decode_step)

    def record_abort(self, request_id: str) -> None:
        """A request aborted before it finished (its client went away, or the server stops)."""
        self._num_seen.pop(request_id, None)
        self.request_success["abort"].inc()

    # ------------------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (for GET /metrics)."""
        return generate_latest(self.registry)

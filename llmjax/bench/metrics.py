"""Serving metrics from finished `RequestOutput`s, named as in ALGORITHMS.md §1.

  TTFT              first token - arrival (includes queueing), per request.
  TBT               gaps between a request's consecutive tokens, pooled over ALL decode tokens of
                    all requests: its P99 is Sarathi-Serve's token-level tail.
  TPOT              per request (t_last - t_first) / (n_out - 1), 0 for one token (DistServe).
  e2e latency       finish - arrival, per request.
  scheduling delay  first scheduled - arrival, per request.
  SLO attainment    fraction of ALL requests with TTFT <= slo_ttft and TPOT <= slo_tpot
                    (DistServe); a rejected request misses.
  capacity criterion  P99 TBT <= tbt_slo and P50 scheduling delay <= 2 s (Sarathi-Serve).
  throughput        finished requests, output tokens and prompt + output tokens per second over
                    the makespan (first arrival to last finish).
  prefix cache hit rate
                    cached / prompt tokens over the finished requests, where a request's cached
                    tokens are `RequestOutput.num_cached_tokens` (prompt tokens whose KV came from
                    the prefix cache at its first admission).
  device utilization  the devices' busy (step) time / their time over the makespan, from the
                    engines' `EngineStats` (`device_utilization`; not part of `Summary`).
Percentiles are numpy's (linear interpolation between order statistics).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from llmjax.engine.request import RequestOutput

MAX_SCHEDULING_DELAY_S = 2.0  # Sarathi-Serve's P50 scheduling-delay guard for capacity


@dataclasses.dataclass(frozen=True)
class Percentiles:
    """P50/P90/P99, mean and max of a sample, in its unit (None for an empty sample)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    max: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if len(values) == 0:
            return cls()
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
        return cls(p50, p90, p99, float(a.mean()), float(a.max()), len(a))


@dataclasses.dataclass(frozen=True)
class Summary:
    """A run's metrics (seconds, requests/s, tokens/s). `meets_capacity` and `slo_attainment` are
    None when their SLOs were not given."""

    num_requests: int
    num_finished: int
    num_errors: int
    duration_s: float  # makespan: first arrival to last finish
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    num_prompt_tokens: int  # over the finished requests (a dependent one's whole prompt)
    num_cached_tokens: int  # of those, the ones whose KV the prefix cache supplied
    prefix_cache_hit_rate: float | None  # cached / prompt tokens (None without prompt tokens)
    ttft: Percentiles
    tbt: Percentiles
    tpot: Percentiles
    e2e_latency: Percentiles
    normalized_latency: Percentiles  # e2e / output tokens (vLLM)
    scheduling_delay: Percentiles
    slo_attainment: float | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    tbt_slo: float | None = None
    meets_capacity: bool | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def meets_capacity(
    summary, tbt_slo: float, max_scheduling_delay: float = MAX_SCHEDULING_DELAY_S
) -> bool:
    """Sarathi-Serve's criterion: P99 TBT <= tbt_slo and P50 scheduling delay <= 2 s. A run with
    no decode tokens passes on TBT; one where nothing was scheduled fails."""
    tbt_p99 = summary.tbt.p99
    delay_p50 = summary.scheduling_delay.p50
    tbt_ok = tbt_p99 is None or tbt_p99 <= tbt_slo
    return tbt_ok and delay_p50 is not None and delay_p50 <= max_scheduling_delay


def summarize(
    outputs: Sequence[RequestOutput],
    *,
    tbt_slo: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    max_scheduling_delay: float = MAX_SCHEDULING_DELAY_S,
) -> Summary:
    """The metrics of one run. SLO attainment needs both slo_ttft and slo_tpot; the capacity
    criterion needs tbt_slo."""
    ok = [o for o in outputs if o.error is None and o.finished]
    metrics = [o.metrics for o in ok]
    arrivals = [o.metrics.arrival_time for o in outputs]
    finishes = [m.finished_time for m in metrics if m.finished_time is not None]
    duration = float(max(finishes) - min(arrivals)) if finishes else 0.0
    num_output = sum(len(o.token_ids) for o in ok)
    num_prompt = sum(len(o.prompt_token_ids) for o in ok)
    num_cached = sum(o.num_cached_tokens for o in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)

    def values(name):
        return [v for m in metrics if (v := getattr(m, name)) is not None]

    normalized = [
        o.metrics.e2e_latency / len(o.token_ids)
        for o in ok
        if o.token_ids and o.metrics.e2e_latency is not None
    ]
    attainment = None
    if slo_ttft is not None and slo_tpot is not None and outputs:
        met = sum(
            m.ttft is not None and m.ttft <= slo_ttft and m.tpot is not None and m.tpot <= slo_tpot
            for m in metrics
        )
        attainment = float(met / len(outputs))
    summary = Summary(
        num_requests=len(outputs),
        num_finished=len(ok),
        num_errors=sum(o.error is not None for o in outputs),
        duration_s=duration,
        request_throughput=per_s(len(ok)),
        output_token_throughput=per_s(num_output),
        total_token_throughput=per_s(num_output + num_prompt),
        num_prompt_tokens=num_prompt,
        num_cached_tokens=num_cached,
        prefix_cache_hit_rate=float(num_cached / num_prompt) if num_prompt else None,
        ttft=Percentiles.of(values("ttft")),
        tbt=Percentiles.of([gap for m in metrics for gap in m.tbt]),
        tpot=Percentiles.of(values("tpot")),
        e2e_latency=Percentiles.of(values("e2e_latency")),
        normalized_latency=Percentiles.of(normalized),
        scheduling_delay=Percentiles.of(values("scheduling_delay")),
        slo_attainment=attainment,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        tbt_slo=tbt_slo,
    )
    if tbt_slo is not None:
        summary = dataclasses.replace(
            summary, meets_capacity=meets_capacity(summary, tbt_slo, max_scheduling_delay)
        )
    return summary


def device_utilization(engines: Sequence, duration_s: float) -> float | None:
    """The share of the devices' time spent running steps over `duration_s` (a run's makespan,
    `Summary.duration_s`): sum over `engines` (a cluster's instances) of tp x pp x
    `EngineStats.device_time_s`, over their devices x duration_s. On a simulated device
    `device_time_s` is the modeled seconds of its steps, so this is busy time / wall time as
    `nvidia-smi` reports GPU utilization (not MFU); on hardware it is launch-to-collect time.
    None for a zero duration or no devices."""
    devices = [e.config.parallel.tp * e.config.parallel.pp for e in engines]
    if not sum(devices) or not duration_s > 0:
        return None
    busy = sum(n * e.stats.device_time_s for n, e in zip(devices, engines, strict=True))
    return float(busy / (sum(devices) * duration_s))


# ------------------------------------------------------------------------------------------------
# Printing.

# (label, getter, format): latencies print in milliseconds.
_ROWS = [
    ("requests (finished/errors)", lambda s: f"{s.num_finished}/{s.num_errors}", None),
    ("duration s", lambda s: s.duration_s, "{:.2f}"),
    ("throughput req/s", lambda s: s.request_throughput, "{:.2f}"),
    ("throughput output tok/s", lambda s: s.output_token_throughput, "{:.1f}"),
    ("throughput total tok/s", lambda s: s.total_token_throughput, "{:.1f}"),
    ("prompt tokens (cached/all)", lambda s: f"{s.num_cached_tokens}/{s.num_prompt_tokens}", None),
    ("prefix cache hit rate", lambda s: s.prefix_cache_hit_rate, "{:.1%}"),
    *[
        (f"{name} P{q} ms", lambda s, n=attr, q=q: getattr(getattr(s, n), f"p{q}"), "ms")
        for name, attr, qs in [
            ("TTFT", "ttft", (50, 90, 99)),
            ("TBT", "tbt", (50, 90, 99)),
            ("TPOT", "tpot", (50, 90, 99)),
            ("e2e", "e2e_latency", (50, 90, 99)),
            ("sched delay", "scheduling_delay", (50, 99)),
        ]
        for q in qs
    ],
    ("TBT max ms", lambda s: s.tbt.max, "ms"),
    ("SLO attainment", lambda s: s.slo_attainment, "{:.1%}"),
    ("meets capacity criterion", lambda s: s.meets_capacity, None),
]


def _cell(value, fmt) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "ms":
        return f"{1e3 * value:.1f}"
    return fmt.format(value) if fmt else str(value)


def format_side_by_side(summaries: dict[str, Summary], extra_rows=()) -> str:
    """A text table, one column per run (e.g. per policy). `extra_rows` adds (label, {column:
    cell text}) rows (engine counters, say)."""
    names = list(summaries)
    rows = [(label, [_cell(get(summaries[n]), fmt) for n in names]) for label, get, fmt in _ROWS]
    rows += [(label, [str(cells.get(n, "-")) for n in names]) for label, cells in extra_rows]
    return format_table(["metric", *names], [[label, *cells] for label, cells in rows])


def format_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Left-aligned first column, right-aligned others, widths from the content."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        first = r[0].ljust(widths[0])
        return "  ".join([first] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)])

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *map(line, cells[1:])])

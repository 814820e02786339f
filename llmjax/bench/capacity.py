"""Sarathi-Serve's capacity search: the highest Poisson QPS whose run meets the capacity criterion
(P99 TBT <= tbt_slo and P50 scheduling delay <= 2 s), by binary search with adaptive bounds.

As in `sarathi/benchmark/capacity_search/capacity_search.py`: test the midpoint of [lo, hi]; on a
pass raise lo, and when the scheduling delay was far below its limit (< 1/8: x4, < 1/4: x2) or the
pass was near hi (> 0.8 hi), expand hi — never beyond the lowest QPS already seen to fail; on a
fail lower hi. Stop when hi - lo < 2.5 % of the QPS last tried, or after max_iters trials.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from llmjax.bench.metrics import MAX_SCHEDULING_DELAY_S, meets_capacity


@dataclasses.dataclass
class CapacityResult:
    capacity_qps: float  # the highest QPS that passed (0.0 if none did)
    tbt_slo: float
    trials: list[tuple[float, object, bool]]  # (qps, summary, passed), in the order run

    def as_dict(self) -> dict:
        return {
            "capacity_qps": self.capacity_qps,
            "tbt_slo": self.tbt_slo,
            "trials": trials_as_dicts(self.trials),
        }


def trials_as_dicts(trials) -> list[dict]:
    """A search's (qps, summary, passed) trials as JSON-ready dicts."""
    return [
        {"qps": q, "passed": ok, "summary": s.as_dict() if hasattr(s, "as_dict") else s}
        for q, s, ok in trials
    ]


def capacity_search(
    run_at_qps: Callable[[float], object],
    tbt_slo: float,
    lo: float = 0.0,
    hi: float = 2.0,
    *,
    max_scheduling_delay: float = MAX_SCHEDULING_DELAY_S,
    granularity: float = 0.025,
    max_iters: int = 20,
    log: Callable[[str], None] | None = None,
) -> CapacityResult:
    """Binary-search the capacity. `run_at_qps(qps)` runs the workload with Poisson arrivals at
    qps and returns its `Summary` (anything with `.tbt.p99` and `.scheduling_delay.p50`). `lo` is
    assumed to pass (0 by default); `hi` is the first upper bound and grows while runs pass."""
    if not 0 <= lo < hi:
        raise ValueError(f"need 0 <= {lo=} < {hi=}")
    if not 0 < granularity < 1:
        raise ValueError(f"{granularity=} must be a fraction in (0, 1)")
    best = 0.0
    min_failed = float("inf")
    trials = []
    qps = 0.0
    for _ in range(max_iters):
        if hi - lo < granularity * qps:
            break
        qps = (lo + hi) / 2
        summary = run_at_qps(qps)
        passed = meets_capacity(summary, tbt_slo, max_scheduling_delay)
        trials.append((qps, summary, passed))
        if log:
            log(
                f"capacity trial qps={qps:.3f}: P99 TBT={_ms(summary.tbt.p99)} ms, P50 sched "
                f"delay={_ms(summary.scheduling_delay.p50)} ms -> {'pass' if passed else 'fail'}"
            )
        if passed:
            lo = best = qps
            delay = summary.scheduling_delay.p50
            if delay < max_scheduling_delay / 8:
                hi = min(hi * 4, min_failed)
            elif delay < max_scheduling_delay / 4 or qps > 0.8 * hi:
                hi = min(hi * 2, min_failed)
        else:
            hi = min_failed = qps
    return CapacityResult(capacity_qps=best, tbt_slo=tbt_slo, trials=trials)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"

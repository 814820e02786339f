"""DistServe's goodput: the highest request rate per device at which at least `target` (90 %) of
the requests meet both their TTFT and TPOT SLOs (ALGORITHMS.md §7.2-7.3), by bisection as
DistServe's simulator finds it (`simdistserve`: per-device rate in [lo, hi = max_per_device_rate
(5)], halved until hi - lo < esp (0.25)).

The attainment is `Summary.slo_attainment` (`summarize(..., slo_ttft=, slo_tpot=)`): per request,
TTFT and TPOT both within their SLOs, over all requests (failed ones count as missing). Sarathi-
Serve's capacity (llmjax/bench/capacity.py) reads the same per-token timestamps with its own
criterion (P99 TBT and P50 scheduling delay), so both can be compared on one run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from llmjax.bench.capacity import trials_as_dicts


@dataclasses.dataclass
class GoodputResult:
    goodput_per_device: float  # the highest per-device rate that passed (0.0 if none did)
    num_devices: int
    target: float
    slo_ttft: float
    slo_tpot: float
    trials: list[tuple[float, object, bool]]  # (total rate, summary, passed), in the order run

    @property
    def goodput(self) -> float:
        """The whole deployment's rate (per device x devices)."""
        return self.goodput_per_device * self.num_devices

    def as_dict(self) -> dict:
        return {
            "goodput_per_device": self.goodput_per_device,
            "goodput": self.goodput,
            "num_devices": self.num_devices,
            "target": self.target,
            "slo_ttft": self.slo_ttft,
            "slo_tpot": self.slo_tpot,
            "trials": trials_as_dicts(self.trials),
        }


def goodput_search(
    run_at_qps: Callable[[float], object],
    slo_ttft: float,
    slo_tpot: float,
    *,
    num_devices: int = 1,
    target: float = 0.9,
    lo: float = 0.0,
    max_per_device_rate: float = 5.0,
    esp: float = 0.25,
    max_iters: int = 30,
    log: Callable[[str], None] | None = None,
) -> GoodputResult:
    """Bisect the per-device rate. `run_at_qps(qps)` runs the workload at the deployment's total
    rate qps (= per-device rate x num_devices) and returns its `Summary`, summarized with these
    SLOs (its `slo_attainment` must be set). `lo` is assumed to pass."""
    if not (slo_ttft > 0 and slo_tpot > 0):
        raise ValueError(f"need positive SLOs, got {slo_ttft=} {slo_tpot=}")
    if not 0 < target <= 1:
        raise ValueError(f"{target=} must be in (0, 1]")
    if num_devices < 1 or not 0 <= lo < max_per_device_rate or not esp > 0:
        raise ValueError(f"need {num_devices=} >= 1, 0 <= {lo=} < {max_per_device_rate=}, {esp=}")
    hi, best, trials = max_per_device_rate, 0.0, []
    for _ in range(max_iters):
        if hi - lo < esp:
            break
        rate = (lo + hi) / 2
        summary = run_at_qps(rate * num_devices)
        attainment = getattr(summary, "slo_attainment", None)
        if attainment is None:
            raise ValueError("run_at_qps must summarize with slo_ttft and slo_tpot")
        passed = attainment >= target
        trials.append((rate * num_devices, summary, passed))
        if log:
            log(
                f"goodput trial {rate:.3f}/device ({rate * num_devices:.3f} qps): attainment "
                f"{attainment:.1%} -> {'pass' if passed else 'fail'}"
            )
        if passed:
            lo = best = rate
        else:
            hi = rate
    return GoodputResult(best, num_devices, target, slo_ttft, slo_tpot, trials)

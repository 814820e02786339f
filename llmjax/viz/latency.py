"""Latency and throughput plots of serving runs (colab/01_quickstart.ipynb,
colab/02_schedulers.ipynb, `scripts/benchmark.py --plot_dir`).

Everything is drawn from finished `RequestOutput`s (their `metrics.token_times`, perf_counter
seconds) or from `llmjax.bench` results (`Summary`, `CapacityResult`), with the metric names of
ALGORITHMS.md §1. Times on the x axes are seconds since the run's first arrival. Data helpers
(plain numpy):

  token_gaps        each generated token after a request's first: (time, gap to the previous
                    token of its request), pooled over the requests: the per-token latency
                    timeline, whose gaps are exactly the TBT sample that `summarize` pools
  ecdf              the empirical CDF of a sample
  long_prompt_arrivals
                    arrival times of the requests whose prompt has at least n tokens

Plots: `plot_request_timeline` (each request's arrival, first scheduling and tokens),
`plot_token_latency` / `plot_token_latency_panels` (per-token latency over time: the stalls a
whole-prompt prefill causes are spikes), `plot_tbt_cdf` (TBT CDFs, one line per run),
`plot_throughput_vs_budget` (throughput and P99 TBT against the token budget),
`plot_capacity` (capacity QPS under a TBT SLO, one bar per run) and
`plot_throughput_vs_batch` (throughput at batch N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from llmjax.viz import new_axes, pyplot

# One color per scheduling policy in every figure; other names take the remaining tab10 colors.
POLICY_COLORS = {
    "sarathi": "tab:blue",
    "splitfuse": "tab:orange",
    "decode_first": "tab:green",
    "prefill_first": "tab:red",
}
_OTHER_COLORS = ["tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]
SLO_STYLE = dict(color="black", linestyle="--", linewidth=1.0)


def run_color(name: str, index: int = 0) -> str:
    """The color of run `name`: its policy's (a name like 'sarathi/radix' uses 'sarathi'), else
    the index-th of the other colors."""
    policy = str(name).split("/")[0]
    return POLICY_COLORS.get(policy, _OTHER_COLORS[index % len(_OTHER_COLORS)])


# ------------------------------------------------------------------------------------------------
# Data helpers.


def run_start(outputs) -> float:
    """The earliest arrival time of `outputs` (perf_counter seconds): the runs' time origin."""
    arrivals = [o.metrics.arrival_time for o in outputs]
    if not arrivals:
        raise ValueError("no outputs")
    return float(min(arrivals))


@dataclasses.dataclass(frozen=True)
class TokenGaps:
    """Every generated token after its request's first, sorted by time: `times` [n] seconds since
    the run's start, `gaps` [n] seconds since the previous token of the same request (a TBT
    sample), `request` [n] the index of the request in the outputs."""

    times: np.ndarray
    gaps: np.ndarray
    request: np.ndarray


def token_gaps(outputs, t0: float | None = None) -> TokenGaps:
    """The per-token latency timeline of a run: for each request's tokens 2..n, the token's time
    (minus `t0`, default the run's first arrival) and its gap to the request's previous token.
    Rejected requests and one-token outputs contribute nothing. The gaps are the pooled TBT
    sample of `llmjax.bench.summarize`."""
    if t0 is None:
        t0 = run_start(outputs)
    times, gaps, request = [], [], []
    for i, out in enumerate(outputs):
        t = np.asarray(out.metrics.token_times, dtype=np.float64)
        if len(t) < 2:
            continue
        times.append(t[1:] - t0)
        gaps.append(np.diff(t))
        request.append(np.full(len(t) - 1, i, dtype=np.int64))
    if not times:
        empty = np.zeros(0)
        return TokenGaps(empty, empty, np.zeros(0, dtype=np.int64))
    times, gaps, request = np.concatenate(times), np.concatenate(gaps), np.concatenate(request)
    order = np.argsort(times, kind="stable")
    return TokenGaps(times[order], gaps[order], request[order])


def ecdf(values) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of `values`: (x sorted ascending, y = (i + 1) / n), so y[k] is the
    fraction of the sample <= x[k]. Empty in, empty out."""
    x = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))
    y = np.arange(1, len(x) + 1, dtype=np.float64) / max(len(x), 1)
    return x, y


def long_prompt_arrivals(outputs, min_prompt_len: int, t0: float | None = None) -> np.ndarray:
    """Arrival times (seconds since `t0`, default the run's first arrival) of the requests whose
    prompt has at least `min_prompt_len` tokens, sorted."""
    if t0 is None:
        t0 = run_start(outputs)
    return np.sort(
        np.array(
            [
                o.metrics.arrival_time - t0
                for o in outputs
                if len(o.prompt_token_ids) >= min_prompt_len
            ],
            dtype=np.float64,
        )
    )


# ------------------------------------------------------------------------------------------------
# Plots.


def plot_request_timeline(outputs, *, ax=None, labels: Sequence[str] | None = None):
    """One row per request (the first at the top): a thin line from arrival to finish, a bar from
    arrival to first scheduling (the scheduling delay), and a dot at every generated token, so the
    first dot's distance from the arrival is the TTFT and the dot spacing the TBT. A rejected
    request (an error) shows only its arrival, labelled 'rejected'. Returns the Axes."""
    ax = new_axes(ax, figsize=(6.4, 0.5 + 0.4 * max(len(outputs), 1)))
    t0 = run_start(outputs)
    for i, out in enumerate(outputs):
        m = out.metrics
        y = -i
        start = m.arrival_time - t0
        if out.error is not None:
            ax.plot([start], [y], marker="x", color="tab:red", linestyle="none")
            ax.annotate("rejected", (start, y), xytext=(6, -3), textcoords="offset points")
            continue
        end = (m.finished_time if m.finished_time is not None else m.arrival_time) - t0
        ax.plot([start, end], [y, y], color="lightgray", linewidth=1.0, zorder=1)
        if m.first_scheduled_time is not None:
            ax.barh(
                y,
                m.first_scheduled_time - m.arrival_time,
                left=start,
                height=0.3,
                color="tab:orange",
                alpha=0.6,
                zorder=2,
            )
        tokens = np.asarray(m.token_times, dtype=np.float64) - t0
        ax.plot(
            tokens,
            np.full(len(tokens), y),
            linestyle="none",
            marker="o",
            markersize=3,
            color="tab:blue",
            zorder=3,
        )
    ax.set_yticks([-i for i in range(len(outputs))])
    ax.set_yticklabels(
        list(labels) if labels is not None else [f"req {o.request_id}" for o in outputs]
    )
    ax.set_xlabel("time since first arrival (s)")
    ax.set_title("requests: scheduling delay (bar) and generated tokens (dots)")
    return ax


def plot_token_latency(
    outputs,
    *,
    ax=None,
    label: str | None = None,
    color: str | None = None,
    tbt_slo: float | None = None,
    mark_prompts_from: int | None = None,
    log_y: bool = False,
):
    """Per-token latency over time: a dot per generated token after a request's first, at (its
    time, its gap to the previous token of its request) in ms (`token_gaps`). A step that
    stalls the decodes (e.g. a whole-prompt prefill) shows as a column of high dots, one per
    decoding request. `tbt_slo` (s) draws the SLO; `mark_prompts_from` draws a dotted vertical
    line at the arrival of each request whose prompt has at least that many tokens. Returns the
    Axes."""
    ax = new_axes(ax)
    g = token_gaps(outputs)
    color = color or run_color(label or "", 0)
    ax.plot(
        g.times,
        1e3 * g.gaps,
        linestyle="none",
        marker=".",
        markersize=4,
        color=color,
        alpha=0.7,
        label=label,
    )
    if mark_prompts_from is not None:
        for i, t in enumerate(long_prompt_arrivals(outputs, mark_prompts_from)):
            ax.axvline(
                t,
                color="gray",
                linestyle=":",
                linewidth=1.0,
                label="long prompt arrives" if i == 0 else None,
            )
    if tbt_slo is not None:
        ax.axhline(1e3 * tbt_slo, label=f"TBT SLO {1e3 * tbt_slo:.0f} ms", **SLO_STYLE)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("gap to previous token (ms)")
    if label:
        ax.set_title(label)
    return ax


def plot_token_latency_panels(
    runs: Mapping[str, Sequence],
    *,
    tbt_slo: float | None = None,
    mark_prompts_from: int | None = None,
    log_y: bool = False,
    sharey: bool = True,
):
    """`plot_token_latency` for each run (name -> outputs), one panel per run stacked vertically
    in the run's color, on shared axes so the stalls compare at a glance. Returns the Figure."""
    plt = pyplot()
    n = max(len(runs), 1)
    fig, axes = plt.subplots(
        n, 1, figsize=(7.5, 2.2 * n + 0.6), sharex=True, sharey=sharey, squeeze=False
    )
    for i, (name, outputs) in enumerate(runs.items()):
        ax = axes[i, 0]
        plot_token_latency(
            outputs,
            ax=ax,
            label=name,
            color=run_color(name, i),
            tbt_slo=tbt_slo,
            mark_prompts_from=mark_prompts_from,
            log_y=log_y,
        )
        if i < n - 1:
            ax.set_xlabel("")
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def plot_tbt_cdf(
    runs: Mapping[str, Sequence],
    *,
    ax=None,
    tbt_slo: float | None = None,
    log_x: bool = True,
    ymin: float = 0.0,
):
    """The empirical CDF of each run's TBT (name -> outputs; every decode token's gap, pooled as
    `summarize` pools them) in ms, one step line per run; a dotted line at P99 and the SLO dashed.
    `ymin` > 0 zooms on the tail (e.g. 0.9). Returns the Axes."""
    ax = new_axes(ax)
    for i, (name, outputs) in enumerate(runs.items()):
        x, y = ecdf(token_gaps(outputs).gaps)
        if len(x):
            ax.step(1e3 * x, y, where="post", color=run_color(name, i), label=name)
    ax.axhline(0.99, color="gray", linestyle=":", linewidth=1.0, label="P99")
    if tbt_slo is not None:
        ax.axvline(1e3 * tbt_slo, label=f"TBT SLO {1e3 * tbt_slo:.0f} ms", **SLO_STYLE)
    if log_x:
        ax.set_xscale("log")
    ax.set_ylim(ymin, 1.005)
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("fraction of decode tokens")
    ax.set_title("TBT CDF" if ymin == 0 else f"TBT CDF (tail above {ymin:g})")
    ax.legend(loc="lower right", fontsize="small")
    return ax


def plot_throughput_vs_budget(
    summaries: Mapping[int, object],
    *,
    ax=None,
    tbt_slo: float | None = None,
    throughput: str = "total_token_throughput",
):
    """Throughput (tokens/s, left axis, solid) and P99 TBT (ms, right axis, dashed) against the
    token budget `max_num_batched_tokens` (log2 x axis), from one `Summary` per budget
    (budget -> summary). `throughput` names the Summary field ('total_token_throughput': prompt
    + output tokens/s, or 'output_token_throughput'). Returns the left Axes; the right one is
    its twin, the last axes of `ax.figure`."""
    ax = new_axes(ax)
    budgets = sorted(summaries)
    values = [getattr(summaries[b], throughput) for b in budgets]
    ax.plot(budgets, values, marker="o", color="tab:blue", label="throughput")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel("token budget (max_num_batched_tokens)")
    kind = "prompt + output" if throughput == "total_token_throughput" else "output"
    ax.set_ylabel(f"throughput ({kind} tokens/s)", color="tab:blue")
    right = ax.twinx()
    p99 = [summaries[b].tbt.p99 for b in budgets]
    p99 = [np.nan if v is None else 1e3 * v for v in p99]
    right.plot(budgets, p99, marker="s", linestyle="--", color="tab:red", label="P99 TBT")
    if tbt_slo is not None:
        right.axhline(1e3 * tbt_slo, label=f"TBT SLO {1e3 * tbt_slo:.0f} ms", **SLO_STYLE)
    right.set_ylabel("P99 TBT (ms)", color="tab:red")
    right.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right", fontsize="small")
    ax.set_title("throughput and P99 TBT against the token budget")
    return ax


def plot_capacity(capacities: Mapping[str, object], *, ax=None, tbt_slo: float | None = None):
    """One bar per run (name -> `CapacityResult` or a QPS): the capacity, i.e. the highest
    Poisson QPS that met P99 TBT <= SLO and P50 scheduling delay <= 2 s (Sarathi-Serve), with
    its value written on the bar. Returns the Axes."""
    ax = new_axes(ax)
    names = list(capacities)
    qps = [float(getattr(c, "capacity_qps", c)) for c in capacities.values()]
    if tbt_slo is None:  # from the results when they carry it
        slos = [getattr(c, "tbt_slo", None) for c in capacities.values()]
        tbt_slo = slos[0] if slos and slos[0] is not None else None
    bars = ax.bar(names, qps, color=[run_color(n, i) for i, n in enumerate(names)])
    for bar, q in zip(bars, qps, strict=True):
        ax.annotate(
            f"{q:.2f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
        )
    ax.set_ylabel("capacity (requests/s)")
    slo = f" under P99 TBT ≤ {1e3 * tbt_slo:.0f} ms" if tbt_slo is not None else ""
    ax.set_title("capacity" + slo)
    ax.set_ylim(0, max([*qps, 0.0]) * 1.15 or 1.0)
    return ax


def plot_throughput_vs_batch(rows: Mapping[str, Sequence[Mapping]], *, ax=None):
    """Output tokens/s against the number of requests run at once, one line per run (name ->
    rows with 'batch' and 'output_tokens_per_s', as `scripts/benchmark.py --batch_sizes` measures
    them), on log2 axes. Returns the Axes."""
    ax = new_axes(ax)
    batches = set()
    for i, (name, points) in enumerate(rows.items()):
        b = [int(r["batch"]) for r in points]
        batches.update(b)
        ax.plot(
            b,
            [r["output_tokens_per_s"] for r in points],
            marker="o",
            color=run_color(name, i),
            label=name,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches))
    ax.set_xticklabels([str(b) for b in sorted(batches)])
    ax.set_xlabel("requests at once (batch)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput at batch N")
    ax.legend(fontsize="small")
    return ax

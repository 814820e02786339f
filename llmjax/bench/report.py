"""scripts/benchmark.py's report: its variants side by side (`format_side_by_side` with the
engine's counters, speedups, sparse KV traffic and a cluster's transfers), the capacity, goodput,
throughput-at-batch and host-overhead tables, the --plot_dir plots and the JSON's values.
`flags` is the script's parsed absl flags.
"""

from __future__ import annotations

import math
import os

from llmjax.bench.workload_flags import qps_given


def report(flags, results: dict, state: dict) -> str:
    from llmjax.bench.metrics import format_side_by_side, format_table

    names = list(results)
    extra = [
        ("engine steps", {p: r["engine_stats"]["num_steps"] for p, r in results.items()}),
        (
            "tokens per step",
            {p: f"{r['engine_stats']['tokens_per_step']:.1f}" for p, r in results.items()},
        ),
        ("preemptions", {p: r["engine_stats"]["num_preemptions"] for p, r in results.items()}),
        *[
            (label, {p: r["engine_stats"][key] for p, r in results.items()})
            for label, key in [
                ("prefill tokens computed", "num_prefill_tokens"),
                ("prefill tokens from cache", "num_cached_prefill_tokens"),
                ("pages evicted from cache", "num_evicted_pages"),
            ]
        ],
        *speedup_rows(results),
        *[
            (label, {p: fmt.format(r["step_times"][key]) for p, r in results.items()})
            for label, key, fmt in [
                ("host ms/step", "host_ms_per_step", "{:.2f}"),
                ("device ms/step", "device_ms_per_step", "{:.2f}"),
                ("host fraction", "host_fraction", "{:.1%}"),
            ]
        ],
        ("compiles during run", {p: r["num_compiles_during_run"] for p, r in results.items()}),
        *(
            [
                (label, {p: fmt.format(r["engine_stats"][key]) for p, r in results.items()})
                for label, key, fmt in [
                    ("pipeline ticks", "num_pipeline_ticks", "{}"),
                    ("pipeline bubble", "pipeline_bubble_fraction", "{:.1%}"),
                    ("pipeline idle stages", "pipeline_idle_fraction", "{:.1%}"),
                ]
                + (
                    [("pipeline bubble (time)", "pipeline_time_bubble_fraction", "{:.1%}")]
                    if flags.device == "sim"
                    else []
                )
            ]
            if flags.pp > 1
            else []
        ),
        (
            "token budget",
            {p: r["engine"]["max_num_batched_tokens"] for p, r in results.items()},
        ),
        *sparse_rows(results),
        *cluster_rows(results),
    ]
    specs = state["specs"]
    # Prompt lengths as run (a dependent request's prompt includes its parent's conversation).
    s0 = next(iter(results.values()))["summary"]
    mean_prompt = _mean([s0.num_prompt_tokens / s0.num_finished] if s0.num_finished else [])
    lines = [
        f"model {flags.model} ({flags.dtype}), workload {flags.workload}: {len(specs)} requests, "
        f"qps {flags.qps if qps_given(flags) else '(trace)'}, mean prompt {mean_prompt} / output "
        f"{_mean(s.output_len for s in specs)} tokens; TBT SLO {1e3 * state['tbt_slo']:.1f} ms",
        "",
        format_side_by_side({p: r["summary"] for p, r in results.items()}, extra),
    ]
    if flags.capacity_search:
        rows = []
        for p in names:
            cap = results[p]["capacity"]
            at = [s for q, s, ok in cap.trials if ok and q == cap.capacity_qps]
            tbt = f"{1e3 * at[0].tbt.p99:.1f}" if at and at[0].tbt.p99 is not None else "-"
            delay = f"{1e3 * at[0].scheduling_delay.p50:.1f}" if at else "-"
            rows.append([p, f"{cap.capacity_qps:.3f}", len(cap.trials), tbt, delay])
        header = ["policy", "capacity qps", "trials", "P99 TBT ms @cap", "P50 sched ms @cap"]
        lines += ["", f"capacity (P99 TBT <= {1e3 * state['tbt_slo']:.1f} ms, P50 sched <= 2 s)"]
        lines.append(format_table(header, rows))
    if flags.goodput_search:
        rows = [
            [
                p,
                f"{g.goodput_per_device:.3f}",
                f"{g.goodput:.3f}",
                g.num_devices,
                len(g.trials),
            ]
            for p in names
            if (g := results[p]["goodput"])
        ]
        g0 = results[names[0]]["goodput"]
        header = ["policy", "goodput qps/device", "goodput qps", "devices", "trials"]
        lines += [
            "",
            f"goodput (>= {g0.target:.0%} of requests with TTFT <= {1e3 * g0.slo_ttft:.0f} ms and "
            f"TPOT <= {1e3 * g0.slo_tpot:.0f} ms; DistServe)",
            format_table(header, rows),
        ]
    if flags.batch_sizes:
        header = ["batch"] + [f"{p} {k}" for p in names for k in ("out tok/s", "decode tok/s")]
        rows = []
        for i, b in enumerate(flags.batch_sizes):
            row = [b]
            for p in names:
                r = results[p]["throughput_at_batch"][i]
                row += [f"{r['output_tokens_per_s']:.1f}", _num(r["decode_tokens_per_s"])]
            rows.append(row)
        lines += [
            "",
            f"throughput at batch N (prompt {flags.prompt_len}, output "
            f"{flags.output_len}, all at once)",
            format_table(header, rows),
        ]
    if flags.host_overhead_requests:
        header = ["policy", "running", "host ms/step", "device ms/step", "host fraction"]
        rows = [
            [
                p,
                h["num_running"],
                f"{h['host_ms_per_step']:.2f}",
                f"{h['device_ms_per_step']:.2f}",
                f"{h['host_fraction']:.1%}",
            ]
            for p in names
            if (h := results[p]["host_overhead"])
        ]
        lines += ["", "host overhead per decode step", format_table(header, rows)]
    return "\n".join(lines)


def cluster_rows(results: dict) -> list:
    """KV transfers and per-instance utilization of a real cluster (--instances)."""
    if not any("transfer_stats" in r for r in results.values()):
        return []
    t = {p: r.get("transfer_stats", {}) for p, r in results.items()}
    u = {p: r.get("instance_utilization", []) for p, r in results.items()}
    return [
        ("KV transfers", {p: v.get("num_transfers", "-") for p, v in t.items()}),
        ("KV MB moved", {p: f"{v.get('bytes', 0) / 1e6:.2f}" for p, v in t.items()}),
        (
            "KV transfer ms (mean)",
            {p: f"{1e3 * v.get('mean_transfer_s', 0):.2f}" for p, v in t.items()},
        ),
        ("KV transfer failures", {p: v.get("num_failures", "-") for p, v in t.items()}),
    ] + (
        [("instance utilization", {p: " ".join(f"{x:.0%}" for x in v) for p, v in u.items()})]
        if any(u.values())
        else []
    )


def speedup_rows(results: dict) -> list:
    """Throughput and TTFT of each column relative to the first (e.g. the cache off)."""
    if len(results) < 2:
        return []
    first_name, first = next(iter(results.items()))
    rows = []
    for label, get in [
        ("throughput", lambda r: r["summary"].total_token_throughput),
        ("TTFT P50", lambda r: r["summary"].ttft.p50),
    ]:
        base = get(first)
        cells = {}
        for p, r in results.items():
            value = get(r)
            ok = base and value and math.isfinite(base) and math.isfinite(value)
            cells[p] = f"{value / base:.2f}x" if ok else "-"
        rows.append((f"{label} vs {first_name}", cells))
    return rows


def sparse_rows(results: dict) -> list:
    """With sparse KV modes: host -> device KV traffic, and agreement with the first column."""
    if all(r["engine"]["sparse_kv"] == "none" for r in results.values()):
        return []
    rows = [
        (
            "KV MiB host->device / decode token",
            {
                p: f"{r['engine_stats']['h2d_bytes_per_decode_token'] / 2**20:.2f}"
                for p, r in results.items()
            },
        ),
        (
            "KV fetched vs offload",
            _relative(results, lambda r: r["engine_stats"]["h2d_bytes_per_decode_token"]),
        ),
        ("sparse steps", {p: r["engine_stats"]["num_sparse_steps"] for p, r in results.items()}),
        (
            "pool evictions",
            {p: r["engine_stats"]["num_pool_evictions"] for p, r in results.items()},
        ),
    ]
    first_name, first = next(iter(results.items()))
    same, prefix = {}, {}
    for p, r in results.items():
        equal, lead = [], []
        for a, b in zip(first["output_token_ids"], r["output_token_ids"], strict=True):
            n = min(len(a), len(b))
            if not n:
                continue
            eq = [x == y for x, y in zip(a[:n], b[:n], strict=True)]
            equal.append(sum(eq) / n)
            lead.append((eq.index(False) if False in eq else n) / n)
        same[p] = f"{sum(equal) / len(equal):.1%}" if equal else "-"
        prefix[p] = f"{sum(lead) / len(lead):.1%}" if lead else "-"
    rows += [
        (f"greedy tokens equal to {first_name}", same),
        (f"matching prefix vs {first_name}", prefix),
    ]
    return rows


def _relative(results: dict, get) -> dict:
    """Each column's value / the offload column's (the full fetch), where there is one."""
    base = [get(r) for r in results.values() if r["engine"]["sparse_kv"] == "offload"]
    if not base or not base[0]:
        return {p: "-" for p in results}
    return {
        p: (f"{get(r) / base[0]:.3f}" if r["engine"]["sparse_kv"] != "none" else "-")
        for p, r in results.items()
    }


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    return f"{sum(values) / len(values):.0f}" if values else "-"


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def write_plots(flags, results: dict, state: dict, plot_dir: str) -> list[str]:
    """The --plot_dir PNGs (see the flag); returns their paths."""
    import re

    from llmjax.viz import latency, save_figure

    runs = state["outputs"]
    tbt_slo = state["tbt_slo"]
    # long_prompt_interference: mark where the long prompts arrive (the short ones have
    # exactly --prompt_len tokens).
    long_from = flags.prompt_len + 1 if flags.workload == "long_prompt_interference" else None
    paths = []
    for i, (name, outputs) in enumerate(runs.items()):
        ax = latency.plot_token_latency(
            outputs,
            label=name,
            color=latency.run_color(name, i),
            tbt_slo=tbt_slo,
            mark_prompts_from=long_from,
        )
        ax.legend(loc="upper right", fontsize="small")
        safe = re.sub(r"[^\w.-]+", "_", name)
        paths.append(save_figure(ax, os.path.join(plot_dir, f"timeline_{safe}.png")))
    ax = latency.plot_tbt_cdf(runs, tbt_slo=tbt_slo)
    paths.append(save_figure(ax, os.path.join(plot_dir, "tbt_cdf.png")))
    if flags.capacity_search:
        ax = latency.plot_capacity({p: r["capacity"] for p, r in results.items()})
        paths.append(save_figure(ax, os.path.join(plot_dir, "capacity.png")))
    if flags.batch_sizes:
        ax = latency.plot_throughput_vs_batch(
            {p: r["throughput_at_batch"] for p, r in results.items()}
        )
        paths.append(save_figure(ax, os.path.join(plot_dir, "throughput_vs_batch.png")))
    return paths


def jsonable(obj):
    """`obj` as JSON can hold it: `as_dict()` of results, str keys, None for inf and nan."""
    if hasattr(obj, "as_dict"):
        return jsonable(obj.as_dict())
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj

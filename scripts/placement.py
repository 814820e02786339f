r"""DistServe's placement search on the simulator, and its goodput against colocated serving.

    python scripts/placement.py                     # OPT-13B on A100-80GB, ShareGPT-shaped chat
    python scripts/placement.py --compare           # + disaggregated vs vLLM vs Sarathi-Serve
    python scripts/placement.py --quick --compare   # a small, fast version (tests)

The search is DistServe's high node-affinity algorithm (ALGORITHMS.md §7.2, paper Alg. 1): each
phase is placed on its own. For every (tp, pp) with tp * pp <= --gpus_per_node whose weights
leave KV room for at least one --max_model_len request on --hardware:

  prefill  one instance that serves each request up to its first token only (output 1 token,
           KV freed at once, as if a decode instance took it at once): its TTFT attainment;
  decode   one decode instance fed already-prefilled requests at the arrival rate (an ideal
           prefill instance, zero step time and unbounded KV, parks them; they migrate at
           once, with DistServe's pull condition): its TPOT attainment.

For each, `llmjax.bench.goodput_search` bisects the per-device rate (in [0, --max_rate], to
--esp) at which --attainment of the requests meet that phase's SLO. The best per-device goodput
wins per phase; both are then replicated to --target_rate: n_prefill = ceil(target / prefill
instance goodput), n_decode likewise.

With --compare, the choice runs end to end as a disaggregated `llmjax.sim.SimCluster` (n_prefill
prefill + n_decode decode instances, KV migrated over NVLink when they share a node, else the
network, `SimCluster`'s transfer model) and its per-device goodput (both SLOs per request,
`goodput_search` over the whole deployment) is compared at the same device count with colocated
prefill_first (vLLM) and colocated sarathi (Sarathi-Serve, --sarathi_budget tokens per step)
instances at --colocated_tp, behind least_outstanding routers; on OPT-13B also the paper's AE
placement (prefill TP2, decode TP1, replicated to --target_rate by our phase goodputs, at its own
device count: --nopaper_placement skips it). The paper's figures printed
beside ours are what ALGORITHMS.md §7 records (§7.3: the OPT-13B AE placement prefill TP2 /
decode TP1 vs vLLM TP1; the headline "up to 7.4x" more requests over all its workloads; §7.2: the
simdistserve README's OPT-13B example, best per-GPU rate 1.56 at tp_prefill=2, tp_decode=1 under
TTFT 0.2 s / TPOT 0.1 s). Every number here is simulated (roofline cost model,
llmjax/sim/roofline.py); the JSON (--output_json) keeps every trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKLOADS = ("sharegpt", "arxiv")
PAGE_SIZE = 16  # CacheConfig's default, every instance
PAPER = {
    "headline_gain": "up to 7.4x",  # ALGORITHMS.md §7.3 [abs/doc]: over all workloads
    "ae_placement": {"prefill": "TP2", "decode": "TP1", "vllm": "TP1"},  # §7.3, OPT-13B
    # §7.2: simdistserve README, OPT-13B ShareGPT, 1 node x 4 A100, TTFT 0.2 s / TPOT 0.1 s
    "simdistserve_example": {"per_gpu_rate": 1.56, "tp_prefill": 2, "tp_decode": 1},
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags (defined when it runs, so that tests can import its functions)."""
    flags.DEFINE_string("model", "opt-13b", "Model preset (configs/).")
    flags.DEFINE_string("hardware", "a100-80gb", "Hardware preset (llmjax.sim.hardware.HARDWARE).")
    flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node (the hardware's devices_per_node).")
    flags.DEFINE_list("tps", ["1", "2", "4", "8"], "Tensor-parallel degrees to try.")
    flags.DEFINE_list("pps", ["1", "2", "4"], "Pipeline-parallel degrees to try.")
    flags.DEFINE_float("ttft_slo", 0.25, "TTFT SLO, seconds (DistServe chatbot OPT-13B: 0.25).")
    flags.DEFINE_float("tpot_slo", 0.1, "TPOT SLO, seconds (DistServe chatbot OPT-13B: 0.1).")
    flags.DEFINE_float("attainment", 0.9, "SLO attainment target (DistServe: 90 %).")
    flags.DEFINE_integer("num_requests", 200, "Requests per trial (simdistserve's example: 300).")
    flags.DEFINE_float(
        "min_trial_s",
        60.0,
        "If > 0, a trial at rate q has max(--num_requests, q x this) requests, so that it "
        "spans this many seconds of arrivals. A fixed count (0; DistServe's search uses 300) "
        "favors deployments of many instances: 200 requests over 6 instances are ~33 each, "
        "mostly the empty system's transient, while one prefill instance sees all 200 "
        "(--quick: 0).",
    )
    flags.DEFINE_enum(
        "workload", "sharegpt", WORKLOADS, "Length statistics (llmjax.bench.workloads)."
    )
    flags.DEFINE_float("scale", 1.0, "Multiply the workload's lengths by this (1: as published).")
    flags.DEFINE_integer("max_model_len", None, "Context per request (default: the model's).")
    flags.DEFINE_integer("seed", 0, "Workload seed (lengths and arrivals).")
    flags.DEFINE_float(
        "max_rate", 5.0, "Bisection upper bound, requests/s per device (DistServe 5)."
    )
    flags.DEFINE_float("esp", 0.25, "Stop bisecting when the bracket is narrower (per device).")
    flags.DEFINE_float("target_rate", 4.0, "Traffic to replicate the phases to, requests/s.")
    flags.DEFINE_integer("max_num_seqs", 256, "Requests per step, every instance (vLLM's default).")
    flags.DEFINE_integer(
        "prefill_max_tokens", None, "Prefill instances' tokens per step (default max_model_len)."
    )
    flags.DEFINE_float("memory_utilization", 0.9, "Share of device memory for weights and KV.")
    flags.DEFINE_bool("compare", False, "Also run the choice end to end against colocated serving.")
    flags.DEFINE_integer(
        "colocated_tp", 1, "Colocated baselines' tp (DistServe's vLLM OPT-13B: 1)."
    )
    flags.DEFINE_list(
        "sarathi_budgets",
        ["512", "2048"],
        "Sarathi-Serve token budgets (strict SLO 512, relaxed 2048).",
    )
    flags.DEFINE_bool(
        "paper_placement",
        True,
        "With --compare on opt-13b: also run the paper's AE placement (prefill TP2, decode TP1), "
        "replicated to --target_rate by its phase goodputs.",
    )
    flags.DEFINE_list(
        "compare_seeds",
        [],
        "With --compare: run the end-to-end comparison once per workload seed (lengths and "
        "arrivals) and report the mean and the range (default: --seed only). The goodput of a "
        "200-request trial moves with the seed; several seeds show by how much.",
    )
    flags.DEFINE_list(
        "curve_rates",
        [],
        "With --compare: also measure each deployment's SLO attainment at these per-GPU rates "
        "(DistServe's attainment-vs-rate curves, Fig. 8/9 top rows).",
    )
    flags.DEFINE_list(
        "slo_scales",
        [],
        "With --compare and --curve_rates: each deployment's attainment at the first curve "
        "rate with both SLOs multiplied by these factors (DistServe's SLO-scale curves).",
    )
    flags.DEFINE_bool("quick", False, "Tiny settings for a smoke run (40 requests, tp 1-2, pp 1).")
    flags.DEFINE_string("output_json", "out/placement.json", "Where to write the results.")


# ------------------------------------------------------------------------------------------------
# Engines.


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a trial needs, from the flags."""

    model: object  # ModelConfig
    hardware: object  # Hardware
    max_model_len: int
    max_num_seqs: int
    prefill_max_tokens: int
    memory_utilization: float
    workload: str
    scale: float
    num_requests: int
    seed: int
    ttft_slo: float
    tpot_slo: float
    attainment: float
    max_rate: float
    esp: float
    min_trial_s: float = 0.0  # > 0: at least qps x this many requests a trial


class _Instant:
    """A cost model whose steps take no time (the decode phase's ideal prefill instance)."""

    def step_seconds(self, features) -> float:
        return 0.0


def engine_config(
    s: Setup, tp: int, pp: int, policy: str, budget: int | None = None, cost_model="roofline"
):
    from llmjax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from llmjax.sim import SimConfig

    budget = budget or max(s.max_model_len, s.max_num_seqs)
    return EngineConfig(
        model=s.model,
        device="sim",
        dtype="bfloat16",
        sim=SimConfig(
            cost_model=cost_model, hardware=s.hardware, memory_utilization=s.memory_utilization
        ),
        parallel=ParallelConfig(tp=tp, pp=pp),
        scheduler=SchedulerConfig(
            policy=policy, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=budget
        ),
        cache=CacheConfig(page_size=PAGE_SIZE, prefix_cache="none"),  # random prompts: no sharing
        max_model_len=s.max_model_len,
    )


def make_engine(s: Setup, tp: int, pp: int, role: str, policy: str = "prefill_first", budget=None):
    from llmjax.engine.engine import LLMEngine

    return LLMEngine(engine_config(s, tp, pp, policy, budget), None, None, role=role)


def fits(s: Setup, tp: int, pp: int) -> int | None:
    """KV pages a (tp, pp) instance has beside its weights, or None if it cannot run (tp must
    divide the heads, pp the layers at most; KV room for one max_model_len request)."""
    from llmjax.sim import sim_num_pages
    from llmjax.sim.roofline import RooflineCostModel

    try:
        RooflineCostModel(s.model, s.hardware, "bfloat16", tp, pp)
        pages = sim_num_pages(engine_config(s, tp, pp, "prefill_first"))
    except ValueError:
        return None
    return pages if pages * PAGE_SIZE >= s.max_model_len else None


def specs_at(s: Setup, qps: float, output_len: int | None = None):
    """The workload at `qps`: `num_requests` requests, or more to span `min_trial_s`."""
    from llmjax.bench import workloads

    n = max(s.num_requests, math.ceil(qps * s.min_trial_s))
    specs = getattr(workloads, s.workload)(
        n, qps=qps, scale=s.scale, max_model_len=s.max_model_len, seed=s.seed
    )
    if output_len is not None:
        specs = [dataclasses.replace(x, output_len=output_len) for x in specs]
    return specs


# ------------------------------------------------------------------------------------------------
# One phase alone, and the bisection.


def run_prefill_phase(s: Setup, tp: int, pp: int, qps: float):
    """One prefill instance at `qps`, each request done at its first token: its Summary with
    TTFT attainment (TPOT unconstrained)."""
    from llmjax.bench import replay, summarize

    engine = make_engine(s, tp, pp, "colocated", budget=s.prefill_max_tokens)
    outputs = replay(engine, specs_at(s, qps, output_len=1), seed=s.seed)
    return summarize(outputs, slo_ttft=s.ttft_slo, slo_tpot=math.inf)


def run_decode_phase(s: Setup, tp: int, pp: int, qps: float):
    """One decode instance fed at `qps` by an ideal prefill instance (zero step time, KV for
    every request, instant migration, DistServe's pull condition on the decode side): its
    Summary with TPOT attainment (TTFT unconstrained)."""
    from llmjax.bench import replay, summarize
    from llmjax.engine.block_manager import pages_needed
    from llmjax.engine.engine import LLMEngine
    from llmjax.sim import SimCluster

    specs = specs_at(s, qps)
    pages = sum(pages_needed(x.prompt_len + 1, PAGE_SIZE) for x in specs)
    pages += pages_needed(s.max_model_len, PAGE_SIZE) + 2
    config = engine_config(s, 1, 1, "prefill_first", budget=16 * s.max_model_len)
    config = dataclasses.replace(
        config,
        sim=dataclasses.replace(config.sim, cost_model=_Instant()),
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=len(specs)),
    )
    ideal = LLMEngine(config, None, pages, role="prefill")
    decode = make_engine(s, tp, pp, "decode")
    cluster = SimCluster([ideal, decode], transfer_bandwidth=math.inf, transfer_latency_s=0.0)
    outputs = replay(cluster, specs, seed=s.seed)
    return summarize(outputs, slo_ttft=math.inf, slo_tpot=s.tpot_slo)


def phase_goodput(run_at_qps, num_devices: int, s: Setup, log=None):
    """DistServe's bisection of one phase's per-device rate (`goodput_search`); the SLOs are
    those `run_at_qps` summarized with (the other phase's is inf)."""
    from llmjax.bench import goodput_search

    return goodput_search(
        run_at_qps,
        s.ttft_slo,
        s.tpot_slo,
        num_devices=num_devices,
        target=s.attainment,
        max_per_device_rate=s.max_rate,
        esp=s.esp,
        log=log,
    )


def search(s: Setup, tps, pps, gpus_per_node: int, log=print) -> list[dict]:
    """Every fitting (phase, tp, pp) with its per-device goodput, in the order run."""
    rows = []
    for phase, runner in (("prefill", run_prefill_phase), ("decode", run_decode_phase)):
        for tp in tps:
            for pp in pps:
                if tp * pp > gpus_per_node:
                    continue
                pages = fits(s, tp, pp)
                if pages is None:
                    log(f"{phase} tp={tp} pp={pp}: does not fit, skipped")
                    continue
                t = time.perf_counter()
                result = phase_goodput(
                    lambda qps, runner=runner, tp=tp, pp=pp: runner(s, tp, pp, qps),
                    tp * pp,
                    s,
                    log=lambda m, phase=phase, tp=tp, pp=pp: log(f"{phase} tp={tp} pp={pp}: {m}"),
                )
                rows.append(
                    {
                        "phase": phase,
                        "tp": tp,
                        "pp": pp,
                        "num_devices": tp * pp,
                        "kv_pages": pages,
                        "goodput_per_device": result.goodput_per_device,
                        "goodput_per_instance": result.goodput,
                        # passed up to the bisection's bound: the goodput is at least this
                        "capped": result.goodput_per_device >= s.max_rate - s.esp,
                        "trials": [
                            {"qps": q, "attainment": x.slo_attainment, "passed": ok}
                            for q, x, ok in result.trials
                        ],
                        "wall_s": time.perf_counter() - t,
                    }
                )
    return rows


def choose(rows: list[dict], target_rate: float, pick: dict | None = None) -> dict:
    """The best per-device goodput per phase (ties: fewer devices, then lower tp), replicated
    to `target_rate`; `pick` ({phase: (tp, pp)}) imposes a phase's configuration instead."""
    best = {}
    for phase in ("prefill", "decode"):
        cands = [r for r in rows if r["phase"] == phase]
        if pick and phase in pick:
            cands = [r for r in cands if (r["tp"], r["pp"]) == tuple(pick[phase])]
        if not cands:
            raise ValueError(f"no {phase} configuration fits")
        top = max(cands, key=lambda r: (r["goodput_per_device"], -r["num_devices"], -r["tp"]))
        if top["goodput_per_instance"] <= 0:
            raise ValueError(
                f"no {phase} configuration meets its SLO at any rate tried (lower the load or "
                "relax the SLO); see the table"
            )
        best[phase] = top
    n = {p: math.ceil(target_rate / best[p]["goodput_per_instance"] - 1e-9) for p in best}
    devices = sum(n[p] * best[p]["num_devices"] for p in best)
    keys = ("tp", "pp", "num_devices", "goodput_per_device", "goodput_per_instance", "capped")
    capacity = min(n[p] * best[p]["goodput_per_instance"] for p in best)
    return {
        "prefill": {k: best["prefill"][k] for k in keys},
        "decode": {k: best["decode"][k] for k in keys},
        "n_prefill": n["prefill"],
        "n_decode": n["decode"],
        "num_devices": devices,
        "target_rate": target_rate,
        # what the phase goodputs say the deployment sustains (a lower bound where capped)
        "estimated_goodput": capacity,
        "estimated_goodput_per_device": capacity / devices,
    }


# ------------------------------------------------------------------------------------------------
# End to end: the choice against colocated serving at the same device count.


def run_deployment(s: Setup, kind: str, choice: dict, qps: float, colocated_tp: int, budget=None):
    """One trial of a whole deployment at `qps`: 'disaggregated' (the choice) or a colocated
    policy ('prefill_first', 'sarathi' with `budget` tokens a step) on choice['num_devices'] //
    colocated_tp instances. Returns (Summary, the cluster)."""
    from llmjax.bench import replay, summarize
    from llmjax.sim import SimCluster

    if kind == "disaggregated":
        p, d = choice["prefill"], choice["decode"]
        engines = [
            make_engine(s, p["tp"], p["pp"], "prefill", budget=s.prefill_max_tokens)
            for _ in range(choice["n_prefill"])
        ] + [make_engine(s, d["tp"], d["pp"], "decode") for _ in range(choice["n_decode"])]
    else:
        n = max(1, choice["num_devices"] // colocated_tp)
        engines = [make_engine(s, colocated_tp, 1, "colocated", kind, budget) for _ in range(n)]
    cluster = SimCluster(engines, "least_outstanding")
    outputs = replay(cluster, specs_at(s, qps), seed=s.seed)
    cluster.outputs = outputs  # for the attainment curves at other SLO scales
    return summarize(outputs, slo_ttft=s.ttft_slo, slo_tpot=s.tpot_slo), cluster


def deployments(choice: dict, budgets, paper_choice: dict | None = None) -> list[tuple]:
    """(name, kind, token budget, placement) of each deployment compared."""
    return [
        ("disaggregated", "disaggregated", None, choice),
        *([("disaggregated/paper", "disaggregated", None, paper_choice)] if paper_choice else []),
        ("prefill_first", "prefill_first", None, choice),
        *[(f"sarathi/{b}", "sarathi", int(b), choice) for b in budgets],
    ]


def compare(
    s: Setup,
    choice: dict,
    colocated_tp: int,
    budgets,
    paper_choice=None,
    log=print,
    curve_rates=(),
    slo_scales=(),
) -> dict:
    """Each deployment's per-device goodput, end to end (the module doc); the colocated ones
    on as many devices as `choice`."""
    from llmjax.bench import goodput_search

    out = {}
    for name, kind, budget, placed in deployments(choice, budgets, paper_choice):
        devices = (
            placed["num_devices"]
            if kind == "disaggregated"
            else max(1, choice["num_devices"] // colocated_tp) * colocated_tp
        )
        clusters = []

        def run(qps, kind=kind, budget=budget, placed=placed, clusters=clusters):
            summary, cluster = run_deployment(s, kind, placed, qps, colocated_tp, budget)
            clusters.append((qps, summary.slo_attainment, cluster))
            return summary

        t = time.perf_counter()
        result = goodput_search(
            run,
            s.ttft_slo,
            s.tpot_slo,
            num_devices=devices,
            target=s.attainment,
            max_per_device_rate=s.max_rate,
            esp=s.esp,
            log=lambda m, name=name: log(f"{name}: {m}"),
        )
        passed = [c for q, a, c in clusters if a is not None and a >= s.attainment]
        transfers = None
        if kind == "disaggregated" and passed:
            transfers = passed[-1].transfer_stats.as_dict()
        out[name] = {
            "policy": kind,
            "token_budget": budget,
            "placement": placed if kind == "disaggregated" else None,
            "goodput_per_device": result.goodput_per_device,
            "goodput": result.goodput,
            "num_devices": devices,
            "trials": [
                {
                    "qps": q,
                    "attainment": x.slo_attainment,
                    "passed": ok,
                    "ttft_p90": x.ttft.p90,
                    "tpot_p90": x.tpot.p90,
                }
                for q, x, ok in result.trials
            ],
            "transfer_stats_at_goodput": transfers,
            "wall_s": time.perf_counter() - t,
        }
        if curve_rates:
            out[name]["curves"] = attainment_curves(
                s, kind, placed, devices, colocated_tp, budget, curve_rates, slo_scales
            )
    return out


def attainment_curves(
    s: Setup, kind, placed, devices: int, colocated_tp: int, budget, rates, scales
) -> dict:
    """SLO attainment of one deployment at each per-GPU rate, and at the first rate with both
    SLOs scaled by each factor (the same outputs, summarized again)."""
    from llmjax.bench import summarize

    by_rate, by_scale = [], []
    for k, rate in enumerate(rates):
        summary, cluster = run_deployment(s, kind, placed, rate * devices, colocated_tp, budget)
        by_rate.append({"per_device_rate": rate, "attainment": summary.slo_attainment})
        if k == 0:
            for f in scales:
                x = summarize(cluster.outputs, slo_ttft=f * s.ttft_slo, slo_tpot=f * s.tpot_slo)
                by_scale.append({"slo_scale": f, "attainment": x.slo_attainment})
    return {"by_rate": by_rate, "by_slo_scale": by_scale}


def merge_seeds(runs: list[dict], seeds: list[int]) -> dict:
    """One comparison from one per seed: each deployment's goodput per device is the mean over
    the seeds, with `per_seed`, `min`, `max` and `ratio_vs_vllm` per seed beside it; trials and
    transfer stats are the first seed's."""
    out = {}
    for name in runs[0]:
        gs = [r[name]["goodput_per_device"] for r in runs]
        bases = [r["prefill_first"]["goodput_per_device"] for r in runs]
        ratios = [g / b if b > 0 else None for g, b in zip(gs, bases, strict=True)]
        out[name] = {
            **runs[0][name],
            "goodput_per_device": sum(gs) / len(gs),
            "goodput_per_device_per_seed": gs,
            "ratio_vs_vllm_per_seed": ratios,
            "seeds": seeds,
            "wall_s": sum(r[name]["wall_s"] for r in runs),
        }
    return out


# ------------------------------------------------------------------------------------------------
# Report.


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _rate(x: float, capped: bool = False) -> str:
    return (">= " if capped else "") + f"{x:.3f}"


def report(rows, choice, cmp, s: Setup, colocated_tp: int) -> str:
    from llmjax.bench.metrics import format_table

    lines = [
        f"DistServe placement search (simulated: roofline, {s.model.name} on {s.hardware.name}; "
        f"{s.workload} x{s.scale:g}, {s.num_requests} requests/trial"
        + (f" (at least {s.min_trial_s:g} s of arrivals)" if s.min_trial_s > 0 else "")
        + f"; TTFT <= {s.ttft_slo:g} s "
        f"(prefill), TPOT <= {s.tpot_slo:g} s (decode), {s.attainment:.0%} attainment)",
        format_table(
            ["phase", "tp", "pp", "devices", "KV pages", "goodput/device", "goodput/instance"],
            [
                [
                    r["phase"],
                    r["tp"],
                    r["pp"],
                    r["num_devices"],
                    r["kv_pages"],
                    _rate(r["goodput_per_device"], r["capped"]),
                    _rate(r["goodput_per_instance"], r["capped"]),
                ]
                for r in rows
            ],
        ),
    ]
    if any(r["capped"] for r in rows):
        lines.append(
            f">=: passed up to the bisection's bound (--max_rate {s.max_rate:g}/device); ties go "
            "to fewer devices, then lower tp"
        )
    if choice:
        p, d = choice["prefill"], choice["decode"]
        est = choice["estimated_goodput_per_device"]
        lines += [
            "",
            f"choice (simulated): prefill TP{p['tp']}-PP{p['pp']} x {choice['n_prefill']}, decode "
            f"TP{d['tp']}-PP{d['pp']} x {choice['n_decode']} for {choice['target_rate']:g} req/s: "
            f"{choice['num_devices']} GPUs; the phases' goodputs sustain "
            f"{_rate(est, p['capped'] or d['capped'])} req/s per GPU",
            "paper (ALGORITHMS.md §7.3, OPT-13B AE): prefill TP2, decode TP1 (vs vLLM TP1); "
            "simdistserve README (§7.2; TTFT 0.2 s, 4 A100): best per-GPU rate 1.56 at "
            "tp_prefill=2, tp_decode=1",
        ]
    if cmp:
        base = cmp["prefill_first"]["goodput_per_device"]
        table = []
        for name, r in cmp.items():
            g = r["goodput_per_device"]
            label = f"colocated sarathi (budget {r['token_budget']}) TP{colocated_tp}"
            if r["policy"] == "disaggregated":
                pl = r["placement"]
                label = (
                    f"disaggregated{' (paper AE placement)' if name.endswith('paper') else ''} "
                    f"P TP{pl['prefill']['tp']}-PP{pl['prefill']['pp']} x{pl['n_prefill']} + "
                    f"D TP{pl['decode']['tp']}-PP{pl['decode']['pp']} x{pl['n_decode']}"
                )
            elif name == "prefill_first":
                label = f"colocated prefill_first (vLLM) TP{colocated_tp}"
            ratio = f"{g / base:.2f}x" if base > 0 else ("inf" if g > 0 else "-")
            per_seed = r.get("goodput_per_device_per_seed", [g])
            rate = _rate(g)
            if len(per_seed) > 1:  # the mean, the range and the ratio's range over the seeds
                rate += f" ({min(per_seed):.2f}-{max(per_seed):.2f})"
                rs = [x for x in r["ratio_vs_vllm_per_seed"] if x is not None]
                if rs:
                    ratio += f" ({min(rs):.2f}-{max(rs):.2f})"
            paper = {"disaggregated": PAPER["headline_gain"], "prefill_first": "1x"}
            paper = paper.get(r["policy"], "")
            p90 = [t for t in r["trials"] if t["passed"]]
            p90 = max(p90, key=lambda t: t["qps"], default=None)
            lat = f"{p90['ttft_p90']:.3f} / {p90['tpot_p90']:.3f}" if p90 else "-"
            table.append([label, r["num_devices"], rate, ratio, paper, lat])
        lines += [
            "",
            f"End to end (simulated; goodput/GPU = the highest rate per GPU at which >= "
            f"{s.attainment:.0%} of requests meet both SLOs"
            + (
                f"; mean (range) over workload seeds {cmp['prefill_first']['seeds']}, the ratio "
                "of the means (range of the per-seed ratios))"
                if len(cmp["prefill_first"].get("seeds", [])) > 1
                else ")"
            ),
            format_table(
                [
                    "deployment",
                    "GPUs",
                    "goodput/GPU",
                    "vs vLLM",
                    "paper vs vLLM",
                    "P90 TTFT / TPOT s",
                ],
                table,
            ),
            "paper: ALGORITHMS.md records only DistServe's headline, up to 7.4x more requests "
            "over all its workloads and models; it quotes no OPT-13B chatbot figure.",
        ]
        curves = {n: r["curves"] for n, r in cmp.items() if r.get("curves")}
        if curves:
            first = next(iter(curves.values()))
            rates = [c["per_device_rate"] for c in first["by_rate"]]
            lines += [
                "",
                "SLO attainment vs per-GPU rate (simulated, workload seed "
                f"{cmp['prefill_first'].get('seeds', [s.seed])[0]})",
                format_table(
                    ["deployment", *[f"{r:g}/GPU" for r in rates]],
                    [
                        [n, *[_pct(c["attainment"]) for c in v["by_rate"]]]
                        for n, v in curves.items()
                    ],
                ),
            ]
            scales = [c["slo_scale"] for c in first["by_slo_scale"]]
            if scales:
                lines += [
                    "",
                    f"SLO attainment vs SLO scale at {rates[0]:g} req/s per GPU "
                    "(both SLOs x scale)",
                    format_table(
                        ["deployment", *[f"x{f:g}" for f in scales]],
                        [
                            [n, *[_pct(c["attainment"]) for c in v["by_slo_scale"]]]
                            for n, v in curves.items()
                        ],
                    ),
                ]
        st = cmp["disaggregated"].get("transfer_stats_at_goodput")
        if st and st["num_transfers"]:
            lines.append(
                f"KV transfers at the disaggregated goodput: {st['num_transfers']}, mean "
                f"{1e3 * st['mean_transfer_s']:.2f} ms, p99 {1e3 * st['p99_transfer_s']:.2f} ms, "
                f"{st['bytes'] / 2**30:.1f} GiB in all"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------


def setup_from_flags() -> Setup:
    from configs import get_preset
    from llmjax.sim import get_hardware

    model = get_preset(FLAGS.model)
    hw = get_hardware(FLAGS.hardware).replace(devices_per_node=FLAGS.gpus_per_node)
    max_len = FLAGS.max_model_len or model.max_position_embeddings
    num_requests = 40 if FLAGS.quick and not FLAGS["num_requests"].present else FLAGS.num_requests
    return Setup(
        model=model,
        hardware=hw,
        max_model_len=max_len,
        max_num_seqs=FLAGS.max_num_seqs,
        prefill_max_tokens=FLAGS.prefill_max_tokens or max_len,
        memory_utilization=FLAGS.memory_utilization,
        workload=FLAGS.workload,
        scale=FLAGS.scale,
        num_requests=num_requests,
        seed=FLAGS.seed,
        ttft_slo=FLAGS.ttft_slo,
        tpot_slo=FLAGS.tpot_slo,
        attainment=FLAGS.attainment,
        max_rate=FLAGS.max_rate,
        esp=FLAGS.esp,
        min_trial_s=0.0 if FLAGS.quick and not FLAGS["min_trial_s"].present else FLAGS.min_trial_s,
    )


def main(argv):
    del argv
    s = setup_from_flags()
    tps, pps = [int(x) for x in FLAGS.tps], [int(x) for x in FLAGS.pps]
    if FLAGS.quick:
        tps = [t for t in tps if t <= 2] if not FLAGS["tps"].present else tps
        pps = [1] if not FLAGS["pps"].present else pps
    if FLAGS.gpus_per_node < 1 or FLAGS.target_rate <= 0 or FLAGS.colocated_tp < 1:
        raise app.UsageError("need --gpus_per_node >= 1, --target_rate > 0, --colocated_tp >= 1")

    def log(m):
        print(m, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    rows = search(s, tps, pps, FLAGS.gpus_per_node, log=log)
    choice = choose(rows, FLAGS.target_rate)
    cmp = paper_choice = None
    if FLAGS.compare:
        if FLAGS.paper_placement and s.model.name == "opt-13b":  # §7.3's AE placement
            try:
                paper_choice = choose(
                    rows, FLAGS.target_rate, {"prefill": (2, 1), "decode": (1, 1)}
                )
            except ValueError as e:  # not searched (--tps, --pps) or no goodput
                log(f"paper placement skipped: {e}")
        budgets = FLAGS.sarathi_budgets
        seeds = [int(x) for x in FLAGS.compare_seeds] or [s.seed]
        runs = [
            compare(
                dataclasses.replace(s, seed=k),
                choice,
                FLAGS.colocated_tp,
                budgets,
                paper_choice,
                log=lambda m, k=k: log(f"seed {k}: {m}"),
                # the curves at the first seed only (they are many trials each)
                curve_rates=[float(x) for x in FLAGS.curve_rates] if k == seeds[0] else [],
                slo_scales=[float(x) for x in FLAGS.slo_scales],
            )
            for k in seeds
        ]
        cmp = merge_seeds(runs, seeds)
    wall = time.perf_counter() - t0
    print(report(rows, choice, cmp, s, FLAGS.colocated_tp), flush=True)
    print(f"({wall:.0f} s of wall time)", flush=True)
    if FLAGS.output_json:
        doc = {
            "simulated": True,
            "settings": {
                **{
                    k: v for k, v in dataclasses.asdict(s).items() if k not in ("model", "hardware")
                },
                "model": s.model.name,
                "hardware": s.hardware.name,
                "gpus_per_node": FLAGS.gpus_per_node,
                "tps": tps,
                "pps": pps,
                "colocated_tp": FLAGS.colocated_tp,
                "sarathi_budgets": [int(b) for b in FLAGS.sarathi_budgets],
            },
            "candidates": rows,
            "choice": choice,
            "paper_placement": paper_choice,
            "comparison": cmp,
            "paper": PAPER,
            "wall_s": wall,
        }
        if cmp:
            base = cmp["prefill_first"]["goodput_per_device"]
            doc["ratios_vs_vllm"] = {
                k: (v["goodput_per_device"] / base if base > 0 else None) for k, v in cmp.items()
            }
        os.makedirs(os.path.dirname(FLAGS.output_json) or ".", exist_ok=True)
        with open(FLAGS.output_json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    define_flags()
    app.run(main)

r"""The survey's three cluster-level figures, measured on llmjax's simulator (issue 40, item 5).

    python scripts/survey_cluster.py                    # all three parts (~5 min on 2 cores)
    python scripts/survey_cluster.py --parts sglang     # some of distserve, sglang, mooncake
    python scripts/survey_cluster.py --quick            # small and fast (the test)

Every figure here is SIMULATED: llmjax's own engines (scheduler, block manager, radix cache) on
a virtual clock (device='sim') with the roofline cost model (llmjax/sim/roofline.py), many of
them in one `SimCluster` with the real cluster's routers, DistServe's pull migration and the
Conductor. The survey's figures, printed beside ours, are the ones issue 40 quotes as the
survey's measured effects; ALGORITHMS.md does not record them (it has the papers' headlines).

distserve  DistServe on LLaMA-13B against a colocated deployment on the same GPUs: the shape of
           configs' llama2-13b with LLaMA(-1)-13B's 2048-token context (the two 13B models
           differ only in context), bfloat16, A100-80GB nodes of 8. Disaggregated: the AE
           placement ALGORITHMS.md §7.3 records for DistServe's 13B model (prefill TP2, decode
           TP1), one prefill instance and two decode instances (docs/cluster.md: the phase
           goodputs replicate it so), KV over NVLink; colocated: as many TP1 prefill_first
           (vLLM) instances, behind least_outstanding. ShareGPT4-shaped chat lengths
           (llmjax.bench.workloads.sharegpt, clipped to the context), Poisson arrivals, each
           trial at least 60 s of arrivals. DistServe's chatbot SLOs (§7.3): TTFT 0.25 s, TPOT
           0.1 s, 90 % of requests meeting both. Goodput per GPU by DistServe's bisection
           (scripts/placement.py's `compare`); then the median and P90 TTFT and TPOT of both at
           one rate, the lower of the two goodputs (a rate both sustain).
sglang     RadixAttention on multi-turn chat: a 7B model (configs' llama2-7b) on one A100-80GB,
           SGLang-like scheduling (chunked prefill, 8192 tokens a step, the 2024 default;
           longest-prefix-match admission with the cache), prefix_cache 'radix' against 'none'.
           multi_turn_chat's own shape (the one docs/cpu_performance.md measured on SmolLM2:
           256-token first prompt, ~64-token user turns, 32 output tokens a turn), 4 and 8
           turns, 128 sessions all at t=0 with no think time (each next turn as soon as the last
           one ends): the prefix-cache hit rate and the throughput ratio (the same tokens, so
           the makespan ratio).
mooncake   The Conductor on a 128-GPU cluster: Mooncake's conversation trace (a sample of its
           conversations, all their turns, compressed in time), LLaMA2-70B-shaped TP8 instances
           on A800-like GPUs (scripts/mooncake_capacity.py's deployment, scaled out): 12 prefill
           + 4 decode instances behind the Conductor (no early rejection, so both serve every
           request) against 16 colocated vLLM-like instances (prefill_first with a prefix cache,
           least_outstanding). At one rate, 0.5 req/s per instance (about 80 % of vLLM's
           capacity on that trace, docs/cluster.md): GPU utilization (devices' busy time / their
           time over the makespan, `llmjax.bench.metrics.device_utilization`) and the queueing
           delay (arrival -> first scheduled, `RequestMetrics.scheduling_delay`), mean and P90.

--quick shrinks every part (fewer requests, coarser bisection, 16 GPUs for mooncake) and says
so. The JSON (--json_out) keeps every setting, result and trial.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PARTS = ("distserve", "sglang", "mooncake")
# As issue 40 (item 5) quotes the survey this project started from.
SURVEY = {
    "distserve": {"ttft_lower": 2.1, "tpot_lower": 1.5, "goodput": 1.8},
    "sglang": {"hit_rate": 0.85, "speedup": 2.3},
    "mooncake": {"gpus": 128, "utilization_gain": 0.35, "queueing_reduction": 0.60},
    "source": "issue 40, item 5 (the survey's figures; not in ALGORITHMS.md)",
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags (defined when it runs, so that tests can import its functions)."""
    flags.DEFINE_list("parts", list(PARTS), f"Which parts to run, of {', '.join(PARTS)}.")
    flags.DEFINE_bool("quick", False, "Small settings (the test): each part well under a minute.")
    flags.DEFINE_string("json_out", "out/survey_cluster.json", "Where to write the results.")
    flags.DEFINE_string(
        "trace_dir",
        os.path.join(HERE, "../../shared/data/mooncake"),
        "Directory of Mooncake's conversation_trace.jsonl.",
    )


# ------------------------------------------------------------------------------------------------
# Settings of each part (the module doc); QUICK_* are the --quick ones.


@dataclasses.dataclass(frozen=True)
class DistServeSettings:
    model: str = "llama2-13b"
    max_model_len: int = 2048  # LLaMA-13B's context
    hardware: str = "a100-80gb"
    prefill_tp: int = 2
    num_prefill: int = 1
    decode_tp: int = 1
    num_decode: int = 2
    ttft_slo: float = 0.25
    tpot_slo: float = 0.1
    attainment: float = 0.9
    num_requests: int = 200
    min_trial_s: float = 60.0
    max_rate: float = 5.0  # per GPU (DistServe's bisection bound)
    esp: float = 0.05  # finer than DistServe's 0.25: the two goodputs are close
    seed: int = 0

    @property
    def num_gpus(self) -> int:
        return self.prefill_tp * self.num_prefill + self.decode_tp * self.num_decode


@dataclasses.dataclass(frozen=True)
class SGLangSettings:
    model: str = "llama2-7b"
    hardware: str = "a100-80gb"
    max_model_len: int = 4096
    token_budget: int = 8192  # SGLang's chunked_prefill_size (2024 default)
    max_num_seqs: int = 256
    page_size: int = 16
    turns: tuple[int, ...] = (4, 8)
    num_sessions: int = 128
    first_prompt_len: int = 256
    user_turn_len: int = 64
    output_len: int = 32
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    model: str = "llama2-70b"
    max_model_len: int = 131072
    tp: int = 8
    num_prefill: int = 12
    num_decode: int = 4
    sample_fraction: float = 0.12  # of the conversations (~4x mooncake_capacity.py's 3 %)
    max_requests: int | None = None
    rate_per_instance: float = 0.5  # req/s
    ttft_slo: float = 30.0  # Mooncake's, for the attainment shown beside
    tbt_slo: float = 0.1
    sample_seed: int = 0
    scale_note: str = ""  # why fewer than the survey's GPUs, if so

    @property
    def num_gpus(self) -> int:
        return self.tp * (self.num_prefill + self.num_decode)


QUICK_DISTSERVE = DistServeSettings(num_requests=40, min_trial_s=0.0, esp=1.0)
QUICK_SGLANG = SGLangSettings(turns=(4,), num_sessions=16)
QUICK_MOONCAKE = MooncakeSettings(
    num_prefill=1,
    num_decode=1,
    sample_fraction=0.005,
    scale_note="--quick: 2 instances (16 GPUs) and 0.5 % of the conversations, for the test; "
    "the full run simulates the 128 GPUs",
)


def settings(part: str, quick: bool):
    full = {"distserve": DistServeSettings, "sglang": SGLangSettings, "mooncake": MooncakeSettings}
    quick_ = {"distserve": QUICK_DISTSERVE, "sglang": QUICK_SGLANG, "mooncake": QUICK_MOONCAKE}
    return quick_[part] if quick else full[part]()


def _script(name: str):
    """scripts/<name>.py as a module (its flags are defined only when it runs as a script)."""
    key = f"_survey_cluster_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]


def _latencies(summary) -> dict:
    return {
        "ttft_p50": summary.ttft.p50,
        "ttft_p90": summary.ttft.p90,
        "tpot_p50": summary.tpot.p50,
        "tpot_p90": summary.tpot.p90,
        "slo_attainment": summary.slo_attainment,
        "request_throughput": summary.request_throughput,
        "num_requests": summary.num_requests,
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _instances(cluster, duration_s: float) -> dict:
    """Per role ('prefill', 'decode', 'colocated') of a cluster's instances: their GPU
    utilization, decode tokens per step, preemptions and peak share of KV pages used."""
    from llmjax.bench.metrics import device_utilization

    roles = {}
    for e in cluster.instances:
        roles.setdefault(e.role, []).append(e)
    return {
        role: {
            "utilization": device_utilization(es, duration_s),
            "decode_tokens_per_step": sum(e.stats.num_decode_tokens for e in es)
            / max(sum(e.stats.num_steps for e in es), 1),
            "preemptions": sum(e.stats.num_preemptions for e in es),
            "peak_kv_used": max(e.stats.peak_used_pages / max(e.stats.num_pages, 1) for e in es),
        }
        for role, es in roles.items()
    }


# ------------------------------------------------------------------------------------------------
# 1. DistServe.


def run_distserve(p: DistServeSettings, log=print) -> dict:
    """Goodput per GPU of both deployments (placement.compare), then both at the lower one."""
    from configs import get_preset
    from llmjax.sim import get_hardware

    placement = _script("placement")
    s = placement.Setup(
        model=get_preset(p.model),
        hardware=get_hardware(p.hardware),
        max_model_len=p.max_model_len,
        max_num_seqs=256,
        prefill_max_tokens=p.max_model_len,
        memory_utilization=0.9,
        workload="sharegpt",
        scale=1.0,
        num_requests=p.num_requests,
        seed=p.seed,
        ttft_slo=p.ttft_slo,
        tpot_slo=p.tpot_slo,
        attainment=p.attainment,
        max_rate=p.max_rate,
        esp=p.esp,
        min_trial_s=p.min_trial_s,
    )
    choice = {
        "prefill": {"tp": p.prefill_tp, "pp": 1},
        "decode": {"tp": p.decode_tp, "pp": 1},
        "n_prefill": p.num_prefill,
        "n_decode": p.num_decode,
        "num_devices": p.num_gpus,
    }
    cmp = placement.compare(s, choice, 1, [], log=log)  # disaggregated, prefill_first
    goodput = {k: cmp[k]["goodput_per_device"] for k in ("disaggregated", "prefill_first")}
    # a rate both sustain: the lower goodput (or, if one has none, the bisection's resolution)
    rate = min(goodput.values()) or p.esp
    at_rate = {}
    for kind in ("disaggregated", "prefill_first"):
        summary, cluster = placement.run_deployment(s, kind, choice, rate * p.num_gpus, 1)
        at_rate[kind] = {
            **_latencies(summary),
            "instances": _instances(cluster, summary.duration_s),
        }
    d, c = at_rate["disaggregated"], at_rate["prefill_first"]
    return {
        "settings": dataclasses.asdict(p),
        "num_gpus": p.num_gpus,
        "goodput_per_gpu": goodput,
        "goodput_ratio": _ratio(goodput["disaggregated"], goodput["prefill_first"]),
        "latency_rate_per_gpu": rate,
        "at_rate": at_rate,
        # colocated / disaggregated: > 1 where disaggregation is lower
        "ttft_lower": {q: _ratio(c[f"ttft_{q}"], d[f"ttft_{q}"]) for q in ("p50", "p90")},
        "tpot_lower": {q: _ratio(c[f"tpot_{q}"], d[f"tpot_{q}"]) for q in ("p50", "p90")},
        "comparison": cmp,
    }


# ------------------------------------------------------------------------------------------------
# 2. SGLang.


def sglang_engine(p: SGLangSettings, prefix_cache: str):
    from configs import get_preset
    from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmjax.engine.engine import LLMEngine
    from llmjax.sim import SimConfig, get_hardware

    config = EngineConfig(
        model=get_preset(p.model),
        device="sim",
        dtype="bfloat16",
        sim=SimConfig(cost_model="roofline", hardware=get_hardware(p.hardware)),
        scheduler=SchedulerConfig(
            policy="sarathi",
            max_num_seqs=p.max_num_seqs,
            max_num_batched_tokens=p.token_budget,
            admission_order="lpm" if prefix_cache == "radix" else "fcfs",
        ),
        cache=CacheConfig(page_size=p.page_size, prefix_cache=prefix_cache),
        max_model_len=p.max_model_len,
    )
    return LLMEngine(config, None, None)


def run_sglang(p: SGLangSettings, log=print) -> dict:
    """Per number of turns: the workload with the radix cache and without."""
    from llmjax.bench import replay, summarize, workloads

    rows = {}
    for turns in p.turns:
        runs = {}
        for cache in ("radix", "none"):
            engine = sglang_engine(p, cache)
            specs = workloads.multi_turn_chat(
                p.num_sessions * turns,
                num_turns=turns,
                first_prompt_len=p.first_prompt_len,
                user_turn_len=p.user_turn_len,
                output_len=p.output_len,
                think_time=0.0,
                qps=math.inf,
                vocab_size=engine.config.model.vocab_size,
                max_model_len=p.max_model_len,
                seed=p.seed,
            )
            x = summarize(replay(engine, specs, seed=p.seed))
            runs[cache] = {
                "prefix_cache_hit_rate": x.prefix_cache_hit_rate,
                "makespan_s": x.duration_s,
                "total_token_throughput": x.total_token_throughput,
                "request_throughput": x.request_throughput,
                "ttft_p50": x.ttft.p50,
                "prompt_tokens": x.num_prompt_tokens,
                "prefill_tokens_computed": engine.stats.num_prefill_tokens,
                "evicted_pages": engine.stats.num_evicted_pages,
                "kv_pages": engine.stats.num_pages,
                "num_requests": x.num_requests,
            }
            log(
                f"sglang {turns} turns, {cache}: hit {x.prefix_cache_hit_rate:.1%}, "
                f"makespan {x.duration_s:.1f} s"
            )
        r, n = runs["radix"], runs["none"]
        new_tokens = sum(x.prompt_len for x in specs)  # first prompts and user messages
        rows[str(turns)] = {
            **runs,
            # the share of prompt tokens an earlier turn computed (an unbounded, token-exact cache)
            "ideal_hit_rate": 1 - new_tokens / n["prompt_tokens"],
            "speedup": _ratio(r["total_token_throughput"], n["total_token_throughput"]),
        }
    return {"settings": dataclasses.asdict(p), "by_turns": rows}


# ------------------------------------------------------------------------------------------------
# 3. Mooncake.


def run_mooncake(p: MooncakeSettings, trace_dir: str, log=print) -> dict:
    """Both deployments replay the same trace sample at the same rate."""
    from configs import get_preset
    from llmjax.bench import replay, summarize
    from llmjax.bench.metrics import device_utilization

    mc = _script("mooncake_capacity")
    model = get_preset(p.model)
    model = model.replace(
        max_position_embeddings=max(model.max_position_embeddings, p.max_model_len)
    )
    s = mc.Setup(
        model=model,
        hardware=mc.a800(),
        max_model_len=p.max_model_len,
        tp=p.tp,
        num_prefill=p.num_prefill,
        num_decode=p.num_decode,
        page_size=256,
        prefill_chunk=8192,
        max_num_seqs=128,
        ttft_slo=p.ttft_slo,
        tbt_stat="p90",
        attainment=0.9,
        threshold=1.0,
    )
    path = os.path.join(trace_dir, "conversation_trace.jsonl")
    lines, native, _ = mc.sample_trace(
        path, "conversation", p.sample_fraction, p.sample_seed, p.max_requests
    )
    specs = mc.load_specs(lines, s)
    rate = p.rate_per_instance * (p.num_prefill + p.num_decode)
    runs = {}
    for name in ("vllm", "mooncake"):
        t = time.perf_counter()
        cluster = mc.make_cluster(s, name, p.tbt_slo)
        outputs = replay(cluster, mc.at_rate(specs, native, rate))
        x = summarize(outputs)
        runs[name] = {
            "utilization": device_utilization(cluster.instances, x.duration_s),
            "instances": _instances(cluster, x.duration_s),
            "queueing_delay_mean": x.scheduling_delay.mean,
            "queueing_delay_p50": x.scheduling_delay.p50,
            "queueing_delay_p90": x.scheduling_delay.p90,
            "ttft_p50": x.ttft.p50,
            "ttft_p90": x.ttft.p90,
            "prefix_cache_hit_rate": x.prefix_cache_hit_rate,
            "busy_gpu_s_per_request": sum(
                e.config.parallel.tp * e.stats.device_time_s for e in cluster.instances
            )
            / max(x.num_finished, 1),
            "makespan_s": x.duration_s,
            "num_finished": x.num_finished,
            "attainment": mc.attainment(outputs, p.ttft_slo, p.tbt_slo, "p90"),
            "wall_s": time.perf_counter() - t,
        }
        log(
            f"mooncake {name}: utilization {runs[name]['utilization']:.1%}, queueing delay mean "
            f"{x.scheduling_delay.mean:.2f} s ({runs[name]['wall_s']:.0f} s wall)"
        )
    v, m = runs["vllm"], runs["mooncake"]
    return {
        "settings": dataclasses.asdict(p),
        "num_gpus": p.num_gpus,
        "num_requests": len(specs),
        "native_rate": native,
        "rate": rate,
        "runs": runs,
        "utilization_gain": _ratio(m["utilization"], v["utilization"]) - 1,
        "queueing_reduction": {
            q: 1 - _ratio(m[f"queueing_delay_{q}"], v[f"queueing_delay_{q}"])
            for q in ("mean", "p90")
        },
    }


# ------------------------------------------------------------------------------------------------
# Report.


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _s(v) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _pct(v, sign=False) -> str:
    return "-" if v is None else (f"{v:+.0%}" if sign else f"{v:.1%}")


def _differs(ours, survey, tolerance=0.2) -> bool:
    return ours is None or abs(ours - survey) > tolerance * abs(survey)


def distserve_rows(r: dict) -> tuple[list, list, list]:
    """(table rows, setup lines, why lines)."""
    p, sv = r["settings"], SURVEY["distserve"]
    d, c = r["at_rate"]["disaggregated"], r["at_rate"]["prefill_first"]
    gd, gc = r["goodput_per_gpu"]["disaggregated"], r["goodput_per_gpu"]["prefill_first"]
    setup = (
        f"LLaMA-13B, {r['num_gpus']} x A100-80GB: P TP{p['prefill_tp']} x{p['num_prefill']} + "
        f"D TP{p['decode_tp']} x{p['num_decode']} vs {r['num_gpus']} x TP1 vLLM"
    )
    rate = r["latency_rate_per_gpu"]
    rows = [
        [
            "DistServe TTFT, colocated / disaggregated",
            f"P50 {_x(r['ttft_lower']['p50'])}, P90 {_x(r['ttft_lower']['p90'])} lower",
            f"{sv['ttft_lower']}x lower",
            setup,
        ],
        [
            "DistServe TPOT, colocated / disaggregated",
            f"P50 {_x(r['tpot_lower']['p50'])}, P90 {_x(r['tpot_lower']['p90'])} lower",
            f"{sv['tpot_lower']}x lower",
            f"at {rate:.3g} req/s per GPU, the lower goodput",
        ],
        [
            "DistServe goodput per GPU, disagg. / colocated",
            f"{_x(r['goodput_ratio'])} ({gd:.3g} vs {gc:.3g} req/s/GPU)",
            f"{sv['goodput']}x",
            f"TTFT <= {p['ttft_slo']:g} s and TPOT <= {p['tpot_slo']:g} s for "
            f"{p['attainment']:.0%}",
        ],
    ]
    lines = [
        f"DistServe: llama2-13b's shape with LLaMA-13B's {p['max_model_len']}-token context, "
        f"bfloat16, A100-80GB; ShareGPT4-shaped lengths (median prompt 1730 / output 415 tokens, "
        f"clipped to the context), Poisson, >= {p['num_requests']} requests and >= "
        f"{p['min_trial_s']:g} s of arrivals a trial; DistServe's chatbot SLOs TTFT "
        f"{p['ttft_slo']:g} s / TPOT {p['tpot_slo']:g} s at {p['attainment']:.0%}; bisection to "
        f"{p['esp']:g} req/s/GPU. At {rate:.3g} req/s/GPU: TTFT P50/P90 {_s(d['ttft_p50'])} / "
        f"{_s(d['ttft_p90'])} disaggregated vs {_s(c['ttft_p50'])} / {_s(c['ttft_p90'])} "
        f"colocated; TPOT {_s(d['tpot_p50'])} / {_s(d['tpot_p90'])} vs {_s(c['tpot_p50'])} / "
        f"{_s(c['tpot_p90'])}.",
    ]
    why = []
    if any(_differs(r[k]["p50"], sv[k]) for k in ("ttft_lower", "tpot_lower")) or _differs(
        r["goodput_ratio"], sv["goodput"]
    ):
        di, ci = d["instances"], c["instances"]
        pre, dec, col = di["prefill"], di["decode"], ci["colocated"]
        why.append(
            "why (DistServe): ALGORITHMS.md records no 13B chatbot figure (only the headline, "
            "up to 7.4x more requests or 12.6x tighter SLOs over all models and workloads, and "
            "DistServe's own ShareGPT lengths are not recorded); ShareGPT4's long outputs make "
            f"this placement decode-bound: at {rate:.3g} req/s/GPU the prefill instance is busy "
            f"{_pct(pre['utilization'])} of the time, the decode instances "
            f"{_pct(dec['utilization'])}, their KV up to {_pct(dec['peak_kv_used'])} full"
            + (
                f" ({dec['preemptions']} preemptions, recomputed; DistServe swaps to CPU)."
                if dec["preemptions"]
                else "."
            )
        )
        if r["tpot_lower"]["p50"] is not None and r["tpot_lower"]["p50"] < 1:
            why.append(
                f"  TPOT is higher disaggregated: its {p['num_decode']} decode GPUs hold every "
                f"decode ({dec['decode_tokens_per_step']:.0f} a step) while the colocated "
                f"deployment spreads them over {r['num_gpus']} "
                f"({col['decode_tokens_per_step']:.0f} a step); a decode step of these "
                "~2k-token contexts is bound by reading weights and KV (roofline), so the "
                "larger batch costs more than the colocated prefill stalls add."
            )
        if (r["ttft_lower"]["p50"] or 0) < sv["ttft_lower"]:
            lower = "colocated" if gc <= gd else "disaggregated"
            why.append(
                f"  TTFT: compared at the lower goodput (the {lower} deployment's); the prefill "
                "instance's TP2 at most halves a prompt's time, and one prefill instance queues "
                f"the prompts that the colocated deployment spreads over {r['num_gpus']}."
            )
    return rows, lines, why


def sglang_rows(r: dict) -> tuple[list, list, list]:
    p, sv = r["settings"], SURVEY["sglang"]
    by = r["by_turns"]
    turns = ", ".join(by)
    hits = ", ".join(_pct(v["radix"]["prefix_cache_hit_rate"]) for v in by.values())
    none_hits = ", ".join(_pct(v["none"]["prefix_cache_hit_rate"]) for v in by.values())
    speedups = ", ".join(_x(v["speedup"]) for v in by.values())
    setup = f"7B (llama2-7b) on 1 A100-80GB, multi-turn chat, {turns} turns"
    rows = [
        [
            "SGLang prefix-cache hit rate (radix)",
            f"{hits} (none: {none_hits})",
            "up to 85 %",
            setup,
        ],
        [
            "SGLang throughput, radix / none",
            speedups,
            f"{sv['speedup']}x faster",
            f"{p['num_sessions']} sessions at once, no think time",
        ],
    ]
    lines = [
        f"SGLang: {p['model']} bfloat16 on {p['hardware']}, chunked prefill "
        f"{p['token_budget']} tokens a step, LPM admission with the radix cache (FCFS without), "
        f"page {p['page_size']}; multi_turn_chat with {turns} turns, first prompt ~"
        f"{p['first_prompt_len']}, user turns ~{p['user_turn_len']}, {p['output_len']} output "
        f"tokens a turn, {p['num_sessions']} sessions at t=0, each turn at once after the last; "
        "throughput = prompt + output tokens / makespan (makespan "
        + ", ".join(
            f"{v['radix']['makespan_s']:.1f} vs {v['none']['makespan_s']:.1f} s"
            for v in by.values()
        )
        + ").",
    ]
    why = []
    best = max(v["radix"]["prefix_cache_hit_rate"] or 0 for v in by.values())
    if _differs(best, sv["hit_rate"], 0.1) or any(
        _differs(v["speedup"], sv["speedup"]) for v in by.values()
    ):
        ideal = ", ".join(_pct(v["ideal_hit_rate"]) for v in by.values())
        evicted = ", ".join(str(v["radix"]["evicted_pages"]) for v in by.values())
        computed = ", ".join(
            f"{v['none']['prefill_tokens_computed']} -> {v['radix']['prefill_tokens_computed']}"
            for v in by.values()
        )
        why.append(
            "why (SGLang): the hit rate is set by the conversation's shape (turn k's prompt holds "
            f"turns 1..k-1's prompts and outputs: at most {ideal} here) and by evictions when the "
            f"sessions' KV outgrows the cache ({evicted} pages evicted); the speedup by the "
            f"prefill work removed (prompt tokens computed {computed}) beside the decode steps, "
            "which the cache does not shorten. SGLang's own multi-turn lengths are not recorded "
            "in ALGORITHMS.md."
        )
    return rows, lines, why


def mooncake_rows(r: dict) -> tuple[list, list, list]:
    p, sv = r["settings"], SURVEY["mooncake"]
    v, m = r["runs"]["vllm"], r["runs"]["mooncake"]
    n = p["num_prefill"] + p["num_decode"]
    setup = (
        f"{r['num_gpus']} GPUs: {p['num_prefill']}P+{p['num_decode']}D TP8 vs {n} x TP8 "
        f"vLLM, conversation trace"
    )
    qr = r["queueing_reduction"]
    rows = [
        [
            "Mooncake GPU utilization, Conductor vs vLLM",
            f"{_pct(r['utilization_gain'], True)} ({_pct(m['utilization'])} vs "
            f"{_pct(v['utilization'])})",
            "+35 %",
            setup,
        ],
        [
            "Mooncake queueing delay, Conductor vs vLLM",
            f"mean {_pct(-qr['mean'], True)}, P90 {_pct(-qr['p90'], True)}",
            "-60 %",
            f"{r['num_requests']} requests at {r['rate']:g} req/s",
        ],
    ]
    lines = [
        f"Mooncake: LLaMA2-70B-shaped, bfloat16, TP8 on A800-like GPUs (A100-80GB, 400 GB/s "
        f"NVLink, 100 Gb/s RDMA a GPU assumed), 256-token KV pages, radix prefix caches; "
        f"{r['num_requests']} requests ({p['sample_fraction']:.1%} of the conversation trace's "
        f"conversations) compressed from {r['native_rate']:.3f} to {r['rate']:g} req/s "
        f"({p['rate_per_instance']:g} per instance); the Conductor without early rejection. "
        f"Queueing delay mean/P90 {v['queueing_delay_mean']:.2f} / {v['queueing_delay_p90']:.2f} "
        f"s vLLM vs {m['queueing_delay_mean']:.2f} / {m['queueing_delay_p90']:.2f} s Conductor; "
        f"prefix hit {_pct(v['prefix_cache_hit_rate'])} vs {_pct(m['prefix_cache_hit_rate'])}; "
        f"busy GPU-s per request {v['busy_gpu_s_per_request']:.1f} vs "
        f"{m['busy_gpu_s_per_request']:.1f}; share of requests with TTFT < {p['ttft_slo']:g} s "
        f"and P90 TBT < {1e3 * p['tbt_slo']:g} ms (Mooncake's SLOs) {_pct(v['attainment'])} vs "
        f"{_pct(m['attainment'])}.",
    ]
    if r["num_gpus"] != sv["gpus"]:
        lines.append(
            f"Mooncake ran on {r['num_gpus']} GPUs, not the survey's {sv['gpus']}: "
            f"{p['scale_note'] or 'as configured'}."
        )
    why = []
    if _differs(r["utilization_gain"], sv["utilization_gain"]) or _differs(
        qr["mean"], sv["queueing_reduction"]
    ):
        by_role = ", ".join(f"{k} {_pct(u['utilization'])}" for k, u in m["instances"].items())
        lower = m["utilization"] < v["utilization"]
        if qr["mean"] > 0:
            queues = "less prefill work also shortens the prefill queues"
        else:
            queues = (
                f"its {p['num_prefill']} prefill instance(s) take the prompts that all {n} "
                "colocated instances share, so they queue longer"
            )
        why.append(
            "why (Mooncake): at a fixed rate, busy time is the work done, and the Conductor's "
            f"cache-aware placement (prefix hit {_pct(m['prefix_cache_hit_rate'])} vs "
            f"{_pct(v['prefix_cache_hit_rate'])} behind least_outstanding) needs "
            f"{m['busy_gpu_s_per_request']:.1f} busy GPU-s a request against "
            f"{v['busy_gpu_s_per_request']:.1f}"
            + (", so its utilization is lower, not higher" if lower else "")
            + f" (Conductor by role: {by_role}); {queues}. Both depend on the rate (one, "
            f"{r['rate']:g} req/s) and the trace sample; how the survey measured utilization "
            "is not known here."
        )
    return rows, lines, why


def report(results: dict, quick: bool) -> str:
    from llmjax.bench.metrics import format_table

    builders = {"distserve": distserve_rows, "sglang": sglang_rows, "mooncake": mooncake_rows}
    rows, lines, why = [], [], []
    for part, r in results.items():
        a, b, c = builders[part](r)
        rows += a
        lines += b
        why += c
    head = (
        "The survey's cluster-level figures, SIMULATED on llmjax's simulator (the engines' own "
        "scheduling on a virtual clock, device='sim', roofline cost model; no figure here was "
        "measured on hardware)" + (" -- QUICK settings, not the published run" if quick else "")
    )
    return "\n".join(
        [
            head,
            format_table(["figure", "ours (simulated)", "survey's", "setup"], rows),
            f"survey's figures: {SURVEY['source']}",
            "",
            *lines,
            *(["", *why] if why else []),
        ]
    )


# ------------------------------------------------------------------------------------------------


def run_parts(parts, quick: bool, trace_dir: str, log=print) -> dict:
    """{part: result} for each part, in PARTS order, each with its wall time."""
    runners = {
        "distserve": lambda p: run_distserve(p, log),
        "sglang": lambda p: run_sglang(p, log),
        "mooncake": lambda p: run_mooncake(p, trace_dir, log),
    }
    out = {}
    for part in PARTS:
        if part in parts:
            t = time.perf_counter()
            out[part] = runners[part](settings(part, quick))
            out[part]["wall_s"] = time.perf_counter() - t
            log(f"{part}: {out[part]['wall_s']:.0f} s of wall time")
    return out


def main(argv):
    del argv
    unknown = set(FLAGS.parts) - set(PARTS)
    if unknown or not FLAGS.parts:
        raise app.UsageError(f"--parts must name some of {PARTS}; unknown: {sorted(unknown)}")

    def log(m):
        print(m, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = run_parts(FLAGS.parts, FLAGS.quick, FLAGS.trace_dir, log)
    wall = time.perf_counter() - t0
    print(report(results, FLAGS.quick), flush=True)
    print(
        "(wall time: "
        + ", ".join(f"{k} {v['wall_s']:.0f} s" for k, v in results.items())
        + f"; {wall:.0f} s in all)",
        flush=True,
    )
    if FLAGS.json_out:
        doc = {"simulated": True, "quick": FLAGS.quick, "survey": SURVEY, **results, "wall_s": wall}
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)

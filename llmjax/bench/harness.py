"""scripts/benchmark.py's measurements, from its flags: one variant's engine warmed up, rehearsed
and replayed in real time (`run_variant`), the TBT SLO from a measured decode step, Sarathi-Serve's
capacity search, DistServe's goodput search, throughput at batch N and host overhead per step.
`flags` is the script's parsed absl flags; the report is report.py's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time

from llmjax.bench.variants import Variant, build_cluster, build_llm, engine_info, instance_specs
from llmjax.bench.workload_flags import build_specs, mooncake_specs, parse_qps, qps_given


def run_variant(flags, variant: Variant, state: dict, *, log, clock=None) -> dict:
    """Everything measured for one variant, on one fresh engine. `state` carries what the
    variants share (the requests, the TBT SLO, the outputs to plot); `log` takes progress lines;
    `clock` is real-time replay's clock (None: the engine's own)."""
    from llmjax.bench import CapacityResult, capacity_search, replay, summarize, warm_up

    name = variant.name
    t0 = time.perf_counter()
    cluster = None
    if instance_specs(flags) and flags.device != "sim":
        cluster, llm = build_cluster(flags, variant)
        engine = cluster
        info = engine_info(flags, llm) | {"instances": cluster.describe(), "router": flags.router}
    else:
        llm = build_llm(
            flags,
            variant.policy,
            prefix_cache=variant.prefix_cache,
            admission_order=variant.admission_order,
            sparse_mode=variant.sparse_kv,
        )
        engine = llm.engine
        info = engine_info(flags, llm)
    if flags.device == "sim" and instance_specs(flags):  # simulated instances on one timeline
        from llmjax.sim import SimCluster

        specs = instance_specs(flags)
        engines = [] if flags.instances else [engine]  # --num_instances: the one built above
        for spec in specs[len(engines) :]:
            engines.append(
                build_llm(
                    flags,
                    variant.policy,
                    prefix_cache=variant.prefix_cache,
                    admission_order=variant.admission_order,
                    sparse_mode=variant.sparse_kv,
                    tp=spec.tp,
                    pp=spec.pp,
                    role=spec.role,
                ).engine
            )
        if flags.instances:  # the measured LLM: a decode (or colocated) one
            measured = next(i for i, p in enumerate(specs) if p.role != "prefill")
            llm = build_llm(
                flags,
                variant.policy,
                prefix_cache=variant.prefix_cache,
                admission_order=variant.admission_order,
                sparse_mode=variant.sparse_kv,
                tp=specs[measured].tp,
                pp=specs[measured].pp,
            )
            info = engine_info(flags, llm)
        cluster = SimCluster(
            engines,
            flags.router,
            waiting_page_fraction=flags.waiting_page_fraction,
        )
        engine = cluster
        info |= {
            "num_instances": len(specs),
            "router": flags.router,
            "instances": [
                {"index": i, "role": p.role, "tp": p.tp, "pp": p.pp} for i, p in enumerate(specs)
            ],
        }
    log(f"{name}: engine ready in {time.perf_counter() - t0:.1f} s: {info}")
    if "specs" not in state:
        state["max_model_len"] = llm.config.max_model_len
        state["vocab_size"] = llm.model_config.vocab_size
        qps = parse_qps(flags.qps)
        if flags.workload == "trace" and state.get("trace") is None:  # Mooncake's, loaded once
            state["trace"] = mooncake_specs(flags, state["vocab_size"], state["max_model_len"])
        state["specs"] = build_specs(
            flags,
            qps,
            llm.config.max_model_len,
            state["vocab_size"],
            state.get("trace"),
            retime_trace=qps_given(flags),
            tokenizer=llm.tokenizer,
        )
    specs = state["specs"]
    if flags.warmup:
        t = time.perf_counter()
        warm_up(engine, specs[: flags.warmup], seed=flags.seed)
        log(f"{name}: warm-up ({flags.warmup} requests) {time.perf_counter() - t:.1f} s")
    if flags.rehearse:
        t = time.perf_counter()
        engine.reset_prefix_cache()  # as the measured run will start
        replay(
            engine,
            specs,
            realtime=True,
            seed=flags.seed,
            clock=clock,
            progress=f"{name} rehearsal",
        )
        log(f"{name}: rehearsal {time.perf_counter() - t:.1f} s")
    if "tbt_slo" not in state:
        state["tbt_slo"], state["slo_reference"] = choose_tbt_slo(flags, llm)
        log(f"TBT SLO {1e3 * state['tbt_slo']:.1f} ms")
    tbt_slo = state["tbt_slo"]
    slos = dict(tbt_slo=tbt_slo, slo_ttft=flags.slo_ttft, slo_tpot=flags.slo_tpot or tbt_slo)

    engine.reset_prefix_cache()  # the same requests ran before: start cold
    engine.reset_stats()
    compiles = engine.num_compiles
    t = time.perf_counter()
    profiling = contextlib.nullcontext()
    if flags.profile_dir:  # the measured run only (warm-up and rehearsal compiled already)
        directory = os.path.join(flags.profile_dir, re.sub(r"[^\w.-]+", "_", name))
        profiling = llm.profile(directory, create_perfetto_trace=True)
    with profiling:
        outputs = replay(engine, specs, realtime=True, seed=flags.seed, clock=clock, progress=name)
    log(f"{name}: replayed {len(specs)} requests in {time.perf_counter() - t:.1f} s")
    if flags.plot_dir:  # the plots need every token's time, which the JSON does not keep
        state.setdefault("outputs", {})[name] = outputs
    result = {
        "engine": info,
        "summary": summarize(outputs, **slos),
        "engine_stats": _stats(engine).as_dict(),
        "step_times": step_times(_stats(engine)),
        "num_compiles_during_run": engine.num_compiles - compiles,
        "output_token_ids": [list(o.token_ids) for o in outputs],
    }
    if cluster is not None and any(r != "colocated" for r in cluster.roles):
        result["transfer_stats"] = cluster.transfer_stats.as_dict()
        if hasattr(cluster, "utilization"):  # real instances: device time / wall time
            result["instance_utilization"] = cluster.utilization()
        result["instance_stats"] = [s.as_dict() for s in cluster.stats]
    if flags.capacity_search or flags.goodput_search:

        def run_at_qps(qps: float):
            trial = build_specs(
                flags,
                qps,
                state["max_model_len"],
                state["vocab_size"],
                state.get("trace"),
                retime_trace=True,
                tokenizer=llm.tokenizer,
            )
            engine.reset_prefix_cache()
            outputs = replay(
                engine, trial, seed=flags.seed, clock=clock, progress=f"{name} at {qps:.3g} qps"
            )
            return summarize(outputs, **slos)

    if flags.capacity_search:
        cap: CapacityResult = capacity_search(
            run_at_qps,
            tbt_slo,
            lo=0.0,
            hi=2 * flags.capacity_start_qps,
            max_iters=flags.capacity_max_iters,
            log=lambda m: log(f"{name}: {m}"),
        )
        result["capacity"] = cap
    if flags.goodput_search:
        from llmjax.bench import goodput_search

        result["goodput"] = goodput_search(
            run_at_qps,
            slos["slo_ttft"],
            slos["slo_tpot"],
            num_devices=flags.tp * flags.pp * flags.num_instances,
            target=flags.goodput_target,
            max_per_device_rate=flags.goodput_max_rate,
            esp=flags.goodput_esp,
            log=lambda m: log(f"{name}: {m}"),
        )
    if flags.batch_sizes:
        result["throughput_at_batch"] = throughput_at_batch(
            flags, llm, [int(b) for b in flags.batch_sizes]
        )
    return result


def _stats(engine):
    """The engine's counters; a cluster's summed over its instances."""
    total = getattr(engine, "total_stats", None)
    return total if total is not None else engine.stats


def choose_tbt_slo(flags, llm) -> tuple[float, dict | None]:
    """--tbt_slo, or --tbt_slo_factor x the measured step of --slo_reference_batch decodes."""
    if flags.tbt_slo is not None:
        return flags.tbt_slo, None
    n = min(flags.slo_reference_batch, llm.config.scheduler.max_num_seqs)
    ref = measure_decode_step(flags, llm, n, num_steps=8)
    # a simulated step's modeled time holds its host overhead; this process's is not the device's
    host = 0.0 if flags.device == "sim" else ref["host_ms_per_step"]
    step_s = (host + ref["device_ms_per_step"]) / 1e3
    return flags.tbt_slo_factor * step_s, ref


def measure_decode_step(flags, llm, num_requests: int, num_steps: int) -> dict:
    """llmjax.bench.measure_decode_step on `llm`'s engine, seeded by --seed."""
    from llmjax.bench import measure_decode_step as measure

    return measure(llm.engine, num_requests, num_steps, seed=flags.seed)


def host_overhead(flags, variant: Variant, n: int) -> dict:
    """Host vs device time per step with `n` running decodes, on an engine sized for them."""
    from llmjax.bench.step_time import DECODE_SLACK
    from llmjax.engine.block_manager import pages_needed

    per_request = pages_needed(16 + flags.host_overhead_steps + DECODE_SLACK, flags.page_size)
    llm = build_llm(
        flags,
        variant.policy,
        prefix_cache=variant.prefix_cache,
        admission_order=variant.admission_order,
        max_num_seqs=max(n, flags.max_num_seqs),
        max_num_batched_tokens=max(n, flags.max_num_batched_tokens or 512),
        num_pages=n * per_request + 8,
    )
    try:
        return measure_decode_step(flags, llm, n, flags.host_overhead_steps)
    finally:
        del llm
        gc.collect()


def throughput_at_batch(flags, llm, sizes: list[int]) -> list[dict]:
    """The 'fixed' workload with N requests at once, per N: output tok/s over the run, and the
    decode rate N / median TPOT."""
    from llmjax.bench import replay, summarize, warm_up, workloads

    rows = []
    for n in sizes:
        specs = workloads.fixed(
            n,
            prompt_len=flags.prompt_len,
            output_len=flags.output_len,
            max_model_len=llm.config.max_model_len,
        )
        warm_up(llm.engine, specs, seed=flags.seed)
        llm.reset_prefix_cache()
        s = summarize(replay(llm.engine, specs, realtime=False, seed=flags.seed))
        tpot = s.tpot.p50
        rows.append(
            {
                "batch": n,
                "capped_at_max_num_seqs": n > llm.config.scheduler.max_num_seqs,
                "output_tokens_per_s": s.output_token_throughput,
                "decode_tokens_per_s": min(n, llm.config.scheduler.max_num_seqs) / tpot
                if tpot
                else None,
                "tpot_p50_ms": 1e3 * tpot if tpot else None,
                "duration_s": s.duration_s,
            }
        )
    return rows


def step_times(stats) -> dict:
    steps = max(stats.num_steps, 1)
    return {
        "host_ms_per_step": 1e3 * stats.host_time_s / steps,
        "device_ms_per_step": 1e3 * stats.device_time_s / steps,
        "host_fraction": stats.host_time_s / max(stats.host_time_s + stats.device_time_s, 1e-12),
    }

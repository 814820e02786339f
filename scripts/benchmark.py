r"""Serving benchmark: replay a workload against each scheduling policy and compare them.

    python scripts/benchmark.py                              # SmolLM2: sarathi vs prefill_first
    python scripts/benchmark.py --workload long_prompt_interference --num_requests 16 --qps 2
    python scripts/benchmark.py --capacity_search --tbt_slo 0.2 --plot_dir out/plots  # capacity
    python scripts/benchmark.py --goodput_search --slo_ttft 0.5 --slo_tpot 0.1   # DistServe goodput
    python scripts/benchmark.py --batch_sizes 1,8,32,64           # + throughput at batch N
    python scripts/benchmark.py --host_overhead_requests 256      # + host vs device time per step
    python scripts/benchmark.py --model tiny --load_format dummy --num_requests 8   # smoke test
    # the prefix cache off, on with FCFS, on with longest-prefix-match admission (few_shot):
    python scripts/benchmark.py --workload few_shot --prefix_caches none,radix \
        --admission_orders fcfs,lpm
    python scripts/benchmark.py --tp 2 --pad_heads        # sharded (flags as scripts/generate.py)
    # all four policies on long prompts arriving among decodes, with PNG plots in out/plots:
    python scripts/benchmark.py --workload long_prompt_interference --num_requests 12 --qps 1 \
        --policies sarathi,prefill_first,decode_first,splitfuse --plot_dir out/plots
    # the KV cache in host memory: full attention on the device vs full offload vs InfiniGen
    python scripts/benchmark.py --workload long_context --sparse_kv none,offload,infinigen \
        --num_requests 4 --long_prompt_len 1920 --output_len 128 --max_model_len 2048

Every combination of --policies, --prefix_caches, --admission_orders (an admission order only
with a cache) and --sparse_kv modes is a *variant*; columns are named policy[/cache[/order]]
[/sparse mode] when there are several. With sparse KV modes the table adds the KV bytes fetched
host -> device per decode token and each column's greedy agreement with the first column.
For each variant a fresh engine is built and warmed up (compilation excluded from measurements as
far as the warm-up covers the step shapes; the table reports compiles during the run), the same
requests are replayed in real time (Poisson arrivals at --qps, or all at once with --qps inf), and
the metrics of ALGORITHMS.md §1 are printed side by side and written to --json_out with the
engine's counters (prefill tokens computed, prefix-cache hits and evictions among them). The
prefix cache is emptied before each measured replay, so warm-up and rehearsal do not pre-fill it.
--plot_dir draws the measured replays (llmjax/viz/latency.py): each variant's per-token latency
over time, the TBT CDFs side by side, and the capacity and throughput-at-batch results.
Without --tbt_slo the TBT SLO is --tbt_slo_factor x a measured decode step of
--slo_reference_batch requests (Sarathi-Serve chose its SLOs as ~5x / ~25x a decode iteration).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import sys
import time
from typing import NamedTuple

from absl import app, flags

from llmjax import engine_flags

engine_flags.define_flags()  # --model, --dtype, --tp, ..., --config.*: as every script
engine_flags.define_cluster_flags()  # --num_instances, --instances, --router, ...
flags.adopt_module_key_flags(engine_flags)  # listed by --help, not only --helpfull
flags.FLAGS.set_default("max_num_seqs", 64)
flags.DEFINE_list(
    "policies",
    ["sarathi", "prefill_first"],
    "Scheduling policies to compare (sarathi, prefill_first, decode_first, splitfuse); each gets "
    "a fresh engine and the same requests.",
)
flags.DEFINE_list(
    "prefix_caches",
    ["radix"],
    "Prefix caches to compare (none, radix): each is a variant of every policy.",
)
flags.DEFINE_list(
    "admission_orders",
    ["fcfs"],
    "Admission orders to compare with a prefix cache (fcfs, lpm = longest prefix match first).",
)
PREFIX_WORKLOADS = ("shared_system_prompt", "few_shot", "multi_turn_chat")
flags.DEFINE_enum(
    "workload",
    "sharegpt",
    [
        "sharegpt",
        "arxiv",
        "long_prompt_interference",
        "fixed",
        "long_context",
        *PREFIX_WORKLOADS,
        "trace",
    ],
    "sharegpt/arxiv: lognormal lengths with the published medians and P90s, times --scale. "
    "long_prompt_interference: decode-heavy short requests at t=0 plus long prompts arriving at "
    "--qps while they decode. fixed: --prompt_len/--output_len each. shared_system_prompt: one "
    "--system_prompt_len prompt + a --question_len question each. few_shot: --num_tasks tasks of "
    "--num_shots examples of --shot_len tokens + a question. multi_turn_chat: sessions of "
    "--num_turns turns, each turn's prompt = the previous prompt + its generated output + "
    "--user_turn_len new tokens, --think_time s after the previous turn (sessions start at "
    "--qps). long_context: --num_requests windows of --long_prompt_len tokens (default 2048) of "
    "a bundled public-domain book, --output_len each (InfiniGen's setting). trace: --trace.",
)
flags.DEFINE_integer("system_prompt_len", 1024, "shared_system_prompt: shared prompt tokens.")
flags.DEFINE_integer(
    "question_len", None, "shared_system_prompt/few_shot: median question tokens (default 64/48)."
)
flags.DEFINE_integer("num_tasks", 4, "few_shot: tasks, each with its own examples.")
flags.DEFINE_integer("num_shots", 5, "few_shot: examples per task.")
flags.DEFINE_integer("shot_len", 96, "few_shot: median tokens per example.")
flags.DEFINE_integer("num_turns", 4, "multi_turn_chat: turns per session.")
flags.DEFINE_integer("first_prompt_len", 256, "multi_turn_chat: median first-turn prompt tokens.")
flags.DEFINE_integer("user_turn_len", 64, "multi_turn_chat: median new user tokens per turn.")
flags.DEFINE_float("think_time", 1.0, "multi_turn_chat: mean seconds between turns.")
flags.DEFINE_string(
    "trace",
    None,
    "JSONL trace: llmjax's (arrival_time, prompt or prompt_len, output_len per line) or "
    "Mooncake's (timestamp, input_length, output_length, hash_ids; ../shared/data/mooncake/).",
)
flags.DEFINE_integer(
    "mooncake_block_tokens", 512, "Mooncake traces: tokens per hash block (512: as recorded)."
)
flags.DEFINE_float("mooncake_output_scale", 1.0, "Mooncake traces: output length scale.")
flags.DEFINE_float("trace_time_scale", 1.0, "Mooncake traces: arrival times scale (0.5: 2x rate).")
flags.DEFINE_integer(
    "trace_requests", None, "Mooncake traces: only the first this many requests (default: all)."
)
flags.DEFINE_integer("num_requests", 64, "Requests in a synthetic workload.")
flags.DEFINE_string(
    "qps",
    "1.0",
    "Poisson arrival rate in requests/s, or 'inf' for all at t=0. For a trace, given explicitly "
    "it replaces the trace's arrival times.",
)
flags.DEFINE_float(
    "scale", 1 / 16, "Length scale for sharegpt/arxiv (1/16: medians of ~100 prompt tokens)."
)
flags.DEFINE_integer(
    "prompt_len",
    128,
    "Prompt tokens per request for 'fixed' and --batch_sizes, and of the short (decoding) "
    "requests of long_prompt_interference.",
)
flags.DEFINE_integer(
    "output_len",
    64,
    "Output tokens per request for 'fixed', --batch_sizes and the prefix-sharing workloads "
    "(shared_system_prompt, few_shot, multi_turn_chat), and of the short (decoding) requests "
    "of long_prompt_interference.",
)
flags.DEFINE_float("long_fraction", 0.25, "long_prompt_interference: fraction of long prompts.")
flags.DEFINE_integer(
    "long_prompt_len",
    None,
    "long_prompt_interference / long_context: long prompt tokens (default 2048, capped).",
)
flags.DEFINE_integer("long_output_len", 8, "long_prompt_interference: long requests' outputs.")
flags.DEFINE_integer("seed", 0, "Seed of the workload's lengths, arrivals and token ids.")
flags.DEFINE_float(
    "tbt_slo",
    None,
    "P99 TBT SLO in seconds for the capacity criterion (default: --tbt_slo_factor x a measured "
    "decode step).",
)
flags.DEFINE_float("tbt_slo_factor", 5.0, "TBT SLO = this x the measured decode step.")
flags.DEFINE_integer(
    "slo_reference_batch", 8, "Concurrent decodes of the step that --tbt_slo_factor multiplies."
)
flags.DEFINE_float("slo_ttft", 1.0, "TTFT SLO in seconds for SLO attainment (DistServe).")
flags.DEFINE_float("slo_tpot", None, "TPOT SLO in seconds for SLO attainment (default: tbt_slo).")
flags.DEFINE_bool(
    "capacity_search", False, "Binary-search each policy's capacity QPS (Sarathi-Serve)."
)
flags.DEFINE_float(
    "capacity_start_qps", 1.0, "Capacity search starts on [0, 2x this] and expands upward."
)
flags.DEFINE_integer("capacity_max_iters", 20, "Max capacity-search trials per policy.")
flags.DEFINE_bool(
    "goodput_search",
    False,
    "Bisect each policy's goodput (DistServe): the highest rate per device at which "
    "--goodput_target of requests meet both --slo_ttft and --slo_tpot (llmjax/bench/goodput.py).",
)
flags.DEFINE_float("goodput_target", 0.9, "Goodput: the SLO attainment to reach (DistServe: 90 %).")
flags.DEFINE_float(
    "goodput_max_rate", 5.0, "Goodput: the bisection's upper bound, requests/s per device."
)
flags.DEFINE_float("goodput_esp", 0.25, "Goodput: stop when the bracket is narrower (per device).")
flags.DEFINE_list(
    "batch_sizes",
    [],
    "Throughput at batch N: the 'fixed' workload with N requests at once (e.g. 1,8,32,64).",
)
flags.DEFINE_integer(
    "host_overhead_requests",
    0,
    "If > 0, measure host vs device time per step with this many running decodes (e.g. 256), "
    "on an engine sized for them.",
)
flags.DEFINE_integer("host_overhead_steps", 16, "Timed decode steps for --host_overhead_requests.")
flags.DEFINE_integer(
    "warmup",
    16,
    "Requests of the workload replayed at once (short outputs) before measuring, so "
    "compilation is excluded; 0 disables.",
)
flags.DEFINE_bool(
    "rehearse",
    True,
    "After the warm-up, replay the whole workload once in real time, unmeasured, so the step "
    "shapes that real-time arrivals produce are compiled too.",
)
flags.DEFINE_list(
    "sparse_kv",
    ["none"],
    "KV cache placement and fetching per variant (SparseKVConfig.mode): none (device memory), "
    "offload (host pool, every layer fetches everything), infinigen (host pool, speculated "
    "fetches).",
)
flags.DEFINE_string("json_out", "out/benchmark.json", "Where to write the results ('' = nowhere).")
flags.DEFINE_string(
    "profile_dir",
    None,
    "Profile each variant's measured run into DIR/<variant> (LLM.profile: device and host "
    "timelines with one llmjax_step range per engine step; XProf/TensorBoard, or Perfetto from "
    "trace.json.gz).",
)
flags.DEFINE_string(
    "plot_dir",
    "",
    "If set, write PNG plots there (llmjax/viz/latency.py; needs matplotlib, the viz extra): "
    "timeline_<variant>.png (each generated token's gap to its request's previous token against "
    "time), tbt_cdf.png (TBT CDFs of all variants), with --capacity_search capacity.png (capacity "
    "QPS per variant) and with --batch_sizes throughput_vs_batch.png.",
)

FLAGS = flags.FLAGS
_MODULE = sys.argv[0] if __name__ == "__main__" else __name__  # absl's key for these flags


def _log(msg: str) -> None:
    if engine_flags.is_leader(FLAGS):
        print(f"[benchmark] {msg}", file=sys.stderr, flush=True)


def _clock():
    """Real-time replay's clock: process 0's, shared, in a multi-process run (lockstep); None
    for one process and for a simulated device (its own virtual clock)."""
    if FLAGS.device == "sim":
        return None
    import jax

    from llmjax.parallel.distributed import leader_clock

    return leader_clock if jax.process_count() > 1 else None


# ------------------------------------------------------------------------------------------------
# Engines.


def _is_whole_prompt(policy: str) -> bool:
    from llmjax.config import SchedulerConfig

    return not SchedulerConfig(policy=policy).chunks_prefills


def build_llm(policy: str, **options):
    """A fresh `LLM` for `policy` from the flags (`options` replace single LLM options, e.g.
    prefix_cache and admission_order; `sparse_mode` names the sparse KV mode, whose parameters
    come from --config.sparse_kv.*)."""
    from llmjax import LLM

    return LLM(FLAGS.model, **llm_kwargs(policy, **options))


def llm_kwargs(policy: str, **options) -> dict:
    """build_llm's LLM arguments (but the model)."""
    kwargs = engine_flags.llm_kwargs(FLAGS) | dict(seed=FLAGS.seed, scheduler_policy=policy)
    budget = options.pop("max_num_batched_tokens", FLAGS.max_num_batched_tokens)
    if budget is not None and _is_whole_prompt(policy):
        # vLLM's classic policy admits whole prompts: its budget must hold the longest one.
        budget = max(budget, FLAGS.max_model_len) if FLAGS.max_model_len else None
    kwargs["max_num_batched_tokens"] = budget  # None: the LLM's default for the policy
    kwargs.update(options)
    kwargs["sparse_kv"] = kwargs.pop("sparse_mode", "none")
    return kwargs


def instance_specs():
    """--instances, or --num_instances colocated ones: InstanceSpecs (None for one engine)."""
    try:
        return engine_flags.instance_specs(FLAGS)
    except ValueError as e:
        raise app.UsageError(str(e)) from e


def build_cluster(variant: Variant):
    """Real instances (--instances / --num_instances) behind --router: (cluster, the LLM of
    its first decode or colocated instance, for the engine info and the TBT SLO)."""
    from llmjax.cluster import launch

    kwargs = llm_kwargs(
        variant.policy,
        prefix_cache=variant.prefix_cache,
        admission_order=variant.admission_order,
        sparse_mode=variant.sparse_kv,
    )
    for fixed in ("tp", "pp"):  # per instance
        kwargs.pop(fixed, None)
    cluster = launch(FLAGS.model, instance_specs(), **engine_flags.launch_kwargs(FLAGS), **kwargs)
    measured = next(i for i, r in enumerate(cluster.roles) if r in ("decode", "colocated"))
    llm = getattr(cluster.instances[measured], "llm", None)
    if llm is None:
        raise app.UsageError("--launcher ray: pass --tbt_slo (no in-process engine to measure)")
    return cluster, llm


def engine_info(llm) -> dict:
    config = llm.config
    return {
        "policy": config.scheduler.policy,
        "prefix_cache": config.cache.prefix_cache,
        "admission_order": config.scheduler.admission_order,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_model_len": config.max_model_len,
        "page_size": config.cache.page_size,
        "num_pages": llm.engine.block_manager.num_pages,
        "dtype": config.dtype,
        "attention_backend": getattr(llm.engine.runner, "attention_backend", "simulated"),
        "flash_prefill": FLAGS.flash_prefill,
        "pallas_kernel": FLAGS.pallas_kernel,
        "kernel_options": config.kernel_options,
        "sparse_kv": config.sparse_kv.mode,
        # every EngineConfig field but the model's shape: what exactly ran
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "model"},
    }


def step_times(stats) -> dict:
    steps = max(stats.num_steps, 1)
    return {
        "host_ms_per_step": 1e3 * stats.host_time_s / steps,
        "device_ms_per_step": 1e3 * stats.device_time_s / steps,
        "host_fraction": stats.host_time_s / max(stats.host_time_s + stats.device_time_s, 1e-12),
    }


# ------------------------------------------------------------------------------------------------
# Workloads.


def _qps(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"--qps={text} must be > 0 or 'inf'")
    return value


def load_trace() -> list | None:
    """The --trace file, checked before any engine is built (errors name the line); None for a
    Mooncake trace, whose token ids need the model's vocabulary (`mooncake_specs`)."""
    from llmjax.bench import workloads
    from llmjax.bench.mooncake import is_mooncake_trace

    if not FLAGS.trace:
        raise app.UsageError("--workload=trace needs --trace=path.jsonl")
    try:
        if is_mooncake_trace(FLAGS.trace):
            return None
        return workloads.load_trace(FLAGS.trace)
    except (OSError, ValueError) as e:
        raise app.UsageError(f"bad --trace: {e}") from e


def mooncake_specs(vocab_size: int, max_model_len: int) -> list:
    from llmjax.bench.mooncake import load_mooncake_trace

    try:
        return load_mooncake_trace(
            FLAGS.trace,
            vocab_size=vocab_size,
            block_tokens=FLAGS.mooncake_block_tokens,
            output_scale=FLAGS.mooncake_output_scale,
            time_scale=FLAGS.trace_time_scale,
            max_model_len=max_model_len,
            num_requests=FLAGS.trace_requests,
            seed=FLAGS.seed,
        )
    except (OSError, ValueError) as e:
        raise app.UsageError(f"bad --trace: {e}") from e


def build_specs(
    qps: float,
    max_model_len: int,
    vocab_size: int,
    trace=None,
    *,
    retime_trace: bool = False,
    tokenizer=None,
):
    """The workload at `qps` (a trace keeps its own arrival times unless `retime_trace`)."""
    from llmjax.bench import workloads

    if FLAGS.workload == "trace":
        if trace is None:  # Mooncake's
            trace = mooncake_specs(vocab_size, max_model_len)
        return workloads.with_poisson_arrivals(trace, qps, FLAGS.seed) if retime_trace else trace
    kwargs = dict(qps=qps, max_model_len=max_model_len, seed=FLAGS.seed, scale=FLAGS.scale)
    if FLAGS.workload in PREFIX_WORKLOADS:
        kwargs |= dict(vocab_size=vocab_size, output_len=FLAGS.output_len)
    question = {} if FLAGS.question_len is None else {"question_len": FLAGS.question_len}
    if FLAGS.workload == "shared_system_prompt":
        kwargs |= dict(system_prompt_len=FLAGS.system_prompt_len, **question)
    if FLAGS.workload == "few_shot":
        kwargs |= dict(
            num_tasks=FLAGS.num_tasks,
            num_shots=FLAGS.num_shots,
            shot_len=FLAGS.shot_len,
            **question,
        )
    if FLAGS.workload == "multi_turn_chat":
        kwargs |= dict(
            num_turns=FLAGS.num_turns,
            first_prompt_len=FLAGS.first_prompt_len,
            user_turn_len=FLAGS.user_turn_len,
            think_time=FLAGS.think_time,
        )
    if FLAGS.workload == "fixed":
        kwargs |= dict(prompt_len=FLAGS.prompt_len, output_len=FLAGS.output_len)
    if FLAGS.workload == "long_context":
        kwargs |= dict(
            prompt_len=FLAGS.long_prompt_len or 2048,
            output_len=FLAGS.output_len,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
        )
    if FLAGS.workload == "long_prompt_interference":
        kwargs |= dict(
            long_fraction=FLAGS.long_fraction,
            decode_prompt_len=FLAGS.prompt_len,
            decode_output_len=FLAGS.output_len,
            long_prompt_len=FLAGS.long_prompt_len,
            long_output_len=FLAGS.long_output_len,
        )
    return workloads.make_workload(FLAGS.workload, FLAGS.num_requests, **kwargs)


# ------------------------------------------------------------------------------------------------
# Measurements.


def measure_decode_step(llm, num_requests: int, num_steps: int) -> dict:
    """llmjax.bench.measure_decode_step on `llm`'s engine, seeded by --seed."""
    from llmjax.bench import measure_decode_step as measure

    return measure(llm.engine, num_requests, num_steps, seed=FLAGS.seed)


def host_overhead(variant: Variant, n: int) -> dict:
    """Host vs device time per step with `n` running decodes, on an engine sized for them."""
    from llmjax.bench.step_time import DECODE_SLACK
    from llmjax.engine.block_manager import pages_needed

    per_request = pages_needed(16 + FLAGS.host_overhead_steps + DECODE_SLACK, FLAGS.page_size)
    llm = build_llm(
        variant.policy,
        prefix_cache=variant.prefix_cache,
        admission_order=variant.admission_order,
        max_num_seqs=max(n, FLAGS.max_num_seqs),
        max_num_batched_tokens=max(n, FLAGS.max_num_batched_tokens or 512),
        num_pages=n * per_request + 8,
    )
    try:
        return measure_decode_step(llm, n, FLAGS.host_overhead_steps)
    finally:
        del llm
        gc.collect()


def throughput_at_batch(llm, sizes: list[int]) -> list[dict]:
    """The 'fixed' workload with N requests at once, per N: output tok/s over the run, and the
    decode rate N / median TPOT."""
    from llmjax.bench import replay, summarize, warm_up, workloads

    rows = []
    for n in sizes:
        specs = workloads.fixed(
            n,
            prompt_len=FLAGS.prompt_len,
            output_len=FLAGS.output_len,
            max_model_len=llm.config.max_model_len,
        )
        warm_up(llm.engine, specs, seed=FLAGS.seed)
        llm.reset_prefix_cache()
        s = summarize(replay(llm.engine, specs, realtime=False, seed=FLAGS.seed))
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


class Variant(NamedTuple):
    """One engine configuration to measure."""

    policy: str
    prefix_cache: str
    admission_order: str
    sparse_kv: str
    name: str  # its column in the report


def variants() -> list[Variant]:
    """Every policy x prefix cache x admission order (an order only with a cache), from the
    flags; named by policy alone when the cache options give one variant per policy."""
    from llmjax.config import ADMISSION_ORDERS, PREFIX_CACHES, SCHEDULER_POLICIES, SPARSE_KV_MODES

    def names(flag: str, allowed) -> list[str]:
        values = [v.strip() for v in FLAGS[flag].value if v.strip()]
        if not values:
            raise app.UsageError(f"--{flag} is empty")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise app.UsageError(f"--{flag}: unknown {bad}; choose from {list(allowed)}")
        return list(dict.fromkeys(values))

    policies = names("policies", SCHEDULER_POLICIES)
    caches = names("prefix_caches", PREFIX_CACHES)
    orders = names("admission_orders", ADMISSION_ORDERS)
    sparse = names("sparse_kv", SPARSE_KV_MODES)
    combos = [
        (p, c, o) for p in policies for c in caches for o in (orders if c != "none" else ["fcfs"])
    ]
    one_per_policy = len(combos) == len(policies)
    out = []
    for p, c, o in combos:
        name = p if one_per_policy else f"{p}/{c}" + (f"/{o}" if c != "none" else "")
        for m in sparse:
            out.append(Variant(p, c, o, m, name if len(sparse) == 1 else f"{name}/{m}"))
    return out


def run_variant(variant: Variant, state: dict) -> dict:
    """Everything measured for one variant, on one fresh engine."""
    from llmjax.bench import CapacityResult, capacity_search, replay, summarize, warm_up

    name = variant.name
    t0 = time.perf_counter()
    cluster = None
    if instance_specs() and FLAGS.device != "sim":
        cluster, llm = build_cluster(variant)
        engine = cluster
        info = engine_info(llm) | {"instances": cluster.describe(), "router": FLAGS.router}
    else:
        llm = build_llm(
            variant.policy,
            prefix_cache=variant.prefix_cache,
            admission_order=variant.admission_order,
            sparse_mode=variant.sparse_kv,
        )
        engine = llm.engine
        info = engine_info(llm)
    if FLAGS.device == "sim" and instance_specs():  # simulated instances on one timeline
        from llmjax.sim import SimCluster

        specs = instance_specs()
        engines = [] if FLAGS.instances else [engine]  # --num_instances: the one built above
        for spec in specs[len(engines) :]:
            engines.append(
                build_llm(
                    variant.policy,
                    prefix_cache=variant.prefix_cache,
                    admission_order=variant.admission_order,
                    sparse_mode=variant.sparse_kv,
                    tp=spec.tp,
                    pp=spec.pp,
                    role=spec.role,
                ).engine
            )
        if FLAGS.instances:  # the measured LLM: a decode (or colocated) one
            measured = next(i for i, p in enumerate(specs) if p.role != "prefill")
            llm = build_llm(
                variant.policy,
                prefix_cache=variant.prefix_cache,
                admission_order=variant.admission_order,
                sparse_mode=variant.sparse_kv,
                tp=specs[measured].tp,
                pp=specs[measured].pp,
            )
            info = engine_info(llm)
        cluster = SimCluster(
            engines,
            FLAGS.router,
            waiting_page_fraction=FLAGS.waiting_page_fraction,
        )
        engine = cluster
        info |= {
            "num_instances": len(specs),
            "router": FLAGS.router,
            "instances": [
                {"index": i, "role": p.role, "tp": p.tp, "pp": p.pp} for i, p in enumerate(specs)
            ],
        }
    _log(f"{name}: engine ready in {time.perf_counter() - t0:.1f} s: {info}")
    if "specs" not in state:
        state["max_model_len"] = llm.config.max_model_len
        state["vocab_size"] = llm.model_config.vocab_size
        qps = _qps(FLAGS.qps)
        if FLAGS.workload == "trace" and state.get("trace") is None:  # Mooncake's, loaded once
            state["trace"] = mooncake_specs(state["vocab_size"], state["max_model_len"])
        state["specs"] = build_specs(
            qps,
            llm.config.max_model_len,
            state["vocab_size"],
            state.get("trace"),
            retime_trace=_qps_given(),
            tokenizer=llm.tokenizer,
        )
    specs = state["specs"]
    if FLAGS.warmup:
        t = time.perf_counter()
        warm_up(engine, specs[: FLAGS.warmup], seed=FLAGS.seed)
        _log(f"{name}: warm-up ({FLAGS.warmup} requests) {time.perf_counter() - t:.1f} s")
    if FLAGS.rehearse:
        t = time.perf_counter()
        engine.reset_prefix_cache()  # as the measured run will start
        replay(
            engine,
            specs,
            realtime=True,
            seed=FLAGS.seed,
            clock=_clock(),
            progress=f"{name} rehearsal",
        )
        _log(f"{name}: rehearsal {time.perf_counter() - t:.1f} s")
    if "tbt_slo" not in state:
        state["tbt_slo"], state["slo_reference"] = choose_tbt_slo(llm)
        _log(f"TBT SLO {1e3 * state['tbt_slo']:.1f} ms")
    tbt_slo = state["tbt_slo"]
    slos = dict(tbt_slo=tbt_slo, slo_ttft=FLAGS.slo_ttft, slo_tpot=FLAGS.slo_tpot or tbt_slo)

    engine.reset_prefix_cache()  # the same requests ran before: start cold
    engine.reset_stats()
    compiles = engine.num_compiles
    t = time.perf_counter()
    profiling = contextlib.nullcontext()
    if FLAGS.profile_dir:  # the measured run only (warm-up and rehearsal compiled already)
        directory = os.path.join(FLAGS.profile_dir, re.sub(r"[^\w.-]+", "_", name))
        profiling = llm.profile(directory, create_perfetto_trace=True)
    with profiling:
        outputs = replay(
            engine, specs, realtime=True, seed=FLAGS.seed, clock=_clock(), progress=name
        )
    _log(f"{name}: replayed {len(specs)} requests in {time.perf_counter() - t:.1f} s")
    if FLAGS.plot_dir:  # the plots need every token's time, which the JSON does not keep
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
    if FLAGS.capacity_search or FLAGS.goodput_search:

        def run_at_qps(qps: float):
            trial = build_specs(
                qps,
                state["max_model_len"],
                state["vocab_size"],
                state.get("trace"),
                retime_trace=True,
                tokenizer=llm.tokenizer,
            )
            engine.reset_prefix_cache()
            outputs = replay(
                engine, trial, seed=FLAGS.seed, clock=_clock(), progress=f"{name} at {qps:.3g} qps"
            )
            return summarize(outputs, **slos)

    if FLAGS.capacity_search:
        cap: CapacityResult = capacity_search(
            run_at_qps,
            tbt_slo,
            lo=0.0,
            hi=2 * FLAGS.capacity_start_qps,
            max_iters=FLAGS.capacity_max_iters,
            log=lambda m: _log(f"{name}: {m}"),
        )
        result["capacity"] = cap
    if FLAGS.goodput_search:
        from llmjax.bench import goodput_search

        result["goodput"] = goodput_search(
            run_at_qps,
            slos["slo_ttft"],
            slos["slo_tpot"],
            num_devices=FLAGS.tp * FLAGS.pp * FLAGS.num_instances,
            target=FLAGS.goodput_target,
            max_per_device_rate=FLAGS.goodput_max_rate,
            esp=FLAGS.goodput_esp,
            log=lambda m: _log(f"{name}: {m}"),
        )
    if FLAGS.batch_sizes:
        result["throughput_at_batch"] = throughput_at_batch(
            llm, [int(b) for b in FLAGS.batch_sizes]
        )
    return result


def _stats(engine):
    """The engine's counters; a cluster's summed over its instances."""
    total = getattr(engine, "total_stats", None)
    return total if total is not None else engine.stats


def _qps_given() -> bool:
    return FLAGS.workload != "trace" or FLAGS["qps"].present


def choose_tbt_slo(llm) -> tuple[float, dict | None]:
    """--tbt_slo, or --tbt_slo_factor x the measured step of --slo_reference_batch decodes."""
    if FLAGS.tbt_slo is not None:
        return FLAGS.tbt_slo, None
    n = min(FLAGS.slo_reference_batch, llm.config.scheduler.max_num_seqs)
    ref = measure_decode_step(llm, n, num_steps=8)
    # a simulated step's modeled time holds its host overhead; this process's is not the device's
    host = 0.0 if FLAGS.device == "sim" else ref["host_ms_per_step"]
    step_s = (host + ref["device_ms_per_step"]) / 1e3
    return FLAGS.tbt_slo_factor * step_s, ref


# ------------------------------------------------------------------------------------------------
# Report.


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


def report(results: dict, state: dict) -> str:
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
                    if FLAGS.device == "sim"
                    else []
                )
            ]
            if FLAGS.pp > 1
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
        f"model {FLAGS.model} ({FLAGS.dtype}), workload {FLAGS.workload}: {len(specs)} requests, "
        f"qps {FLAGS.qps if _qps_given() else '(trace)'}, mean prompt {mean_prompt} / output "
        f"{_mean(s.output_len for s in specs)} tokens; TBT SLO {1e3 * state['tbt_slo']:.1f} ms",
        "",
        format_side_by_side({p: r["summary"] for p, r in results.items()}, extra),
    ]
    if FLAGS.capacity_search:
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
    if FLAGS.goodput_search:
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
    if FLAGS.batch_sizes:
        header = ["batch"] + [f"{p} {k}" for p in names for k in ("out tok/s", "decode tok/s")]
        rows = []
        for i, b in enumerate(FLAGS.batch_sizes):
            row = [b]
            for p in names:
                r = results[p]["throughput_at_batch"][i]
                row += [f"{r['output_tokens_per_s']:.1f}", _num(r["decode_tokens_per_s"])]
            rows.append(row)
        lines += [
            "",
            f"throughput at batch N (prompt {FLAGS.prompt_len}, output "
            f"{FLAGS.output_len}, all at once)",
            format_table(header, rows),
        ]
    if FLAGS.host_overhead_requests:
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


def write_plots(results: dict, state: dict, plot_dir: str) -> list[str]:
    """The --plot_dir PNGs (see the flag); returns their paths."""
    import re

    from llmjax.viz import latency, save_figure

    runs = state["outputs"]
    tbt_slo = state["tbt_slo"]
    # long_prompt_interference: mark where the long prompts arrive (the short ones have
    # exactly --prompt_len tokens).
    long_from = FLAGS.prompt_len + 1 if FLAGS.workload == "long_prompt_interference" else None
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
    if FLAGS.capacity_search:
        ax = latency.plot_capacity({p: r["capacity"] for p, r in results.items()})
        paths.append(save_figure(ax, os.path.join(plot_dir, "capacity.png")))
    if FLAGS.batch_sizes:
        ax = latency.plot_throughput_vs_batch(
            {p: r["throughput_at_batch"] for p, r in results.items()}
        )
        paths.append(save_figure(ax, os.path.join(plot_dir, "throughput_vs_batch.png")))
    return paths


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


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    return f"{sum(values) / len(values):.0f}" if values else "-"


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _jsonable(obj):
    if hasattr(obj, "as_dict"):
        return _jsonable(obj.as_dict())
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def device_kind() -> str:
    if FLAGS.device == "sim":
        return f"simulated {FLAGS.hardware} ({FLAGS.cost_model})"
    import jax

    return jax.devices()[0].device_kind


def main(argv):
    del argv
    if FLAGS.device != "sim":
        engine_flags.initialize(FLAGS)  # jax.distributed, for a multi-process run
    runs = variants()
    _qps(FLAGS.qps)
    if FLAGS.num_instances < 1:
        raise app.UsageError(f"--num_instances={FLAGS.num_instances} must be >= 1")
    instance_specs()  # a bad --instances fails here
    state: dict = {}
    if FLAGS.workload == "trace":
        state["trace"] = load_trace()
    results = {}
    for v in runs:
        results[v.name] = run_variant(v, state)
        gc.collect()  # free this variant's engine before the next is built
        if FLAGS.host_overhead_requests:
            results[v.name]["host_overhead"] = host_overhead(v, FLAGS.host_overhead_requests)
    if not engine_flags.is_leader(FLAGS):
        return  # every process ran the same replays in lockstep; process 0 reports
    print(report(results, state), flush=True)
    if FLAGS.plot_dir:
        for path in write_plots(results, state, FLAGS.plot_dir):
            print(f"wrote {path}")
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        doc = {
            "device": device_kind(),
            "flags": {
                f.name: f.value
                for module in (_MODULE, engine_flags.__name__)
                for f in FLAGS.get_flags_for_module(module)
                if f.name != engine_flags.CONFIG_FLAG
            }
            | {"config_overrides": engine_flags.config_overrides(FLAGS)},
            "tbt_slo": state["tbt_slo"],
            "slo_reference_step": state.get("slo_reference"),
            "workload": [
                {
                    "arrival_time": s.arrival_time,
                    "prompt_len": s.prompt_len,
                    "output_len": s.output_len,
                }
                for s in state["specs"]
            ],
            "variants": results,
        }
        with open(FLAGS.json_out, "w") as f:
            json.dump(_jsonable(doc), f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

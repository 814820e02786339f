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

This file is the flags, main and the printing; the work is llmjax/bench/'s: variants.py (the
variants and their engines), workload_flags.py (the requests), harness.py (the measurements) and
report.py (the tables, plots and JSON values).
"""

from __future__ import annotations

import gc
import json
import os
import sys

from absl import app, flags

from llmjax import engine_flags
from llmjax.bench import harness, report, variants, workload_flags
from llmjax.bench.workload_flags import PREFIX_WORKLOADS

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


def device_kind() -> str:
    if FLAGS.device == "sim":
        return f"simulated {FLAGS.hardware} ({FLAGS.cost_model})"
    import jax

    return jax.devices()[0].device_kind


def main(argv):
    del argv
    if FLAGS.device != "sim":
        engine_flags.initialize(FLAGS)  # jax.distributed, for a multi-process run
    runs = variants.variants(FLAGS)
    workload_flags.parse_qps(FLAGS.qps)
    if FLAGS.num_instances < 1:
        raise app.UsageError(f"--num_instances={FLAGS.num_instances} must be >= 1")
    variants.instance_specs(FLAGS)  # a bad --instances fails here
    state: dict = {}
    if FLAGS.workload == "trace":
        state["trace"] = workload_flags.load_trace(FLAGS)
    results = {}
    for v in runs:
        results[v.name] = harness.run_variant(FLAGS, v, state, log=_log, clock=_clock())
        gc.collect()  # free this variant's engine before the next is built
        if FLAGS.host_overhead_requests:
            results[v.name]["host_overhead"] = harness.host_overhead(
                FLAGS, v, FLAGS.host_overhead_requests
            )
    if not engine_flags.is_leader(FLAGS):
        return  # every process ran the same replays in lockstep; process 0 reports
    print(report.report(FLAGS, results, state), flush=True)
    if FLAGS.plot_dir:
        for path in report.write_plots(FLAGS, results, state, FLAGS.plot_dir):
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
            json.dump(report.jsonable(doc), f, indent=1)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

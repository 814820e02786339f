r"""Mooncake's effective request capacity on the simulator (FAST'25 §8; ALGORITHMS.md §10.4): the
Conductor against simpler routers, and colocated vLLM, replaying Mooncake's released traces.

    python scripts/mooncake_capacity.py                 # conversation trace, a sample of it
    python scripts/mooncake_capacity.py --trace synthetic
    python scripts/mooncake_capacity.py --quick         # a tiny, fast version (smoke test)

Deployment (defaults): a LLaMA2-70B-shaped dummy model (configs' llama2-70b, its context raised
to --max_model_len) in bfloat16 at TP8 on "a800-80gb", an A100-80GB with the A800's 400 GB/s
NVLink and an assumed 100 Gb/s of RDMA per GPU (the hardware presets have no A800; Mooncake's
testbed is A800 nodes). Disaggregated: --num_prefill prefill + --num_decode decode instances
(Mooncake-[3P+1D], the paper's split for its long-prompt workloads: these traces' prompts
average 11-15k tokens and their outputs 150-350, so prefill is the bottleneck), one node each,
the KV moved over the network (SimCluster's transfer model);
the baseline vLLM: --num_prefill + --num_decode colocated instances at the same TP (vLLM-[4M]),
prefill_first (whole prompts, decodes paused: vLLM v0.5's default) with its prefix cache, behind
least_outstanding. KV pages of --page_size 256 tokens (the paper's evaluation's block size; the
trace's hash ids are 512-token blocks). Prefill instances chunk prompts at --prefill_chunk tokens.

Routers over the prefill instances (the decode instance: DistServe's pull with least_outstanding,
except for the Conductor, which pins it): random, least_outstanding (load balancing),
cache_aware (sglang-router's local cache-aware), mooncake (the Conductor, no rejection) and
mooncake+predicted (with prediction-based early rejection at the run's TTFT and TBT SLOs; and
mooncake+current, naive early rejection, on request). Every instance keeps its own radix prefix
cache in its KV pages; the Conductor can fetch a longer prefix from another prefill instance's
cache. Without +pool its KV store is the union of the prefill instances' HBM caches; the +pool
deployments (mooncake+pool, mooncake+pool+predicted; +pool+current on request) add Mooncake
Store's DRAM pool (llmjax/sim/kvpool.py): --kv_pool_bytes_per_node (assumed 1 TB) of every
prefill node, in the model's full KV bytes per token (LLaMA2-70B bf16: 320 KiB), LRU over
chained 256-token page keys, written with every prefill chunk's KV, fetched over the network
at --kv_pool_bandwidth (default: the network's, 12.5 GB/s per GPU) when that beats both the
instance's own cache and a fetch from another instance. At the default sample the sample's
working set fits the prefill instances' HBM (sampling conversations shrinks the reuse distance by
the sampled share), so the pool is never used; with --sample_fraction 0.33 it is (docs/cluster.md).

The trace: the conversations of --sample_fraction of them (a request's conversation is its second
hash id, the 512-token block after the shared system block; a single-block request is its own),
all their turns, in trace order; synthetic groups by the first hash id. A rate r replays them
compressed in time: arrival = timestamp x (native rate / r). The attainment rule: a request meets
the SLOs iff it finished (not rejected) with TTFT < --ttft_slo and its TBT < the TBT SLO, where
its TBT is the --tbt_stat of its own token gaps (p90: its 90th-percentile gap; mean: TPOT;
p90_decode: the 90th percentile without its first gap, the prefill -> decode handoff, whose KV
transfer Mooncake overlaps with the prefill by streaming it layer by layer while the simulator
moves it after the prefill: with p90, a request of few output tokens and a long prompt misses a
100 ms SLO on that one gap alone); the attainment is the share of ALL requests that meet them.
The effective request capacity (ALGORITHMS.md §10.4: "effective request capacity with TTFT <
30 s and TBT in {100, 200, 300} ms") is the highest rate with attainment >= --attainment
(90 %), by bisection over (0, --max_rate] in --bisections steps (0 assumed to pass). Every
number here is simulated (roofline cost model); the JSON (--output_json) keeps every trial.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRACES = ("conversation", "synthetic")
ROUTER_CHOICES = (
    "vllm",
    "random",
    "least_outstanding",
    "cache_aware",
    "mooncake",
    "mooncake+predicted",
    "mooncake+current",
    "mooncake+pool",
    "mooncake+pool+predicted",
    "mooncake+pool+current",
)
# ALGORITHMS.md §10.4: effective request capacity vs vLLM v0.5.1, over the TBT thresholds
PAPER = {
    "conversation": "+59% .. +498%",
    "toolagent": "+22% .. +64%",
    "synthetic": "+28% .. +62%",
    "source": "ALGORITHMS.md §10.4 (FAST'25 end to end, third-party summary)",
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("trace", "conversation", TRACES, "Which released Mooncake trace.")
    flags.DEFINE_string(
        "trace_dir",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../shared/data/mooncake"),
        "Directory of <trace>_trace.jsonl.",
    )
    flags.DEFINE_float(
        "sample_fraction",
        None,
        "Share of the conversations replayed (default: 0.03 of conversation's, 0.1 of "
        "synthetic's; --quick 0.01 and 0.03).",
    )
    flags.DEFINE_integer("sample_seed", 0, "Seed of the conversation sample.")
    flags.DEFINE_integer("max_requests", None, "Keep at most this many requests of the sample.")
    flags.DEFINE_string("model", "llama2-70b", "Model preset (configs/), its shape only.")
    flags.DEFINE_integer("max_model_len", 131072, "Context per request (the trace's max: 126k).")
    flags.DEFINE_integer("tp", 8, "Tensor parallelism of every instance.")
    flags.DEFINE_integer(
        "num_prefill", 3, "Prefill instances (vLLM: num_prefill + num_decode colocated ones)."
    )
    flags.DEFINE_integer("num_decode", 1, "Decode instances.")
    flags.DEFINE_integer("page_size", 256, "KV page (block) tokens.")
    flags.DEFINE_integer("prefill_chunk", 8192, "Prefill instances' tokens per step.")
    flags.DEFINE_integer("max_num_seqs", 128, "Sequences per step, every instance.")
    flags.DEFINE_float("ttft_slo", 30.0, "TTFT SLO, seconds (Mooncake: 30).")
    flags.DEFINE_list("tbt_slos", ["0.1", "0.2", "0.3"], "TBT SLOs, seconds (Mooncake's).")
    flags.DEFINE_enum(
        "tbt_stat", "p90", ["p90", "mean", "p90_decode"], "A request's TBT (the module doc)."
    )
    flags.DEFINE_float("attainment", 0.9, "Share of requests that must meet both SLOs.")
    flags.DEFINE_float("max_rate", 6.0, "Bisection upper bound, requests/s.")
    flags.DEFINE_integer("bisections", 5, "Bisection steps (resolution max_rate / 2^steps).")
    flags.DEFINE_list(
        "routers",
        [
            "vllm",
            "random",
            "least_outstanding",
            "cache_aware",
            "mooncake",
            "mooncake+predicted",
            "mooncake+pool",
            "mooncake+pool+predicted",
        ],
        f"Deployments to compare, of {', '.join(ROUTER_CHOICES)}.",
    )
    flags.DEFINE_float(
        "kvcache_balancing_threshold", 1.0, "The Conductor's fetch threshold (best / local)."
    )
    flags.DEFINE_float(
        "kv_pool_bytes_per_node",
        1e12,
        "The +pool deployments: DRAM each prefill node gives the KV pool (Mooncake Store), "
        "bytes (assumed 1 TB; the pool holds this x prefill nodes / the model's KV bytes per "
        "token).",
    )
    flags.DEFINE_float(
        "kv_pool_bandwidth",
        None,
        "The +pool deployments: bytes/s per receiving GPU of a fetch from the pool (default: "
        "the network's, as an instance-to-instance fetch).",
    )
    flags.DEFINE_integer(
        "prefill_kv_tokens",
        None,
        "KV tokens (pages x page size) of each prefill instance's HBM (default: what fits "
        "beside the weights in 90 % of the GPUs' memory, 1.47 M tokens; smaller: a sensitivity "
        "run where the sample's working set outgrows the prefill instances' caches, as the full "
        "trace's does; vLLM's and the decode instance's are unchanged).",
    )
    flags.DEFINE_bool(
        "quick", False, "A tiny run: a third of the sample, 3 bisections, the 100 ms SLO only."
    )
    flags.DEFINE_string("output_json", "out/mooncake_capacity.json", "Where to write results.")


# ------------------------------------------------------------------------------------------------
# Hardware, model, engines.


def a800():
    from llmjax.sim.hardware import A100_80GB, GB

    return A100_80GB.replace(
        name="a800-80gb",
        link_bandwidth=200 * GB,  # NVLink 400 GB/s both directions (the A800's export limit)
        network_bandwidth=12.5 * GB,  # assumed: 4 x 200 Gb/s RDMA per 8-GPU node
        source="A100-80GB SXM figures with the A800's 400 GB/s NVLink; 100 Gb/s RDMA per GPU "
        "assumed (Mooncake's testbed: A800 nodes with RDMA)",
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    model: object
    hardware: object
    max_model_len: int
    tp: int
    num_prefill: int
    num_decode: int
    page_size: int
    prefill_chunk: int
    max_num_seqs: int
    ttft_slo: float
    tbt_stat: str
    attainment: float
    threshold: float
    kv_pool_bytes_per_node: float = 1e12
    kv_pool_bandwidth: float | None = None
    prefill_kv_tokens: int | None = None


def conductor_options(name: str) -> tuple[bool, str]:
    """(with the KV pool, rejection mode) of a mooncake[+pool][+mode] deployment."""
    parts = name.split("+")[1:]
    pool = "pool" in parts
    modes = [p for p in parts if p != "pool"]
    return pool, modes[0] if modes else "none"


def engine_config(s: Setup, policy: str, budget: int):
    from llmjax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from llmjax.sim import SimConfig

    return EngineConfig(
        model=s.model,
        device="sim",
        dtype="bfloat16",
        sim=SimConfig(cost_model="roofline", hardware=s.hardware, memory_utilization=0.9),
        parallel=ParallelConfig(tp=s.tp),
        scheduler=SchedulerConfig(
            policy=policy, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=budget
        ),
        cache=CacheConfig(page_size=s.page_size, prefix_cache="radix"),
        max_model_len=s.max_model_len,
    )


def make_cluster(s: Setup, name: str, tbt_slo: float):
    """The SimCluster of deployment `name` (ROUTER_CHOICES)."""
    from llmjax.cluster import Conductor
    from llmjax.engine.engine import LLMEngine
    from llmjax.sim import SimCluster

    if name == "vllm":
        config = engine_config(s, "prefill_first", s.max_model_len)
        n = s.num_prefill + s.num_decode
        return SimCluster([LLMEngine(config, None, None) for _ in range(n)], "least_outstanding")
    config = engine_config(s, "sarathi", s.prefill_chunk)
    pages = None if s.prefill_kv_tokens is None else s.prefill_kv_tokens // s.page_size
    engines = [LLMEngine(config, None, pages, role="prefill") for _ in range(s.num_prefill)]
    engines += [LLMEngine(config, None, None, role="decode") for _ in range(s.num_decode)]
    router, pool = name, {}
    if name.startswith("mooncake"):
        with_pool, rejection = conductor_options(name)
        router = Conductor(
            kvcache_balancing_threshold=s.threshold,
            ttft_slo=s.ttft_slo,
            tbt_slo=tbt_slo,
            rejection=rejection,
        )
        if with_pool:
            pool = {
                "kv_pool_bytes_per_node": s.kv_pool_bytes_per_node,
                "kv_pool_bandwidth": s.kv_pool_bandwidth,
            }
    return SimCluster(engines, router, **pool)


# ------------------------------------------------------------------------------------------------
# The trace.


def conversation_key(trace: str, index: int, hash_ids: list[int]):
    if trace == "conversation":  # block 0 is every request's system prompt
        return hash_ids[1] if len(hash_ids) > 1 else ("single", index)
    return hash_ids[0]


def sample_trace(path: str, trace: str, fraction: float, seed: int, max_requests=None):
    """The lines of the sampled conversations (the module doc), and the native request rate of
    the sample (requests / the trace's span)."""
    with open(path) as f:
        rows = [line for line in f if line.strip()]
    parsed = [json.loads(line) for line in rows]
    groups = collections.defaultdict(list)
    for i, r in enumerate(parsed):
        groups[conversation_key(trace, i, r["hash_ids"])].append(i)
    rng = random.Random(seed)
    chosen = [k for k in groups if rng.random() < fraction]  # in first-request order
    keep = sorted(i for k in chosen for i in groups[k])
    if max_requests is not None:
        keep = keep[:max_requests]
    if not keep:
        raise ValueError(f"--sample_fraction={fraction} sampled no request of {path}")
    span = (parsed[-1]["timestamp"] - parsed[0]["timestamp"]) / 1000.0
    return [rows[i] for i in keep], len(keep) / span, len(groups)


def load_specs(lines: list[str], s: Setup):
    from llmjax.bench.mooncake import load_mooncake_trace

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(lines)
    try:
        return load_mooncake_trace(
            f.name, vocab_size=s.model.vocab_size, max_model_len=s.max_model_len
        )
    finally:
        os.unlink(f.name)


def at_rate(specs, native_rate: float, rate: float):
    scale = native_rate / rate
    return [dataclasses.replace(x, arrival_time=x.arrival_time * scale) for x in specs]


# ------------------------------------------------------------------------------------------------
# Trials and the search.


def request_tbt(gaps, stat: str) -> float:
    """A request's TBT from its token gaps (`--tbt_stat`)."""
    if stat == "p90_decode":
        gaps = gaps[1:]  # without the prefill -> decode handoff (the module doc)
    if not gaps:
        return 0.0
    return float(np.mean(gaps) if stat == "mean" else np.percentile(gaps, 90))


def attainment(outputs, ttft_slo: float, tbt_slo: float, stat: str) -> float:
    """The share of all requests that finished with TTFT < ttft_slo and TBT < tbt_slo."""
    met = 0
    for o in outputs:
        m = o.metrics
        if o.error is not None or not o.finished or m.ttft is None or not m.ttft < ttft_slo:
            continue
        met += request_tbt(m.tbt, stat) < tbt_slo
    return met / len(outputs)


def run_trial(s: Setup, name: str, specs, native_rate: float, rate: float, tbt_slo: float):
    """One replay at `rate`: its outputs and a JSON-ready summary."""
    from llmjax.bench import replay, summarize

    t = time.perf_counter()
    cluster = make_cluster(s, name, tbt_slo)
    outputs = replay(cluster, at_rate(specs, native_rate, rate))
    summary = summarize(outputs)
    tbts = [request_tbt(o.metrics.tbt, s.tbt_stat) for o in outputs if o.error is None]
    info = {
        "rate": rate,
        "num_rejected": sum(o.finish_reason == "rejected" for o in outputs),
        "ttft_p50": summary.ttft.p50,
        "ttft_p90": summary.ttft.p90,
        "request_tbt_p90": float(np.percentile(tbts, 90)) if tbts else None,
        "prefix_cache_hit_rate": summary.prefix_cache_hit_rate,
        "num_engine_steps": sum(st.num_steps for st in cluster.stats),
        "conductor": cluster.conductor_stats.as_dict() if name.startswith("mooncake") else None,
        "kv_pool": None
        if cluster.kv_pool is None
        else {
            "capacity_tokens": cluster.kv_pool.capacity_tokens,
            "pages": cluster.kv_pool.num_pages,
            "inserted_pages": cluster.kv_pool.num_inserted,
            "evicted_pages": cluster.kv_pool.num_evicted,
        },
        "wall_s": time.perf_counter() - t,
    }
    return outputs, info


def pool_note(info) -> str:
    """The pool fetches of a +pool trial, for the log line."""
    conductor = info.get("conductor") or {}
    if not info.get("kv_pool"):
        return ""
    return (
        f"pool fetches {conductor.get('num_pool_fetches', 0)} "
        f"({conductor.get('pool_fetched_tokens', 0)} tokens), "
    )


def capacity(trial, tbt_slo: float, s: Setup, max_rate: float, steps: int, log):
    """Bisect the rate (the module doc); `trial(rate)` returns (outputs, info), memoized."""
    lo, hi, trials = 0.0, max_rate, []
    for _ in range(steps):
        rate = (lo + hi) / 2
        outputs, info = trial(rate)
        a = attainment(outputs, s.ttft_slo, tbt_slo, s.tbt_stat)
        passed = a >= s.attainment
        trials.append({**info, "attainment": a, "passed": passed})
        log(
            f"  TBT {1e3 * tbt_slo:g} ms, {rate:.3f} req/s: attainment {a:.1%} "
            f"(rejected {info['num_rejected']}, TTFT p90 {info['ttft_p90'] or 0:.1f} s, "
            f"hit {info['prefix_cache_hit_rate'] or 0:.1%}, "
            f"{pool_note(info)}{info['wall_s']:.0f} s wall) -> "
            f"{'pass' if passed else 'fail'}"
        )
        if passed:
            lo = rate
        else:
            hi = rate
    return lo, trials


# ------------------------------------------------------------------------------------------------


def report(results: dict, tbt_slos, s: Setup, meta: dict) -> str:
    from llmjax.bench.metrics import format_table

    base = results.get("vllm")
    rows = []
    for name, per_slo in results.items():
        row = [name]
        for slo in tbt_slos:
            cap = per_slo[str(slo)]["capacity"]
            cell = f"{cap:.2f}"
            if base and name != "vllm":
                b = base[str(slo)]["capacity"]
                cell += f" ({cap / b - 1:+.0%})" if b > 0 else " (vLLM 0)"
            row.append(cell)
        rows.append(row)
    resolution = meta["max_rate"] / 2 ** meta["bisections"]
    lines = [
        f"Mooncake effective request capacity, SIMULATED (roofline; {s.model.name} TP{s.tp} on "
        f"{s.hardware.name}; {s.num_prefill}P+{s.num_decode}D vs "
        f"vLLM-[{s.num_prefill + s.num_decode}M]; {meta['trace']} trace: "
        f"{meta['num_requests']} requests of {meta['sample_fraction']:.1%} of its "
        f"conversations, native {meta['native_rate']:.3f} req/s"
        + (
            f"; prefill instances' HBM KV cut to {s.prefill_kv_tokens} tokens each"
            if s.prefill_kv_tokens is not None
            else ""
        )
        + (
            f"; +pool: {s.kv_pool_bytes_per_node / 1e12:g} TB DRAM per prefill node"
            if any("+pool" in name for name in results)
            else ""
        )
        + ")",
        f"req/s at which >= {s.attainment:.0%} of requests have TTFT < {s.ttft_slo:g} s and "
        f"{s.tbt_stat} TBT < the SLO (bisection resolution {resolution:.2f} req/s); "
        "(vs vLLM)",
        format_table(["deployment", *[f"TBT {1e3 * x:g} ms" for x in tbt_slos]], rows),
        f"paper (vs vLLM, over the TBT thresholds; {PAPER['source']}): conversation "
        f"{PAPER['conversation']}, tool&agent {PAPER['toolagent']}, synthetic "
        f"{PAPER['synthetic']}",
    ]
    return "\n".join(lines)


def setup_from_flags() -> Setup:
    from configs import get_preset

    model = get_preset(FLAGS.model)
    model = model.replace(
        max_position_embeddings=max(model.max_position_embeddings, FLAGS.max_model_len)
    )
    return Setup(
        model=model,
        hardware=a800(),
        max_model_len=FLAGS.max_model_len,
        tp=FLAGS.tp,
        num_prefill=FLAGS.num_prefill,
        num_decode=FLAGS.num_decode,
        page_size=FLAGS.page_size,
        prefill_chunk=FLAGS.prefill_chunk,
        max_num_seqs=FLAGS.max_num_seqs,
        ttft_slo=FLAGS.ttft_slo,
        tbt_stat=FLAGS.tbt_stat,
        attainment=FLAGS.attainment,
        threshold=FLAGS.kvcache_balancing_threshold,
        kv_pool_bytes_per_node=FLAGS.kv_pool_bytes_per_node,
        kv_pool_bandwidth=FLAGS.kv_pool_bandwidth,
        prefill_kv_tokens=FLAGS.prefill_kv_tokens,
    )


def main(argv):
    del argv
    unknown = set(FLAGS.routers) - set(ROUTER_CHOICES)
    if unknown:
        raise app.UsageError(f"unknown --routers {sorted(unknown)}; choose of {ROUTER_CHOICES}")
    s = setup_from_flags()
    fraction, steps, tbt_slos = FLAGS.sample_fraction, FLAGS.bisections, FLAGS.tbt_slos
    if fraction is None:
        fraction = {"conversation": 0.03, "synthetic": 0.1}[FLAGS.trace]
        fraction = fraction / 3 if FLAGS.quick else fraction
    if FLAGS.quick:
        steps = steps if FLAGS["bisections"].present else 3
        tbt_slos = tbt_slos if FLAGS["tbt_slos"].present else ["0.1"]
    tbt_slos = [float(x) for x in tbt_slos]

    def log(m):
        print(m, file=sys.stderr, flush=True)

    path = os.path.join(FLAGS.trace_dir, f"{FLAGS.trace}_trace.jsonl")
    lines, native, num_groups = sample_trace(
        path, FLAGS.trace, fraction, FLAGS.sample_seed, FLAGS.max_requests
    )
    specs = load_specs(lines, s)
    log(f"{len(specs)} requests of {num_groups} conversations ({fraction:.1%} sampled)")
    t0 = time.perf_counter()
    results, memo = {}, {}
    for name in FLAGS.routers:
        results[name] = {}
        for slo in tbt_slos:
            log(f"{name}:")
            rejects = name.startswith("mooncake") and conductor_options(name)[1] != "none"
            key_slo = slo if rejects else None  # only rejection depends on the TBT SLO

            def trial(rate, name=name, slo=slo, key_slo=key_slo):
                key = (name, key_slo, rate)
                if key not in memo:
                    memo[key] = run_trial(s, name, specs, native, rate, slo)
                return memo[key]

            cap, trials = capacity(trial, slo, s, FLAGS.max_rate, steps, log)
            results[name][str(slo)] = {"capacity": cap, "trials": trials}
    wall = time.perf_counter() - t0
    meta = {
        "trace": FLAGS.trace,
        "num_requests": len(specs),
        "sample_fraction": fraction,
        "native_rate": native,
        "max_rate": FLAGS.max_rate,
        "bisections": steps,
    }
    print(report(results, tbt_slos, s, meta), flush=True)
    print(f"({wall:.0f} s of wall time, {len(memo)} simulated runs)", flush=True)
    if FLAGS.output_json:
        doc = {
            "simulated": True,
            "settings": {
                **{
                    k: v for k, v in dataclasses.asdict(s).items() if k not in ("model", "hardware")
                },
                "model": s.model.name,
                "hardware": dataclasses.asdict(s.hardware),
                "tbt_slos": tbt_slos,
                "routers": FLAGS.routers,
                **meta,
            },
            "results": results,
            "paper": PAPER,
            "wall_s": wall,
        }
        os.makedirs(os.path.dirname(FLAGS.output_json) or ".", exist_ok=True)
        with open(FLAGS.output_json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    define_flags()
    app.run(main)

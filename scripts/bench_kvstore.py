r"""The KV tiers (issue 22; llmjax/kvstore/, llmjax/engine/kv_tiers.py) measured on the real
model: what moving a block costs per tier against recomputing its tokens, and what the tiers
buy on Mooncake's traces.

    # (a) T0 <-> T1 <-> T2 (<-> T3 with --mooncake) seconds per block of 16/256/512 tokens,
    #     bytes/s, latency, against prefilling those tokens; the fitted cost model
    python scripts/bench_kvstore.py --mode micro
    # (b) SmolLM2 on the conversation trace scaled to 16 tokens a block: hit ratio per tier
    #     against the trace's own ideal, prefill tokens saved, TTFT, with and without T1 / T2
    python scripts/bench_kvstore.py --mode trace
    python scripts/bench_kvstore.py --mode trace \
        --trace ../shared/data/mooncake/synthetic_trace.jsonl --trace_sample_fraction 0.05

Micro (a): for each block size, the median of --repeats timed copies of one block of the model's
real KV pages: T0 -> host (`export_host_pages` and the copy to host memory), into and out of T1
(`HostTier.put` / `get`), into and out of T2 (`DiskTier.put`, and with fsync; a cold `get` after
`posix_fadvise(DONTNEED)` drops the file from the page cache), and host -> T0
(`import_host_pages` until the device has it); T3 (Mooncake Store over TCP on 127.0.0.1, a
master started here) with --mooncake. Recompute: the median time to first token of a fresh
prompt of that many tokens, alone, the prefix cache off. Each load path's seconds are fitted as
latency + bytes / bandwidth over the block sizes: the `KVStoreConfig` cost model's numbers,
printed as the --config.kv_store.* flags to pass.

Trace (b): the requests of --trace_sample_fraction of a Mooncake trace's conversations (every
turn of each: the sample keeps the trace's sharing), every hash block turned into
--mooncake_block_tokens tokens (16: 1/32 of the recorded 512), outputs scaled by
--mooncake_output_scale, replayed in real time at a mean --rate (the sample's arrivals
compressed) against a fresh engine per variant: device only (the radix cache, --device_tokens of
KV), + T1 (--host_tokens of host memory), + T1 + T2 (unbounded disk). The KV block is one hash
block. Each row reports the prompt tokens whose KV came from each tier, the prefill tokens
computed, TTFT P50/P90 and the greedy agreement with the first variant; "ideal" is the trace's
own (these requests, an unbounded cache: the longest prefix of whole blocks any earlier request
had), beside the README's full-trace figures (0.366 conversation, 0.640 synthetic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from llmjax import engine_flags

engine_flags.define_flags()
flags.adopt_module_key_flags(engine_flags)
FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
TRACE_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data", "mooncake"))
FULL_TRACE_IDEAL = {"conversation": 0.366, "synthetic": 0.640}

flags.DEFINE_enum("mode", "micro", ["micro", "trace", "both"], "What to measure.")
flags.DEFINE_list("block_tokens", ["16", "256", "512"], "micro: block sizes in tokens.")
flags.DEFINE_integer("repeats", 5, "micro: timed copies per measurement (the median).")
flags.DEFINE_bool("mooncake", False, "micro: also T3, Mooncake Store (needs the mooncake extra).")
flags.DEFINE_string(
    "trace", os.path.join(TRACE_DIR, "conversation_trace.jsonl"), "trace: a Mooncake JSONL trace."
)
flags.DEFINE_float(
    "trace_sample_fraction",
    0.02,
    "trace: replay the requests of this share of the trace's conversations (every turn of "
    "each, so the sample keeps the trace's sharing; llmjax.bench.mooncake.sample_conversations).",
)
flags.DEFINE_integer("trace_requests", None, "trace: at most this many of them (default: all).")
flags.DEFINE_float(
    "rate", 1.0, "trace: mean arrival rate in requests/s (the sample's arrivals compressed)."
)
flags.DEFINE_integer(
    "mooncake_block_tokens", 16, "trace: tokens per hash block (512: as recorded)."
)
flags.DEFINE_float("mooncake_output_scale", 1 / 32, "trace: output length scale.")
flags.DEFINE_integer("device_tokens", 4096, "trace: the device KV cache, in tokens.")
flags.DEFINE_integer("host_tokens", 16384, "trace: T1's capacity, in tokens.")
flags.DEFINE_list(
    "variants", ["device", "host", "host+disk"], "trace: the tiers of each run (device only, ...)."
)
flags.DEFINE_enum(
    "write_policy",
    "write_back",
    ["write_through", "write_through_selective", "write_back"],
    "trace: how blocks move down (KVStoreConfig.write_policy).",
)
flags.DEFINE_string("json_out", "out/bench_kvstore.json", "Where to write the results ('': none).")
FLAGS.set_default("max_model_len", 2048)
FLAGS.set_default("max_num_batched_tokens", 512)


def _median_time(fn, repeats: int) -> float:
    fn()  # untimed: first-call effects
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit(sizes_bytes, seconds) -> tuple[float, float]:
    """latency (s) and bandwidth (bytes/s) of seconds = latency + bytes / bandwidth."""
    slope, intercept = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(seconds, float), 1)
    return max(float(intercept), 0.0), (1.0 / slope if slope > 0 else float("inf"))


def _llm(**kw):
    from llmjax import LLM

    return LLM(FLAGS.model, **(engine_flags.llm_kwargs(FLAGS) | kw))


# ---- (a) micro ------------------------------------------------------------------------------


def _measure_block(llm, tokens: int, tmp: str, stack, rng, mooncake) -> dict:
    """One row of the micro table: a block of `tokens` tokens through every tier."""
    import jax

    from llmjax import SamplingParams
    from llmjax.kvstore import DiskTier, HostTier
    from llmjax.kvstore.keys import ROOT_KEY

    runner, ps = llm.engine.runner, FLAGS.page_size
    bp = tokens // ps
    pages = list(range(1, bp + 1))
    shape = list(runner.transfer_shape(bp))
    shape[2] = bp
    np.asarray(runner.export_host_pages(pages))  # compile this bucket
    data = np.asarray(runner.export_host_pages(pages))[:, :, :bp]
    nbytes = data.nbytes
    runner.import_host_pages(pages, data)
    jax.block_until_ready(runner.kv_pages)
    keys = iter(rng.bytes(16) for _ in range(10_000))
    host = HostTier(FLAGS.repeats + 2, shape, runner.kv_dtype)
    disk = DiskTier(os.path.join(tmp, str(tokens)), 10_000, shape, runner.kv_dtype)
    r = {"tokens": tokens, "bytes": nbytes}
    r["t0_to_host"] = _median_time(
        lambda: np.asarray(runner.export_host_pages(pages)), FLAGS.repeats
    )
    k = next(keys)
    r["t1_put"] = _median_time(lambda: (host.put(k, ROOT_KEY, data), host.remove(k)), FLAGS.repeats)
    host.put(k, ROOT_KEY, data)
    assert np.array_equal(host.get(k), data), "T1 did not return the block"
    r["t1_get"] = _median_time(lambda: host.get(k), FLAGS.repeats)

    def disk_put():
        key = next(keys)
        disk.put(key, ROOT_KEY, data)
        return key

    r["t2_put"] = _median_time(disk_put, FLAGS.repeats)
    durable = DiskTier(
        os.path.join(tmp, f"{tokens}-fsync"), 10_000, shape, runner.kv_dtype, fsync=True
    )
    r["t2_put_fsync"] = _median_time(lambda: durable.put(next(keys), ROOT_KEY, data), FLAGS.repeats)
    cold = [disk_put() for _ in range(FLAGS.repeats + 1)]  # (+1: the untimed first call)
    for key in cold:  # out of the page cache: a cold read
        fd = os.open(disk.path(key), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert np.array_equal(disk.get(cold[-1]), data), "T2 did not return the block"
    cold = [*cold[:-1], disk_put()]  # (the check above warmed that one)
    for key in cold[-1:]:
        fd = os.open(disk.path(key), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    it = iter(cold)
    r["t2_get_cold"] = _median_time(lambda: disk.get(next(it)), FLAGS.repeats)
    r["t2_get_warm"] = _median_time(lambda: disk.get(cold[0]), FLAGS.repeats)

    def host_to_t0():
        runner.import_host_pages(pages, data)
        jax.block_until_ready(runner.kv_pages)

    r["host_to_t0"] = _median_time(host_to_t0, FLAGS.repeats)
    if mooncake is not None:
        t3 = mooncake(stack, shape, runner.kv_dtype)
        kk = next(keys)
        r["t3_put"] = _median_time(
            lambda: (t3.put(kk, ROOT_KEY, data), t3.remove(kk)), FLAGS.repeats
        )
        t3.put(kk, ROOT_KEY, data)
        got = t3.get(kk)
        assert got is not None and np.array_equal(got, data), f"T3 failed: {t3.last_error}"
        r["t3_get"] = _median_time(lambda: t3.get(kk), FLAGS.repeats)
    prompt = rng.integers(2, llm.config.model.vocab_size, tokens + 1).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft():
        (o,) = llm.generate([prompt], one, use_tqdm=False)
        return o.metrics.first_token_time - o.metrics.arrival_time

    ttft()  # compile these shapes
    r["recompute"] = statistics.median(ttft() for _ in range(FLAGS.repeats))
    return r


def micro() -> dict:
    sizes = [int(x) for x in FLAGS.block_tokens]
    ps = FLAGS.page_size
    if any(s % ps for s in sizes):
        raise app.UsageError(f"--block_tokens must be multiples of --page_size {ps}")
    max_pages = max(sizes) // ps
    llm = _llm(num_pages=max_pages + 2, prefix_cache="none", max_num_seqs=1)
    rows, rng = [], np.random.default_rng(0)
    mooncake = _mooncake_tier if FLAGS.mooncake else None
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        for tokens in sizes:
            r = _measure_block(llm, tokens, tmp, stack, rng, mooncake)
            rows.append(r)
            print(f"measured {tokens}-token blocks", file=sys.stderr, flush=True)
    paths = {
        "host": ["t1_get", "host_to_t0"],
        "disk": ["t2_get_cold", "host_to_t0"],
    }
    if mooncake is not None:
        paths["mooncake"] = ["t3_get", "host_to_t0"]
    fits = {}
    for tier, ops in paths.items():
        secs = [sum(r[o] for o in ops) for r in rows]
        lat, bw = _fit([r["bytes"] for r in rows], secs)
        fits[tier] = {"latency": lat, "bandwidth": bw, "seconds": secs}
    rate = [r["tokens"] / r["recompute"] for r in rows]
    return {"rows": rows, "fits": fits, "prefill_tokens_per_s": rate}


def _mooncake_tier(stack, shape, dtype):
    from llmjax.kvstore.mooncake_master import start_master
    from llmjax.kvstore.mooncake_tier import MooncakeTier

    master = stack.enter_context(start_master())
    tier = MooncakeTier(
        shape, dtype, master_address=master.master_address, metadata_url=master.metadata_url
    )
    stack.callback(tier.close)
    return tier


def micro_table(res: dict) -> str:
    ops = [k for k in res["rows"][0] if k not in ("tokens", "bytes")]
    lines = ["seconds per block (median)   " + "".join(f"{r['tokens']:>12d}" for r in res["rows"])]
    lines.append(
        "  bytes                      " + "".join(f"{r['bytes']:>12d}" for r in res["rows"])
    )
    for op in ops:
        lines.append(f"  {op:<27s}" + "".join(f"{r[op] * 1e3:>10.3f}ms" for r in res["rows"]))
    lines.append("load (tier -> device) vs recompute")
    for tier, f in res["fits"].items():
        ratios = "".join(
            f"{r['recompute'] / s:>11.1f}x" for r, s in zip(res["rows"], f["seconds"], strict=True)
        )
        lines.append(
            f"  {tier:<8s} latency {f['latency'] * 1e3:7.3f} ms  {f['bandwidth'] / 1e9:6.2f} GB/s"
            f"  recompute/load:{ratios}"
        )
    rates = ", ".join(f"{x:.0f}" for x in res["prefill_tokens_per_s"])
    sizes = "/".join(str(r["tokens"]) for r in res["rows"])
    lines.append(f"  prefill tokens/s recomputing {sizes} tokens: {rates}")
    flags_ = " ".join(
        f"--config.kv_store.{t}_latency={f['latency']:.3g} "
        f"--config.kv_store.{t}_bandwidth={f['bandwidth']:.3g}"
        for t, f in res["fits"].items()
    )
    lines.append(f"cost model flags: {flags_}")
    return "\n".join(lines)


# ---- (b) trace ------------------------------------------------------------------------------


def ideal_hit(specs, page_size: int) -> tuple[float, float]:
    """The trace's own ideal (unbounded cache): per request the longest prefix of whole pages
    that an earlier request had. Returns (token-weighted hit ratio, block hit ratio)."""
    from llmjax.kvstore.keys import chain_keys

    salt = b"ideal"
    seen: set[bytes] = set()
    hit = total = hit_blocks = total_blocks = 0
    for s in specs:
        keys = chain_keys(s.prompt_token_ids, page_size, salt)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += n * page_size
        total += len(s.prompt_token_ids)
        hit_blocks += sum(k in seen for k in keys)
        total_blocks += len(keys)
        seen.update(keys)
    return hit / max(total, 1), hit_blocks / max(total_blocks, 1)


def trace() -> dict:
    from llmjax.bench.metrics import summarize
    from llmjax.bench.mooncake import load_mooncake_trace
    from llmjax.bench.replay import replay, warm_up
    from llmjax.config import KVStoreConfig

    bt, ps = FLAGS.mooncake_block_tokens, FLAGS.page_size
    if bt % ps:
        raise app.UsageError(f"--mooncake_block_tokens must be a multiple of --page_size {ps}")
    base = _llm(num_pages=FLAGS.device_tokens // ps + 1)
    specs = load_mooncake_trace(
        FLAGS.trace,
        vocab_size=base.config.model.vocab_size,
        block_tokens=bt,
        output_scale=FLAGS.mooncake_output_scale,
        max_model_len=FLAGS.max_model_len,
        num_requests=FLAGS.trace_requests,
        sample_fraction=FLAGS.trace_sample_fraction,
    )
    span = specs[-1].arrival_time - specs[0].arrival_time
    if span > 0 and FLAGS.rate > 0:  # compress to the --rate
        scale = len(specs) / span / FLAGS.rate
        specs = [dataclasses.replace(sp, arrival_time=sp.arrival_time * scale) for sp in specs]
    ideal_tokens, ideal_blocks = ideal_hit(specs, bt)
    all_prompt = sum(len(sp.prompt_token_ids) for sp in specs)  # the ideal's denominator
    runs, first = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for variant in FLAGS.variants:
            tiers = set(variant.split("+"))
            if not tiers <= {"device", "host", "disk"}:
                raise app.UsageError(f"bad --variants entry {variant!r}")
            kv = None
            if tiers - {"device"}:
                kv = KVStoreConfig(
                    host_blocks=FLAGS.host_tokens // bt if "host" in tiers else 0,
                    disk_dir=os.path.join(tmp, variant) if "disk" in tiers else "",
                    disk_blocks=1_000_000,
                    block_size=bt,
                    write_policy=FLAGS.write_policy,
                )
            llm = base.with_options(kv_store=kv)
            engine = llm.engine
            print(f"{variant}: warming up", file=sys.stderr, flush=True)
            warm_up(engine, specs[:16], max_output_len=8)
            engine.reset_prefix_cache()
            if engine.kv_tiers is not None:
                engine.kv_tiers.store.reset()
                engine.kv_tiers.stats = type(engine.kv_tiers.stats)()
            engine.reset_stats()
            compiles = engine.num_compiles
            t = time.perf_counter()
            outs = replay(engine, specs, realtime=True, progress=variant)
            wall = time.perf_counter() - t
            s = summarize(outs)
            per_tier: dict[str, int] = {}
            for o in outs:
                for k, v in o.num_cached_tokens_per_tier.items():
                    per_tier[k] = per_tier.get(k, 0) + v
            ids = [o.token_ids for o in outs]
            first = ids if first is None else first
            agree = sum(a == b for a, b in zip(ids, first, strict=True)) / len(ids)
            runs[variant] = {
                "prompt_tokens": s.num_prompt_tokens,
                "cached_tokens": s.num_cached_tokens,
                "cached_per_tier": per_tier,
                "hit_ratio": s.num_cached_tokens / all_prompt,
                "hit_ratio_per_tier": {k: v / all_prompt for k, v in per_tier.items()},
                "prefill_tokens_computed": s.num_prompt_tokens - s.num_cached_tokens,
                "ttft_p50": s.ttft.p50,
                "ttft_p90": s.ttft.p90,
                "tbt_p50": s.tbt.p50,
                "duration_s": s.duration_s,
                "wall_s": wall,
                "errors": s.num_errors,
                "compiles": engine.num_compiles - compiles,
                "greedy_agreement": agree,
                "tier_stats": engine.kv_tiers.stats.as_dict() if engine.kv_tiers else None,
            }
            del llm, engine
    name = next((k for k in FULL_TRACE_IDEAL if k in os.path.basename(FLAGS.trace)), None)
    return {
        "trace": FLAGS.trace,
        "requests": len(specs),
        "block_tokens": bt,
        "ideal_token_hit": ideal_tokens,
        "ideal_block_hit": ideal_blocks,
        "full_trace_ideal": FULL_TRACE_IDEAL.get(name),
        "runs": runs,
    }


def trace_table(res: dict) -> str:
    runs = res["runs"]
    names = list(runs)
    w = max(14, *(len(n) + 2 for n in names))

    def row(label, f):
        return f"  {label:<30s}" + "".join(f"{f(runs[n]):>{w}s}" for n in names)

    tiers = sorted({k for r in runs.values() for k in r["cached_per_tier"]})
    lines = [
        f"{os.path.basename(res['trace'])}: {res['requests']} requests, {res['block_tokens']} "
        f"tokens a block; ideal hit (these requests, unbounded cache) {res['ideal_token_hit']:.3f}"
        f" of prompt tokens, {res['ideal_block_hit']:.3f} of blocks"
        + (f"; full trace {res['full_trace_ideal']}" if res["full_trace_ideal"] else ""),
        f"  {'':<30s}" + "".join(f"{n:>{w}s}" for n in names),
        row("hit ratio (cached/prompt)", lambda r: f"{r['hit_ratio']:.3f}"),
    ]
    for t in tiers:
        lines.append(row(f"  from {t}", lambda r, t=t: f"{r['hit_ratio_per_tier'].get(t, 0):.3f}"))
    lines += [
        row(
            "  of the ideal", lambda r: f"{r['hit_ratio'] / max(res['ideal_token_hit'], 1e-9):.2f}"
        ),
        row("prefill tokens computed", lambda r: str(r["prefill_tokens_computed"])),
        row("TTFT P50 (s)", lambda r: f"{r['ttft_p50']:.3f}"),
        row("TTFT P90 (s)", lambda r: f"{r['ttft_p90']:.3f}"),
        row("TBT P50 (ms)", lambda r: f"{r['tbt_p50'] * 1e3:.1f}"),
        row("makespan (s)", lambda r: f"{r['duration_s']:.1f}"),
        row("greedy agreement", lambda r: f"{r['greedy_agreement']:.3f}"),
        row("requests failed", lambda r: str(r["errors"])),
        row("compiles during the run", lambda r: str(r["compiles"])),
    ]
    return "\n".join(lines)


def main(argv):
    del argv
    out = {}
    if FLAGS.mode in ("micro", "both"):
        out["micro"] = micro()
        print(micro_table(out["micro"]), flush=True)
    if FLAGS.mode in ("trace", "both"):
        out["trace"] = trace()
        print(trace_table(out["trace"]), flush=True)
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

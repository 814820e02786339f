r"""Where a serving run's steps go: a stream of requests through the engine, step by step.

A closed loop as `vllm bench serve --max-concurrency C --request-rate inf` drives a server: C
requests in flight, a new one (random token ids, --input_len prompt tokens, exactly --output_len
new tokens) admitted as soon as one finishes, --num_prompts in all; run in this process through
`LLMEngine.step`, so every step's real tokens, padded tokens (its token bucket), decodes and
device / host time are recorded (`EngineStats` deltas). Prints, per step kind (decode-only,
mixed, prefill-only) and token bucket, the steps, real and padded tokens and milliseconds, and
the totals; steps that compiled are counted apart. Each --compare configuration runs the same
requests after a warm-up pass of other prompts (so compiles fall there), in one process over
one load of the weights.

    python scripts/profile_serving.py --max_num_seqs 16            # the issue-36 workload
    python scripts/profile_serving.py --max_num_seqs 16 \
        --compare pow2:token_buckets_per_octave=1 --compare fine:token_buckets_per_octave=4
    python scripts/profile_serving.py --dtype bfloat16 --out out/profile_serving.json
"""

from __future__ import annotations

import collections
import json
import os
import time

import numpy as np
from absl import app, flags

from llmjax import engine_flags

engine_flags.define_flags()
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_integer("num_prompts", 64, "Requests in all.")
flags.DEFINE_integer("input_len", 128, "Prompt tokens per request.")
flags.DEFINE_integer("output_len", 64, "New tokens per request (ignore_eos).")
flags.DEFINE_integer("concurrency", 16, "Requests in flight.")
flags.DEFINE_integer("warmup", 1, "Unmeasured passes over other prompts first.")
flags.DEFINE_multi_string(
    "compare",
    [],
    "A configuration as name:field=value,... (EngineConfig overrides by dotted path, values "
    "as Python literals, e.g. pow2:token_buckets_per_octave=1); repeatable. None: the flags' "
    "engine alone.",
)
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_string("out", "out/profile_serving.json", "Where to write the JSON ('' for none).")
FLAGS = flags.FLAGS

COUNTERS = (
    "num_batched_tokens",
    "num_padded_tokens",
    "num_decode_tokens",
    "num_prefill_tokens",
    "device_time_s",
    "host_time_s",
)


def parse_compare(specs: list[str]) -> list[tuple[str, dict]]:
    """['a:x=1,y.z=True'] -> [('a', {'x': 1, 'y.z': True})] (values as Python literals where
    they parse, as bench_peers' configurations)."""
    from llmjax.bench.peers import EngineSpec

    out = []
    for text in specs:
        try:
            spec = EngineSpec.parse(text, "llmjax")
        except ValueError as e:
            raise app.UsageError(f"--compare: {e}") from None
        if not spec.kwargs:
            raise app.UsageError(f"--compare {text!r}: want name:field=value,...")
        out.append((spec.name, spec.kwargs))
    return out


def prompts(seed: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab_size, (FLAGS.num_prompts, FLAGS.input_len)).tolist()


def serve(engine, prompt_ids: list[list[int]]) -> tuple[list[dict], float, int]:
    """The closed loop over `prompt_ids`; returns one record per step, the wall seconds and
    the tokens generated."""
    from llmjax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=FLAGS.output_len, ignore_eos=True)
    queue = collections.deque(prompt_ids)
    in_flight, steps, generated = set(), [], 0
    runner = engine.runner
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < FLAGS.concurrency:
            in_flight.add(engine.add_request(queue.popleft(), params))
        before = {k: getattr(engine.stats, k) for k in COUNTERS}
        compiles = runner.num_compiles + getattr(runner, "num_sample_compiles", 0)
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                generated += len(out.token_ids)
        rec = {k: getattr(engine.stats, k) - before[k] for k in COUNTERS}
        rec["compiled"] = compiles != runner.num_compiles + getattr(
            runner, "num_sample_compiles", 0
        )
        if rec["num_batched_tokens"]:
            steps.append(rec)
    return steps, time.perf_counter() - t0, generated


def kind(step: dict) -> str:
    if not step["num_prefill_tokens"]:
        return "decode"
    return "mixed" if step["num_decode_tokens"] else "prefill"


def summarize(steps: list[dict], seconds: float, generated: int) -> dict:
    timed = [s for s in steps if not s["compiled"]]
    groups = collections.defaultdict(list)
    for s in timed:
        groups[(kind(s), s["num_padded_tokens"])].append(s)
    rows = []
    for (k, T), ss in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        real = np.mean([s["num_batched_tokens"] for s in ss])
        ms = 1000 * np.mean([s["device_time_s"] for s in ss])
        rows.append(
            dict(
                kind=k,
                bucket=T,
                steps=len(ss),
                real_tokens=float(real),
                device_ms=float(ms),
                host_ms=float(1000 * np.mean([s["host_time_s"] for s in ss])),
                share=float(sum(s["device_time_s"] for s in ss)),
            )
        )
    total_device = sum(r["share"] for r in rows) or 1.0
    for r in rows:
        r["share"] /= total_device
    n = max(len(steps), 1)
    return dict(
        seconds=seconds,
        output_tok_s=generated / seconds,
        steps=len(steps),
        compiled_steps=len(steps) - len(timed),
        tokens_per_step=sum(s["num_batched_tokens"] for s in steps) / n,
        padded_tokens_per_step=sum(s["num_padded_tokens"] for s in steps) / n,
        device_ms_per_step=1000 * sum(s["device_time_s"] for s in timed) / max(len(timed), 1),
        host_ms_per_step=1000 * sum(s["host_time_s"] for s in timed) / max(len(timed), 1),
        buckets=rows,
    )


def print_summary(name: str, r: dict) -> None:
    print(
        f"\n== {name}: {r['output_tok_s']:.1f} output tok/s, {r['seconds']:.1f} s, "
        f"{r['steps']} steps ({r['compiled_steps']} compiled), {r['tokens_per_step']:.1f} real "
        f"/ {r['padded_tokens_per_step']:.1f} padded tokens per step, device "
        f"{r['device_ms_per_step']:.1f} ms + host {r['host_ms_per_step']:.1f} ms per step"
    )
    print(
        f"{'kind':8} {'bucket':>6} {'steps':>5} {'real':>6} {'device ms':>9} {'ms/real tok':>11} "
        f"{'host ms':>7} {'share':>6}"
    )
    for b in r["buckets"]:
        print(
            f"{b['kind']:8} {b['bucket']:6d} {b['steps']:5d} {b['real_tokens']:6.1f} "
            f"{b['device_ms']:9.1f} {b['device_ms'] / b['real_tokens']:11.2f} "
            f"{b['host_ms']:7.2f} {b['share']:6.1%}"
        )


def main(argv):
    del argv
    from llmjax.llm import LLM

    engine_flags.initialize(FLAGS)
    kwargs = engine_flags.llm_kwargs(FLAGS)
    base = LLM(FLAGS.model, **kwargs)
    configs = parse_compare(FLAGS.compare) or [("engine", {})]
    vocab = base.engine.config.model.vocab_size
    results = {}
    for name, overrides in configs:
        llm = base
        if overrides:
            llm = base.with_options(overrides={**kwargs.get("overrides", {}), **overrides})
        for i in range(FLAGS.warmup):
            serve(llm.engine, prompts(FLAGS.seed + 1000 + i, vocab))
        llm.engine.reset_stats()
        results[name] = summarize(*serve(llm.engine, prompts(FLAGS.seed, vocab)))
        print_summary(name, results[name])
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(dict(flags=engine_flags.argv(FLAGS), results=results), f, indent=1)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

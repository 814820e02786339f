"""Decode speed at small batch against the memory-bandwidth roofline.

At batch 1 a decode step reads every weight once, so tokens/s is bounded by
    measured read bandwidth / weight bytes per token.
This script measures both in the same run (the bandwidth with a jitted reduction over a large
array) and reports decode tokens/s and the fraction of the bound achieved, per layer loop, dtype
and batch, with the seconds the first decode step took beyond the others (its compilation; 0 when
the prefill already compiled its bucket; the persistent compilation cache is off here) and the
milliseconds of the jitted step alone ("device ms": the same step's inputs run again, waited for;
the rest of "step ms" is the host's scheduling, input building and sampling):
`--layer_loops scan,unroll` compares EngineConfig.layer_loop's two loops.

    python scripts/bench_decode.py                       # SmolLM2, float32 and bfloat16, batch 1
    python scripts/bench_decode.py --batch_sizes 1,8 --dtypes float32 --json_out out/decode.json
    python scripts/bench_decode.py --dtypes float32 --layer_loops scan,unroll
    python scripts/bench_decode.py --batch_sizes 16 --attention_backends reference,cpu
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_enum(
    "load_format", "auto", ["auto", "dummy"], "'dummy': random weights of the preset's shapes."
)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Weight/KV dtypes to compare.")
flags.DEFINE_list("batch_sizes", ["1"], "Concurrent decoding requests.")
flags.DEFINE_list(
    "layer_loops", ["auto"], "EngineConfig.layer_loop values to compare (auto, scan, unroll)."
)
flags.DEFINE_list(
    "attention_backends",
    ["auto"],
    "EngineConfig.attention_backend values to compare (auto, reference, cpu, pallas).",
)
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per request.")
flags.DEFINE_integer("max_model_len", 512, "Max prompt + generated tokens (the page buckets).")
flags.DEFINE_integer("decode_steps", 64, "Timed decode steps (after warm-up).")
flags.DEFINE_integer("warmup_steps", 4, "Untimed decode steps (compilation happens here).")
flags.DEFINE_integer("bandwidth_mib", 1024, "Size of the array read to measure bandwidth.")
flags.DEFINE_string("json_out", "out/bench_decode.json", "Where to write the results.")

FLAGS = flags.FLAGS


def measure_read_bandwidth(num_bytes: int, repeats: int = 10) -> float:
    """Bytes/s of a jitted sum over a float32 array of `num_bytes` (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 4,), jnp.float32) * 1.5
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def time_decode(llm, batch: int) -> dict:
    """Median seconds per decode step with `batch` requests running, measured via engine.step,
    and the seconds the first decode step took beyond that (its compilation)."""
    import numpy as np

    from llmjax import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    total = FLAGS.warmup_steps + FLAGS.decode_steps + 1
    params = SamplingParams(max_tokens=total, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(100, vocab, FLAGS.prompt_len).tolist(), params)
    while any(r.num_uncomputed_tokens > 1 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill
    t = time.perf_counter()
    engine.step()  # the first decode step of this batch size: compiles its bucket
    first_s = time.perf_counter() - t
    runner = engine.runner
    captured = []
    real_launch = runner.launch

    def capturing_launch(step, sampling, tag=None):
        captured[:] = [step, sampling]
        return real_launch(step, sampling, tag)

    runner.launch = capturing_launch
    times = []
    try:
        for i in range(FLAGS.warmup_steps + FLAGS.decode_steps - 1):
            t = time.perf_counter()
            engine.step()
            if i >= FLAGS.warmup_steps:
                times.append(time.perf_counter() - t)
    finally:
        del runner.launch
    device_s = runner.time_step(*captured, FLAGS.decode_steps, FLAGS.warmup_steps)
    while engine.has_unfinished_requests():
        engine.step()
    step_s = float(np.median(times))
    return {
        "step_ms": 1e3 * step_s,
        "device_ms": 1e3 * device_s,
        "tokens_per_s": batch / step_s,
        "compile_s": max(first_s - step_s, 0.0),
    }


def main(argv):
    del argv
    import jax

    from llmjax import LLM

    bandwidth = measure_read_bandwidth(FLAGS.bandwidth_mib << 20)
    rows = []
    for dtype in FLAGS.dtypes:
        base = None
        for layer_loop in FLAGS.layer_loops:
            for backend in FLAGS.attention_backends:
                options = dict(layer_loop=layer_loop, attention_backend=backend)
                if base is None:
                    base = llm = LLM(
                        FLAGS.model,
                        load_format=FLAGS.load_format,
                        dtype=dtype,
                        max_model_len=FLAGS.max_model_len,
                        compilation_cache_dir="",
                        **options,
                    )
                else:  # the same weights (converted to the other layout if needed)
                    llm = base.with_options(**options)
                rows += _rows(llm, dtype, layer_loop, bandwidth)
    header = f"{'loop':>6} {'attention':>9} {'dtype':>9} {'batch':>5} {'weights MB':>10} "
    header += f"{'compile s':>9} "
    header += f"{'step ms':>8} {'device ms':>9} {'tok/s':>8} {'bound tok/s':>11} {'of bound':>8}"
    print(f"device: {jax.devices()[0].device_kind}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(header)
    for r in rows:
        print(
            f"{r['layer_loop']:>6} {r['attention']:>9} {r['dtype']:>9} {r['batch']:>5} "
            f"{r['weight_mb']:>10.1f} "
            f"{r['compile_s']:>9.2f} {r['step_ms']:>8.2f} {r['device_ms']:>9.2f} "
            f"{r['tokens_per_s']:>8.1f} "
            f"{r['roofline_tokens_per_s']:>11.1f} {r['fraction_of_roofline']:>8.2f}"
        )
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=2)
        print(f"wrote {FLAGS.json_out}")


def _rows(llm, dtype: str, layer_loop: str, bandwidth: float) -> list[dict]:
    import jax

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    bound = bandwidth / weight_bytes
    rows = []
    for batch in map(int, FLAGS.batch_sizes):
        r = time_decode(llm, batch)
        rows.append(
            {
                "model": FLAGS.model,
                "layer_loop": "scan" if llm.config.scans_layers else "unroll",
                "attention": llm.engine.runner.attention_backend,
                "dtype": dtype,
                "batch": batch,
                "weight_mb": weight_bytes / 1e6,
                "bandwidth_gb_s": bandwidth / 1e9,
                "roofline_tokens_per_s": bound * batch,
                **r,
                "fraction_of_roofline": r["tokens_per_s"] / (bound * batch),
            }
        )
    return rows


if __name__ == "__main__":
    app.run(main)

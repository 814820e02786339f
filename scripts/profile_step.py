r"""Profile the real engine's steps on this machine and fit the simulator's cost model to them.

Runs workloads through the engine (every combination of --batch_sizes requests x --prompt_lens
prompt tokens, each generating --max_tokens), records each step's features
(`llmjax.sim.StepFeatures`: tokens, prefill attention, decodes, decode context) and its seconds
(--fit_to: 'step', the whole `LLMEngine.step` in wall time, host work included, which is what
the engine's clock moves by from one step to the next and so what a simulated engine must
advance; or 'device', `ModelRunner.launch` to `collect` alone; steps that compiled are left
out), fits
`llmjax.sim.LinearCostModel` by least squares on all but every --holdout_every-th step and
reports the relative error on those held-out steps. --roofline also measures this machine's
read bandwidth and matmul rate (llmjax/roofline.py), so that `SimConfig(hardware=<the JSON>)`
models this CPU analytically. Prints a table, writes the profile as JSON (--out), which
`LinearCostModel.from_profile` and `llmjax.sim.hardware.cpu_from_profile` read.

    python scripts/profile_step.py                                  # SmolLM2, ~2 min on 2 CPUs
    python scripts/profile_step.py --batch_sizes 1,8,32 --prompt_lens 32,256,1024 --dtype bfloat16
    python scripts/profile_step.py --roofline --out out/cpu_profile.json
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or HF directory.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_string("dtype", "float32", "Weights and KV dtype.")
flags.DEFINE_string("quantization", "none", "Weight quantization (LLM(quantization=...)).")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Requests per workload.")
flags.DEFINE_list("prompt_lens", ["32", "256"], "Prompt tokens per request.")
flags.DEFINE_integer("max_tokens", 16, "New tokens per request.")
flags.DEFINE_integer("max_num_batched_tokens", 256, "The engine's token budget per step.")
flags.DEFINE_integer(
    "max_num_seqs",
    None,
    "The engine's max_num_seqs (default: the largest batch size). Steps run S = min(T, "
    "max_num_seqs) sequence rows, so profile with the serving engine's value.",
)
flags.DEFINE_integer("max_model_len", 2048, "The engine's max_model_len.")
flags.DEFINE_integer("holdout_every", 4, "Every n-th recorded step is held out of the fit.")
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_string("out", "out/step_profile.json", "Where to write the profile JSON.")
flags.DEFINE_enum(
    "fit_to",
    "step",
    ["step", "device"],
    "What a step's seconds are: 'step', the whole engine step (host + device, wall time); "
    "'device', the runner's run alone.",
)
flags.DEFINE_bool(
    "roofline", False, "Also measure this machine's read bandwidth and matmul FLOP/s."
)

FLAGS = flags.FLAGS


def record_steps(
    llm, batch_sizes, prompt_lens, max_tokens, seed, fit_to: str = "step"
) -> list[dict]:
    """Every non-compiling step of the workloads: {"features": {...}, "seconds": s (the whole
    step's or, fit_to='device', the run's), "device_seconds": s}."""
    import time

    from llmjax import SamplingParams
    from llmjax.sim import StepFeatures

    engine = llm.engine
    runner = engine.runner
    rows = []
    launch, collect, step_fn = runner.launch, runner.collect, engine.step
    current: list[dict] = []  # the row the step in progress recorded (none if it compiled)
    launched: list[tuple] = []  # (compiles before, clock, step input) of the step in flight

    def timed_launch(step, sampling, tag=None):
        launched.append((runner.num_compiles, engine.clock.now(), step))
        return launch(step, sampling, tag)

    def timed_collect(handle):
        out = collect(handle)
        compiles, t, step = launched.pop(0)
        seconds = engine.clock.now() - t
        if runner.num_compiles == compiles:
            features = StepFeatures.from_step(step)
            current.append({"features": features.__dict__, "device_seconds": seconds})
        return out

    def timed_step():
        current.clear()
        t = time.perf_counter()
        outs = step_fn()
        wall = time.perf_counter() - t
        for row in current:
            row["step_seconds"] = wall
            row["seconds"] = wall if fit_to == "step" else row["device_seconds"]
            rows.append(row)
        return outs

    runner.launch, runner.collect, engine.step = timed_launch, timed_collect, timed_step
    rng = np.random.default_rng(seed)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        for batch, length in itertools.product(batch_sizes, prompt_lens):
            for _ in range(2):  # the first pass compiles its shapes (those steps are dropped)
                prompts = rng.integers(min(100, vocab - 1), vocab, (batch, length)).tolist()
                llm.generate(prompts, params)
                llm.reset_prefix_cache()
    finally:
        runner.launch, runner.collect, engine.step = launch, collect, step_fn
    return rows


def measure_roofline(dtype: str, step_overhead_s: float) -> dict:
    """This machine's read bandwidth (a 256 MiB float32 sum) and matmul rate (1024^3 in
    `dtype`), best of a few runs, with the engine's measured host seconds per step (the median
    of step minus run) as the host overhead."""
    from llmjax.roofline import measure_matmul_flops, measure_read_bandwidth

    return {
        "read_bytes_per_s": measure_read_bandwidth(256 << 20),
        "matmul_flops": measure_matmul_flops(1024, dtype),
        "matmul_dtype": dtype,
        "step_overhead_s": max(0.0, float(step_overhead_s)),
    }


def main(argv):
    del argv
    from llmjax import LLM
    from llmjax.sim import LinearCostModel, StepFeatures
    from llmjax.sim.cost import FEATURES

    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    prompt_lens = [int(p) for p in FLAGS.prompt_lens]
    llm = LLM(
        FLAGS.model,
        load_format=FLAGS.load_format,
        dtype=FLAGS.dtype,
        quantization=FLAGS.quantization,
        max_model_len=FLAGS.max_model_len,
        max_num_seqs=FLAGS.max_num_seqs or max(batch_sizes),
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
    )
    rows = record_steps(llm, batch_sizes, prompt_lens, FLAGS.max_tokens, FLAGS.seed, FLAGS.fit_to)
    if len(rows) < 2 * len(FEATURES):
        raise app.UsageError(f"only {len(rows)} steps recorded: add workloads")
    feats = [StepFeatures(**r["features"]) for r in rows]
    secs = [r["seconds"] for r in rows]
    held = [i % FLAGS.holdout_every == FLAGS.holdout_every - 1 for i in range(len(rows))]
    train = [i for i, h in enumerate(held) if not h]
    test = [i for i, h in enumerate(held) if h]
    model = LinearCostModel.fit([feats[i] for i in train], [secs[i] for i in train])
    error = model.relative_error([feats[i] for i in test], [secs[i] for i in test])
    for r, f, h in zip(rows, feats, held, strict=True):
        r["predicted_seconds"] = model.step_seconds(f)
        r["held_out"] = h
    print(f"{len(rows)} steps ({len(test)} held out); fitted seconds per feature:")
    for name, c in zip(FEATURES, model.coefficients, strict=True):
        print(f"  {name:<18} {c:.3e}")
    print(f"held-out mean relative error: {100 * error:.1f} %")
    print(f"{'tokens':>7} {'decodes':>7} {'measured ms':>12} {'predicted ms':>12}  (held out)")
    for i in test[:12]:
        f, predicted = feats[i], rows[i]["predicted_seconds"]
        print(f"{f.tokens:7d} {f.decodes:7d} {1e3 * secs[i]:12.2f} {1e3 * predicted:12.2f}")
    import jax

    result = {
        "model": FLAGS.model,
        "dtype": FLAGS.dtype,
        "quantization": FLAGS.quantization,
        "device": jax.devices()[0].device_kind,
        "fit_to": FLAGS.fit_to,
        "features": list(FEATURES),
        "coefficients": list(model.coefficients),
        "held_out_relative_error": error,
        "steps": rows,
    }
    if FLAGS.roofline:
        host = float(np.median([r["step_seconds"] - r["device_seconds"] for r in rows]))
        result["roofline"] = measure_roofline(FLAGS.dtype, host)
        r = result["roofline"]
        print(
            f"roofline: read {r['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
            f"{r['matmul_flops'] / 1e9:.1f} GFLOP/s ({FLAGS.dtype})"
        )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

"""Synchronous against async scheduling (EngineConfig.async_scheduling), per decode step.

For each batch size B, B requests of --prompt_len random tokens generate --max_tokens tokens
each (ignore_eos) through `LLMEngine.step`, once with the synchronous loop and once with async
scheduling (the same weights; the two alternate for --rounds rounds after a warm-up round that
compiles). Over the steps where all B requests decode, it reports per step (medians):

  wall ms     one `LLMEngine.step` call
  waited ms   of that, the host blocked waiting for the device's tokens (`runner.collect`)
  host ms     wall - waited: the engine's own work (schedule, pack, dispatch, update, emit)
  device ms   the jitted step alone (the decode batch's inputs run again, each call waited for)
  tok/s       B / wall

and, for async, the share of the synchronous step's host time it hid:
(sync wall - async wall) / sync host. Measured, not simulated.

    python scripts/bench_async.py                                   # SmolLM2, B = 1, 16, 64
    python scripts/bench_async.py --batch_sizes 16 --dtype bfloat16 --json_out out/async.json
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
flags.DEFINE_string("dtype", "float32", "Weight/KV dtype.")
flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "Concurrent decoding requests.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per request.")
flags.DEFINE_integer("max_tokens", 64, "Tokens each request generates.")
flags.DEFINE_integer("rounds", 2, "Timed rounds per mode (after one warm-up round each).")
flags.DEFINE_string("json_out", "out/bench_async.json", "Where to write the results.")

FLAGS = flags.FLAGS

MODES = {"sync": False, "async": True}


def run_round(llm, batch: int, seed: int) -> dict:
    """One round of `batch` requests; the decode steps' per-step seconds (lists)."""
    import numpy as np

    from llmjax import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(seed)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(100, vocab, FLAGS.prompt_len).tolist(), params)
    waited = [0.0]
    collect = runner.collect
    captured = []
    launch = runner.launch

    def timed_collect(handle):
        t = time.perf_counter()
        out = collect(handle)
        waited[0] += time.perf_counter() - t
        return out

    def capturing_launch(step, sampling, tag=None):
        captured[:] = [step, sampling]
        return launch(step, sampling, tag)

    runner.collect, runner.launch = timed_collect, capturing_launch
    rows = {"wall": [], "waited": []}
    decode_inputs = None
    try:
        while engine.has_unfinished_requests():
            sched = engine.scheduler
            decoding = (
                not sched.waiting
                and len(sched.running) == batch
                and all(r.num_uncomputed_tokens <= 1 for r in sched.running)
            )
            waited[0] = 0.0
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            if decoding:
                rows["wall"].append(wall)
                rows["waited"].append(waited[0])
                decode_inputs = list(captured)
    finally:
        del runner.collect, runner.launch
    rows["inputs"] = decode_inputs
    return rows


def main(argv):
    del argv
    import jax
    import numpy as np

    from llmjax import LLM

    batches = [int(b) for b in FLAGS.batch_sizes]
    base = LLM(
        FLAGS.model,
        load_format=FLAGS.load_format,
        dtype=FLAGS.dtype,
        max_num_seqs=max(batches),
        max_model_len=FLAGS.prompt_len + FLAGS.max_tokens + 8,
        compilation_cache_dir="",
        async_scheduling=False,
    )
    llms = {"sync": base, "async": base.with_options(async_scheduling=True)}
    assert llms["async"].engine.async_scheduling and not base.engine.async_scheduling
    rows = []
    for batch in batches:
        samples = {m: {"wall": [], "waited": []} for m in MODES}
        inputs = {}
        for r in range(FLAGS.rounds + 1):  # round 0 warms up (compiles)
            for mode in MODES:
                got = run_round(llms[mode], batch, seed=1000 * batch + r)
                if r:
                    samples[mode]["wall"] += got["wall"]
                    samples[mode]["waited"] += got["waited"]
                    inputs[mode] = got["inputs"]
        device_ms = 1e3 * base.engine.runner.time_step(*inputs["sync"], repeats=20)
        for mode in MODES:
            wall = 1e3 * float(np.median(samples[mode]["wall"]))
            waited = 1e3 * float(np.median(samples[mode]["waited"]))
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "wall_ms": wall,
                    "waited_ms": waited,
                    "host_ms": wall - waited,
                    "device_ms": device_ms,
                    "tokens_per_s": 1e3 * batch / wall,
                    "steps": len(samples[mode]["wall"]),
                }
            )
        sync, asy = rows[-2], rows[-1]
        asy["speedup"] = sync["wall_ms"] / asy["wall_ms"]
        asy["host_hidden"] = (sync["wall_ms"] - asy["wall_ms"]) / max(sync["host_ms"], 1e-9)
    print(f"device: {jax.devices()[0].device_kind}, {FLAGS.model} {FLAGS.dtype}, measured")
    print(
        f"{'batch':>5} {'mode':>6} {'wall ms':>8} {'host ms':>8} {'waited ms':>9} "
        f"{'device ms':>9} {'tok/s':>8} {'vs sync':>7} {'host hidden':>11}"
    )
    for r in rows:
        extra = ""
        if r["mode"] == "async":
            extra = f"{r['speedup']:>7.2f} {100 * r['host_hidden']:>10.0f}%"
        print(
            f"{r['batch']:>5} {r['mode']:>6} {r['wall_ms']:>8.2f} {r['host_ms']:>8.2f} "
            f"{r['waited_ms']:>9.2f} {r['device_ms']:>9.2f} {r['tokens_per_s']:>8.1f} {extra}"
        )
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=2)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

r"""Simulate serving at scale: the engine's own schedulers, block manager and prefix cache on a
virtual clock, each step's time from a cost model of the chosen hardware (llmjax/sim/).

    # Mistral-7B on one A100: Sarathi-Serve vs prefill-first (vLLM) on ShareGPT-like lengths
    python scripts/simulate.py --qps 2 --num_requests 512
    # their capacity under a P99 TBT SLO of 100 ms (Sarathi-Serve's strict one for Mistral-7B)
    python scripts/simulate.py --capacity_search --tbt_slo 0.1 --num_requests 512
    # Falcon-180B at TP4 x PP2 on two nodes of 4 A100s, the pipeline's bubbles reported
    python scripts/simulate.py --model falcon-180b --hardware a100-80gb-pcie --tp 4 --pp 2 \
        --max_model_len 2048 --qps 0.5
    # Mooncake's conversation trace (12,031 requests, real arrivals) on 8 instances
    python scripts/simulate.py --workload trace \
        --trace ../shared/data/mooncake/conversation_trace.jsonl --num_instances 8 \
        --router least_outstanding --max_model_len 131072 --max_num_batched_tokens 8192 \
        --policies sarathi
    # this CPU, from a fitted profile of the real engine (scripts/profile_step.py)
    python scripts/simulate.py --model smollm2-135m-instruct --dtype float32 \
        --cost_model fitted --cost_profile out/step_profile.json --hardware out/step_profile.json

It is `scripts/benchmark.py` with a simulated device: the same flags (workloads, --policies,
--prefix_caches, --capacity_search, --plot_dir, --json_out, the engine flags), the same tables
and JSON, and these defaults changed: --device sim, --model mistral-7b-instruct-v0.2, --dtype
bfloat16, --scale 1 (the published ShareGPT / arXiv lengths, not 1/16), --max_model_len 8192,
--max_num_seqs 128 (Sarathi-Serve's), --warmup 0 and --norehearse (nothing compiles). Times in
the report are simulated seconds, except the "host ms/step" rows: the real scheduler's cost in
this process's wall time, as it would run on the hardware. Each run logs its simulation rate
(simulated steps per wall second and host ms per step) and writes it to the JSON ("simulation").
`--hardware` names a preset (llmjax.sim.hardware.HARDWARE, each with its sources) or a profile
JSON with a measured roofline; `--num_instances` > 1 puts that many engines behind `--router`
on one simulated timeline (llmjax.sim.SimCluster).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # scripts/benchmark.py: the flags, workloads, replay and report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(benchmark)  # --help lists benchmark.py's and the engine's flags
for name, value in {
    "device": "sim",
    "model": "mistral-7b-instruct-v0.2",
    "dtype": "bfloat16",
    "scale": 1.0,
    "max_model_len": 8192,
    "max_num_seqs": 128,
    "warmup": 0,
    "rehearse": False,
    "json_out": "out/simulate.json",
}.items():
    FLAGS.set_default(name, value)


def main(argv):
    if FLAGS.device != "sim":
        raise app.UsageError("scripts/simulate.py runs --device sim; use benchmark.py for jax")
    t = time.perf_counter()
    steps = _count_steps()
    benchmark.main(argv)
    wall = time.perf_counter() - t
    n = steps["n"]
    line = (
        f"simulation: {n} engine steps in {wall:.1f} s of wall time, {n / max(wall, 1e-9):.0f} "
        f"steps/s, {1e3 * steps['host_s'] / max(n, 1):.2f} host ms/step (schedule, pack, update)"
    )
    print(line, flush=True)
    if FLAGS.json_out and os.path.exists(FLAGS.json_out):
        import json

        with open(FLAGS.json_out) as f:
            doc = json.load(f)
        doc["simulation"] = {
            "engine_steps": n,
            "wall_s": wall,
            "steps_per_s": n / max(wall, 1e-9),
            "host_ms_per_step": 1e3 * steps["host_s"] / max(n, 1),
        }
        with open(FLAGS.json_out, "w") as f:
            json.dump(doc, f, indent=1)


def _count_steps() -> dict:
    """Count every simulated engine step of the run (warm-ups, trials and all) and its host
    seconds, by wrapping `EngineStats.record_step`."""
    from llmjax.engine.stats import EngineStats

    counts = {"n": 0, "host_s": 0.0}
    record = EngineStats.record_step

    def counted(self, batch, host_s, *args, **kwargs):
        counts["n"] += 1
        counts["host_s"] += host_s
        return record(self, batch, host_s, *args, **kwargs)

    EngineStats.record_step = counted
    return counts


if __name__ == "__main__":
    app.run(main)

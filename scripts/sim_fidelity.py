r"""How close the simulated device comes to the real engine: the same workload through
`scripts/benchmark.py` on this machine and through `scripts/simulate.py` with cost models of
this machine, for two policies and two loads; a table of simulated vs measured throughput, TTFT
and TBT (P50 and P99) with the relative errors (goal: 10 % on medians, 20 % on P99s).

    python scripts/sim_fidelity.py                        # SmolLM2 f32, ~15 min on 2 CPUs
    python scripts/sim_fidelity.py --qps 1,3 --num_requests 48

Steps: (1) scripts/profile_step.py --roofline profiles the real engine's steps (unless
--profile names an existing profile JSON); (2) benchmark.py measures each load (both policies,
warmed up and rehearsed so nothing compiles in the measured replay); (3) simulate.py replays the
same requests (same seed, lengths and arrival times, same KV pages) with the 'fitted' cost model
(the profile's least-squares fit of whole steps, padded bucket shapes among its features) and
with 'roofline' on this CPU as measured (--hardware the profile, --sim_padded). Run it on an
otherwise idle machine: every figure is one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
METRICS = (  # (label, summary path, tolerance)
    ("throughput tok/s", ("total_token_throughput",), 0.10),
    ("TTFT P50", ("ttft", "p50"), 0.10),
    ("TTFT P99", ("ttft", "p99"), 0.20),
    ("TBT P50", ("tbt", "p50"), 0.10),
    ("TBT P99", ("tbt", "p99"), 0.20),
)

flags.DEFINE_string("model", "smollm2-135m-instruct", "Model (as benchmark.py --model).")
flags.DEFINE_string("dtype", "float32", "Dtype of the real engine and of the simulated one.")
flags.DEFINE_list("policies", ["sarathi", "prefill_first"], "Policies to compare.")
flags.DEFINE_list("qps", ["2", "4"], "The loads (Poisson requests/s).")
flags.DEFINE_integer("num_requests", 64, "Requests per load.")
flags.DEFINE_string("workload", "sharegpt", "benchmark.py --workload (its default lengths).")
flags.DEFINE_integer("max_num_seqs", 64, "Max running requests.")
flags.DEFINE_string("profile", None, "An existing profile JSON (else one is made first).")
flags.DEFINE_list("cost_models", ["fitted", "roofline"], "Simulated cost models to compare.")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("json_out", "out/sim_fidelity.json", "Where to write the results.")
FLAGS = flags.FLAGS


def _run(script: str, *args: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        cmd = [sys.executable, os.path.join(SCRIPTS, script), *args, f"--json_out={out}"]
        if script == "profile_step.py":
            cmd[-1] = f"--out={out}"
        print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{script} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _get(summary: dict, path: tuple) -> float | None:
    for key in path:
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def main(argv):
    del argv
    common = [
        f"--model={FLAGS.model}",
        f"--dtype={FLAGS.dtype}",
        f"--policies={','.join(FLAGS.policies)}",
        f"--workload={FLAGS.workload}",
        f"--num_requests={FLAGS.num_requests}",
        f"--max_num_seqs={FLAGS.max_num_seqs}",
        f"--seed={FLAGS.seed}",
        "--tbt_slo=1.0",  # fixed, so no SLO reference step is measured (nor simulated)
    ]
    profile_path = FLAGS.profile
    if profile_path is None:
        profile = _run(
            "profile_step.py",
            f"--model={FLAGS.model}",
            f"--dtype={FLAGS.dtype}",
            "--batch_sizes=1,4,16,32",
            "--prompt_lens=16,64,256,1024",
            "--max_num_batched_tokens=2048",  # prefill_first's whole-prompt steps are large
            f"--max_num_seqs={FLAGS.max_num_seqs}",
            "--roofline",
        )
        os.makedirs("out", exist_ok=True)
        profile_path = "out/sim_fidelity_profile.json"
        with open(profile_path, "w") as f:
            json.dump(profile, f)
    rows, doc = [], {"profile": profile_path, "loads": {}}
    for qps in FLAGS.qps:
        real = _run("benchmark.py", *common, f"--qps={qps}")
        num_pages = next(iter(real["variants"].values()))["engine"]["num_pages"]
        sims = {
            cm: _run(
                "simulate.py",
                *common,
                f"--qps={qps}",
                f"--cost_model={cm}",
                f"--cost_profile={profile_path}",
                f"--hardware={profile_path}",
                f"--num_pages={num_pages}",
                "--sim_padded",  # roofline: llmjax's steps run at their padded bucket
                "--scale=0.0625",  # benchmark.py's default lengths
                f"--max_model_len={real['variants'][FLAGS.policies[0]]['engine']['max_model_len']}",
            )
            for cm in FLAGS.cost_models
        }
        doc["loads"][qps] = {"measured": real, "simulated": sims}
        for policy in FLAGS.policies:
            measured = real["variants"][policy]["summary"]
            for label, path, tol in METRICS:
                m = _get(measured, path)
                row = [qps, policy, label, _fmt(m, path)]
                for cm in FLAGS.cost_models:
                    s = _get(sims[cm]["variants"][policy]["summary"], path)
                    err = abs(s - m) / m if m and s is not None else None
                    ok = "" if err is None else (" ok" if err <= tol else " !")
                    row += [_fmt(s, path), "-" if err is None else f"{100 * err:.1f} %{ok}"]
                rows.append(row)
    from llmjax.bench.metrics import format_table

    header = ["qps", "policy", "metric", "measured"]
    for cm in FLAGS.cost_models:
        header += [f"sim {cm}", "error"]
    print(
        f"simulated vs measured, {FLAGS.model} {FLAGS.dtype} on this CPU, {FLAGS.workload} x "
        f"{FLAGS.num_requests} (ok: within 10 % on medians and throughput, 20 % on P99s)"
    )
    print(format_table(header, rows))
    doc["table"] = {"header": header, "rows": rows}
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.json_out}")


def _fmt(value, path) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if path[0].endswith("throughput") else f"{1e3 * value:.1f} ms"


if __name__ == "__main__":
    app.run(main)

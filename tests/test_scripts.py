"""The absl scripts run end to end (on tiny checkpoints, in subprocesses)."""

import json
import os
import subprocess
import sys

import numpy as np

from tests.conftest import TESTDATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(script, *args):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=ENV, cwd=ROOT)


def test_convert_checkpoint_then_serve_from_orbax(tmp_path):
    from llmjax import LLM, SamplingParams

    src = os.path.join(TESTDATA, "hf_tiny", "llama")
    out = str(tmp_path / "orbax")
    _run("convert_checkpoint.py", f"--model={src}", f"--out={out}")
    golden = np.load(os.path.join(src, "golden.npz"))
    prompt = golden["input_ids"][0][: golden["lengths"][0]].tolist()
    llm = LLM(out, compilation_cache_dir="")
    params = SamplingParams(max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    assert llm.generate([prompt], params)[0].token_ids == golden["greedy_ids"].tolist()


def test_generate_script_help_and_run():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--help"]
    help_text = subprocess.run(cmd, capture_output=True, text=True, env=ENV).stdout
    assert "--temperature" in help_text and "--max_tokens" in help_text
    assert "--profile_dir" in help_text and "--pallas_kernel" in help_text
    assert "--kernel_options" in help_text
    out = _run(
        "generate.py",
        "--model=smollm2-135m-instruct",
        "--load_format=dummy",
        "--chat",
        "--max_tokens=4",
        "--max_model_len=128",
        "--nostream",
    )
    assert out.stdout.startswith(">>> What is the capital of France?")
    assert "compiles=" in out.stderr


def test_bench_kernels_times_what_runs_here_and_says_what_it_skips(tmp_path):
    import json

    out = tmp_path / "k.json"
    _run(
        "bench_kernels.py",
        "--implementations=reference,model_reference,jax_gpu,flash_gpu,mgpu,flash_mgpu",
        "--batches=decode,mixed",
        "--num_kv_heads=2",
        "--num_queries_per_kv=2",
        "--head_dim=32",
        "--num_decodes=4",
        "--decode_kv_len=40",
        "--prefill_len=24",
        "--iters=1",
        "--peak_bandwidth_gbs=10",
        f"--json_out={out}",
    )
    doc = json.loads(out.read_text())
    assert {(r["batch"], r["implementation"]) for r in doc["rows"]} == {
        (b, i) for b in ("decode", "mixed") for i in ("reference", "model_reference")
    }
    for r in doc["rows"]:
        assert r["ms"] > 0 and r["GB/s"] > 0 and r["of_peak_bw"] == r["GB/s"] / 10
    assert "CUDA only" in doc["skipped"]["decode/jax_gpu"]
    assert "one prompt with no cache hit" in doc["skipped"]["mixed/flash_gpu"]
    assert "compiles only on gpu" in doc["skipped"]["decode/mgpu"]
    assert "one prompt with no cache hit" in doc["skipped"]["mixed/flash_mgpu"]


def test_eval_precision_reports_each_precision(tmp_path):
    out = tmp_path / "p.json"
    stdout = _run(
        "eval_precision.py",
        "--model=smollm2-tiny",
        "--load_format=dummy",
        "--window=48",
        "--num_windows=2",
        "--num_prompts=2",
        "--prompt_len=12",
        "--gen_len=6",
        "--precisions=f32=float32:none,int8=float32:int8,q4_1=float32:q4_1",
        f"--out={out}",
    ).stdout
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["f32", "int8", "q4_1"] and "| int8 | float32 | int8 |" in stdout
    assert rows["f32"]["greedy_agreement"] == 1.0  # the reference agrees with itself
    for r in rows.values():
        assert np.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert 0 <= r["greedy_agreement"] <= 1
    # Packed weights take less memory: int8 about 1/4 of f32, Q4_1 less still.
    assert rows["q4_1"]["weight_mb"] < rows["int8"]["weight_mb"] < rows["f32"]["weight_mb"] / 3


def test_profile_step_fits_the_simulators_cost_model(tmp_path):
    """scripts/profile_step.py on the tiny model: every recorded step's features and seconds,
    a fit with its held-out error, and a profile LinearCostModel.from_profile reads back."""
    from llmjax.sim import LinearCostModel, StepFeatures

    out = tmp_path / "profile.json"
    stdout = _run(
        "profile_step.py", "--model=tiny", "--load_format=dummy", "--batch_sizes=1,3",
        "--prompt_lens=8,40", "--max_tokens=6", "--max_model_len=128", f"--out={out}",
        "--roofline",
    ).stdout  # fmt: skip
    profile = json.loads(out.read_text())
    steps = profile["steps"]
    assert len(steps) >= 20 and "held-out mean relative error" in stdout
    assert any(s["held_out"] for s in steps) and not all(s["held_out"] for s in steps)
    assert all(s["seconds"] > 0 for s in steps)
    # the whole step (the default --fit_to) includes the run
    assert all(s["seconds"] == s["step_seconds"] >= s["device_seconds"] for s in steps)
    from llmjax.sim.hardware import cpu_from_profile

    cpu = cpu_from_profile(str(out))  # the measured roofline makes this CPU a Hardware
    assert cpu.memory_bandwidth > 1e8 and cpu.peak_flops > 1e8
    assert {s["features"]["decodes"] for s in steps} >= {1, 3}  # decode batches of each size
    assert any(s["features"]["prefill_attention"] > 0 for s in steps)
    model = LinearCostModel.from_profile(str(out))
    assert len(model.coefficients) == len(profile["features"])
    mean = np.mean([s["seconds"] for s in steps])
    for s in steps[:5]:
        assert 0 < model.step_seconds(StepFeatures(**s["features"])) < 20 * mean

"""The absl scripts run end to end (on tiny checkpoints, in subprocesses)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

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


def test_generate_script_help_and_run(smollm2_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--help"]
    help_text = subprocess.run(cmd, capture_output=True, text=True, env=ENV).stdout
    assert "--temperature" in help_text and "--max_tokens" in help_text
    assert "--profile_dir" in help_text and "--pallas_kernel" in help_text
    assert "--kernel_options" in help_text
    out = _run(  # SmolLM2's tokenizer and chat template on a random 2-layer body
        "generate.py",
        "--model=smollm2-tiny",
        f"--tokenizer={smollm2_path}",
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
        "--precisions=f32=float32:none,int8=float32:int8,w8a8=float32:w8a8,q4_1=float32:q4_1",
        f"--out={out}",
    ).stdout
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["f32", "int8", "w8a8", "q4_1"] and "| int8 | float32 | int8 |" in stdout
    assert (rows["int8"]["smoothquant"], rows["w8a8"]["smoothquant"]) == (None, 0.5)
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


def test_simulate_script_runs_benchmarks_tables_on_a_simulated_cluster(tmp_path):
    """scripts/simulate.py: benchmark.py's table and JSON on simulated time, with a Mooncake
    trace on 3 instances behind a router, and a pipeline with its modeled bubble."""
    out = tmp_path / "sim.json"
    trace = os.path.join(ROOT, "..", "shared", "data", "mooncake", "conversation_trace.jsonl")
    if not os.path.exists(trace):
        trace = str(tmp_path / "trace.jsonl")  # a few lines in Mooncake's format
        rows = [
            {"timestamp": 300 * i, "input_length": 600 + 10 * i, "output_length": 20 + i,
             "hash_ids": [0, 10 + i % 5]}
            for i in range(24)
        ]  # fmt: skip
        with open(trace, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    stdout = _run(
        "simulate.py", "--workload=trace", f"--trace={trace}", "--trace_requests=24",
        "--mooncake_block_tokens=64", "--num_instances=3", "--router=least_outstanding",
        "--policies=sarathi,prefill_first", "--max_model_len=4096", "--tbt_slo=0.2",
        "--goodput_search", "--slo_ttft=5", "--goodput_esp=2", f"--json_out={out}",
    ).stdout  # fmt: skip
    assert "TTFT P99 ms" in stdout and "simulation:" in stdout and "steps/s" in stdout
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "simulate.py"), "--help"]
    help_text = subprocess.run(cmd, capture_output=True, text=True, env=ENV).stdout
    assert "--num_instances" in help_text and "--hardware" in help_text and "--qps" in help_text
    doc = json.loads(out.read_text())
    assert doc["device"].startswith("simulated a100-80gb")
    assert doc["simulation"]["engine_steps"] > 0
    assert "goodput (>= 90% of requests" in stdout
    for v in doc["variants"].values():
        assert v["summary"]["num_finished"] == 24 and v["engine"]["num_instances"] == 3
        assert v["goodput"]["num_devices"] == 3 and v["goodput"]["trials"]
    # the same requests get the same greedy tokens under both policies (batch invariance)
    a, b = (v["output_token_ids"] for v in doc["variants"].values())
    assert a == b
    out2 = tmp_path / "pp.json"
    stdout = _run(
        "simulate.py", "--model=llama2-70b", "--tp=4", "--pp=2", "--num_requests=12",
        "--qps=1", "--max_model_len=2048", "--tbt_slo=0.5", "--policies=sarathi",
        f"--json_out={out2}",
    ).stdout  # fmt: skip
    assert "pipeline bubble (time)" in stdout
    stats = json.loads(out2.read_text())["variants"]["sarathi"]["engine_stats"]
    assert 0 < stats["pipeline_time_bubble_fraction"] < 1


def test_reproduce_sarathi_prints_ours_beside_the_paper(tmp_path):
    out = tmp_path / "rep.json"
    stdout = _run(
        "reproduce_sarathi.py", "--models=mistral-7b", "--datasets=arxiv", "--slos=relaxed",
        "--num_requests=24", "--capacity_max_iters=2", "--jobs=2", f"--json_out={out}",
        "--async_scheduling=off,on", "--kv_cache_dtypes=auto,fp8_e4m3",
    ).stdout  # fmt: skip
    assert "mistral-7b" in stdout and "2.6x" in stdout
    rows = json.loads(out.read_text())["capacity"]
    runs = [(r["async_scheduling"], r["kv_cache_dtype"]) for r in rows]
    assert runs == [("off", "auto"), ("off", "fp8_e4m3"), ("on", "auto"), ("on", "fp8_e4m3")]
    for row in rows:
        assert row["capacity_qps"]["sarathi"] > 0 and row["tbt_slo"] == 0.5
        assert len(row["trials"]["sarathi"]) == 2
    assert "fp8_e4m3" in stdout


def test_reproduce_sarathi_compares_the_hybrid_kv_layout(tmp_path):
    out = tmp_path / "rep.json"
    _run(
        "reproduce_sarathi.py", "--models=gemma3-27b", "--datasets=arxiv", "--slos=relaxed",
        "--num_requests=16", "--capacity_max_iters=2", "--jobs=2", f"--json_out={out}",
        "--hybrid_kv_cache=off,on",
    )  # fmt: skip
    rows = json.loads(out.read_text())["capacity"]
    assert [r["hybrid_kv_cache"] for r in rows] == ["off", "on"]
    assert all(r["capacity_qps"]["sarathi"] > 0 for r in rows)


def test_profile_serving_counts_real_and_padded_tokens_per_bucket(tmp_path):
    """scripts/profile_serving.py on the tiny model, two token-bucket settings in one process:
    every step accounted for (real tokens = prompts + decodes), padding only with the coarser
    buckets' larger steps, and the per-bucket rows' steps summing to the timed ones."""
    out = tmp_path / "profile.json"
    stdout = _run(
        "profile_serving.py", "--model=tiny", "--load_format=dummy", "--max_model_len=64",
        "--num_prompts=6", "--input_len=21", "--output_len=4", "--concurrency=3",
        "--max_num_batched_tokens=48", "--compare=pow2:token_buckets_per_octave=1",
        "--compare=fine:token_buckets_per_octave=4", f"--out={out}",
    ).stdout  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert "== pow2" in stdout and "== fine" in stdout
    for r in results.values():
        assert r["tokens_per_step"] * r["steps"] == 6 * (21 + 3)  # the last token is not computed
        assert r["padded_tokens_per_step"] >= r["tokens_per_step"]
        assert sum(b["steps"] for b in r["buckets"]) == r["steps"] - r["compiled_steps"]
        assert all(b["real_tokens"] <= b["bucket"] for b in r["buckets"])
    assert results["fine"]["padded_tokens_per_step"] < results["pow2"]["padded_tokens_per_step"]


def test_bench_decode_reports_the_step_and_the_jitted_step_alone(tmp_path):
    """scripts/bench_decode.py on the tiny model: a row per batch size with the engine's step
    time and the jitted step's alone (its inputs re-run, waited for), both positive."""
    out = tmp_path / "decode.json"
    stdout = _run(
        "bench_decode.py",
        "--model=tiny",
        "--load_format=dummy",
        "--dtypes=float32",
        "--batch_sizes=1,2",
        "--decode_steps=3",
        "--warmup_steps=1",
        "--max_model_len=64",
        "--bandwidth_mib=8",
        f"--json_out={out}",
    ).stdout
    assert "device ms" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["step_ms"] > 0 and r["device_ms"] > 0 and r["tokens_per_s"] > 0


def test_bench_async_compares_sync_and_async_steps(tmp_path):
    """scripts/bench_async.py on the tiny model: per batch size a synchronous and an async row
    of decode steps (wall = host + waited), and the async row's share of host time hidden."""
    out = tmp_path / "async.json"
    stdout = _run(
        "bench_async.py",
        "--model=tiny",
        "--load_format=dummy",
        "--batch_sizes=3",
        "--prompt_len=5",
        "--max_tokens=8",
        "--rounds=1",
        f"--json_out={out}",
    ).stdout
    assert "host hidden" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(3, "sync"), (3, "async")]
    for r in rows:
        assert r["steps"] > 0 and r["device_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["wall_ms"] == pytest.approx(r["host_ms"] + r["waited_ms"])
    assert all("host_hidden" in r for r in rows if r["mode"] == "async")


def test_bench_kv_cache_times_each_kv_dtype(tmp_path):
    """scripts/bench_kv_cache.py on the tiny model: a row per context and KV dtype, the KV bytes
    a step reads (head_dim + 4) / (4 head_dim) of float32's for a quantized cache; an entry
    with the CPU kernel's options."""
    import configs

    out = tmp_path / "kv.json"
    _run(
        "bench_kv_cache.py", "--model=tiny", "--load_format=dummy", "--contexts=32,64",
        "--kv_cache_dtypes=auto,int8,int8:int8_scores=false", "--repeats=1", "--rounds=2",
        "--batch=4",
        f"--json_out={out}",
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["kv_cache_dtype"]) for r in rows] == [
        (c, d) for c in (32, 64) for d in ("auto", "int8", "int8:int8_scores=false")
    ]
    assert {r["backend"] for r in rows[1::3] + rows[2::3]} == {"cpu"}  # the option's kernel
    H = configs.get_preset("tiny").head_dim
    for auto, *quantized in (rows[:3], rows[3:]):
        assert auto["step_ms"] > 0 and auto["speedup"] == 1.0
        for r in quantized:
            assert r["kv_mib_read"] * 4 * H == pytest.approx(auto["kv_mib_read"] * (H + 4))
            assert r["step_ms"] > 0


def test_eval_kv_cache_reports_quality_granularity_and_what_fits(tmp_path):
    """scripts/eval_kv_cache.py on the tiny model (random weights): the reference dtype agrees
    with itself, int8 is priced at (H + 4) / (4 H) of float32's bytes, the granularity rows and
    the what-fits table come out."""
    import configs

    out = tmp_path / "kv.json"
    _run(
        "eval_kv_cache.py", "--models=tiny", "--load_format=dummy", "--contexts=32",
        "--kv_cache_dtypes=auto,int8,int8:int8_scores=false", "--num_windows=1",
        "--num_prompts=1", "--gen_len=4", "--memory_models=llama2-7b", f"--out={out}",
    )  # fmt: skip
    result = json.loads(out.read_text())
    auto, int8, float_scores = result["rows"]
    assert auto["tf_agree"] == 1.0 and auto["free_agree"] == 1.0
    assert float_scores["kv_cache_dtype"] == "int8:int8_scores=false"
    for r in (int8, float_scores):
        assert 0 < r["tf_agree"] <= 1 and np.isfinite(r["perplexity"])
        assert r["kib_per_token"] == int8["kib_per_token"]
    H = configs.get_preset("tiny").head_dim
    assert int8["kib_per_token"] * 4 * H == pytest.approx(auto["kib_per_token"] * (H + 4))
    [grain] = result["granularity"]
    assert grain["kv_cache_dtype"] == "int8"
    assert 0 < grain["k_token_mean"] <= grain["k_token_max"] < 0.05
    fits = {r["kv_cache_dtype"]: r for r in result["memory"]["rows"]}
    assert fits["int8"]["pages"] > fits["auto"]["pages"]


def test_bench_lora_on_a_real_and_a_simulated_device(tmp_path):
    """scripts/bench_lora.py: the base row, then one row per adapter count, every request
    served (the script exits non-zero otherwise); on the real device the adapters are PEFT
    directories it writes (the tiny HF llama), on the simulated one a 7B's shapes."""
    real, simulated = tmp_path / "real.json", tmp_path / "sim.json"
    _run(
        "bench_lora.py", f"--model={os.path.join(TESTDATA, 'hf_tiny', 'llama')}",
        "--num_adapters=1,3", "--num_requests=6", "--prompt_len=8", "--output_len=3",
        "--rank=2", "--max_lora_rank=4", "--max_loras_cap=2", "--kernels=masked",
        f"--json_out={real}",
    )  # fmt: skip
    _run(
        "bench_lora.py", "--device=sim", "--model=llama2-7b", "--num_adapters=1,16",
        "--num_requests=16", "--prompt_len=64", "--output_len=8", "--kernels=masked,grouped",
        f"--json_out={simulated}",
    )  # fmt: skip
    rows = json.loads(real.read_text())["rows"]
    assert [(r["adapters"], r["max_loras"]) for r in rows] == [(0, 0), (1, 1), (3, 2)]
    assert rows[2]["slot_loads"] >= 1 and all(r["output_tokens_per_s"] > 0 for r in rows)
    sim = {
        (r["adapters"], r["kernel"]): r["vs_base"]
        for r in json.loads(simulated.read_text())["rows"]
    }
    assert sorted(sim) == [(0, "-"), (1, "grouped"), (1, "masked"), (16, "grouped"), (16, "masked")]
    assert sim[0, "-"] == 1 > sim[1, "masked"] > sim[16, "masked"]  # more slots cost more, masked
    assert sim[16, "grouped"] < 1

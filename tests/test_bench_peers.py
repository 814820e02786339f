"""scripts/bench_peers.py and llmjax/bench/peers.py: spec parsing, workload rates, agreement, and
the harness end to end on a tiny random llmjax model beside a *fake* vLLM.

The fake `vllm` package (written to a temporary directory put on PYTHONPATH) returns fixed token
ids and records what it was given: it tests the harness's plumbing (the worker's job / result
protocol, the arguments and environment a vLLM worker gets, the table and JSON), not vLLM."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llmjax.bench import peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_VLLM = """
import json, os, time
__version__ = "0.0-fake"
FIXED = 3  # every generated token


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, **kwargs):
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump({"kwargs": kwargs, "env": env}, f)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert sampling_params.temperature == 0.0 and sampling_params.ignore_eos
        time.sleep(0.002 * sampling_params.max_tokens)  # so that every rate is positive
        return [_Output([FIXED] * sampling_params.max_tokens) for p in prompts
                if isinstance(p["prompt_token_ids"], list)]
"""


def test_engine_spec_parsing():
    spec = peers.EngineSpec.parse("f32:dtype=float32,max_num_seqs=8,precompile=True", "llmjax")
    assert (spec.name, spec.engine) == ("f32", "llmjax")
    assert spec.kwargs == {"dtype": "float32", "max_num_seqs": 8, "precompile": True}
    opts = peers.EngineSpec.parse("k:kernel_options='a=1,b=2',quantization=int8,x=[1, 2]", "llmjax")
    assert opts.kwargs == {"kernel_options": "a=1,b=2", "quantization": "int8", "x": [1, 2]}
    assert peers.EngineSpec.parse("plain", "vllm").kwargs == {}
    assert peers.EngineSpec.parse("plain", "vllm").dtype == "float32"
    for bad in (":dtype=float32", "x:dtype", "x:=3"):
        with pytest.raises(ValueError):
            peers.EngineSpec.parse(bad, "llmjax")


def test_workloads_and_rates():
    ws = peers.build_workloads(num_requests=4, prompt_len=8, max_tokens=10, decode_batch_sizes=[2])
    assert [w.name for w in ws] == ["4x(8+10)", "decode b=2", "prefill 2048"]
    throughput, decode, prefill = ws
    assert throughput.rate({"full": 2.0}) == 4 * 10 / 2.0
    assert decode.phases == (("full", 2, 32, 128), ("first", 2, 32, 1))
    assert decode.rate({"full": 3.0, "first": 0.5}) == 2 * 127 / 2.5
    assert decode.rate({"full": 0.5, "first": 0.5}) is None
    assert prefill.rate({"full": 0.5}) == 4096
    with pytest.raises(ValueError, match="unknown workloads"):
        peers.build_workloads(["nope"])


def test_prompts_avoid_special_ids_and_repeat_per_seed():
    ids = peers.allowed_ids(50, [0, 1, 2, 49])
    a = peers.make_prompts(3, 100, ids, (0, 1, 0, 0))
    assert a == peers.make_prompts(3, 100, ids, (0, 1, 0, 0))
    assert a != peers.make_prompts(3, 100, ids, (0, 1, 0, 1))
    flat = np.array(a)
    assert flat.shape == (3, 100) and not np.isin(flat, [0, 1, 2, 49]).any()


def test_agreement():
    assert peers.agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == (1.0, 1.0)
    assert peers.agreement([[1, 2, 9, 4], [5, 6]], [[1, 2, 3, 4], [7, 6]]) == (4 / 6, 0.25)


def test_flops_and_params():
    model = dict(hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=2, vocab_size=10)  # fmt: skip
    per_layer = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8
    assert peers.matmul_params(model) == 2 * per_layer + 10 * 4
    assert peers.prefill_flops(model, 3) == 2 * peers.matmul_params(model) * 3 + 4 * 2 * 2 * 2 * 6


def test_harness_end_to_end(tmp_path):
    """A tiny llmjax config and a fake vLLM, every workload, two rounds, and the cold start."""
    import jax

    import configs
    from llmjax.checkpoint.hf import save_hf
    from llmjax.model.params import init_params

    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    hf_dir = tmp_path / "hf"
    save_hf(hf_dir, configs.TINY, init_params(configs.TINY, jax.random.key(0)))
    record, out = tmp_path / "vllm_record.json", tmp_path / "peers.json"
    env = dict(os.environ, FAKE_VLLM_RECORD=str(record))
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_peers.py"), "--model=tiny"]
    cmd += ["--llmjax=tiny:load_format='dummy',max_num_batched_tokens=64", "--vllm=fake:"]
    cmd += [f"--vllm_python={sys.executable}", f"--hf_dir={hf_dir}", "--vllm_preload="]
    cmd += ["--num_requests=3", "--prompt_len=8", "--max_tokens=6", "--decode_batch_sizes=1,2"]
    cmd += ["--decode_prompt_len=4", "--decode_max_tokens=5", "--prefill_len=40", "--rounds=2"]
    cmd += ["--warmup_rounds=1"]
    cmd += ["--max_model_len=128", "--bandwidth_mib=16", "--matmul_n=128", "--cold"]
    cmd += [f"--out={out}", f"--engine_log_dir={tmp_path / 'logs'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())

    # The fake vLLM got the harness's arguments and environment.
    given = json.loads(record.read_text())
    want = {"max_model_len": 128, "max_num_seqs": 32, "model": str(hf_dir), "dtype": "float32"}
    assert given["kwargs"] == want | {"seed": 0, "kv_cache_memory_bytes": 1 << 30}
    assert given["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert given["env"]["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    # its last launch was the cold start's, with caches of its own
    assert "vllm-cold-cache-" in given["env"]["VLLM_CACHE_ROOT"]
    assert result["engines"]["fake"]["info"]["version"] == "0.0-fake"
    # weight bytes: llmjax's counted on its device, vLLM's from the safetensors header
    nbytes = result["engines"]["tiny"]["info"]["weight_bytes"]
    assert nbytes == result["engines"]["fake"]["info"]["weight_bytes"] > 0

    roof = result["roofline"]
    assert roof["read_bandwidth_gb_s"] > 0 and roof["matmul_gflop_s"]["float32"] > 0
    rows = {(r["engine"], r["workload"]): r for r in result["rows"]}
    names = ["3x(8+6)", "decode b=1", "decode b=2", "prefill 40"]
    assert sorted(rows) == sorted((e, w) for e in ("tiny", "fake") for w in names)
    for (engine, workload), r in rows.items():
        assert len(r["rounds"]) == 2 and r["reference"] == "fake" and r["agree_with"] == "tiny"
        # A round's rate is None when its time difference is not positive (the tiny model's
        # decode rounds, timed on a busy machine, can be): the best is over the others.
        rates = [x["tok_s"] for x in r["rounds"] if x["tok_s"] is not None]
        assert rates or (engine == "tiny" and r["workload_kind"] == "decode")
        if not rates:
            assert r["tok_s"] is None and r["ratio"] is None
        else:
            assert r["tok_s"] == max(rates) > 0
            ref = rows[("fake", workload)]["tok_s"]
            assert r["ratio"] == pytest.approx(r["tok_s"] / ref)
        if r["workload_kind"] == "throughput":
            assert r["bound_tok_s"] is None
        elif rates:
            assert r["fraction_of_bound"] == pytest.approx(r["tok_s"] / r["bound_tok_s"])
        if r["workload_kind"] == "decode":
            batch = int(workload.split("=")[1])
            want = batch * roof["read_bandwidth_gb_s"] * 1e9 / nbytes
            assert r["bound_tok_s"] == pytest.approx(want)
        tokens = result["tokens"][engine][workload]
        reference = result["tokens"]["tiny"][workload]
        same, prefix = peers.agreement(tokens, reference)
        assert (r["token_agreement"], r["prefix_agreement"]) == (same, prefix)
        if engine == "tiny":
            assert same == prefix == 1.0
        else:
            assert all(t == [3] * len(t) for t in tokens)
            flat = np.concatenate(reference)
            assert same == pytest.approx(np.mean(flat == 3))
    # every request's tokens: 2 rounds of 3 requests, 6 each
    assert [len(t) for t in result["tokens"]["tiny"]["3x(8+6)"]] == [6] * 6

    # --cold: the first llmjax and the first vLLM config, each from its own launch
    tiny, fake = result["cold_starts"]
    assert (tiny["engine"], fake["engine"]) == ("tiny", "fake")
    for cold in (tiny, fake):
        assert cold["workload"] == "3x(8+6)" and cold["warm_process_workload_s"] > 0
        for label in ("empty_cache", "warm_cache"):
            c = cold[label]
            assert 0 < c["ready_s"] <= c["total_s"] and c["workload_s"] > 0
            if cold is tiny:
                assert c["ready_s"] < c["ttft_s"] <= c["total_s"]
            else:  # vLLM's offline API reports no first-token time
                assert c["ttft_s"] is None
    (ratio,) = result["cold_start_ratios"]
    assert (ratio["engine"], ratio["reference"]) == ("tiny", "fake")
    want = fake["empty_cache"]["total_s"] / tiny["empty_cache"]["total_s"]
    assert ratio["launch_to_end_speedup"] == pytest.approx(want)

    for line in ("read bandwidth", "tiny         3x(8+6)", "fake         prefill 40", "TTFT",
                 "cold, empty caches: tiny vs fake"):  # fmt: skip
        assert line in res.stdout, res.stdout


def test_worker_reports_errors(tmp_path):
    """A worker whose engine fails to load answers with the error, and the harness raises it
    with the log's tail."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class LLM:\n    def __init__(self, **kw):\n"
                                      "        raise RuntimeError('no such model')\n")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    spec = peers.EngineSpec.parse("broken:", "vllm")
    with pytest.raises(RuntimeError, match="no such model"):
        peers.EngineProcess(spec, {"model": "x"}, sys.executable, env, str(tmp_path))

"""scripts/bench_peers.py and llmjax/bench/peers.py: spec parsing, workload rates, agreement, and
the harness end to end on a tiny random llmjax model beside *fake* peers.

The fake `vllm`, `openvino_genai`, `ctranslate2` and `transformers` packages (written to a
temporary directory put on PYTHONPATH) return fixed token ids and record what they were given,
and fake `optimum-cli` / `ct2-transformers-converter` commands write marker exports: they test
the harness's plumbing (the worker's job / result protocol, the arguments, precisions and
environment each peer gets, the exports, the HF check, the table and JSON), not the peers."""

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


FAKE_OPENVINO = """
def get_version():
    return "0.0-fake"


class Tensor:
    def __init__(self, array):
        self.data = array
"""

FAKE_OPENVINO_GENAI = """
import json, os, time
__version__ = "0.0-fake"


class SchedulerConfig:
    def __init__(self):
        self.max_num_seqs, self.max_num_batched_tokens, self.cache_size = 256, 256, 0
        self.dynamic_split_fuse, self.enable_prefix_caching = True, True


class GenerationConfig:
    max_new_tokens, ignore_eos, do_sample = 0, False, True


class _Result:
    def __init__(self, rid, ids):
        self.m_request_id, self.m_generation_ids = rid, [ids]


class ContinuousBatchingPipeline:
    def __init__(self, path, scheduler, device, properties):
        with open(os.environ["FAKE_PEER_RECORD"] + ".openvino", "w") as f:
            json.dump({"path": path, "device": device, "properties": properties,
                       "max_num_seqs": scheduler.max_num_seqs,
                       "cache_size": scheduler.cache_size}, f)
        self.count = 0

    def generate(self, ids, configs):
        assert all(c.ignore_eos and not c.do_sample for c in configs)
        time.sleep(0.002 * configs[0].max_new_tokens)
        out = [_Result(self.count + i, [3] * c.max_new_tokens) for i, c in enumerate(configs)]
        self.count += len(configs)
        return out[::-1]  # out of order: the worker sorts by request id
"""

FAKE_CTRANSLATE2 = """
import json, os, time
__version__ = "0.0-fake"


class _Result:
    def __init__(self, ids):
        self.sequences_ids = [ids]


class Generator:
    def __init__(self, path, device, compute_type, intra_threads, inter_threads):
        self.compute_type = compute_type
        with open(os.environ["FAKE_PEER_RECORD"] + ".ct2", "w") as f:
            json.dump({"path": path, "compute_type": compute_type, "threads": intra_threads}, f)

    def generate_batch(self, tokens, max_length, min_length, include_prompt_in_result,
                       sampling_topk):
        assert min_length == max_length and sampling_topk == 1 and not include_prompt_in_result
        assert all(isinstance(t, str) for p in tokens for t in p)
        time.sleep(0.002 * max_length)
        return [_Result([3] * max_length) for _ in tokens]
"""

FAKE_TORCH = """
__version__ = "0.0-fake"
float32 = long = "dtype"


def set_num_threads(n):
    pass


class inference_mode:
    def __enter__(self):
        pass

    def __exit__(self, *a):
        pass


class _T:
    def __init__(self, rows):
        self.rows = rows

    def __getitem__(self, index):
        row, cols = index
        return _T(self.rows[row][cols])

    def tolist(self):
        return self.rows


def tensor(rows, dtype=None):
    return _T(rows)


def ones_like(t):
    return t
"""

FAKE_TRANSFORMERS = """
__version__ = "0.0-fake"
import torch


class _Model:
    def eval(self):
        return self

    def generate(self, ids, attention_mask, max_new_tokens, min_new_tokens, do_sample,
                 pad_token_id):
        assert min_new_tokens == max_new_tokens and not do_sample
        return torch._T([ids.rows[0] + [3] * max_new_tokens])


class AutoModelForCausalLM:
    @staticmethod
    def from_pretrained(path, dtype):
        return _Model()
"""

FAKE_CONVERTER = """#!/bin/sh
# the output directory is the last argument (optimum-cli) or follows --output_dir (ct2)
out=""; prev=""
for a in "$@"; do [ "$prev" = "--output_dir" ] && out="$a"; prev="$a"; last="$a"; done
[ -z "$out" ] && out="$last"
mkdir -p "$out" && echo "$@" > "$out/config.json"
seq 0 4095 | sed 's/.*/"t&"/' | paste -sd, | sed 's/^/[/; s/$/]/' > "$out/vocabulary.json"
"""


def fake_peers(tmp_path):
    """(PYTHONPATH dir, a Python whose bin/ holds the fake converters) for the fake peers."""
    fake = tmp_path / "fake"
    for name, text in (("vllm", FAKE_VLLM), ("openvino", FAKE_OPENVINO),
                       ("openvino_genai", FAKE_OPENVINO_GENAI), ("ctranslate2", FAKE_CTRANSLATE2),
                       ("torch", FAKE_TORCH), ("transformers", FAKE_TRANSFORMERS)):  # fmt: skip
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(text)
    bin_dir = tmp_path / "peer-venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", f'#!/bin/sh\nexec {sys.executable} "$@"\n'),
                       ("optimum-cli", FAKE_CONVERTER),
                       ("ct2-transformers-converter", FAKE_CONVERTER)):  # fmt: skip
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return fake, bin_dir / "python"


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


def test_peer_configurations_state_their_precision():
    """Each peer's worker kwargs set its precision explicitly; unknown keys are refused."""
    from llmjax.bench import peer_engines

    ov = peers.EngineSpec.parse("ov:dtype=bfloat16,weight_format=int8,max_num_seqs=4", "openvino")
    assert ov.precision == "bfloat16+int8"
    kw = peer_engines.worker_kwargs("openvino", ov.kwargs, model_dir="d", max_num_seqs=16,
                                    kv_cache_bytes=2 << 30, threads=2)  # fmt: skip
    assert kw["properties"] == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16",
                                "INFERENCE_NUM_THREADS": 2}  # fmt: skip
    assert kw["scheduler"] == {"max_num_seqs": 4, "cache_size": 2} and kw["model"] == "d"
    assert peer_engines.export_dir("openvino", ov.kwargs, "/x/hf/") == "/x/hf-openvino-int8"
    u8 = peer_engines.worker_kwargs("openvino", {"kv_cache_precision": "u8"}, model_dir="d",
                                    max_num_seqs=16, kv_cache_bytes=1 << 30, threads=1)  # fmt: skip
    assert u8["properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert u8["properties"]["KV_CACHE_PRECISION"] == "u8"
    for kwargs, want, label in (({}, "float32", "float32"),
                                ({"quantization": "int8"}, "int8_float32", "float32+int8"),
                                ({"dtype": "bfloat16", "quantization": "int8"}, "int8_bfloat16",
                                 "bfloat16+int8"),
                                ({"compute_type": "int8"}, "int8", "float32+int8")):  # fmt: skip
        assert peer_engines.ct2_compute_type(kwargs) == want
        assert peers.EngineSpec("c", "ct2", kwargs).precision == label
    assert peers.EngineSpec("l", "llmjax", {"quantization": "int8_wo"}).precision == "float32+int8"
    assert peers.EngineSpec("l", "llmjax", {"quantization": "w8a8"}).precision == "float32+int8"
    assert peers.EngineSpec("l", "llmjax", {"dtype": "bfloat16"}).precision == "bfloat16"
    for bad, kind in (("ov:precision=f32", "openvino"), ("c:threads=4", "ct2"), ("x:", "tgi")):
        with pytest.raises(ValueError):
            peers.EngineSpec.parse(bad, kind)
    with pytest.raises(ValueError, match="must be int8"):
        peer_engines.ct2_compute_type({"quantization": "int4"})


def test_server_commands():
    """llmjax's server gets the configuration as scripts/serve.py flags, vLLM's as `vllm serve`
    options, both with the serving workload's max_num_seqs."""
    from llmjax.bench import peer_serving

    opts = peers.Options(model="tiny", hf_dir="/h", pythons={"vllm": "/v/bin/python"},
                         max_model_len=512)  # fmt: skip
    work = peer_serving.ServingWorkload(max_num_seqs=8)
    spec = peers.EngineSpec.parse("a:dtype=bfloat16,precompile=True", "llmjax")
    cmd = peer_serving.server_command(spec, opts, work, 1234)
    assert cmd[1].endswith("scripts/serve.py") and "--port=1234" in cmd and "--model=tiny" in cmd
    assert {"--max_model_len=512", "--max_num_seqs=8", "--dtype=bfloat16",
            "--precompile=true"} <= set(cmd)  # fmt: skip
    spec = peers.EngineSpec.parse("v:dtype=bfloat16,enforce_eager=True", "vllm")
    cmd = peer_serving.server_command(spec, opts, work, 1234)
    assert cmd[:2] == ["/v/bin/python", "-c"] and cmd[3:5] == ["serve", "/h"]
    assert {"--max-num-seqs=8", "--dtype=bfloat16", "--enforce-eager",
            f"--kv-cache-memory-bytes={1 << 30}"} <= set(cmd)  # fmt: skip
    with pytest.raises(ValueError, match="no OpenAI server"):
        peer_serving.server_command(peers.EngineSpec("o", "openvino", {}), opts, work, 1)


def test_a_server_that_fails_is_recorded(tmp_path):
    """A server that dies at start is a row saying so; the run goes on (nothing is lost)."""
    from llmjax.bench import peer_serving

    opts = peers.Options(model="tiny", hf_dir="/h", pythons={"vllm": "/bin/false"},
                         log_dir=str(tmp_path))  # fmt: skip
    spec = peers.EngineSpec.parse("v:dtype=float32", "vllm")
    out = peer_serving.run_serving([spec], opts, peer_serving.ServingWorkload(), 100)
    assert len(out) == 1 and out[0]["engine"] == "v" and "server exited (1)" in out[0]["error"]
    assert out[0]["output_throughput"] is None and out[0]["ratio"] is None
    assert "failed: v: the server exited" in peer_serving.format_serving(out)


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
    """A tiny llmjax config beside fake vLLM, OpenVINO GenAI and CTranslate2 engines, checked
    against a fake HF, every workload, two rounds, the cold start, and llmjax's server."""
    import jax

    import configs
    from llmjax.checkpoint.hf import save_hf
    from llmjax.model.params import init_params

    fake, peer_python = fake_peers(tmp_path)
    hf_dir = tmp_path / "hf"
    save_hf(hf_dir, configs.TINY, init_params(configs.TINY, jax.random.key(0)))
    record, out = tmp_path / "vllm_record.json", tmp_path / "peers.json"
    env = dict(os.environ, FAKE_VLLM_RECORD=str(record), FAKE_PEER_RECORD=str(record))
    env["PYTHONPATH"] = os.pathsep.join([str(fake), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_peers.py"), "--model=tiny"]
    cmd += ["--llmjax=tiny:load_format='dummy',max_num_batched_tokens=64", "--vllm=fake:"]
    cmd += [f"--vllm_python={sys.executable}", f"--hf_dir={hf_dir}", "--vllm_preload="]
    cmd += ["--num_requests=3", "--prompt_len=8", "--max_tokens=6", "--decode_batch_sizes=1,2"]
    cmd += ["--decode_prompt_len=4", "--decode_max_tokens=5", "--prefill_len=40", "--rounds=2"]
    cmd += [
        "--warmup_rounds=1",
        "--openvino=ov:dtype=bfloat16,weight_format=int8",
        "--ct2=c2:quantization=int8",
        f"--openvino_python={peer_python}",
        f"--ct2_python={peer_python}",
        "--check=2,5,3",
        "--check_prompts=random",  # the tiny model's HF directory has no tokenizer
        "--threads=3",
    ]
    cmd += [
        "--serving",
        "--serving_engines=tiny",
        "--serving_num_prompts=3",
        "--serving_input_len=6",
        "--serving_output_len=4",
        "--serving_max_concurrency=2",
        "--serving_max_num_seqs=2",
        "--serving_clients=bench_serving",
        "--serving_warmup=0",
    ]
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
    # OpenVINO and CTranslate2: their own exports of the HF directory, precisions explicit
    ov = json.loads((tmp_path / "vllm_record.json.openvino").read_text())
    assert ov["path"] == f"{hf_dir}-openvino-int8" and ov["device"] == "CPU"
    assert ov["properties"] == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16",
                                "INFERENCE_NUM_THREADS": 3}  # fmt: skip
    assert (ov["max_num_seqs"], ov["cache_size"]) == (32, 1)
    assert "--weight-format int8" in (tmp_path / "hf-openvino-int8" / "config.json").read_text()
    ct2 = json.loads((tmp_path / "vllm_record.json.ct2").read_text())
    assert ct2 == {"path": f"{hf_dir}-ct2", "compute_type": "int8_float32", "threads": 3}
    assert result["engines"]["ov"]["precision"] == "bfloat16+int8"
    # the HF check: the fake HF's ids (all 3) against each engine's on the same prompts
    check = result["hf_check"]
    assert sorted(check) == ["c2", "fake", "ov", "tiny"]
    for name in ("c2", "fake", "ov"):
        assert (
            check[name]["token_agreement"] == 1.0 and check[name]["first_difference"] == [None] * 2
        )
    assert check["tiny"]["hf"]["version"] == "0.0-fake"
    # weight bytes: llmjax's counted on its device, vLLM's from the safetensors header
    nbytes = result["engines"]["tiny"]["info"]["weight_bytes"]
    assert nbytes == result["engines"]["fake"]["info"]["weight_bytes"] > 0
    assert result["engines"]["c2"]["info"]["weight_bytes"] == nbytes // 4  # int8: a byte each

    roof = result["roofline"]
    assert roof["read_bandwidth_gb_s"] > 0 and roof["matmul_gflop_s"]["float32"] > 0
    rows = {(r["engine"], r["workload"]): r for r in result["rows"]}
    names = ["3x(8+6)", "decode b=1", "decode b=2", "prefill 40"]
    engines = ("tiny", "fake", "ov", "c2")
    assert sorted(rows) == sorted((e, w) for e in engines for w in names)
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
        elif rates and r["bound_tok_s"]:
            assert r["fraction_of_bound"] == pytest.approx(r["tok_s"] / r["bound_tok_s"])
        else:  # no rate, or no weight bytes to bound it by (the fake OpenVINO IR)
            assert r["fraction_of_bound"] is None
        weight_bytes = result["engines"][engine]["info"]["weight_bytes"]
        if r["workload_kind"] == "decode" and weight_bytes:  # the fake OpenVINO IR has none
            batch = int(workload.split("=")[1])
            want = batch * roof["read_bandwidth_gb_s"] * 1e9 / weight_bytes
            assert r["bound_tok_s"] == pytest.approx(want)
        # first: the process's first run (the warm-up round), steady: the best recorded one
        assert r["first_tok_s"] is None or r["first_tok_s"] > 0
        if r["first_tok_s"] and r["steady_tok_s"]:
            assert r["steady_tok_s"] == r["tok_s"]
            assert r["first_vs_steady"] == pytest.approx(r["first_tok_s"] / r["steady_tok_s"])
        # vs peer: llmjax (float32) against the fastest float32 peer: only the fake vLLM (named
        # even where the tiny model's decode rounds had no rate, its ratio then None)
        if engine == "tiny":
            assert r["peer"] == "fake"
            if r["tok_s"]:
                assert r["peer_ratio"] == pytest.approx(r["ratio"])
            else:
                assert r["peer_ratio"] is None
        else:
            assert r["peer"] is None and r["peer_ratio"] is None
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

    # --serving: llmjax's own server (scripts/serve.py) under scripts/bench_serving.py
    (serve,) = result["serving"]
    assert (serve["engine"], serve["client"], serve["completed"]) == ("tiny", "bench_serving.py", 3)
    assert serve["output_throughput"] > 0 and serve["summary"]["total_output_tokens"] == 12
    assert serve["summary"]["server_num_steps"] > 0  # the server's own step metrics came along

    expected = (
        "read bandwidth", "tiny         float32       3x(8+6)", "c2           float32+int8",
        "fake         float32       prefill 40", "TTFT", "greedy ids against HF",
        "cold, empty caches: tiny vs fake", "through each engine's OpenAI server",
        "agree prefix load s",
    )  # fmt: skip
    for line in expected:
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


def test_text_prompts_are_distinct_windows_of_the_bundled_text(tmp_path):
    """--check_prompts=text: n windows of `length` tokens at distinct offsets of alice.txt,
    tokenized by the HF directory's tokenizer.json, the same for the same seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from llmjax.data.texts import public_domain_text

    text = public_domain_text("alice")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=2000, special_tokens=["[UNK]"])
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(text).ids
    got = peers.text_prompts(6, 40, str(tmp_path), (0, "x"))
    assert got == peers.text_prompts(6, 40, str(tmp_path), (0, "x"))
    assert got != peers.text_prompts(6, 40, str(tmp_path), (1, "x"))
    starts = set()
    for p in got:
        assert len(p) == 40
        start = next(i for i in range(0, len(ids), 40) if ids[i : i + 40] == p)
        starts.add(start)
    assert len(starts) == 6
    with pytest.raises(ValueError, match="windows of"):
        peers.text_prompts(len(ids), 40, str(tmp_path), (0, "x"))


def test_check_only_without_an_hf_python_is_a_usage_error():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "bench_peers.py"), "--workloads=",
         "--check_only", "--llmjax=f32:dtype=float32", "--hf_python="],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode != 0 and "--check_only needs HF transformers' Python" in res.stderr

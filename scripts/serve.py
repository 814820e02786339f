r"""Serve a model over an OpenAI-compatible HTTP API (llmjax/serve/; needs the `serve` extra).

    python scripts/serve.py                                  # SmolLM2 on http://127.0.0.1:8000
    python scripts/serve.py --port 8001 --api_key secret --max_num_queued 256
    python scripts/serve.py --metrics_prefix vllm            # vLLM's dashboards read /metrics
    python scripts/serve.py --config.scheduler.policy=prefill_first --precompile
    python scripts/serve.py --num_instances 2 --router least_outstanding   # 2 engines, 1 router
    python scripts/serve.py --instances prefill:tp=2,decode:tp=2     # DistServe-style (4 devices)

Then, from another shell:

    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "smollm2-135m-instruct", "stream": true,
             "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

The engine is loaded and warmed up (--warmup: one short request compiles the prefill and decode
steps it needs; --precompile compiles every step shape) before the server accepts connections;
its address is logged. The engine flags are every script's (llmjax/engine_flags.py).
`--num_instances` / `--instances` serve several engine instances behind one router
(llmjax/cluster/: the local launcher puts instance k on the next tp * pp devices; `--launcher ray`
on Ray actors); the endpoints and /metrics are the same, the metrics summed over instances.
One engine also serves semantic-variable programs (POST /v1/programs, llmjax/program/; Parrot's
scheduling between steps, docs/programs.md); a cluster answers that endpoint 501.
"""

from __future__ import annotations

import logging as std_logging
import time

from absl import app, flags, logging

from llmjax import engine_flags

engine_flags.define_flags()
engine_flags.define_cluster_flags()
flags.adopt_module_key_flags(engine_flags)  # listed by --help, not only --helpfull
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string(
    "served_model_name", None, "The model name clients send and /v1/models lists (default --model)."
)
flags.DEFINE_string(
    "api_key", None, "If set, /v1/* requests need the header 'Authorization: Bearer <key>'."
)
flags.DEFINE_integer(
    "max_num_queued",
    None,
    "At most this many requests wait for the engine; more are answered 503 with Retry-After "
    "(default: no bound).",
)
flags.DEFINE_string(
    "metrics_prefix",
    "llmjax:",
    "Prefix of the Prometheus metric names on /metrics ('vllm' gives vllm:..., what vLLM's "
    "dashboards read).",
)
flags.DEFINE_float(
    "program_idle_s",
    600.0,
    "A semantic-variable program session kept open (POST /v1/programs with keep_session) "
    "closes after this many seconds without a request (docs/programs.md).",
)
flags.DEFINE_multi_string(
    "lora_modules",
    [],
    "LoRA adapters to serve, as vLLM's --lora-modules: name=path (a PEFT directory), one per "
    "flag; the request's `model` names one (needs --enable_lora).",
)
flags.DEFINE_bool(
    "enable_lora_runtime_updates",
    False,
    "Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
)
flags.DEFINE_bool(
    "enable_weight_updates",
    False,
    "Allow POST /pause, /resume, /sleep, /wake_up and /update_weights_from_disk (a trainer "
    "driving the engine for RL rollouts; vLLM's dev-mode and SGLang's routes; docs/rl.md).",
)
flags.DEFINE_bool(
    "warmup", True, "Run one short request before serving, so the first client does not compile."
)
flags.DEFINE_enum(
    "log_level", "info", ["debug", "info", "warning", "error"], "Server (uvicorn) log level."
)

FLAGS = flags.FLAGS


def main(argv):
    del argv
    std_logging.basicConfig(level=std_logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from llmjax import LLM, SamplingParams
    from llmjax.serve import serve

    t = time.perf_counter()
    try:
        specs = engine_flags.instance_specs(FLAGS)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if specs is None:
        llm = LLM(FLAGS.model, **engine_flags.llm_kwargs(FLAGS))
    else:
        llm = _cluster(specs)
    bos = (llm.config.model if specs is not None else llm.model_config).bos_token_id or 1
    print(f"[serve] loaded {FLAGS.model} in {time.perf_counter() - t:.1f} s", flush=True)
    if FLAGS.warmup:
        t = time.perf_counter()
        prompt = [bos] * 8
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.reset_prefix_cache()
        (llm if specs is not None else llm.engine).reset_stats()
        print(f"[serve] warmed up in {time.perf_counter() - t:.1f} s", flush=True)
    print(f"[serve] starting the server on http://{FLAGS.host}:{FLAGS.port}", flush=True)
    serve(
        llm,
        host=FLAGS.host,
        port=FLAGS.port,
        log_level=FLAGS.log_level,
        served_model_name=FLAGS.served_model_name,
        api_key=FLAGS.api_key,
        max_num_queued=FLAGS.max_num_queued,
        metrics_prefix=FLAGS.metrics_prefix,
        program_idle_s=FLAGS.program_idle_s,
        lora_modules=_lora_modules(FLAGS.lora_modules),
        enable_lora_runtime_updates=FLAGS.enable_lora_runtime_updates,
        enable_weight_updates=FLAGS.enable_weight_updates,
    )


def _lora_modules(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise app.UsageError(f"--lora_modules wants name=path, got {item!r}")
        out.append((name, path))
    return out


def _cluster(specs):
    from llmjax.cluster import launch

    kwargs = engine_flags.llm_kwargs(FLAGS)
    for fixed in ("tp", "pp"):  # per instance
        kwargs.pop(fixed)
    cluster = launch(FLAGS.model, specs, **engine_flags.launch_kwargs(FLAGS), **kwargs)
    for d in cluster.describe():
        print(
            f"[serve] instance {d['index']}: {d['role']} tp={d['tp']} pp={d['pp']} "
            f"on {d['devices']}",
            flush=True,
        )
    return cluster


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main)

"""One engine in its own process, for scripts/bench_peers.py: llmjax or vLLM, run the same way.

    python llmjax/peer_worker.py --job job.json --result_fd 5  (llmjax.bench.peers)

This file imports only the standard library at the top, and then the one engine its job names
(`vllm` or `llmjax`), so it runs under another virtualenv's Python (vLLM's) as a plain script.
Both engines are loaded once and timed by the same code here, through their offline APIs
(`LLM(...)`, `generate(token id prompts, greedy, ignore_eos)`).

Protocol: the job file holds {"engine": "llmjax" | "vllm", "kwargs": {...}} (the engine's
`LLM(**kwargs)`). After loading, the worker writes one JSON line to `result_fd`:
    {"event": "ready", "load_s": ..., "t_start": ..., "info": {...}}
then reads one JSON command per line on stdin and answers each with one JSON line:
    {"cmd": "run", "prompts": [[ids]], "max_tokens": m}  -> {"event": "result", "seconds": s,
        "t_begin": ..., "t_end": ..., "first_token_time": ... | null, "token_ids": [[ids]]}
    {"cmd": "exit"}                                       -> the worker exits.
An error answers {"event": "error", "error": "..."} and the worker exits. Times are
`time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux: comparable across processes).
The engine's own log goes to stdout/stderr, which the harness sends to a file.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # before any engine import: cold-start figures count from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

# Run as a script, this file's folder (llmjax/bench) heads sys.path; its module names must not
# shadow anything the engines import.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


class VllmEngine:
    """vllm.LLM over an HF directory; greedy decoding of token-id prompts."""

    def __init__(self, kwargs: dict):
        import vllm

        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)

    def info(self) -> dict:
        info = {"engine": "vllm", "version": getattr(self._vllm, "__version__", None)}
        try:  # the settings that decide its speed, as vLLM resolved them
            config = self.llm.llm_engine.vllm_config
            sched, cache = config.scheduler_config, config.cache_config
            info |= {
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "enable_prefix_caching": cache.enable_prefix_caching,
                "block_size": cache.block_size,
                "dtype": str(config.model_config.dtype),
                "max_model_len": config.model_config.max_model_len,
            }
        except AttributeError:
            pass
        return info

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], None]:
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs], None


class LlmjaxEngine:
    """llmjax.LLM; greedy decoding of token-id prompts."""

    def __init__(self, kwargs: dict):
        import llmjax

        self._llmjax = llmjax
        self.llm = llmjax.LLM(**kwargs)

    def info(self) -> dict:
        import jax

        config = self.llm.config
        params = self.llm.engine.runner.params
        tok = self.llm.tokenizer
        model = config.model
        special = set(tok.special_ids) if tok is not None else set()
        special |= {i for i in (model.bos_token_id, *model.eos_token_ids) if i is not None}
        return {
            "engine": "llmjax",
            "dtype": config.dtype,
            "weight_bytes": sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(params)),
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_model_len": config.max_model_len,
            "prefix_cache": config.cache.prefix_cache,
            "attention_backend": self.llm.engine.runner.attention_backend,
            "device": jax.devices()[0].device_kind,
            "vocab_size": model.vocab_size,
            "special_ids": sorted(special),
            "model": {
                "hidden_size": model.hidden_size,
                "intermediate_size": model.intermediate_size,
                "num_layers": model.num_layers,
                "num_heads": model.num_heads,
                "num_kv_heads": model.num_kv_heads,
                "head_dim": model.head_dim,
                "vocab_size": model.vocab_size,
                "tie_word_embeddings": model.tie_word_embeddings,
            },
        }

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        params = self._llmjax.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate(prompts, params)
        first = min(o.metrics.first_token_time for o in outputs)
        return [list(o.token_ids) for o in outputs], first


ENGINES = {"vllm": VllmEngine, "llmjax": LlmjaxEngine}


def serve(job: dict, results, commands) -> None:
    """Load the job's engine, then answer `commands` (JSON lines) on `results` until exit."""

    def send(obj: dict) -> None:
        results.write(json.dumps(obj) + "\n")
        results.flush()

    try:
        engine = ENGINES[job["engine"]](job["kwargs"])
        send({"event": "ready", "load_s": time.perf_counter() - T_START, "t_start": T_START,
              "info": engine.info()})  # fmt: skip
        for line in commands:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                return
            if cmd["cmd"] != "run":
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            t_begin = time.perf_counter()
            token_ids, first = engine.run(cmd["prompts"], int(cmd["max_tokens"]))
            t_end = time.perf_counter()
            send({"event": "result", "seconds": t_end - t_begin, "t_begin": t_begin,
                  "t_end": t_end, "first_token_time": first, "token_ids": token_ids})  # fmt: skip
    except Exception as e:
        traceback.print_exc()
        send({"event": "error", "error": f"{type(e).__name__}: {e}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", required=True, help="JSON file: engine and LLM kwargs")
    parser.add_argument("--result_fd", type=int, required=True, help="where answers go")
    args = parser.parse_args()
    with open(args.job) as f:
        job = json.load(f)
    with os.fdopen(args.result_fd, "w") as results:
        serve(job, results, sys.stdin)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn
    main()

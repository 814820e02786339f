"""One engine in its own process, for scripts/bench_peers.py: llmjax, vLLM, OpenVINO GenAI,
CTranslate2 or HF transformers (the reference), run the same way.

    python llmjax/peer_worker.py --job job.json --result_fd 5  (llmjax.bench.peers)

This file imports only the standard library at the top, and then the one engine its job names
(a key of ENGINES), so it runs under another virtualenv's Python (vLLM's, OpenVINO's, ...) as a
plain script. Every engine is loaded once and timed by the same code here, through its offline
API (token-id prompts, greedy, ignore_eos).

Protocol: the job file holds {"engine": name, "kwargs": {...}} (for llmjax and vLLM the
`LLM(**kwargs)`; the others' classes below say theirs). After loading, the worker writes one
JSON line to `result_fd`:
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


class OpenVinoEngine:
    """OpenVINO GenAI's ContinuousBatchingPipeline (continuous batching over paged attention) on
    an `optimum-cli export openvino` directory. kwargs: {"model": dir, "scheduler":
    {SchedulerConfig field: value}, "properties": {CPU plugin property: value}}."""

    def __init__(self, kwargs: dict):
        import openvino_genai

        self._genai = openvino_genai
        scheduler = openvino_genai.SchedulerConfig()
        for key, value in kwargs.get("scheduler", {}).items():
            if not hasattr(scheduler, key):
                raise ValueError(f"SchedulerConfig has no field {key!r}")
            setattr(scheduler, key, value)
        self.scheduler = scheduler
        self.properties = dict(kwargs.get("properties", {}))
        self.pipe = openvino_genai.ContinuousBatchingPipeline(
            kwargs["model"], scheduler, "CPU", self.properties
        )

    def info(self) -> dict:
        import openvino

        s = self.scheduler
        return {
            "engine": "openvino",
            "version": openvino_genai_version(self._genai),
            "runtime": openvino.get_version(),
            "properties": self.properties,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "dynamic_split_fuse": s.dynamic_split_fuse,
            "enable_prefix_caching": s.enable_prefix_caching,
            "cache_size_gb": s.cache_size,
        }

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], None]:
        import numpy as np
        import openvino

        config = self._genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = max_tokens, True, False
        ids = [openvino.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
        results = self.pipe.generate(ids, [config] * len(prompts))
        # results come in request order; m_request_id counts up over the pipeline's life
        results = sorted(results, key=lambda r: r.m_request_id)
        return [list(r.m_generation_ids[0]) for r in results], None


def openvino_genai_version(genai) -> str | None:
    return getattr(genai, "__version__", None) or getattr(genai, "get_version", lambda: None)()


class Ct2Engine:
    """CTranslate2's Generator (static batching: the whole batch prefills, then decodes to the
    end) on a `ct2-transformers-converter` directory. kwargs: {"model": dir, "compute_type": ...,
    "intra_threads": n, "inter_threads": 1}."""

    def __init__(self, kwargs: dict):
        import ctranslate2

        self._ct2 = ctranslate2
        self.kwargs = dict(kwargs)
        model = self.kwargs.pop("model")
        with open(os.path.join(model, "vocabulary.json")) as f:
            self.vocab = json.load(f)  # id -> token string: the Generator takes strings
        self.generator = ctranslate2.Generator(model, device="cpu", **self.kwargs)

    def info(self) -> dict:
        return {"engine": "ct2", "version": self._ct2.__version__, **self.kwargs,
                "compute_type_resolved": self.generator.compute_type}  # fmt: skip

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], None]:
        results = self.generator.generate_batch(
            [[self.vocab[i] for i in p] for p in prompts],
            max_length=max_tokens, min_length=max_tokens,  # min = max: EOS cannot end one early
            include_prompt_in_result=False, sampling_topk=1,
        )  # fmt: skip
        return [list(r.sequences_ids[0]) for r in results], None


class HfEngine:
    """HF transformers' `generate` in float32 (the reference the other engines' greedy ids are
    checked against, not timed). kwargs: {"model": hf_dir, "num_threads": n}."""

    def __init__(self, kwargs: dict):
        import torch
        import transformers

        self._torch, self._transformers = torch, transformers
        torch.set_num_threads(int(kwargs.get("num_threads", os.cpu_count() or 1)))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            kwargs["model"], dtype=torch.float32
        ).eval()

    def info(self) -> dict:
        return {"engine": "hf", "version": self._transformers.__version__,
                "torch": self._torch.__version__, "dtype": "float32"}  # fmt: skip

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], None]:
        torch = self._torch
        out = []
        with torch.inference_mode():
            for p in prompts:  # one at a time: no padding to change the numerics
                ids = torch.tensor([p], dtype=torch.long)
                gen = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                )  # fmt: skip
                out.append(gen[0, len(p) :].tolist())
        return out, None


ENGINES = {
    "vllm": VllmEngine,
    "llmjax": LlmjaxEngine,
    "openvino": OpenVinoEngine,
    "ct2": Ct2Engine,
    "hf": HfEngine,
}


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

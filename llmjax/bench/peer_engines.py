"""What each peer engine of scripts/bench_peers.py is given: its worker's kwargs from a
configuration's key/values, its precision stated explicitly, and the model directory it reads
(exported once from the shared HF directory with the engine's own converter, then reused).

A configuration's keys, per engine (values are Python literals; unknown keys are an error, so a
row is what its name says):

  llmjax    any `llmjax.LLM` keyword (dtype, quantization, max_num_batched_tokens, ...).
  vllm      any `vllm.LLM` keyword (dtype, ...): vLLM checks them itself.
  openvino  dtype (float32 | bfloat16: INFERENCE_PRECISION_HINT f32 | bf16), weight_format
            (fp32 | int8 | int4 | ...: `optimum-cli export openvino --weight-format`),
            kv_cache_precision (default: the compute precision; the CPU plugin's own default
            is u8), max_num_seqs, max_num_batched_tokens, dynamic_split_fuse.
  ct2       dtype (float32 | bfloat16), quantization (int8: CTranslate2's int8 weights and
            dynamically quantized activations, compute_type int8_<dtype>), or compute_type
            given outright.

Every engine gets the harness's max_num_seqs (where it has one), its KV budget and
`Options.threads` threads.
"""

from __future__ import annotations

import os
import shutil
import subprocess

PRECISION_HINT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
OPENVINO_KEYS = {"dtype", "weight_format", "kv_cache_precision", "max_num_seqs",
                 "max_num_batched_tokens", "dynamic_split_fuse"}  # fmt: skip
CT2_KEYS = {"dtype", "quantization", "compute_type"}
# the engines a configuration can name, and the one that is only a reference (never timed)
PEER_KINDS = ("llmjax", "vllm", "openvino", "ct2")
REFERENCE_KIND = "hf"


def precision(kind: str, kwargs: dict) -> str:
    """A configuration's precision label, to pair engines at the same precision:
    '<dtype>' or '<dtype>+int8' (any int8 weight form)."""
    dtype = str(kwargs.get("dtype", "float32"))
    if kind == "openvino":
        int8 = str(kwargs.get("weight_format", "fp32")) == "int8"
    elif kind == "ct2":
        int8 = ct2_compute_type(kwargs, strict=False).startswith("int8")
    else:  # llmjax's int8 / w8a8 / int8_wo, vLLM's quantization methods with int8 in their name
        quant = str(kwargs.get("quantization", ""))
        int8 = "int8" in quant or quant == "w8a8"
    return f"{dtype}+int8" if int8 else dtype


def check_keys(kind: str, name: str, kwargs: dict) -> None:
    allowed = {"openvino": OPENVINO_KEYS, "ct2": CT2_KEYS}.get(kind)
    unknown = sorted(set(kwargs) - allowed) if allowed is not None else []
    if unknown:
        raise ValueError(f"{name}: {kind} configurations take {sorted(allowed)}, not {unknown}")


def ct2_compute_type(kwargs: dict, strict: bool = True) -> str:
    if "compute_type" in kwargs:
        return str(kwargs["compute_type"])
    dtype = str(kwargs.get("dtype", "float32"))
    if strict and dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"ct2: dtype {dtype!r} must be float32, bfloat16 or float16")
    quant = kwargs.get("quantization")
    if quant in (None, "none"):
        return dtype
    if quant != "int8" and strict:
        raise ValueError(f"ct2: quantization {quant!r} must be int8 (or give compute_type)")
    return f"int8_{dtype}"


def export_dir(kind: str, kwargs: dict, hf_dir: str) -> str:
    """Where an engine's export of `hf_dir` lives (beside it; made by `ensure_export`)."""
    base = os.path.normpath(hf_dir)
    if kind == "openvino":
        return f"{base}-openvino-{kwargs.get('weight_format', 'fp32')}"
    if kind == "ct2":  # one float32 conversion: compute_type quantizes at load
        return f"{base}-ct2"
    raise ValueError(f"{kind} reads the HF directory itself")


def ensure_export(kind: str, kwargs: dict, hf_dir: str, python: str, log) -> str:
    """Convert `hf_dir` with the engine's own tool from its virtualenv (`python`'s bin/) unless
    the export exists; written to a temporary directory, then renamed (no half exports)."""
    out = export_dir(kind, kwargs, hf_dir)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    bin_dir = os.path.dirname(python)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "openvino":
        cmd = [os.path.join(bin_dir, "optimum-cli"), "export", "openvino", "--model", hf_dir,
               "--task", "text-generation-with-past",
               "--weight-format", str(kwargs.get("weight_format", "fp32")), tmp]  # fmt: skip
    else:
        cmd = [os.path.join(bin_dir, "ct2-transformers-converter"), "--model", hf_dir,
               "--output_dir", tmp, "--quantization", "float32"]  # fmt: skip
    log(f"exporting {hf_dir} for {kind}: {' '.join(cmd)}")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def worker_kwargs(kind: str, kwargs: dict, *, model_dir: str, max_num_seqs: int,
                  kv_cache_bytes: int, threads: int) -> dict:  # fmt: skip
    """The worker job's kwargs for an OpenVINO, CTranslate2 or HF engine."""
    if kind == "openvino":
        dtype = str(kwargs.get("dtype", "float32"))
        if dtype not in PRECISION_HINT:
            raise ValueError(f"openvino: dtype {dtype!r} must be one of {sorted(PRECISION_HINT)}")
        hint = PRECISION_HINT[dtype]
        scheduler = {"max_num_seqs": int(kwargs.get("max_num_seqs", max_num_seqs)),
                     "cache_size": max(1, round(kv_cache_bytes / 2**30))}  # fmt: skip
        for key in ("max_num_batched_tokens", "dynamic_split_fuse"):
            if key in kwargs:
                scheduler[key] = kwargs[key]
        properties = {
            "INFERENCE_PRECISION_HINT": hint,
            "KV_CACHE_PRECISION": str(kwargs.get("kv_cache_precision", hint)),
            "INFERENCE_NUM_THREADS": threads,
        }
        return {"model": model_dir, "scheduler": scheduler, "properties": properties}
    if kind == "ct2":
        return {"model": model_dir, "compute_type": ct2_compute_type(kwargs),
                "intra_threads": threads, "inter_threads": 1}  # fmt: skip
    if kind == REFERENCE_KIND:
        return {"model": model_dir, "num_threads": threads}
    raise ValueError(f"unknown engine {kind!r}")

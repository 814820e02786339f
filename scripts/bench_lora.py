r"""Throughput with many LoRA adapters in one batch, against the base model alone (the curve
Punica and S-LoRA plot).

    python scripts/bench_lora.py                                   # SmolLM2 on this CPU
    python scripts/bench_lora.py --device sim --model llama2-7b --hardware a100-80gb \
        --max_lora_rank 16 --prompt_len 512 --output_len 128      # simulated: a 7B on an A100

--num_requests requests (--prompt_len random tokens, --output_len greedy tokens each, all
submitted at once, ignore_eos) are served by the base model, then, for each --num_adapters n, by
an engine with n distinct adapters, request i under adapter i mod n, once per --kernels entry
(LoRAConfig.kernel: every slot's columns masked, or tokens grouped by adapter); each adapter
engine has min(n, --max_loras_cap) device slots (LLM(enable_lora=True, max_loras=...)). On a
real device the adapters are random PEFT directories written to a temporary folder (rank --rank
on every projection, A and B ~ N(0, 0.02^2)), read from disk on first use; on the simulated
device (`--device sim`, llmjax/sim/) no weights exist and the roofline charges the slots' shrink
and expand on every projection and each slot load over the host link. Per row: output tokens/s
and its ratio to the base model's (measured in the same run), the engine steps, the slot loads;
table to stdout, JSON to --json_out. A result on the simulated device says so.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_enum("device", "jax", ["jax", "sim"], "A real device, or the simulated one.")
flags.DEFINE_string("hardware", "a100-80gb", "The simulated device's hardware preset.")
flags.DEFINE_string("dtype", None, "Model dtype (default: float32 real, bfloat16 simulated).")
flags.DEFINE_list("num_adapters", ["1", "4", "16", "64"], "Distinct adapters in the batch.")
flags.DEFINE_integer("num_requests", 64, "Requests, all submitted at once.")
flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per request (random ids).")
flags.DEFINE_integer("output_len", 64, "Greedy tokens per request.")
flags.DEFINE_integer("rank", 8, "The adapters' rank.")
flags.DEFINE_integer("max_lora_rank", 8, "The device slots' rank (>= --rank).")
flags.DEFINE_integer("max_loras_cap", 64, "Device slots: min(adapters, this).")
flags.DEFINE_list(
    "kernels", ["masked", "grouped"], "LoRAConfig.kernel of the adapter engines (each a row)."
)
flags.DEFINE_integer("max_num_seqs", 64, "Requests running at once.")
flags.DEFINE_integer("seed", 0, "Seed of the prompts and the adapters' weights.")
flags.DEFINE_string("json_out", "out/bench_lora.json", "Where to write the results.")


def write_adapters(config, n: int, rank: int, root: str, seed: int) -> list[str]:
    """n random PEFT adapter directories (every projection, rank `rank`) under `root`."""
    from safetensors.numpy import save_file

    from llmjax.config import LORA_TARGETS, lora_projection_dims

    dims = lora_projection_dims(config)
    rng = np.random.default_rng(seed)
    paths = []
    for a in range(n):
        tensors = {}
        for layer in range(config.num_layers):
            for target, name in LORA_TARGETS.items():
                n_in, n_out = dims[name]
                part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{target}"
                tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(
                    np.float32
                )
                tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(
                    np.float32
                )
        path = os.path.join(root, f"adapter{a}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank,
                           target_modules=list(LORA_TARGETS)), f)  # fmt: skip
        paths.append(path)
    return paths


def run(llm, prompts, loras) -> dict:
    from llmjax import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=FLAGS.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), lora_request=loras and loras[:2])
    engine.reset_stats()
    writes = getattr(engine.runner, "num_lora_writes", 0)
    clock = engine.clock
    t0 = clock.now()
    outs = llm.generate(prompts, params, lora_request=loras)
    seconds = clock.now() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(
        seconds=seconds,
        output_tokens_per_s=tokens / seconds,
        steps=engine.stats.num_steps,
        slot_loads=getattr(engine.runner, "num_lora_writes", 0) - writes,
        errors=sum(o.error is not None for o in outs),
    )


def main(argv):
    del argv
    from llmjax import LLM, LoRARequest
    from llmjax.bench.metrics import format_table

    sim = FLAGS.device == "sim"
    common = dict(
        max_num_seqs=FLAGS.max_num_seqs,
        max_model_len=FLAGS.prompt_len + FLAGS.output_len + 8,
        dtype=FLAGS.dtype,
    )
    if sim:
        from llmjax.sim import SimConfig

        common |= dict(device="sim", sim=SimConfig(hardware=FLAGS.hardware))
    else:
        common |= dict(compilation_cache_dir="")
    t = time.perf_counter()
    base = LLM(FLAGS.model, **common)
    config = base.model_config
    rng = np.random.default_rng(FLAGS.seed)
    prompts = [rng.integers(10, config.vocab_size - 10, FLAGS.prompt_len).tolist()
               for _ in range(FLAGS.num_requests)]  # fmt: skip
    counts = [int(n) for n in FLAGS.num_adapters]
    rows = [dict(adapters=0, max_loras=0, kernel="-", **run(base, prompts, None))]
    print(f"base: {rows[0]['output_tokens_per_s']:.1f} tok/s ({time.perf_counter() - t:.0f} s)")
    with tempfile.TemporaryDirectory(prefix="llmjax-lora-") as root:
        paths = [f"/simulated/adapter{a}" for a in range(max(counts))]
        if not sim:
            paths = write_adapters(config, max(counts), FLAGS.rank, root, FLAGS.seed)
        for n in counts:
            slots = min(n, FLAGS.max_loras_cap)
            adapters = [LoRARequest(f"adapter{a}", a + 1, paths[a]) for a in range(n)]
            loras = [adapters[i % n] for i in range(FLAGS.num_requests)]
            for kernel in FLAGS.kernels:
                llm = base.with_options(
                    enable_lora=True, max_loras=slots, max_cpu_loras=n,
                    max_lora_rank=FLAGS.max_lora_rank, overrides={"lora.kernel": kernel},
                )  # fmt: skip
                row = dict(adapters=n, max_loras=slots, kernel=kernel, **run(llm, prompts, loras))
                rows.append(row)
                print(f"{n} adapters, {kernel}: {row['output_tokens_per_s']:.1f} tok/s", flush=True)
                del llm
    for r in rows:
        r["vs_base"] = r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    where = f"simulated {FLAGS.hardware}" if sim else "this machine"
    print(f"\n{config.name or FLAGS.model} on {where}: {FLAGS.num_requests} requests of "
          f"{FLAGS.prompt_len} + {FLAGS.output_len} tokens, adapters of rank {FLAGS.rank} on "
          f"every projection (slots of rank {FLAGS.max_lora_rank})")  # fmt: skip
    header = ["adapters", "max_loras", "kernel", "output tok/s", "vs base", "steps", "slot loads"]
    table = [
        ["base" if r["adapters"] == 0 else r["adapters"], r["max_loras"] or "-", r["kernel"],
         f"{r['output_tokens_per_s']:.1f}", f"{r['vs_base']:.3f}", r["steps"], r["slot_loads"]]
        for r in rows
    ]  # fmt: skip
    print(format_table(header, table))
    if any(r["errors"] for r in rows):
        raise SystemExit(f"requests failed: {[r['errors'] for r in rows]}")
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(model=FLAGS.model, device=FLAGS.device, hardware=FLAGS.hardware if sim
                           else None, rank=FLAGS.rank, rows=rows), f, indent=1)  # fmt: skip
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

r"""Generate text with llmjax (SmolLM2-135M-Instruct by default).

    python scripts/generate.py --chat --prompt "What is the capital of France?"
    python scripts/generate.py --prompt "Once upon a time" --temperature 0.8 --top_p 0.95 --seed 1
    python scripts/generate.py --model /path/to/hf_dir --dtype bfloat16 --nostream
    # tensor parallel over 2 devices (on a CPU, fake ones:
    # XLA_FLAGS=--xla_force_host_platform_device_count=2); SmolLM2's 3 kv heads need --pad_heads
    python scripts/generate.py --chat --tp 2 --pad_heads
    # the same over two processes, one per shell (docs/parallelism.md):
    python scripts/generate.py --chat --tp 2 --pad_heads --coordinator_address 127.0.0.1:1234 \
        --num_processes 2 --process_id 0      # and --process_id 1

    # any EngineConfig field by dotted path (llmjax/engine_flags.py; --help lists them):
    python scripts/generate.py --config.scheduler.policy=prefill_first --config.cache.watermark=0.02

The answer is streamed token by token unless --nostream; a line of timings follows on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

from absl import app, flags, logging

from llmjax import engine_flags

engine_flags.define_flags()
flags.adopt_module_key_flags(engine_flags)  # listed by --help, not only --helpfull
flags.DEFINE_string("prompt", "What is the capital of France?", "The prompt text.")
flags.DEFINE_bool("chat", False, "Wrap the prompt as a user message in the model's chat template.")
flags.DEFINE_string("system", None, "Optional system message (with --chat).")
flags.DEFINE_integer("max_tokens", 64, "Maximum number of new tokens.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 decodes greedily.")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("seed", None, "Sampling seed (same seed, same text).")
flags.DEFINE_bool("ignore_eos", False, "Keep generating past the end-of-sequence token.")
flags.DEFINE_bool("stream", True, "Print tokens as they are generated.")
flags.DEFINE_string(
    "profile_dir",
    None,
    "Write a profile of the generation here (LLM.profile: device and host timelines, one "
    "llmjax_step range per engine step; open with XProf/TensorBoard or, from trace.json.gz, "
    "Perfetto). A 2-token run of the prompt compiles first, outside the profile.",
)

FLAGS = flags.FLAGS


def main(argv):
    del argv
    engine_flags.initialize(FLAGS)  # jax.distributed, for a multi-process run
    from llmjax import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, **engine_flags.llm_kwargs(FLAGS))
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        max_tokens=FLAGS.max_tokens,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        seed=FLAGS.seed,
        ignore_eos=FLAGS.ignore_eos,
    )
    prompt = FLAGS.prompt
    if FLAGS.chat:
        messages = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
        messages.append({"role": "user", "content": prompt})
        prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    # Every process runs the same requests (lockstep); process 0 prints.
    show = print if engine_flags.is_leader(FLAGS) else (lambda *a, **k: None)
    show(f">>> {FLAGS.prompt}", flush=True)
    profiling = contextlib.nullcontext()
    if FLAGS.profile_dir:  # compile first (a short run), so the profile shows serving
        llm.generate([prompt], dataclasses.replace(params, max_tokens=min(2, params.max_tokens)))
        llm.reset_prefix_cache()  # else the profiled run's prefill is a cache hit: a new shape
        profiling = llm.profile(FLAGS.profile_dir, create_perfetto_trace=True)
    t1 = time.perf_counter()
    with profiling:
        if FLAGS.stream:
            for piece in llm.stream(prompt, params):
                show(piece, end="", flush=True)
            show()
        else:
            out = llm.generate([prompt], params)[0]
            show(out.text)
    gen_s = time.perf_counter() - t1
    show(
        f"[llmjax] load {load_s:.1f} s, generation {gen_s:.1f} s (first run includes compilation; "
        f"steps={llm.engine.stats.num_steps}, compiles={llm.engine.num_compiles})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    app.run(main)

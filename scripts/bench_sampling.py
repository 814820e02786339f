r"""What the request features cost a decode step: logits processing, logprobs and structured
outputs against plain greedy decoding, at batch 1 and 16, in one run.

    python scripts/bench_sampling.py                           # SmolLM2, float32, batch 1 and 16
    python scripts/bench_sampling.py --batch_sizes 1,8,32 --json_out out/sampling.json

For each variant and batch size, `batch` requests decode together (prompts of --prompt_len
tokens, --decode_steps timed steps after --warmup_steps untimed ones, which compile); the table
gives the median step time, decode tokens/s and the ratio to plain greedy at the same batch.
Variants: greedy (the fast path: argmax inside the step), temperature (temperature 1, no
top-k / top-p: what a client that sends no temperature gets), sampling (temperature 1, top-p 0.9:
the separate sampler program), penalties (repetition 1.1, frequency 0.5: the processed
sampler with the prompt and output history), logprobs (top 5 of the raw log-softmax),
json (a JSON-schema grammar through llguidance: the host fills the token bitmask while the
device runs the forward) and regex.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_string("dtype", "float32", "Weights and KV dtype.")
flags.DEFINE_list("batch_sizes", ["1", "16"], "Concurrent decoding requests.")
flags.DEFINE_list(
    "variants",
    ["greedy", "temperature", "sampling", "penalties", "logprobs", "json", "regex"],
    "Variants.",
)
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per request.")
flags.DEFINE_integer("decode_steps", 48, "Timed decode steps.")
flags.DEFINE_integer("warmup_steps", 4, "Untimed decode steps (compilation happens here).")
flags.DEFINE_string("json_out", "out/bench_sampling.json", "Where to write the results.")
FLAGS = flags.FLAGS

# Grammars that keep going for the whole run (a long array of short strings; lowercase words).
LONG_JSON = {
    "type": "array",
    "items": {"type": "string", "maxLength": 12},
    "minItems": 200,
    "maxItems": 400,
}
LONG_REGEX = r"(?:[a-z]{1,8} ){100,400}"


def params_of(variant: str, max_tokens: int):
    from llmjax import SamplingParams
    from llmjax.sampling_params import StructuredOutputsParams as SO

    kw = dict(max_tokens=max_tokens, ignore_eos=True)
    extra = {
        "greedy": {},
        "temperature": dict(temperature=1.0, seed=0),
        "sampling": dict(temperature=1.0, top_p=0.9, seed=0),
        "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.5),
        "logprobs": dict(logprobs=5),
        "json": dict(structured_outputs=SO(json=LONG_JSON, disable_any_whitespace=True)),
        "regex": dict(structured_outputs=SO(regex=LONG_REGEX)),
    }[variant]
    return SamplingParams(**kw, **extra)


def time_decode(llm, variant: str, batch: int) -> dict:
    engine = llm.engine
    tok = llm.get_tokenizer()
    total = FLAGS.warmup_steps + FLAGS.decode_steps + 2
    params = params_of(variant, total)
    rng = np.random.default_rng(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
    ]
    for _ in range(batch):
        text = " ".join(rng.choice(words, FLAGS.prompt_len))
        engine.add_request(tok.encode(text)[: FLAGS.prompt_len], params)
    while engine.scheduler.waiting or any(
        r.num_uncomputed_tokens > 1 for r in engine.scheduler.running
    ):
        engine.step()
    times = []
    for i in range(FLAGS.warmup_steps + FLAGS.decode_steps):
        t = time.perf_counter()
        engine.step()
        if i >= FLAGS.warmup_steps:
            times.append(time.perf_counter() - t)
    live = len(engine.scheduler.running)
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    step_s = float(np.median(times))
    return {"step_ms": 1e3 * step_s, "tokens_per_s": batch / step_s, "running_at_end": live}


def main(argv):
    del argv
    from llmjax import LLM

    base = LLM(FLAGS.model, dtype=FLAGS.dtype, max_model_len=1024, compilation_cache_dir="")
    rows = []
    for batch in map(int, FLAGS.batch_sizes):
        greedy = None
        for variant in FLAGS.variants:
            llm = base.with_options(max_num_seqs=max(batch, 1))
            r = time_decode(llm, variant, batch)
            if variant == "greedy":
                greedy = r
            ratio = r["tokens_per_s"] / greedy["tokens_per_s"] if greedy else float("nan")
            rows.append({"variant": variant, "batch": batch, **r, "vs_greedy": ratio})
    print(
        f"{FLAGS.model} ({FLAGS.dtype}): decode step per variant (medians of {FLAGS.decode_steps})"
    )
    print(f"{'variant':>10} {'batch':>5} {'step ms':>8} {'tok/s':>8} {'vs greedy':>9}")
    for r in rows:
        print(
            f"{r['variant']:>10} {r['batch']:>5} {r['step_ms']:>8.2f} {r['tokens_per_s']:>8.1f} "
            f"{r['vs_greedy']:>9.2f}"
        )
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump({"model": FLAGS.model, "dtype": FLAGS.dtype, "rows": rows}, f, indent=2)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

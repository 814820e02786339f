r"""Speculative decoding against plain decoding, on a repetitive workload and on free chat, at
batch 1 and 8, in one run (issue 24).

    python scripts/bench_speculative.py                       # SmolLM2, float32, ngram k=4
    python scripts/bench_speculative.py --batch_sizes 1 --num_speculative_tokens 6 \
        --json_out out/spec.json

Workloads (greedy, chat-templated, `--max_tokens` each):
  repetitive  code editing (rename a variable in a function, give the whole code back) and
              document QA that quotes its document (repeat a paragraph, quote a sentence).
  free_chat   open questions whose answers do not copy the prompt.
For each workload and batch size the requests run `batch` at a time, plain, then with
speculation (`--method`, `--num_speculative_tokens`, `--prompt_lookup_min/max`,
`--num_draft_layers`) verifying every proposal ('all', adaptive=False) and choosing them by the
measured step cost ('adaptive', the default), on the same weights; each variant runs once
untimed (measuring step costs; every step shape is compiled before, `--precompile`) and then
`--repeats` times timed, with the prefix cache emptied before each run. The table gives decode
tokens/s (tokens generated after every request of the batch had its first one, over the time
that took; the median over repeats), the speedup, the acceptance rate and mean accepted length,
the tokens per decode step and whether the greedy outputs are identical. Measured on the
machine it runs on: this script does no simulation.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_string("dtype", "float32", "Weights and KV dtype.")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Requests decoding together.")
flags.DEFINE_list("workloads", ["repetitive", "free_chat"], "Workloads.")
flags.DEFINE_enum("method", "ngram", ["ngram", "draft"], "Speculative method.")
flags.DEFINE_integer("num_draft_layers", 4, "draft: the early exit's layers.")
flags.DEFINE_integer("num_speculative_tokens", 4, "Proposals per decode (k).")
flags.DEFINE_integer("prompt_lookup_min", 2, "ngram: shortest suffix looked up.")
flags.DEFINE_integer("prompt_lookup_max", 4, "ngram: longest suffix looked up.")
flags.DEFINE_integer("max_tokens", 128, "Tokens generated per request.")
flags.DEFINE_integer("num_requests", 8, "Requests per workload (a multiple of each batch).")
flags.DEFINE_integer("repeats", 2, "Timed runs per variant (the median is reported).")
flags.DEFINE_bool("precompile", True, "Compile every step shape before timing.")
flags.DEFINE_string("json_out", "out/bench_speculative.json", "Where to write the results.")
FLAGS = flags.FLAGS

FUNCTIONS = [
    (
        "total",
        "result",
        "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\n\ndef mean(values):\n    total = add_all(values)\n"
        "    return total / len(values)\n",
    ),
    (
        "items",
        "entries",
        "def count_words(text):\n    items = {}\n    for word in text.split():\n"
        "        items[word] = items.get(word, 0) + 1\n    return items\n\n\n"
        "def top_word(text):\n    items = count_words(text)\n"
        "    return max(items, key=items.get)\n",
    ),
    (
        "name",
        "label",
        "class Greeter:\n    def __init__(self, name):\n        self.name = name\n\n"
        "    def hello(self):\n        return 'Hello, ' + self.name + '!'\n\n"
        "    def bye(self):\n        return 'Goodbye, ' + self.name + '.'\n",
    ),
    (
        "size",
        "length",
        "def chunks(values, size):\n    out = []\n    for i in range(0, len(values), size):\n"
        "        out.append(values[i : i + size])\n    return out\n\n\n"
        "def pad(values, size):\n    return values + [0] * (size - len(values) % size)\n",
    ),
]
DOCUMENTS = [
    "The city council met on Tuesday to review the budget. Funding for roads was raised by ten "
    "percent, funding for parks was cut by five percent, and funding for libraries stayed the "
    "same. The council will meet again next month to discuss the budget for schools.",
    "The river flows from the mountains in the north to the sea in the south. In spring the "
    "snow melts and the river floods the valley. Farmers plant their crops after the flood, "
    "when the soil is wet and rich.",
    "Our store opens at nine in the morning and closes at six in the evening. On Saturdays we "
    "close at four. We are closed on Sundays and on public holidays. Returns are accepted "
    "within thirty days with a receipt.",
    "The experiment used two groups of plants. The first group received water every day, the "
    "second group every three days. After four weeks the first group was twice as tall as the "
    "second group, and its leaves were darker.",
]
FREE_CHAT = [
    "Write a short story about a cat who learns to fly.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a few sentences.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me some ideas for a birthday party for a child.",
    "What should I think about before adopting a dog?",
    "Write a poem about the ocean at night.",
    "How do I make a good cup of tea?",
]


def repetitive_messages() -> list[str]:
    out = []
    for old, new, code in FUNCTIONS:
        out.append(
            f"Rename the variable `{old}` to `{new}` in this code and give back the whole "
            f"code:\n\n{code}"
        )
    for doc in DOCUMENTS:
        out.append(f"Repeat the following text word for word:\n\n{doc}")
    return out


def run(llm, prompts, params, batch: int) -> dict:
    """The prompts `batch` at a time -> decode tokens/s and the outputs."""
    engine = llm.engine
    engine.reset_prefix_cache()
    outputs, decode_tokens, decode_s = [], 0, 0.0
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(p, params) for p in prompts[i : i + batch]]
        done, started, t0, n0 = {}, False, 0.0, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
            if not started:
                live = [r for r in engine.scheduler.running if r.request_id in ids]
                if all(r.output_token_ids for r in live) and not engine.scheduler.waiting:
                    started, t0 = True, time.perf_counter()
                    n0 = sum(len(r.output_token_ids) for r in live) + sum(
                        len(o.token_ids) for o in done.values()
                    )
        decode_s += time.perf_counter() - t0
        decode_tokens += sum(len(done[r].token_ids) for r in ids) - n0
        outputs += [done[r] for r in ids]
    return {"tokens_per_s": decode_tokens / decode_s, "outputs": outputs}


def main(argv):
    del argv
    from llmjax import LLM, SamplingParams

    batch = max(map(int, FLAGS.batch_sizes))
    base = LLM(
        FLAGS.model,
        dtype=FLAGS.dtype,
        max_model_len=1024,
        num_pages=batch * 1024 // 16 + 1,  # no preemption: every request's tokens fit
        # every step shape compiled before timing (the adaptive choice meets new shapes in
        # any run); JAX's persistent cache makes the next variants' compiles loads
        precompile=FLAGS.precompile,
    )
    tok = base.get_tokenizer()
    spec_config = {
        "method": FLAGS.method,
        "num_speculative_tokens": FLAGS.num_speculative_tokens,
        "prompt_lookup_min": FLAGS.prompt_lookup_min,
        "prompt_lookup_max": FLAGS.prompt_lookup_max,
        "num_draft_layers": FLAGS.num_draft_layers,
    }
    messages = {"repetitive": repetitive_messages(), "free_chat": FREE_CHAT}
    params = SamplingParams(max_tokens=FLAGS.max_tokens)
    rows = []
    for workload in FLAGS.workloads:
        texts = (messages[workload] * FLAGS.num_requests)[: FLAGS.num_requests]
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for t in texts
        ]
        for batch in map(int, FLAGS.batch_sizes):
            result = {}
            for variant in ("plain", "all", "adaptive"):
                opts = dict(max_num_seqs=batch)
                if variant != "plain":
                    opts["speculative_config"] = dict(spec_config, adaptive=variant == "adaptive")
                llm = base.with_options(**opts)
                run(llm, prompts, params, batch)  # compiles its shapes
                llm.engine.reset_stats()
                runs = [run(llm, prompts, params, batch) for _ in range(FLAGS.repeats)]
                stats = llm.engine.stats
                per_step = [
                    o.metrics.spec_decode.tokens_per_decode_step
                    for o in runs[-1]["outputs"]
                    if o.metrics.spec_decode is not None
                ]
                result[variant] = {
                    "tokens_per_s": float(np.median([r["tokens_per_s"] for r in runs])),
                    "outputs": [o.token_ids for o in runs[-1]["outputs"]],
                    "acceptance_rate": stats.spec_acceptance_rate,
                    "mean_accepted_length": stats.spec_mean_accepted_length,
                    "tokens_per_decode_step": float(np.mean(per_step)) if per_step else 1.0,
                }
            plain = result["plain"]
            for variant in ("all", "adaptive"):
                spec = result[variant]
                rows.append(
                    {
                        "workload": workload,
                        "batch": batch,
                        "variant": variant,
                        "plain_tokens_per_s": plain["tokens_per_s"],
                        "spec_tokens_per_s": spec["tokens_per_s"],
                        "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                        "acceptance_rate": spec["acceptance_rate"],
                        "mean_accepted_length": spec["mean_accepted_length"],
                        "tokens_per_decode_step": spec["tokens_per_decode_step"],
                        "identical_outputs": plain["outputs"] == spec["outputs"],
                    }
                )
    print(
        f"{FLAGS.model} ({FLAGS.dtype}), {FLAGS.method} k={FLAGS.num_speculative_tokens} "
        + (
            f"lookup {FLAGS.prompt_lookup_min}..{FLAGS.prompt_lookup_max}"
            if FLAGS.method == "ngram"
            else f"{FLAGS.num_draft_layers} draft layers"
        )
        + ", greedy, "
        f"{FLAGS.max_tokens} tokens: decode tokens/s (median of {FLAGS.repeats})"
    )
    print(
        f"{'workload':>10} {'batch':>5} {'variant':>8} {'plain':>8} {'spec':>8} {'speedup':>7} "
        f"{'accept':>6} {'mean len':>8} {'tok/step':>8} {'same':>5}"
    )
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    for r in rows:
        print(
            f"{r['workload']:>10} {r['batch']:>5} {r['variant']:>8} "
            f"{r['plain_tokens_per_s']:>8.1f} "
            f"{r['spec_tokens_per_s']:>8.1f} {r['speedup']:>7.2f} "
            f"{fmt(r['acceptance_rate']):>6} {fmt(r['mean_accepted_length']):>8} "
            f"{r['tokens_per_decode_step']:>8.2f} {r['identical_outputs']!s:>5}"
        )
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(
                {"model": FLAGS.model, "dtype": FLAGS.dtype, "speculative": spec_config,
                 "rows": rows},
                f,
                indent=2,
            )  # fmt: skip
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

r"""What each weight precision costs in quality (llmjax/quality.py), on SmolLM2 by default.

For each --precisions entry (name=dtype:quantization[:smoothquant]; the first is the reference;
smoothquant as LLM takes it: auto, none or SmoothQuant's migration strength, for w8a8 only):
  MB       bytes of the weights as the engine holds them (quantized ones packed)
  ppl      perplexity of the bundled public-domain text (llmjax/data/alice.txt):
           --num_windows windows of --window tokens, each one prefill, every next token scored
  agree    greedy agreement with the reference on the reference's own greedy continuations
           (--gen_len tokens after --num_prompts prompts of --prompt_len tokens taken from the
           text after the perplexity windows), teacher-forced
Prints a table, writes JSON to --out.

    python scripts/eval_precision.py                       # ~3 min on 2 CPU cores
    python scripts/eval_precision.py --precisions f32=float32:none,int8_wo=float32:int8_wo
"""

from __future__ import annotations

import gc
import json
import os
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or HF directory.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_list(
    "precisions",
    [
        "f32=float32:none",
        "bf16=bfloat16:none",
        "int8=float32:int8",
        "w8a8=float32:w8a8",
        "w8a8_plain=float32:w8a8:none",
        "int8_wo=float32:int8_wo",
        "q8_0=float32:q8_0",
        "q4_1=float32:q4_1",
        "gguf=float32:gguf",
    ],
    "name=dtype:quantization[:smoothquant] entries; the first is the reference.",
)
flags.DEFINE_integer("window", 512, "Tokens per perplexity window.")
flags.DEFINE_integer("num_windows", 4, "Perplexity windows.")
flags.DEFINE_integer("num_prompts", 8, "Prompts for greedy agreement.")
flags.DEFINE_integer("prompt_len", 64, "Tokens per agreement prompt.")
flags.DEFINE_integer("gen_len", 64, "Greedy tokens of the reference compared per prompt.")
flags.DEFINE_string("out", "out/eval_precision.json", "Where to write the JSON results.")

FLAGS = flags.FLAGS


def parse_precisions(entries: list[str]) -> list[tuple[str, str, str]]:
    out = []
    for entry in entries:
        name, sep, rest = entry.partition("=")
        dtype, sep2, quantization = rest.partition(":")
        quantization, _, smoothquant = quantization.partition(":")
        if not (sep and sep2 and name):
            raise ValueError(
                f"--precisions entry {entry!r} is not name=dtype:quantization[:smoothquant]"
            )
        out.append((name, dtype, quantization, smoothquant or "auto"))
    return out


def main(argv):
    del argv
    from llmjax import LLM, SamplingParams, quality
    from llmjax.data.texts import text_token_ids
    from llmjax.model.quant import weight_bytes

    precisions = parse_precisions(FLAGS.precisions)
    rows, reference_seqs = [], None
    ids = None
    for name, dtype, quantization, smoothquant in precisions:
        t0 = time.perf_counter()
        llm = LLM(
            FLAGS.model,
            dtype=dtype,
            quantization=quantization,
            smoothquant=smoothquant,
            load_format=FLAGS.load_format,
            num_pages=64,
            max_num_seqs=FLAGS.num_prompts,
            max_model_len=max(FLAGS.window, FLAGS.prompt_len + FLAGS.gen_len),
        )
        config = llm.model_config
        if ids is None:
            # random weights without a tokenizer: bytes as ids
            ids = np.asarray(text_token_ids(llm.tokenizer, config.vocab_size, "alice"), np.int32)
            windows = quality.text_windows(ids, FLAGS.window, FLAGS.num_windows)
            rest = ids[windows.size :]
            prompts = quality.text_windows(rest, FLAGS.prompt_len, FLAGS.num_prompts)
        if reference_seqs is None:
            greedy = SamplingParams(temperature=0.0, max_tokens=FLAGS.gen_len, ignore_eos=True)
            outs = llm.generate([list(p) for p in prompts], greedy)
            reference_seqs = np.concatenate(
                [prompts, np.asarray([o.token_ids for o in outs], np.int32)], axis=1
            )
        ppl = quality.perplexity(llm.params, config, windows)
        agree = quality.greedy_agreement(llm.params, config, reference_seqs, FLAGS.prompt_len)
        rows.append(
            dict(
                name=name,
                dtype=dtype,
                quantization=quantization,
                smoothquant=llm.smoothquant_alpha,
                weight_mb=weight_bytes(llm.params) / 1e6,
                perplexity=ppl,
                greedy_agreement=agree,
                seconds=time.perf_counter() - t0,
            )
        )
        print(
            f"{name:>8} {dtype:>9} {quantization:>6}  {rows[-1]['weight_mb']:7.1f} MB  "
            f"ppl {ppl:8.3f}  agree {agree:6.3f}  ({rows[-1]['seconds']:.0f} s)",
            flush=True,
        )
        del llm
        gc.collect()
    result = dict(
        model=FLAGS.model,
        text="alice",
        window=FLAGS.window,
        num_windows=FLAGS.num_windows,
        scored_tokens=FLAGS.num_windows * (FLAGS.window - 1),
        num_prompts=FLAGS.num_prompts,
        prompt_len=FLAGS.prompt_len,
        gen_len=FLAGS.gen_len,
        reference=precisions[0][0],
        rows=rows,
    )
    print()
    print(
        "| precision | dtype | quantization | weights MB | perplexity | greedy agreement "
        "| SmoothQuant alpha |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['dtype']} | {r['quantization']} | {r['weight_mb']:.1f} | "
            f"{r['perplexity']:.3f} | {r['greedy_agreement']:.3f} | {r['smoothquant'] or '-'} |"
        )
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

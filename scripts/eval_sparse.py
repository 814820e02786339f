r"""Accuracy against KV bytes fetched for sparse KV fetching (InfiniGen, llmjax/sparse/).

For each setting (full attention = 'offload'; InfiniGen over a grid of --alphas x --ratios x
--granularities) it reports, on SmolLM2-135M-Instruct by default:
  ppl        perplexity of held-out public-domain text (llmjax/bench/data/), each of
             --num_segments segments prefilled for --prefix_len tokens, then --score_len
             tokens scored one decode step at a time (teacher forcing, the sparse path)
  agree      greedy-token agreement with full attention on full attention's own greedy
             continuation (--gen_len tokens after a --prefix_len-token prompt), teacher forced
  fetched    KV bytes fetched per scored token, relative to full attention (1.0)
The skewing matrices are calibrated on the first --calibration_tokens tokens of the text (the
held-out segments come after them). Prints a table, writes JSON to --out.

    python scripts/eval_sparse.py                                     # ~10 min on 2 CPU cores
    python scripts/eval_sparse.py --alphas 1,3,5,9 --ratios 0.2 --granularities token,page
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags, logging

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or HF directory.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_integer("num_segments", 4, "Held-out text segments (scored side by side).")
flags.DEFINE_integer("prefix_len", 1024, "Tokens prefilled before scoring starts.")
flags.DEFINE_integer("score_len", 128, "Tokens scored per segment, one decode step each.")
flags.DEFINE_integer("gen_len", 64, "Tokens of full attention's greedy continuation compared.")
flags.DEFINE_integer("calibration_tokens", 2048, "Tokens for the offline skewing.")
flags.DEFINE_list("alphas", ["1", "3", "5", "9"], "InfiniGen's alpha values.")
flags.DEFINE_list("ratios", ["0.2"], "partial_weight_ratio values.")
flags.DEFINE_list("granularities", ["token", "page"], "Selection granularities.")
flags.DEFINE_float(
    "max_num_kv_fraction",
    0.2,
    "Cap on speculated tokens as a fraction of the context (InfiniGen: 400 of 2048); <= 0: none.",
)
flags.DEFINE_integer("num_dense_layers", 2, "Leading layers that attend fully.")
flags.DEFINE_integer("num_recent_tokens", 16, "Recent tokens always fetched (the token included).")
flags.DEFINE_integer("num_sink_tokens", 1, "Leading tokens always fetched.")
flags.DEFINE_string("out", "out/eval_sparse.json", "Where to write the JSON results.")

FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax

    from llmjax import LLM
    from llmjax.bench.texts import public_domain_text
    from llmjax.config import SparseKVConfig
    from llmjax.sparse.evaluate import (
        fetched_fraction,
        greedy_agreement,
        greedy_continuations,
        teacher_forced,
    )
    from llmjax.sparse.skew import calibrate

    llm = LLM(FLAGS.model, load_format=FLAGS.load_format, num_pages=4, max_model_len=64)
    config, params, tok = llm.model_config, llm.params, llm.tokenizer
    text = public_domain_text()
    ids = tok.encode(text) if tok is not None else [b % config.vocab_size for b in text.encode()]
    n_cal, B, n = FLAGS.calibration_tokens, FLAGS.num_segments, FLAGS.prefix_len + FLAGS.score_len
    need = n_cal + B * n
    if len(ids) < need:
        raise app.UsageError(f"the text has {len(ids)} tokens; these flags need {need}")
    t = time.perf_counter()
    skew = calibrate(params, config, ids[:n_cal])
    logging.info("calibrated on %d tokens in %.1f s", n_cal, time.perf_counter() - t)
    held_out = np.array(ids[n_cal : n_cal + B * n]).reshape(B, n)
    prompts = held_out[:, : FLAGS.prefix_len]
    t = time.perf_counter()
    continued = greedy_continuations(params, config, prompts, FLAGS.gen_len + 1)
    logging.info("full attention's greedy continuations in %.1f s", time.perf_counter() - t)

    cap = None
    if FLAGS.max_num_kv_fraction > 0:
        cap = max(1, int(FLAGS.max_num_kv_fraction * n))
    common = dict(
        num_dense_layers=FLAGS.num_dense_layers,
        num_recent_tokens=FLAGS.num_recent_tokens,
        num_sink_tokens=FLAGS.num_sink_tokens,
        pool_memory="device",  # the same numbers either way; skips host copies on the CPU
    )
    settings = [("full", SparseKVConfig(mode="offload", **common))]
    for g in FLAGS.granularities:
        for r in FLAGS.ratios:
            for a in FLAGS.alphas:
                s = SparseKVConfig(
                    mode="infinigen",
                    alpha=float(a),
                    partial_weight_ratio=float(r),
                    max_num_kv=cap,
                    granularity=g,
                    **common,
                )
                settings.append((f"{g} a={a} r={r}", s))

    rows, full = [], None
    for name, sparse in settings:
        t = time.perf_counter()
        ppl_run = teacher_forced(params, config, sparse, skew, held_out, FLAGS.prefix_len)
        gen_run = teacher_forced(params, config, sparse, skew, continued, FLAGS.prefix_len)
        if full is None:
            full = (ppl_run, gen_run)
        agree = greedy_agreement(gen_run, full[1])
        fetched = fetched_fraction(ppl_run, full[0])
        row = {
            "setting": name,
            "mode": sparse.mode,
            "granularity": sparse.granularity,
            "alpha": sparse.alpha,
            "partial_weight_ratio": sparse.partial_weight_ratio,
            "max_num_kv": sparse.max_num_kv,
            "perplexity": ppl_run.perplexity,
            "greedy_agreement": agree,
            "fetched_fraction": fetched,
            "bytes_per_token": float(
                ppl_run.rows[:, 1:].mean() * 2 * config.head_dim * np.dtype("float32").itemsize
            ),
            "seconds": time.perf_counter() - t,
        }
        rows.append(row)
        logging.info("%s: %s", name, row)

    print(
        f"\n{FLAGS.model}: {B} segments x ({FLAGS.prefix_len} prefilled + {FLAGS.score_len} "
        f"scored), gen {FLAGS.gen_len}, max_num_kv={cap}, dense layers {FLAGS.num_dense_layers}, "
        f"backend {jax.default_backend()}"
    )
    print(f"{'setting':<24}{'ppl':>9}{'agree':>8}{'fetched':>9}{'KiB/token':>11}{'s':>7}")
    for r in rows:
        print(
            f"{r['setting']:<24}{r['perplexity']:9.3f}{r['greedy_agreement']:8.3f}"
            f"{r['fetched_fraction']:9.3f}{r['bytes_per_token'] / 1024:11.1f}{r['seconds']:7.1f}"
        )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"flags": FLAGS.flag_values_dict(), "results": rows}, f, indent=1, default=str)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

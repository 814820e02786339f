r"""Accuracy against KV bytes fetched for sparse KV selection (llmjax/sparse/): InfiniGen beside
its alternatives at equal budgets.

For full attention ('offload') and each of --modes at each of --budgets (the cap on selected
tokens, `max_num_kv`, as a fraction of the context; sinks and recent tokens come on top, and the
first --num_dense_layers layers attend fully), on SmolLM2-135M-Instruct by default, it reports:
  ppl        perplexity of held-out public-domain text (llmjax/data/), each of
             --num_segments segments prefilled for the context length, then --score_len tokens
             scored one decode step at a time (teacher forcing, the sparse path)
  agree      teacher-forced greedy-token agreement with full attention on full attention's own
             greedy continuation (--gen_len tokens after the context)
  free       free-running agreement: the setting generates --gen_len tokens greedily on its own;
             tokens equal to full attention's before the first that differs (mean over segments)
  fetched    KV rows fetched per scored token, relative to full attention (1.0); the oracle
             reads every key to select, so its figure is its selection's, not a saving
Modes: oracle (exact top-k by the true logits: the upper bound at a budget), infinigen
(--alphas x --ratios x --granularities x --query_sources x --page_residuals; setting names end
in 'own' for query_source own_layer and 'mid' / 'upper' for the page residuals), quest (page
bounds; whole pages), h2o (heavy hitters by accumulated attention, evicting the rest for
good). Each context length of --context_lens runs the whole grid. The skewing matrices are
calibrated on the first --calibration_tokens tokens of the text (the held-out segments come
after them). Prints a table, writes JSON to --out.

    python scripts/eval_sparse.py --score_len 64 --gen_len 32   # 4 modes x 4 budgets: ~35 min
    python scripts/eval_sparse.py --context_lens 1024,2048 --budgets 0.1,0.2
    python scripts/eval_sparse.py --modes infinigen --alphas 1,3,5,9 --granularities token,page
    python scripts/eval_sparse.py --modes infinigen --budgets 0.2 --query_sources \
        previous_layer,own_layer --page_residuals none,page_mid   # where InfiniGen loses
"""

from __future__ import annotations

import itertools
import json
import os
import time

import numpy as np
from absl import app, flags, logging

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or HF directory.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_integer("num_segments", 4, "Held-out text segments (scored side by side).")
flags.DEFINE_list("context_lens", ["1024"], "Tokens prefilled before scoring starts (each a run).")
flags.DEFINE_integer("score_len", 128, "Tokens scored per segment, one decode step each.")
flags.DEFINE_integer("gen_len", 64, "Tokens of full attention's greedy continuation compared.")
flags.DEFINE_integer("calibration_tokens", 2048, "Tokens for the offline skewing.")
flags.DEFINE_list("modes", ["oracle", "infinigen", "quest", "h2o"], "Selection modes besides full.")
flags.DEFINE_list(
    "budgets",
    ["0.05", "0.1", "0.2", "0.4"],
    "max_num_kv as fractions of the context (InfiniGen: 400 of 2048); <= 0: no cap.",
)
flags.DEFINE_list("alphas", ["5"], "InfiniGen's alpha values.")
flags.DEFINE_list("ratios", ["0.2"], "InfiniGen's partial_weight_ratio values.")
flags.DEFINE_list("granularities", ["token"], "InfiniGen's and the oracle's granularities.")
flags.DEFINE_list(
    "query_sources",
    ["previous_layer"],
    "InfiniGen's speculated query: previous_layer (InfiniGen's) and/or own_layer (diagnostic).",
)
flags.DEFINE_list(
    "page_residuals",
    ["none"],
    "InfiniGen's estimate of the left-out columns: none, page_mid, page_upper.",
)
flags.DEFINE_integer("num_dense_layers", 2, "Leading layers that attend fully.")
flags.DEFINE_integer("num_recent_tokens", 16, "Recent tokens always fetched (the token included).")
flags.DEFINE_integer("num_sink_tokens", 1, "Leading tokens always fetched.")
flags.DEFINE_string("out", "out/eval_sparse.json", "Where to write the JSON results.")

FLAGS = flags.FLAGS


def settings_for(n: int) -> list[tuple[str, object]]:
    """(name, SparseKVConfig) for full attention and every mode x budget x variant."""
    from llmjax.config import SparseKVConfig

    common = dict(
        num_dense_layers=FLAGS.num_dense_layers,
        num_recent_tokens=FLAGS.num_recent_tokens,
        num_sink_tokens=FLAGS.num_sink_tokens,
        pool_memory="device",  # the same numbers either way; skips host copies on the CPU
    )
    out = [("full", SparseKVConfig(mode="offload", **common))]
    for b in FLAGS.budgets:
        cap = max(1, int(float(b) * n)) if float(b) > 0 else None
        tag = f"{float(b):.0%}" if cap else "all"
        for mode in FLAGS.modes:
            if mode in ("quest", "h2o"):
                out.append((f"{mode} {tag}", SparseKVConfig(mode=mode, max_num_kv=cap, **common)))
                continue
            for g in FLAGS.granularities:
                if mode == "oracle":
                    s = SparseKVConfig(mode=mode, max_num_kv=cap, granularity=g, **common)
                    out.append((f"oracle {g} {tag}", s))
                    continue
                variants = itertools.product(
                    FLAGS.ratios, FLAGS.alphas, FLAGS.query_sources, FLAGS.page_residuals
                )
                for r, a, source, residual in variants:
                    s = SparseKVConfig(
                        mode=mode,
                        alpha=float(a),
                        partial_weight_ratio=float(r),
                        max_num_kv=cap,
                        granularity=g,
                        query_source=source,
                        page_residual=residual,
                        **common,
                    )
                    extra = "".join(f" {v}" for v in s.selection.split("+")[1:])  # own, mid
                    out.append((f"infinigen {g} a={a} r={r}{extra} {tag}", s))
    return out


def main(argv):
    del argv
    import jax

    from llmjax import LLM
    from llmjax.config import PAGE_RESIDUALS, QUERY_SOURCES
    from llmjax.data.texts import public_domain_text
    from llmjax.sparse.evaluate import (
        agreed_prefix,
        clear_compiled,
        fetched_fraction,
        greedy_agreement,
        greedy_continuations,
        teacher_forced,
    )
    from llmjax.sparse.skew import calibrate

    allowed = {
        "modes": ("oracle", "infinigen", "quest", "h2o"),
        "query_sources": QUERY_SOURCES,
        "page_residuals": PAGE_RESIDUALS,
    }
    for flag, choices in allowed.items():  # before the model loads
        for v in FLAGS[flag].value:
            if v not in choices:
                raise app.UsageError(f"--{flag}: unknown {v!r}; choose from {', '.join(choices)}")
    llm = LLM(FLAGS.model, load_format=FLAGS.load_format, num_pages=4, max_model_len=64)
    config, params, tok = llm.model_config, llm.params, llm.tokenizer
    text = public_domain_text()
    ids = tok.encode(text) if tok is not None else [b % config.vocab_size for b in text.encode()]
    n_cal, B = FLAGS.calibration_tokens, FLAGS.num_segments
    t = time.perf_counter()
    skew = calibrate(params, config, ids[:n_cal])
    logging.info("calibrated on %d tokens in %.1f s", n_cal, time.perf_counter() - t)
    rows = []
    for context in (int(c) for c in FLAGS.context_lens):
        n = context + FLAGS.score_len
        if len(ids) < n_cal + B * n:
            raise app.UsageError(
                f"the text has {len(ids)} tokens; these flags need {n_cal + B * n}"
            )
        held_out = np.array(ids[n_cal : n_cal + B * n]).reshape(B, n)
        prompts = held_out[:, :context]
        t = time.perf_counter()
        continued = greedy_continuations(params, config, prompts, FLAGS.gen_len + 1)
        logging.info("full attention's greedy continuations in %.1f s", time.perf_counter() - t)
        full = None
        for name, sparse in settings_for(n):
            t = time.perf_counter()
            ppl_run = teacher_forced(params, config, sparse, skew, held_out, context)
            gen_run = teacher_forced(params, config, sparse, skew, continued, context)
            free = greedy_continuations(
                params, config, prompts, FLAGS.gen_len, sparse=sparse, skew=skew
            )
            if full is None:
                full = (ppl_run, gen_run)
            agreed = agreed_prefix(free, continued[:, : context + FLAGS.gen_len], context)
            row = {
                "context": context,
                "setting": name,
                "mode": sparse.mode,
                "granularity": sparse.granularity,
                "alpha": sparse.alpha,
                "partial_weight_ratio": sparse.partial_weight_ratio,
                "query_source": sparse.query_source,
                "page_residual": sparse.page_residual,
                "max_num_kv": sparse.max_num_kv,
                "budget": (
                    None
                    if sparse.max_num_kv is None or not sparse.selective
                    else sparse.max_num_kv / n
                ),
                "perplexity": ppl_run.perplexity,
                "greedy_agreement": greedy_agreement(gen_run, full[1]),
                "free_running_agreement": float(agreed.mean()),
                "free_running_min": int(agreed.min()),
                "fetched_fraction": fetched_fraction(ppl_run, full[0]),
                "reads_every_key": sparse.mode == "oracle",
                "bytes_per_token": float(
                    ppl_run.rows[:, 1:].mean() * 2 * config.head_dim * np.dtype("float32").itemsize
                ),
                "seconds": time.perf_counter() - t,
            }
            rows.append(row)
            logging.info("%s: %s", name, row)
            # Each setting compiles its own steps; dropping them keeps a long grid from running
            # out of executable memory (LLVM's section mappings).
            clear_compiled()

    print(
        f"\n{FLAGS.model}: {B} segments x (context + {FLAGS.score_len} scored), gen "
        f"{FLAGS.gen_len}, dense layers {FLAGS.num_dense_layers}, sinks {FLAGS.num_sink_tokens}, "
        f"recent {FLAGS.num_recent_tokens}, backend {jax.default_backend()}"
    )
    print(f"{'context':>7}  {'setting':<36}{'ppl':>8}{'agree':>7}{'free':>6}{'fetched':>9}{'s':>6}")
    for r in rows:
        fetched = f"{r['fetched_fraction']:.3f}" + ("*" if r["reads_every_key"] else " ")
        print(
            f"{r['context']:>7}  {r['setting']:<36}{r['perplexity']:8.3f}"
            f"{r['greedy_agreement']:7.3f}{r['free_running_agreement']:6.1f}{fetched:>9}"
            f"{r['seconds']:6.0f}"
        )
    if any(r["reads_every_key"] for r in rows):
        print("* the oracle reads every key to select: its bytes are the selection's, no saving")
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"flags": FLAGS.flag_values_dict(), "results": rows}, f, indent=1, default=str)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

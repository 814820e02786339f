r"""Where a sparse KV selection first leaves full attention, prompt by prompt, on repetitive
contexts (several short chat prompts concatenated and repeated: induction-style attention to
earlier copies everywhere), and by how much (llmjax/sparse/).

For each --settings entry at --max_num_kv, on --num_prompts prompts of --context_len tokens (each
a random choice of 4 of the built-in chat prompts, rendered with the model's chat template,
repeated; odd prompts end with the repetition's end, even ones start with its start), one prompt
at a time:
  free     free-running agreement: greedy tokens equal to full attention's before the first
           that differs (the first token comes from the dense prefill)
  agree    teacher-forced greedy agreement on full attention's continuation (--gen_len tokens;
           the sparse decode steps only)
  kl       mean KL(full || setting) of the next-token distributions over those steps
  kl1      the same at the first sparse decode step alone
  margin1  full attention's top-1 minus top-2 logit at that step (a small one flips easily)
and the mean over prompts per setting. Prints a table, writes JSON to --out.

    python scripts/sparse_divergence.py                          # ~30 min on 2 CPU cores
    python scripts/sparse_divergence.py --settings infinigen:alpha=5,infinigen:alpha=inf
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or HF directory.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_integer("num_prompts", 5, "Prompts, each run alone.")
flags.DEFINE_integer("context_len", 1100, "Tokens per prompt.")
flags.DEFINE_integer("gen_len", 24, "Tokens generated (and teacher-forced) per prompt.")
flags.DEFINE_integer("max_num_kv", 200, "The selection budget (tokens besides sinks and recent).")
flags.DEFINE_integer("calibration_tokens", 2048, "Tokens of the bundled text for the skew.")
flags.DEFINE_integer("num_dense_layers", 2, "Leading layers that attend fully.")
flags.DEFINE_integer("num_recent_tokens", 16, "Recent tokens always fetched (the token included).")
flags.DEFINE_list(
    "settings",
    [
        "oracle",
        "infinigen:alpha=5",
        "infinigen:alpha=inf",
        "infinigen:alpha=inf:page_residual=page_mid",
        "infinigen:alpha=inf:query_source=own_layer:partial_weight_ratio=1.0",
    ],
    "mode[:field=value...] SparseKVConfig settings (full attention is the reference).",
)
flags.DEFINE_integer("seed", 0, "Which chat prompts each prompt repeats.")
flags.DEFINE_string("out", "out/sparse_divergence.json", "Where to write the JSON results.")

FLAGS = flags.FLAGS

CHATS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
)


def parse_setting(text: str):
    """'infinigen:alpha=inf:page_residual=page_mid' -> SparseKVConfig fields."""
    mode, *pairs = text.split(":")
    fields = {"mode": mode}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not value:
            raise app.UsageError(f"--settings: {pair!r} in {text!r} is not field=value")
        try:
            fields[key] = float(value) if key in ("alpha", "partial_weight_ratio") else value
        except ValueError:
            raise app.UsageError(f"--settings: {key}={value!r} is not a number") from None
    return fields


def repeated_chats(tok, vocab_size: int, n: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` prompts of `n` tokens: 4 of CHATS (rendered with the chat template when the
    tokenizer has one; bytes for a model without a tokenizer) concatenated and repeated."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(count):
        one = []
        for i in rng.permutation(len(CHATS))[:4]:
            if tok is None:
                one += [c % vocab_size for c in CHATS[i].encode()]
            elif tok.chat_template:
                chat = [{"role": "user", "content": CHATS[i]}]
                one += tok.apply_chat_template(chat, tokenize=True)
            else:
                one += tok.encode(CHATS[i])
        ids = one * -(-n // len(one))
        out.append(np.array(ids[-n:] if b % 2 else ids[:n]))
    return out


def main(argv):
    del argv
    from llmjax import LLM
    from llmjax.config import SparseKVConfig
    from llmjax.data.texts import public_domain_text
    from llmjax.sparse.evaluate import clear_compiled, decode
    from llmjax.sparse.skew import calibrate

    common = dict(
        max_num_kv=FLAGS.max_num_kv,
        num_dense_layers=FLAGS.num_dense_layers,
        num_recent_tokens=FLAGS.num_recent_tokens,
        pool_memory="device",  # the same numbers either way; skips host copies on the CPU
    )
    try:
        settings = [(s, SparseKVConfig(**common, **parse_setting(s))) for s in FLAGS.settings]
    except (TypeError, ValueError) as e:
        raise app.UsageError(f"--settings: {e}") from None
    llm = LLM(FLAGS.model, load_format=FLAGS.load_format, num_pages=4, max_model_len=64)
    config, params, tok = llm.model_config, llm.params, llm.tokenizer
    text = public_domain_text()
    ids = tok.encode(text) if tok is not None else [b % config.vocab_size for b in text.encode()]
    skew = calibrate(params, config, ids[: FLAGS.calibration_tokens])
    N, GEN = FLAGS.context_len, FLAGS.gen_len
    prompts = repeated_chats(tok, config.vocab_size, N, FLAGS.num_prompts, FLAGS.seed)

    def run(sparse, prompt, forced=None):
        """Greedy (forced None) or teacher-forced on `forced` -> (tokens [GEN], logits)."""
        tokens, logits = decode(
            params, config, prompt[None], GEN, sparse=sparse, skew=skew,
            forced=None if forced is None else forced[None], keep_logits=True,
        )  # fmt: skip
        return tokens[0], logits[0].astype(np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    full = SparseKVConfig(mode="offload", **{k: v for k, v in common.items() if k != "max_num_kv"})
    reference = [run(full, p) for p in prompts]
    clear_compiled()
    rows = []
    for name, sparse in settings:
        t = time.perf_counter()
        for p, prompt in enumerate(prompts):
            ref_tokens, ref_logits = reference[p]
            _, forced_logits = run(sparse, prompt, forced=ref_tokens)
            tokens, _ = run(sparse, prompt)
            lf, lt = log_softmax(ref_logits), log_softmax(forced_logits)
            kl = (np.exp(lf) * (lf - lt)).sum(-1)  # per step; step 0 is the dense prefill's
            top2 = np.sort(ref_logits[1], -1)[-2:] if GEN > 1 else np.zeros(2)
            same = tokens == ref_tokens
            rows.append(
                dict(
                    setting=name,
                    prompt=p,
                    free=int(GEN if same.all() else same.argmin()),
                    agree=float((forced_logits.argmax(-1) == ref_tokens)[1:].mean()),
                    kl=float(kl[1:].mean()),
                    kl1=float(kl[1]) if GEN > 1 else 0.0,
                    margin1=float(top2[1] - top2[0]),
                )
            )
        clear_compiled()  # each setting compiles its own steps
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)

    print(
        f"\n{FLAGS.model}: {FLAGS.num_prompts} repeated-chat prompts of {N} tokens, {GEN} "
        f"generated, max_num_kv {FLAGS.max_num_kv}, dense layers {FLAGS.num_dense_layers}"
    )
    print(f"{'setting':<64}{'free':>16}{'agree':>7}{'kl':>9}{'kl1':>9}{'margin1':>8}")
    for name, _ in settings:
        mine = [r for r in rows if r["setting"] == name]
        free = "/".join(str(r["free"]) for r in mine)
        print(
            f"{name:<64}{free:>16}{np.mean([r['agree'] for r in mine]):7.3f}"
            f"{np.mean([r['kl'] for r in mine]):9.4f}{np.mean([r['kl1'] for r in mine]):9.4f}"
            f"{np.mean([r['margin1'] for r in mine]):8.2f}"
        )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"flags": FLAGS.flag_values_dict(), "results": rows}, f, indent=1, default=str)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

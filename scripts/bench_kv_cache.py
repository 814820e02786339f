r"""Decode speed with a quantized KV cache (CacheConfig.kv_cache_dtype) at long contexts.

A step of --batch decodes, each sequence at --contexts tokens of context, timed as the jitted
model step alone (`ModelRunner.time_step`: the median of --repeats runs, each waited for), for
each --kv_cache_dtypes entry over the same weights, in one process, dtypes alternating per
context, so the ratios are measured in the same run. The cache holds random values (the
quantized ones valid: no NaN or inf bytes), written once on the device; no prefill runs, so an
8k context costs nothing to set up. An entry 'DTYPE:OPTIONS' adds the CPU attention kernel's
options (`int8:int8_scores=false`: an int8 cache scored with float32 dots instead of VNNI int8
dots, the default where the CPU has them). Per row: decode tokens/s, the KV bytes the step's
attention reads (every layer's K and V rows of every sequence, scales included) and how many
times faster than the first dtype (normally 'auto', the model dtype) at that context.

    python scripts/bench_kv_cache.py                    # SmolLM2 float32, batch 16, 1k-8k tokens
    python scripts/bench_kv_cache.py --dtype bfloat16 --contexts 2048 --attention_backend reference
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_enum(
    "load_format", "auto", ["auto", "dummy"], "'dummy': random weights of the preset's shapes."
)
flags.DEFINE_string("dtype", "float32", "The model dtype (weights, activations, 'auto' KV).")
flags.DEFINE_list(
    "kv_cache_dtypes",
    ["auto", "int8", "int8:int8_scores=false", "fp8_e4m3", "fp8_e5m2"],
    "KV dtypes (or 'DTYPE:KERNEL_OPTIONS', the CPU kernel's); the first is the base.",
)
flags.DEFINE_list("contexts", ["1024", "2048", "4096", "8192"], "Tokens of context per sequence.")
flags.DEFINE_integer("batch", 16, "Decoding sequences per step.")
flags.DEFINE_string("attention_backend", "auto", "EngineConfig.attention_backend.")
flags.DEFINE_integer("repeats", 10, "Timed runs of each step a round (after 3 warm-up runs).")
flags.DEFINE_integer("rounds", 3, "Rounds over the KV dtypes, alternating; the median is kept.")
flags.DEFINE_integer("seed", 0, "Seed of the cache's random contents and the tokens.")
flags.DEFINE_string("json_out", "out/bench_kv_cache.json", "Where to write the results.")

FLAGS = flags.FLAGS
PAGE = 16


def random_pages(kv_pages, seed: int):
    """`kv_pages` (donated) refilled with random rows, one leaf at a time: model-dtype values
    ~N(0, 1); a quantized cache's bytes random but finite (fp8's top exponent bit cleared) and
    its scales in [0.005, 0.01)."""
    import jax
    import jax.numpy as jnp

    from llmjax.model.kv_cache import QuantizedPages

    key = jax.random.key(seed)

    def values(key, shape, dtype, kind):
        if kind == "scales":
            return jax.random.uniform(key, shape, dtype, 0.005, 0.01)
        if kind == "auto":
            return jax.random.normal(key, shape, dtype)
        bits = jax.random.bits(key, shape, jnp.uint8)
        if kind == "int8":
            return jax.lax.bitcast_convert_type(bits, jnp.int8)
        return bits & jnp.uint8(0xBF)  # fp8: exponent's top bit cleared (no NaN, no inf)

    def fill(x, key, kind):
        """x (donated) filled in place, 16 slabs of pages one after another: no full-size
        temporary (a 6 GiB float32 cache and its random bits did not fit 24 GiB beside the
        others). The last slab may overlap the one before it; both are random."""
        n = -(-x.shape[0] // 16)

        def slab(i, x):
            new = values(jax.random.fold_in(key, i), (n, *x.shape[1:]), x.dtype, kind)
            return jax.lax.dynamic_update_slice_in_dim(
                x, new, jnp.minimum(i * n, x.shape[0] - n), 0
            )

        return jax.lax.fori_loop(0, 16, slab, x)

    def one(pages, key):
        f = jax.jit(fill, static_argnums=2, donate_argnums=0)
        if isinstance(pages, QuantizedPages):
            k1, k2 = jax.random.split(key)
            return QuantizedPages(
                f(pages.values, k1, pages.kv_cache_dtype),
                f(pages.scales, k2, "scales"),
                pages.kv_cache_dtype,
            )
        return f(pages, key, "auto")

    layers = [kv_pages] if isinstance(kv_pages, tuple) else kv_pages
    out = []
    for k, v in layers:
        key, kk, kv = jax.random.split(key, 3)
        out.append((one(k, kk), one(v, kv)))
    return out[0] if isinstance(kv_pages, tuple) else out


def decode_step(batch: int, context: int, vocab: int, seed: int):
    """`batch` decodes at position context - 1; sequence b on pages 1 + b * n, ... (n each)."""
    from llmjax.engine.runner.launched import greedy_sampling
    from llmjax.model.step_input import StepInput

    n = -(-context // PAGE)
    tables = (1 + np.arange(batch * n, dtype=np.int32)).reshape(batch, n)
    pos = context - 1
    step = StepInput(
        token_ids=np.random.default_rng(seed).integers(100, vocab, batch).astype(np.int32),
        positions=np.full(batch, pos, np.int32),
        slot_mapping=(tables[:, pos // PAGE] * PAGE + pos % PAGE).astype(np.int32),
        cu_q_lens=np.arange(batch + 1, dtype=np.int32),
        kv_lens=np.full(batch, context, np.int32),
        page_indices=tables,
        num_seqs=np.array([batch], np.int32),
        logits_indices=np.arange(batch, dtype=np.int32),
    )
    sampling = greedy_sampling(batch)
    return step, sampling


def main(argv):
    del argv
    from llmjax import LLM
    from llmjax.bench.metrics import format_table
    from llmjax.bench.variants import kv_cache_variant
    from llmjax.model.kv_cache import kv_cache_bytes

    contexts = [int(c) for c in FLAGS.contexts]
    base = LLM(
        FLAGS.model,
        load_format=FLAGS.load_format,
        dtype=FLAGS.dtype,
        max_model_len=max(contexts),
        max_num_seqs=FLAGS.batch,
        num_pages=2,
        compilation_cache_dir="",
    )
    config = base.model_config
    rows = []
    for context in contexts:
        step, sampling = decode_step(FLAGS.batch, context, config.vocab_size, FLAGS.seed)
        runners, dtypes = {}, {}
        for entry in FLAGS.kv_cache_dtypes:  # every cache of this context held at once
            label, options = kv_cache_variant(entry)
            options = dict(attention_backend=FLAGS.attention_backend) | options
            runner = base.with_options(
                num_pages=FLAGS.batch * -(-context // PAGE) + 2, **options
            ).engine.runner
            runner.kv_pages = random_pages(runner.kv_pages, FLAGS.seed)
            runners[label], dtypes[label] = runner, options["kv_cache_dtype"]
        times = {d: [] for d in runners}
        for _ in range(FLAGS.rounds):  # the dtypes alternate: drift on a busy machine is shared
            for kv_dtype, runner in runners.items():
                times[kv_dtype].append(runner.time_step(step, sampling, FLAGS.repeats))
        for kv_dtype, runner in runners.items():
            seconds = float(np.median(times[kv_dtype]))
            read = kv_cache_bytes(config, 1, FLAGS.batch * context, FLAGS.dtype, dtypes[kv_dtype])
            rows.append(
                dict(
                    context=context,
                    kv_cache_dtype=kv_dtype,
                    backend=runner.attention_backend,
                    step_ms=1e3 * seconds,
                    tokens_per_s=FLAGS.batch / seconds,
                    kv_mib_read=read / 2**20,
                )
            )
            first = next(r for r in rows if r["context"] == context)
            rows[-1]["speedup"] = first["step_ms"] / rows[-1]["step_ms"]
            print(
                f"{context:5d} {kv_dtype:>9} ({runner.attention_backend}): "
                f"{rows[-1]['step_ms']:7.1f} ms  {rows[-1]['tokens_per_s']:7.1f} tok/s  "
                f"{rows[-1]['kv_mib_read']:7.1f} MiB of KV  x{rows[-1]['speedup']:.2f}",
                flush=True,
            )
        del runners, runner
    print(
        f"\n{config.name or FLAGS.model} {FLAGS.dtype}, {FLAGS.batch} decodes a step, the jitted "
        "step alone (median of the rounds' medians)"
    )
    header = ["context", "KV dtype", "backend", "step ms", "tok/s", "KV MiB read", "vs first"]
    table = [
        [r["context"], r["kv_cache_dtype"], r["backend"], f"{r['step_ms']:.1f}",
         f"{r['tokens_per_s']:.1f}", f"{r['kv_mib_read']:.1f}", f"{r['speedup']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    print(format_table(header, table))
    if FLAGS.json_out:
        os.makedirs(os.path.dirname(FLAGS.json_out) or ".", exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(dict(model=FLAGS.model, dtype=FLAGS.dtype, batch=FLAGS.batch, rows=rows), f)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)

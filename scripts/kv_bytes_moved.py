r"""The KV bytes one request moves, per KV cache dtype (CacheConfig.kv_cache_dtype; issue 41).

One prompt of --context tokens of the bundled text on --model, for each --kv_cache_dtypes entry,
measured on the engine (not computed from shapes):
  P/D transfer  a prefill instance's export of the request's pages (`export_pages`: the array a
                transport sends, one uint8 row of codes and its scale per token and kv head for a
                quantized cache; the bucket's padding pages included) and the request's own pages
  tier load     the request's prompt stored in a host-memory KV tier, the device's prefix cache
                emptied, the prompt sent again: the blocks loaded x the tier's block bytes (whole
                --tier_block_size blocks only)
  sparse KV     --gen_len tokens decoded over the sparse KV host pool: the bytes fetched host ->
                device per decode token (EngineStats.h2d_bytes_per_decode_token) with 'offload'
                (every cached row, each step) and 'infinigen' (its default budget)
Prints a table (each dtype also as a share of the first's bytes), writes JSON to --out.

    python scripts/kv_bytes_moved.py                 # SmolLM2, 1024 tokens; ~3 min on 2 cores
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset, .gguf file or checkpoint dir.")
flags.DEFINE_string("load_format", "auto", "'auto' or 'dummy' (random weights, for tests).")
flags.DEFINE_string("dtype", "float32", "The model dtype.")
flags.DEFINE_integer("context", 1024, "Prompt tokens.")
flags.DEFINE_integer("gen_len", 16, "Decode tokens of the sparse KV runs.")
flags.DEFINE_list(
    "kv_cache_dtypes", ["auto", "int8", "fp8_e4m3"], "KV dtypes; the first is the base."
)
flags.DEFINE_integer("tier_block_size", 64, "Tokens per KV tier block (a multiple of the page).")
flags.DEFINE_list("sparse_modes", ["offload", "infinigen"], "Sparse KV modes measured.")
flags.DEFINE_string("out", "out/kv_bytes_moved.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS


def measure(base, prompt: list[int], kv_dtype: str) -> dict:
    from llmjax import SamplingParams
    from llmjax.config import KVStoreConfig, SparseKVConfig

    row = dict(kv_cache_dtype=kv_dtype)
    # P/D: the prefill instance's export of the parked request
    engine = base.with_options(kv_cache_dtype=kv_dtype, role="prefill").engine
    engine.add_request(prompt, SamplingParams(max_tokens=8), request_id="r")  # > 1: it parks
    for _ in range(len(prompt) + 8):
        if "r" in engine.parked:
            break
        engine.step()
    else:
        raise RuntimeError("the prefill instance never parked the request")
    _, pages = engine.export_request("r")
    exported = engine.runner.export_pages(pages)
    row["pd_exported_bytes"] = int(exported.nbytes)
    page_bytes = exported.nbytes // exported.shape[-4]  # [..., pages, G, K, H(+4)] per layer
    row["pd_request_bytes"] = int(page_bytes * len(pages))
    del engine
    # a tier load: stored in T1 (host memory), the device cache emptied, the prompt again
    kv = KVStoreConfig(
        host_blocks=256, block_size=FLAGS.tier_block_size, write_policy="write_through",
        load_policy="always",
    )  # fmt: skip
    llm = base.with_options(kv_cache_dtype=kv_dtype, kv_store=kv, prefix_cache="radix")
    one = SamplingParams(max_tokens=1)
    llm.generate([prompt], one, use_tqdm=False)
    llm.engine.kv_tiers.flush()  # the exports stored
    llm.engine.reset_prefix_cache()
    tiers = llm.engine.kv_tiers
    before = sum(tiers.stats.blocks_loaded.values())
    llm.generate([prompt], one, use_tqdm=False)
    row["tier_load_bytes"] = int(
        (sum(tiers.stats.blocks_loaded.values()) - before) * tiers.block_nbytes
    )
    del llm
    # sparse KV: host -> device bytes per decode token
    params = SamplingParams(max_tokens=FLAGS.gen_len, ignore_eos=True)
    for mode in FLAGS.sparse_modes:
        llm = base.with_options(
            kv_cache_dtype=kv_dtype, sparse_kv=SparseKVConfig(mode=mode), prefix_cache="none"
        )
        llm.generate([prompt], params, use_tqdm=False)
        row[f"sparse_{mode}_bytes_per_decode_token"] = float(
            llm.engine.stats.h2d_bytes_per_decode_token
        )
        del llm
    return row


def main(argv):
    del argv
    from llmjax import LLM
    from llmjax.data.texts import text_token_ids

    base = LLM(
        FLAGS.model,
        load_format=FLAGS.load_format,
        dtype=FLAGS.dtype,
        max_model_len=FLAGS.context + FLAGS.gen_len + 16,
        max_num_seqs=4,
        num_pages=(FLAGS.context + FLAGS.gen_len) // 8 + 16,
        compilation_cache_dir="",
    )
    vocab = base.model_config.vocab_size
    prompt = np.asarray(text_token_ids(base.tokenizer, vocab, "alice"))[: FLAGS.context].tolist()
    rows = []
    for kv_dtype in FLAGS.kv_cache_dtypes:
        rows.append(measure(base, prompt, kv_dtype))
        print(rows[-1], flush=True)
    keys = [k for k in rows[0] if k != "kv_cache_dtype"]
    print(
        f"\nKV bytes one request of {FLAGS.context} tokens moves ({FLAGS.model}, {FLAGS.dtype}; "
        f"in parentheses: of {rows[0]['kv_cache_dtype']}'s)"
    )
    print("| KV dtype | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        cells = [f"{r[k] / 2**20:.2f} MiB ({r[k] / rows[0][k]:.2f})" for k in keys]
        print(f"| {r['kv_cache_dtype']} | " + " | ".join(cells) + " |")
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(dict(model=FLAGS.model, dtype=FLAGS.dtype, context=FLAGS.context,
                           rows=rows), f, indent=2)  # fmt: skip
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)

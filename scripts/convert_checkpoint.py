"""Convert a GGUF file, an HF directory or an orbax directory into llmjax's orbax format (fast
restores) or into an HF directory (for transformers, vLLM and other engines).

    python scripts/convert_checkpoint.py --model smollm2-135m-instruct --out checkpoints/smollm2
    python scripts/convert_checkpoint.py --model hf_dir --out checkpoints/mine --dtype bfloat16
    python scripts/convert_checkpoint.py --format hf --out /tmp/smollm2-hf   # SmolLM2 as HF

orbax (the default): the output directory holds `llmjax_model_config.json` and the orbax
`params/` item; pass it as `LLM(model=...)`. A GGUF's tokenizer is not converted: pass
`tokenizer=<the .gguf>` or keep a `tokenizer.json` next to it.

hf: config.json, generation_config.json, model.safetensors (HF names and layouts; a GGUF's
weights dequantized, its Q/K rows in HF's order) and, from the GGUF's vocabulary and merges (or
the HF directory's, or --tokenizer), tokenizer.json and tokenizer_config.json with the chat
template (`llmjax.checkpoint.hf.save_hf`).
"""

from __future__ import annotations

import os
import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset name, .gguf file or directory.")
flags.DEFINE_string("out", None, "Output directory (created).", required=True)
flags.DEFINE_enum("format", "orbax", ["orbax", "hf"], "Output format.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Stored dtype.")
flags.DEFINE_string(
    "tokenizer",
    None,
    "--format hf: the tokenizer to write (a .gguf file or an HF directory); default: the model's "
    "own, when it has one.",
)

FLAGS = flags.FLAGS


def tokenizer_source(model_path: str, kind: str) -> str | None:
    """Where the model's own tokenizer is: the GGUF itself, or a directory with tokenizer.json."""
    if kind == "gguf":
        return model_path
    if os.path.exists(os.path.join(model_path, "tokenizer.json")):
        return model_path
    return None


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from llmjax.checkpoint import load_model, resolve_model_path, save_params
    from llmjax.checkpoint.hf import save_hf

    t0 = time.perf_counter()
    config, params, kind = load_model(FLAGS.model)
    if FLAGS.format == "hf":
        source = FLAGS.tokenizer or tokenizer_source(resolve_model_path(FLAGS.model), kind)
        save_hf(FLAGS.out, config, params, tokenizer_source=source, dtype=FLAGS.dtype)
        if source is None:
            print(f"note: {FLAGS.model} has no tokenizer to write; pass --tokenizer")
    else:
        params = jax.tree.map(lambda w: jnp.asarray(w, FLAGS.dtype), params)
        save_params(FLAGS.out, config, params)
    print(
        f"converted {FLAGS.model} ({kind}) -> {FLAGS.out} ({FLAGS.format}) in "
        f"{time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    app.run(main)

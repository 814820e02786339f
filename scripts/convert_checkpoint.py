"""Convert a GGUF file or an HF directory into llmjax's orbax format once, for fast restores.

    python scripts/convert_checkpoint.py --model smollm2-135m-instruct --out checkpoints/smollm2
    python scripts/convert_checkpoint.py --model hf_dir --out checkpoints/mine --dtype bfloat16

The output directory holds `llmjax_model_config.json` and the orbax `params/` item; pass it as
`LLM(model=...)`. A GGUF's tokenizer is not converted: pass `tokenizer=<the .gguf>` or keep a
`tokenizer.json` next to it.
"""

from __future__ import annotations

import time

from absl import app, flags

flags.DEFINE_string("model", "smollm2-135m-instruct", "Preset name, .gguf file or HF directory.")
flags.DEFINE_string("out", None, "Output directory (created).", required=True)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Stored dtype.")

FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from llmjax.checkpoint import load_model, save_params

    t0 = time.perf_counter()
    config, params, kind = load_model(FLAGS.model)
    params = jax.tree.map(lambda w: jnp.asarray(w, FLAGS.dtype), params)
    save_params(FLAGS.out, config, params)
    print(f"converted {FLAGS.model} ({kind}) -> {FLAGS.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    app.run(main)

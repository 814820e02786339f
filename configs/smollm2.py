"""SmolLM2-135M(-Instruct): the real model of demos, tests and benchmarks (HuggingFaceTB)."""

from llmjax.config import ModelConfig

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m-instruct",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)

# SmolLM2's vocabulary (so its tokenizer and chat template apply) on a 2-layer body: random
# weights (load_format="dummy") for the notebooks' smoke runs, compiling in seconds.
SMOLLM2_TINY = SMOLLM2_135M.replace(
    name="smollm2-tiny",
    hidden_size=96,
    intermediate_size=192,
    num_layers=2,
    num_heads=3,
    num_kv_heads=1,
    head_dim=32,
)

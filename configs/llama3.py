"""Meta Llama 3 / 3.1 8B shapes (config.json of meta-llama/Meta-Llama-3(.1)-8B)."""

from llmjax.config import ModelConfig, RopeScaling

LLAMA3_8B = ModelConfig(
    name="llama3-8b",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)

LLAMA31_8B = LLAMA3_8B.replace(
    name="llama3.1-8b",
    max_position_embeddings=131072,
    rope_scaling=RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    eos_token_ids=(128001, 128008, 128009),
)

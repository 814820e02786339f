"""Qwen2 shapes: Llama with biases on the Q/K/V projections."""

from llmjax.config import ModelConfig

QWEN2_0_5B = ModelConfig(
    name="qwen2-0.5b",
    architecture="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=True,
    bos_token_id=151643,
    eos_token_ids=(151643,),
)

QWEN2_7B = QWEN2_0_5B.replace(
    name="qwen2-7b",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)

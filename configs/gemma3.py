"""Gemma 3 27B's text decoder (Hugging Face google/gemma-3-27b-it, text_config): five local
layers (sliding window 1024, RoPE base 10000) to one global (base 1e6, linear scaling x8),
query/key norms, Gemma's (1 + w) norms and post norms, GeGLU, scaled tied embeddings, scores
scaled by query_pre_attn_scalar 168 = hidden_size / num_heads."""

from llmjax.config import FAMILY_TRAITS, ModelConfig, RopeScaling

GEMMA3_27B = ModelConfig(
    name="gemma3-27b",
    architecture="gemma3",
    **FAMILY_TRAITS["gemma3"],
    vocab_size=262208,
    hidden_size=5376,
    intermediate_size=21504,
    num_layers=62,
    num_heads=32,
    num_kv_heads=16,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rope_scaling=RopeScaling("linear", 8.0),
    rope_local_base_freq=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=168.0,
    sliding_window=1024,
    layer_types=tuple(
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
    ),
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_ids=(1, 106),
)

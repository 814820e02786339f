"""Qwen3 dense shapes (Hugging Face Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json): query/key
RMSNorms, head_dim 128 apart from hidden_size / num_heads, no Q/K/V biases."""

from llmjax.config import FAMILY_TRAITS, ModelConfig

QWEN3_8B = ModelConfig(
    name="qwen3-8b",
    architecture="qwen3",
    **FAMILY_TRAITS["qwen3"],
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_ids=(151645,),
)

QWEN3_32B = QWEN3_8B.replace(
    name="qwen3-32b",
    hidden_size=5120,
    intermediate_size=25600,
    num_layers=64,
    num_heads=64,
    num_kv_heads=8,
)

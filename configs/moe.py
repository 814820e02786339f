"""Mixture-of-experts shapes (Hugging Face config.json of mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B): experts in every layer, top-k routing."""

from llmjax.config import FAMILY_TRAITS, ModelConfig

# 46.7B parameters, 12.9B active per token: 8 experts of Mistral-7B's MLP shape, top-2.
MIXTRAL_8X7B = ModelConfig(
    name="mixtral-8x7b",
    architecture="mixtral",
    **FAMILY_TRAITS["mixtral"],
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    num_experts=8,
    num_experts_per_tok=2,
    bos_token_id=1,
    eos_token_ids=(2,),
)

# 30.5B parameters, 3.3B active: 128 experts of hidden 768, top-8 renormalized.
QWEN3_30B_A3B = ModelConfig(
    name="qwen3-30b-a3b",
    architecture="qwen3_moe",
    **FAMILY_TRAITS["qwen3_moe"],
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    bos_token_id=151643,
    eos_token_ids=(151645,),
)

# 235B parameters, 22B active.
QWEN3_235B_A22B = QWEN3_30B_A3B.replace(
    name="qwen3-235b-a22b",
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=94,
    num_heads=64,
    moe_intermediate_size=1536,
)

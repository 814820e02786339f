"""Tiny models for tests and notebooks (compile in seconds): a Llama with GQA and two layers, and
the same shapes with Qwen3's and Gemma 2/3's traits."""

from llmjax.config import FAMILY_TRAITS, ModelConfig, RopeScaling

TINY = ModelConfig(
    name="tiny",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_ids=(2,),
)

# One KV head shared by all query heads (multi-query attention), tied embeddings.
TINY_GQA1 = TINY.replace(name="tiny-gqa1", num_kv_heads=1, tie_word_embeddings=True)

# Five layers: pipeline stages of unequal size (pp=2: 3 + 2, pp=4: 2 + 1 + 1 + 1).
TINY_DEEP = TINY.replace(name="tiny-deep", num_layers=5)

# Head dim 64 (the smallest the Mosaic GPU attention kernel takes), 2 query heads per kv head.
TINY_H64 = TINY.replace(name="tiny-h64", hidden_size=256, head_dim=64)

# The other families' traits on tiny shapes (random weights: load_format="dummy"). Query/key
# norms and a head_dim apart from hidden_size / num_heads (Qwen3).
TINY_QWEN3 = TINY.replace(
    name="tiny-qwen3", architecture="qwen3", **FAMILY_TRAITS["qwen3"], head_dim=32
)

# Local (window 8) and global layers alternating, both soft caps, GeGLU, Gemma's norms, tied.
TINY_GEMMA2 = TINY.replace(
    name="tiny-gemma2",
    architecture="gemma2",
    **FAMILY_TRAITS["gemma2"],
    num_layers=4,
    head_dim=32,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=24.0,
    sliding_window=8,
    layer_types=("sliding_attention", "full_attention") * 2,
    attn_logit_softcapping=20.0,
    final_logit_softcapping=15.0,
    tie_word_embeddings=True,
)

# Gemma 3's pattern (local, local, global, local, local), local RoPE base 1000 against a
# global 100000 with linear scaling, query/key norms, no soft caps.
TINY_GEMMA3 = TINY_GEMMA2.replace(
    name="tiny-gemma3",
    architecture="gemma3",
    **FAMILY_TRAITS["gemma3"],
    num_layers=5,
    layer_types=("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    rope_theta=100000.0,
    rope_scaling=RopeScaling("linear", 4.0),
    rope_local_base_freq=1000.0,
)

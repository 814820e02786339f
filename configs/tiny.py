"""A tiny Llama for tests and notebooks: compiles in seconds, exercises GQA and two layers."""

from llmjax.config import ModelConfig

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

"""01.AI Yi-34B shape (config.json of 01-ai/Yi-34B): a Llama-architecture model with GQA, in
Sarathi-Serve's evaluation on 2 x A100 (TP2)."""

from llmjax.config import ModelConfig

YI_34B = ModelConfig(
    name="yi-34b",
    vocab_size=64000,
    hidden_size=7168,
    intermediate_size=20480,
    num_layers=60,
    num_heads=56,
    num_kv_heads=8,
    max_position_embeddings=4096,
    rope_theta=5000000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_ids=(2,),
)

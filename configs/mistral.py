"""Mistral-7B-v0.1 shape: Llama with GQA and a 4096-token sliding attention window."""

from llmjax.config import ModelConfig

MISTRAL_7B = ModelConfig(
    name="mistral-7b",
    architecture="mistral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    sliding_window=4096,
    bos_token_id=1,
    eos_token_ids=(2,),
)

# Mistral-7B-Instruct-v0.2 (Sarathi-Serve's Mistral-7B): no sliding window, rope_theta 1e6.
MISTRAL_7B_INSTRUCT_V02 = MISTRAL_7B.replace(
    name="mistral-7b-instruct-v0.2", sliding_window=None, rope_theta=1000000.0
)

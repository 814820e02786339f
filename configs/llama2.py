"""Meta Llama 2 shapes (config.json of meta-llama/Llama-2-{7b,13b,70b}-hf): the models of
Vidur's and Sarathi-Serve's evaluations (LLaMA2-70B on 8 x A40, TP4-PP2)."""

from llmjax.config import ModelConfig

LLAMA2_7B = ModelConfig(
    name="llama2-7b",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_ids=(2,),
)

LLAMA2_13B = LLAMA2_7B.replace(
    name="llama2-13b",
    hidden_size=5120,
    intermediate_size=13824,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
)

LLAMA2_70B = LLAMA2_7B.replace(
    name="llama2-70b",
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
)

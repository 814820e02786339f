"""TII Falcon-180B shape (config.json of tiiuae/falcon-180B: the "new decoder architecture",
attention and MLP in parallel from one LayerNorm'd input, GQA with 8 KV heads of 64, MLP
4 x hidden with GELU, no biases). In Sarathi-Serve's evaluation on 8 x A100 over two nodes
(TP4-PP2). A shape for the simulated device only (architecture 'falcon')."""

from llmjax.config import ModelConfig

FALCON_180B = ModelConfig(
    name="falcon-180b",
    architecture="falcon",
    vocab_size=65024,
    hidden_size=14848,
    intermediate_size=4 * 14848,
    num_layers=80,
    num_heads=232,
    num_kv_heads=8,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,  # Falcon uses LayerNorm (eps 1e-5); the simulator does not read it
    bos_token_id=11,
    eos_token_ids=(11,),
)

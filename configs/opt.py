"""Meta OPT shapes (config.json of facebook/opt-{13b,66b}; OPT-175B from the OPT paper's Table 1):
multi-head attention with biases, a two-matrix ReLU MLP of 4 x hidden, learned positions. The
models of DistServe's evaluation. Shapes for the simulated device only (architecture 'opt')."""

from llmjax.config import ModelConfig

OPT_13B = ModelConfig(
    name="opt-13b",
    architecture="opt",
    vocab_size=50272,
    hidden_size=5120,
    intermediate_size=20480,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    max_position_embeddings=2048,
    attention_bias=True,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_ids=(2,),
)

OPT_66B = OPT_13B.replace(
    name="opt-66b",
    hidden_size=9216,
    intermediate_size=36864,
    num_layers=64,
    num_heads=72,
    num_kv_heads=72,
)

OPT_175B = OPT_13B.replace(
    name="opt-175b",
    hidden_size=12288,
    intermediate_size=49152,
    num_layers=96,
    num_heads=96,
    num_kv_heads=96,
)

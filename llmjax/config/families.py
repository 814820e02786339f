"""The architecture table by family (DESIGN principle 17): the architectures llmjax runs, what
each family fixes that its config.json does not say, HF's model_type names and defaults. Read by
`ModelConfig.from_hf_config` here and by llmjax/checkpoint/'s GGUF and HF readers."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Shapes the simulated device (llmjax/sim/) models but the JAX model does not implement: OPT (two
# MLP matrices, ReLU, learned positions) and Falcon (two MLP matrices, GELU, attention and MLP in
# parallel). A preset of these runs only with EngineConfig.device='sim'.
SIM_ONLY_ARCHITECTURES = ("opt", "falcon")


# The architecture table (DESIGN principle 17), by family. FAMILY_TRAITS: what a family fixes
# that its config.json does not say (ModelConfig fields). HF_MODEL_TYPES: HF's model_type ->
# ours. HF_DEFAULTS: what transformers' config class assumes for keys a config.json may omit
# ("pattern": every pattern-th layer is global, for configs without layer_types).
FAMILY_TRAITS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": {"norm_plus_one": True, "post_norms": True, "scale_embeddings": True},
    "gemma3": {
        "qk_norm": True,
        "norm_plus_one": True,
        "post_norms": True,
        "scale_embeddings": True,
    },
    # Mixtral: every top-k routing renormalized (HF's MixtralTopKRouter has no flag).
    "mixtral": {"norm_topk_prob": True},
    "qwen2_moe": {"attention_bias": True},
    "qwen3_moe": {"qk_norm": True},
}
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
_GEMMA_DEFAULTS = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"rms_norm_eps": 1e-6, "head_dim": 128},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6},
    "qwen2_moe": {
        "rms_norm_eps": 1e-6,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "pattern": 2,
    },
    "gemma3": {
        **_GEMMA_DEFAULTS,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "pattern": 6,
    },
}

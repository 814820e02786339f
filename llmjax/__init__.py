"""llmjax: a JAX research engine for serving LLMs.

The public API reads like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.
See docs/structure.md for the request lifecycle and where each stage lives.
"""

from llmjax.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RopeScaling,
    SchedulerConfig,
    SparseKVConfig,
)
from llmjax.engine.request import RequestOutput
from llmjax.llm import LLM
from llmjax.lora import LoRARequest
from llmjax.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "EngineConfig",
    "LoRAConfig",
    "LoRARequest",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "RopeScaling",
    "SamplingParams",
    "SchedulerConfig",
    "SparseKVConfig",
]
__version__ = "0.1.0"

"""Frozen, validated configuration dataclasses.

Configs are split by concern (model shape, KV cache, scheduler, engine), checked in `__post_init__`
with errors that name the offending values, and changed with `dataclasses.replace` (nested fields
by dotted path: `apply_overrides(config, {"scheduler.lpm_max_queue_len": 64})`, which the scripts'
`--override` flag uses). Presets live in the top-level `configs/` package as Python constants. No
module here imports jax (the Mosaic GPU kernels' shape limits are their modules', imported only
when `pallas_kernel="mgpu"` is asked for), nor anything of llmjax outside this package: the
readers of `ModelConfig` (llmjax/checkpoint/'s GGUF and HF loaders, llmjax/parallel/heads.py)
import it, never the reverse. Every name is importable from `llmjax.config`.

    model.py        ModelConfig (from an HF config.json), AttentionKind, DTYPES
    families.py     the architecture table: SUPPORTED_ARCHITECTURES, FAMILY_TRAITS, HF_DEFAULTS...
    rope.py         RopeScaling
    cache.py        CacheConfig (paged KV cache, prefix cache), KVGroups (the hybrid layout),
                    KVStoreConfig (the KV tiers)
    scheduler.py    SchedulerConfig (policies, admission order), ProgramConfig (Parrot)
    parallel.py     ParallelConfig (tp, pp, ep), tp_head_counts (the tp split of the heads)
    speculative.py  SpeculativeConfig
    lora.py         LoRAConfig (multi-LoRA serving), LORA_TARGETS
    sparse.py       SparseKVConfig (offload, InfiniGen, Quest, H2O)
    engine.py       EngineConfig (the configs together, checked against each other),
                    parse_kernel_options, layer_loop_scans
    overrides.py    apply_overrides, read_override (dotted paths, command-line strings)
    checks.py       _check_positive, shared by the others
"""

from llmjax.config.cache import (
    HYBRID_KV_CACHE,
    KV_CACHE_DTYPES,
    KV_HOST_MEMORIES,
    KV_LOAD_POLICIES,
    KV_SCALE_BYTES,
    KV_WRITE_POLICIES,
    PREFIX_CACHES,
    CacheConfig,
    KVGroups,
    KVStoreConfig,
    kv_groups,
    kv_row_bytes,
)
from llmjax.config.engine import (
    ASYNC_BY_DEFAULT,
    ATTENTION_BACKENDS,
    DEVICES,
    FLASH_PREFILL_MODES,
    LAYER_LOOPS,
    PALLAS_KERNELS,
    QUANTIZATIONS,
    UNROLL_BY_DEFAULT,
    EngineConfig,
    layer_loop_scans,
    parse_kernel_options,
)
from llmjax.config.families import (
    FAMILY_TRAITS,
    HF_DEFAULTS,
    HF_MODEL_TYPES,
    HIDDEN_ACTS,
    LAYER_TYPES,
    MOE_ARCHITECTURES,
    SIM_ONLY_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
)
from llmjax.config.lora import ATTENTION_TARGETS, LORA_TARGETS, LoRAConfig, lora_projection_dims
from llmjax.config.model import DTYPES, AttentionKind, ModelConfig
from llmjax.config.overrides import FIXED_BY_WEIGHTS, apply_overrides, read_override
from llmjax.config.parallel import HeadCounts, ParallelConfig, tp_head_counts
from llmjax.config.rope import RopeScaling
from llmjax.config.scheduler import (
    ADMISSION_ORDERS,
    PROGRAM_MODES,
    SCHEDULER_POLICIES,
    ProgramConfig,
    SchedulerConfig,
)
from llmjax.config.sparse import (
    EVICTION_POLICIES,
    PAGE_RESIDUALS,
    POOL_MEMORIES,
    QUERY_SOURCES,
    SELECTIVE_MODES,
    SPARSE_GRANULARITIES,
    SPARSE_KV_MODES,
    SparseKVConfig,
)
from llmjax.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = [
    "ADMISSION_ORDERS",
    "ASYNC_BY_DEFAULT",
    "ATTENTION_BACKENDS",
    "ATTENTION_TARGETS",
    "DEVICES",
    "DTYPES",
    "EVICTION_POLICIES",
    "FAMILY_TRAITS",
    "FIXED_BY_WEIGHTS",
    "FLASH_PREFILL_MODES",
    "HF_DEFAULTS",
    "HF_MODEL_TYPES",
    "HIDDEN_ACTS",
    "HYBRID_KV_CACHE",
    "KV_CACHE_DTYPES",
    "KV_HOST_MEMORIES",
    "KV_LOAD_POLICIES",
    "KV_SCALE_BYTES",
    "KV_WRITE_POLICIES",
    "LAYER_LOOPS",
    "LAYER_TYPES",
    "LORA_TARGETS",
    "MOE_ARCHITECTURES",
    "PAGE_RESIDUALS",
    "PALLAS_KERNELS",
    "POOL_MEMORIES",
    "PREFIX_CACHES",
    "PROGRAM_MODES",
    "QUANTIZATIONS",
    "QUERY_SOURCES",
    "SCHEDULER_POLICIES",
    "SELECTIVE_MODES",
    "SIM_ONLY_ARCHITECTURES",
    "SPARSE_GRANULARITIES",
    "SPARSE_KV_MODES",
    "SPECULATIVE_METHODS",
    "SUPPORTED_ARCHITECTURES",
    "UNROLL_BY_DEFAULT",
    "AttentionKind",
    "CacheConfig",
    "EngineConfig",
    "HeadCounts",
    "KVGroups",
    "KVStoreConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProgramConfig",
    "RopeScaling",
    "SchedulerConfig",
    "SparseKVConfig",
    "SpeculativeConfig",
    "apply_overrides",
    "kv_groups",
    "kv_row_bytes",
    "layer_loop_scans",
    "lora_projection_dims",
    "parse_kernel_options",
    "read_override",
    "tp_head_counts",
]

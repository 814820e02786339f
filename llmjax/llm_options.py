"""An `LLM`'s engine options (llmjax/llm.py), the `EngineConfig` they make and the engine built
from it. Nothing here imports llm.py.

    ENGINE_OPTIONS      LLM.__init__'s engine options, what `LLM.with_options` may change
    WEIGHT_OPTIONS      its arguments that fix the loaded weights, what it cannot change
    OPTION_PATHS        EngineConfig fields that an option sets (an override of one is the option)
    engine_config       the options and the loaded weights' settings -> EngineConfig
    build_engine        the LLMEngine of that config over the loaded weights
    default_num_pages   KV pages for max_num_seqs full-length requests within the memory budget
"""

from __future__ import annotations

import logging
import time

import numpy as np

from llmjax.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SparseKVConfig,
    SpeculativeConfig,
    apply_overrides,
    read_override,
)
from llmjax.engine.engine import LLMEngine
from llmjax.loading import infinigen_skew

logger = logging.getLogger(__name__)

# Where JAX reports no device memory limit (the CPU), the KV cache gets at most this many bytes
# unless num_pages is given.
CPU_KV_CACHE_BYTES = 1 << 30


# EngineConfig fields that an LLM option sets: an override by path acts as the option.
OPTION_PATHS = {
    "max_model_len": "max_model_len",
    "cache.page_size": "page_size",
    "cache.num_pages": "num_pages",
    "cache.prefix_cache": "prefix_cache",
    "cache.kv_cache_dtype": "kv_cache_dtype",
    "cache.hybrid_kv_cache": "hybrid_kv_cache",
    "scheduler.policy": "scheduler_policy",
    "scheduler.max_num_seqs": "max_num_seqs",
    "scheduler.max_num_batched_tokens": "max_num_batched_tokens",
    "scheduler.admission_order": "admission_order",
    "scheduler.balance_micro_batches": "balance_micro_batches",
    "parallel.check_lockstep": "check_lockstep",
    "attention_backend": "attention_backend",
    "flash_prefill": "flash_prefill",
    "pallas_kernel": "pallas_kernel",
    "kernel_options": "kernel_options",
    "layer_loop": "layer_loop",
    "seed": "seed",
    "precompile": "precompile",
    "async_scheduling": "async_scheduling",
    "compilation_cache_dir": "compilation_cache_dir",
}


def default_num_pages(config: EngineConfig, params_bytes: int, devices=None) -> int:
    """Pages for max_num_seqs full-length requests, capped by the memory budget (per device:
    tp * pp devices share the weights and the KV pages; the memory read is `devices[0]`'s, by
    default the first local device). In a multi-process run every process takes the smallest
    process's answer, so their block managers stay in lockstep."""
    import jax

    from llmjax.model.kv_cache import kv_cache_bytes
    from llmjax.parallel.heads import tp_head_layout

    page_size = config.cache.page_size
    parallel = config.parallel
    layout = tp_head_layout(config.model, parallel.tp, parallel.pad_heads)
    groups = config.kv_groups  # a hybrid layout's page holds fewer layers, and fewer are needed
    wanted = config.scheduler.max_num_seqs * groups.pages_for(config.max_model_len, page_size) + 1
    per_page = kv_cache_bytes(
        layout.model_config(config.model), 1, page_size, config.dtype, config.cache.kv_cache_dtype,
        groups,
    )  # fmt: skip
    per_page //= parallel.num_devices
    if groups.hybrid and parallel.pp > 1:  # a stage's pages hold its groups' KV slots
        slots = groups.slots_per_device(config.model.num_layers, parallel.pp)
        per_page = per_page * parallel.pp * slots // groups.num_slots
    device = next(iter(devices)) if devices else jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        used = stats.get("bytes_in_use", 0) + params_bytes // parallel.num_devices
        free = stats["bytes_limit"] - used
        budget = int(config.cache.memory_fraction * max(free, 0))
    else:
        budget = CPU_KV_CACHE_BYTES
    num_pages = max(2, min(wanted, budget // per_page))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        everyone = multihost_utils.process_allgather(np.array([num_pages], np.int64))
        num_pages = int(np.min(everyone))
    return num_pages


# LLM.__init__'s engine options (what `with_options` may change), in order.
ENGINE_OPTIONS = (
    "max_model_len",
    "page_size",
    "num_pages",
    "scheduler_policy",
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefix_cache",
    "kv_cache_dtype",
    "hybrid_kv_cache",
    "admission_order",
    "balance_micro_batches",
    "attention_backend",
    "flash_prefill",
    "pallas_kernel",
    "kernel_options",
    "layer_loop",
    "check_lockstep",
    "sparse_kv",
    "calibration_tokens",
    "seed",
    "precompile",
    "async_scheduling",
    "compilation_cache_dir",
    "overrides",
    "role",
    "devices",
    "kv_store",
    "speculative_config",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


# Arguments that fix how the weights were loaded and placed: `with_options` cannot change them.
WEIGHT_OPTIONS = (
    "model",
    "dtype",
    "quantization",
    "smoothquant",
    "tokenizer",
    "load_format",
    "tp",
    "pp",
    "ep",
    "pad_heads",
    "device",
    "sim",
)


def option_values(arguments: dict) -> dict:
    return {name: arguments[name] for name in ENGINE_OPTIONS}


def engine_config(options: dict, fixed: dict, model_config: ModelConfig):
    """The `EngineConfig` of an `LLM`'s engine options (`ENGINE_OPTIONS`; an override of a field
    that an option sets acts as that option) over what its weights fixed (`fixed`: model, dtype,
    quantization, tp, pp, ep, pad_heads, device, sim) -> (the options as applied, EngineConfig,
    the `kv_store` to share: a TieredStore, or None when a KVStoreConfig went into the config)."""
    o = dict(options)
    if o["overrides"]:
        # An override of a field that an option sets is that option, so the defaults that
        # derive from it (the token budget from the policy, num_pages) follow it.
        overrides = dict(o["overrides"])
        for path, name in OPTION_PATHS.items():
            if path in overrides:
                o[name] = read_override(EngineConfig, path, overrides.pop(path))
        o["overrides"] = overrides
    parallel = ParallelConfig(
        tp=fixed["tp"],
        pp=fixed["pp"],
        ep=fixed["ep"],
        pad_heads=fixed["pad_heads"],
        check_lockstep=o["check_lockstep"],
    )
    max_model_len = o["max_model_len"]
    if max_model_len is None:
        max_model_len = min(model_config.max_position_embeddings, 4096)
    max_num_batched_tokens = o["max_num_batched_tokens"]
    if max_num_batched_tokens is None:  # whole-prompt policies need room for any prompt
        chunked = SchedulerConfig(policy=o["scheduler_policy"]).chunks_prefills
        max_num_batched_tokens = 512 if chunked else max_model_len
    extra = {}
    if o["compilation_cache_dir"] is not None:
        extra["compilation_cache_dir"] = o["compilation_cache_dir"]
    sparse_kv = o["sparse_kv"]
    kv_store = o["kv_store"]
    if isinstance(kv_store, KVStoreConfig):
        extra["kv_store"] = kv_store
        kv_store = None
    config = EngineConfig(
        model=model_config,
        cache=CacheConfig(
            page_size=o["page_size"],
            num_pages=o["num_pages"],
            prefix_cache=o["prefix_cache"],
            kv_cache_dtype=o["kv_cache_dtype"],
            hybrid_kv_cache=o["hybrid_kv_cache"],
        ),
        scheduler=SchedulerConfig(
            policy=o["scheduler_policy"],
            max_num_seqs=o["max_num_seqs"],
            max_num_batched_tokens=max_num_batched_tokens,
            admission_order=o["admission_order"],
            balance_micro_batches=o["balance_micro_batches"],
        ),
        dtype=fixed["dtype"],
        quantization=fixed["quantization"],
        max_model_len=max_model_len,
        attention_backend=o["attention_backend"],
        flash_prefill=o["flash_prefill"],
        pallas_kernel=o["pallas_kernel"],
        kernel_options=o["kernel_options"],
        layer_loop=o["layer_loop"],
        parallel=parallel,
        sparse_kv=sparse_kv
        if isinstance(sparse_kv, SparseKVConfig)
        else SparseKVConfig(mode=sparse_kv),
        seed=o["seed"],
        precompile=o["precompile"],
        async_scheduling=o["async_scheduling"],
        device=fixed["device"],
        sim=fixed["sim"],
        speculative=SpeculativeConfig.coerce(o["speculative_config"]),
        lora=LoRAConfig(
            max_loras=o["max_loras"],
            max_lora_rank=o["max_lora_rank"],
            max_cpu_loras=o["max_cpu_loras"],
        )
        if o["enable_lora"]
        else None,
        **extra,
    )
    if o["overrides"]:  # any other field, by dotted path (the scripts' --override)
        config = apply_overrides(config, o["overrides"])
    return o, config, kv_store


def build_engine(
    config: EngineConfig, o: dict, fixed: dict, weights, tokenizer, kv_store, t0: float
) -> LLMEngine:
    """The `LLMEngine` of `config` (from `engine_config`, with the options `o` it applied) over
    the loaded `weights` (None on a simulated device): KV pages from the memory budget unless
    num_pages is given, InfiniGen's skew when that is the sparse KV mode."""
    if config.device == "sim":
        engine = LLMEngine(config, None, config.cache.num_pages, tokenizer, role=o["role"])
        logger.info(
            "simulated %s on %s (tp=%d, pp=%d, %s) with %d KV pages in %.3f s",
            fixed["model"],
            config.sim.hardware.name,
            config.parallel.tp,
            config.parallel.pp,
            fixed["dtype"],
            engine.block_manager.num_usable_pages,
            time.perf_counter() - t0,
        )
        return engine
    import jax.numpy as jnp

    from llmjax.model.params import num_params
    from llmjax.model.quant import weight_bytes

    model_config = config.model
    itemsize = jnp.dtype(fixed["dtype"]).itemsize
    params_bytes = num_params(model_config) * itemsize
    if config.parallel.num_devices == 1:
        params_bytes = weight_bytes(weights)  # quantized weights as stored
    num_pages = config.cache.num_pages
    if num_pages is None:
        num_pages = default_num_pages(config, params_bytes, o["devices"])
    skew = None
    if config.sparse_kv.mode == "infinigen":
        skew = infinigen_skew(config, weights, tokenizer, o["calibration_tokens"])
    engine = LLMEngine(
        config,
        weights,
        num_pages,
        tokenizer,
        skew=skew,
        role=o["role"],
        devices=o["devices"],
        kv_store=kv_store,
    )
    logger.info(
        "loaded %s (%.1f M params, %s, quantization %s, %.0f MB) with %d KV pages in %.1f s",
        fixed["model"],
        num_params(model_config) / 1e6,
        fixed["dtype"],
        fixed["quantization"],
        params_bytes / 1e6,
        num_pages,
        time.perf_counter() - t0,
    )
    return engine

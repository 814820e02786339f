"""The variants scripts/benchmark.py compares and the engines each runs on, from its flags: every
--policies x --prefix_caches x --admission_orders x --sparse_kv, each a fresh `LLM` (or real
instances behind --router: llmjax/cluster/) built as scripts/generate.py builds one
(llmjax/engine_flags.py). `flags` is the script's parsed absl flags.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from absl import app

from llmjax import engine_flags


class Variant(NamedTuple):
    """One engine configuration to measure."""

    policy: str
    prefix_cache: str
    admission_order: str
    sparse_kv: str
    name: str  # its column in the report


def variants(flags) -> list[Variant]:
    """Every policy x prefix cache x admission order (an order only with a cache), from the
    flags; named by policy alone when the cache options give one variant per policy."""
    from llmjax.config import ADMISSION_ORDERS, PREFIX_CACHES, SCHEDULER_POLICIES, SPARSE_KV_MODES

    def names(flag: str, allowed) -> list[str]:
        values = [v.strip() for v in flags[flag].value if v.strip()]
        if not values:
            raise app.UsageError(f"--{flag} is empty")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise app.UsageError(f"--{flag}: unknown {bad}; choose from {list(allowed)}")
        return list(dict.fromkeys(values))

    policies = names("policies", SCHEDULER_POLICIES)
    caches = names("prefix_caches", PREFIX_CACHES)
    orders = names("admission_orders", ADMISSION_ORDERS)
    sparse = names("sparse_kv", SPARSE_KV_MODES)
    combos = [
        (p, c, o) for p in policies for c in caches for o in (orders if c != "none" else ["fcfs"])
    ]
    one_per_policy = len(combos) == len(policies)
    out = []
    for p, c, o in combos:
        name = p if one_per_policy else f"{p}/{c}" + (f"/{o}" if c != "none" else "")
        for m in sparse:
            out.append(Variant(p, c, o, m, name if len(sparse) == 1 else f"{name}/{m}"))
    return out


def _is_whole_prompt(policy: str) -> bool:
    from llmjax.config import SchedulerConfig

    return not SchedulerConfig(policy=policy).chunks_prefills


def build_llm(flags, policy: str, **options):
    """A fresh `LLM` for `policy` from the flags (`options` replace single LLM options, e.g.
    prefix_cache and admission_order; `sparse_mode` names the sparse KV mode, whose parameters
    come from --config.sparse_kv.*)."""
    from llmjax import LLM

    return LLM(flags.model, **llm_kwargs(flags, policy, **options))


def llm_kwargs(flags, policy: str, **options) -> dict:
    """build_llm's LLM arguments (but the model)."""
    kwargs = engine_flags.llm_kwargs(flags) | dict(seed=flags.seed, scheduler_policy=policy)
    budget = options.pop("max_num_batched_tokens", flags.max_num_batched_tokens)
    if budget is not None and _is_whole_prompt(policy):
        # vLLM's classic policy admits whole prompts: its budget must hold the longest one.
        budget = max(budget, flags.max_model_len) if flags.max_model_len else None
    kwargs["max_num_batched_tokens"] = budget  # None: the LLM's default for the policy
    kwargs.update(options)
    kwargs["sparse_kv"] = kwargs.pop("sparse_mode", "none")
    return kwargs


def instance_specs(flags):
    """--instances, or --num_instances colocated ones: InstanceSpecs (None for one engine)."""
    try:
        return engine_flags.instance_specs(flags)
    except ValueError as e:
        raise app.UsageError(str(e)) from e


def build_cluster(flags, variant: Variant):
    """Real instances (--instances / --num_instances) behind --router: (cluster, the LLM of
    its first decode or colocated instance, for the engine info and the TBT SLO)."""
    from llmjax.cluster import launch

    kwargs = llm_kwargs(
        flags,
        variant.policy,
        prefix_cache=variant.prefix_cache,
        admission_order=variant.admission_order,
        sparse_mode=variant.sparse_kv,
    )
    for fixed in ("tp", "pp"):  # per instance
        kwargs.pop(fixed, None)
    cluster = launch(
        flags.model, instance_specs(flags), **engine_flags.launch_kwargs(flags), **kwargs
    )
    measured = next(i for i, r in enumerate(cluster.roles) if r in ("decode", "colocated"))
    llm = getattr(cluster.instances[measured], "llm", None)
    if llm is None:
        raise app.UsageError("--launcher ray: pass --tbt_slo (no in-process engine to measure)")
    return cluster, llm


def engine_info(flags, llm) -> dict:
    config = llm.config
    return {
        "policy": config.scheduler.policy,
        "prefix_cache": config.cache.prefix_cache,
        "admission_order": config.scheduler.admission_order,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_model_len": config.max_model_len,
        "page_size": config.cache.page_size,
        "num_pages": llm.engine.block_manager.num_pages,
        "dtype": config.dtype,
        "attention_backend": getattr(llm.engine.runner, "attention_backend", "simulated"),
        "flash_prefill": flags.flash_prefill,
        "pallas_kernel": flags.pallas_kernel,
        "kernel_options": config.kernel_options,
        "sparse_kv": config.sparse_kv.mode,
        # every EngineConfig field but the model's shape: what exactly ran
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "model"},
    }


def kv_cache_variant(entry: str) -> tuple[str, dict]:
    """A --kv_cache_dtypes entry of scripts/bench_kv_cache.py and eval_kv_cache.py ->
    (its label, engine options): 'int8' -> {'kv_cache_dtype': 'int8'}; 'DTYPE:OPTIONS' names the
    CPU attention kernel's options too (EngineConfig.kernel_options, attention_backend 'cpu'):
    'int8:int8_scores=false' is an int8 cache scored with float32 dots."""
    from llmjax.config import KV_CACHE_DTYPES, parse_kernel_options

    kv_cache_dtype, _, kernel_options = entry.partition(":")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise app.UsageError(f"--kv_cache_dtypes: {entry!r}: choose from {KV_CACHE_DTYPES}")
    if not kernel_options:
        return entry, dict(kv_cache_dtype=kv_cache_dtype)
    parse_kernel_options(kernel_options)  # raises on a malformed list
    options = dict(kv_cache_dtype=kv_cache_dtype, attention_backend="cpu")
    return entry, options | dict(kernel_options=kernel_options)

r"""The absl flags every script shares for building an engine, in one place.

Short flags for what researchers set most: `--model`, `--load_format`, `--tokenizer`, `--dtype`,
`--quantization`, `--smoothquant`, `--max_model_len`, `--page_size`, `--num_pages`,
`--kv_cache_dtype`,
`--max_num_seqs`, `--max_num_batched_tokens`, `--precompile`, `--async_scheduling`,
`--speculative_config`, the step's
kernels (`--attention_backend`, `--flash_prefill`, `--pallas_kernel`, `--kernel_options`,
`--layer_loop`), parallelism (`--tp`, `--pp`, `--ep`, `--pad_heads`, `--balance_micro_batches`,
`--check_lockstep`) and a multi-process launch (`--coordinator_address`, `--num_processes`,
`--process_id`), and a simulated device (`--device sim` with `--hardware`, `--cost_model`,
`--cost_profile`, `--memory_utilization`; llmjax/sim/). Scripts that run many instances also call
`define_cluster_flags()` (`--num_instances`, `--instances`, `--router`, `--launcher`,
`--kv_transport`, `--waiting_page_fraction`; llmjax/cluster/).

Every other `EngineConfig` field is an ml_collections config flag (DESIGN principle 4), set by
dotted path and applied after the short flags:

    python scripts/generate.py --config.scheduler.policy=prefill_first \
        --config.cache.watermark=0.02 --config.sparse_kv.mode=infinigen --config.sparse_kv.alpha=3

Values are read by the field's type ('none' for an optional field, true/false or
--config.X / --noconfig.X for a boolean, commas for a tuple) and validated by the config
dataclasses' own `__post_init__` as the script starts, with the errors the Python API gives
(`LLM(overrides=...)`, `llmjax.config.apply_overrides`); the fields the loaded weights fix
(`model.*`, `dtype`, `quantization`, `parallel.tp` / `pp` / `ep` / `pad_heads`) are refused:
use `--model`, `--dtype`, `--quantization`, `--tp`, `--pp`, `--ep`, `--pad_heads`. `--help`
lists the fields (the `--config` entry).

Use from a script:

    from absl import flags
    from llmjax import engine_flags

    engine_flags.define_flags()
    flags.adopt_module_key_flags(engine_flags)  # listed by --help, not only --helpfull
    ...
    def main(argv):
        engine_flags.initialize(FLAGS)            # jax.distributed for a multi-process run
        llm = LLM(FLAGS.model, **engine_flags.llm_kwargs(FLAGS))

ml_collections frozen-dataclass support: `DEFINE_config_dataclass` sets fields in place, and the
configs are frozen, so the flag is defined over an unfrozen mirror of `EngineConfig` (same field
names, types and defaults) whose every leaf is a flag from the start (so `--help` and repeated
in-process parsing see them all); the overrides the command line gives are then applied to the
real, frozen config.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from absl import flags

from llmjax.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    FIXED_BY_WEIGHTS,
    FLASH_PREFILL_MODES,
    HYBRID_KV_CACHE,
    KV_CACHE_DTYPES,
    LAYER_LOOPS,
    PALLAS_KERNELS,
    QUANTIZATIONS,
    EngineConfig,
    apply_overrides,
)

CONFIG_FLAG = "config"

# EngineConfig's sub-configs that validate on their own (the top-level fields are checked against
# the model once it is loaded).
_SUB_CONFIGS = ("cache", "scheduler", "parallel", "sparse_kv", "kv_store", "speculative")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Define the shared engine flags (a second call, from another script loaded in the same
    process, finds them defined)."""
    if CONFIG_FLAG in flag_values:
        return
    f = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "model",
        "smollm2-135m-instruct",
        "Preset name (see configs.PRESETS), a .gguf file, an HF directory (config.json + "
        "*.safetensors) or an llmjax orbax directory.",
        **f,
    )
    flags.DEFINE_enum(
        "load_format", "auto", ["auto", "dummy"], "'dummy' uses random weights (presets only).", **f
    )
    flags.DEFINE_string(
        "tokenizer",
        None,
        "A .gguf file or a directory with tokenizer.json to take the tokenizer from (default: "
        "the model's own), e.g. SmolLM2's for --model smollm2-tiny --load_format dummy.",
        **f,
    )
    flags.DEFINE_enum(
        "dtype",
        "float32",
        list(DTYPES),
        "Weights and KV cache dtype (float32 is fastest on CPUs; bfloat16 on GPUs/TPUs).",
        **f,
    )
    flags.DEFINE_enum(
        "quantization",
        "none",
        list(QUANTIZATIONS),
        "Weight quantization: 'int8' (W8A16: int8 weights per output channel, the matmuls' "
        "activations rounded to bfloat16, float32 sums), 'w8a8' (W8A8 dynamic int8 matmuls, "
        "SmoothQuant-smoothed: --smoothquant; the LM head weight-only), 'int8_wo' (weight-only "
        "int8, activations in --dtype), 'q8_0' / 'q4_0' / 'q4_1' (the "
        "weights quantized to those GGUF block formats), 'gguf' (a GGUF file's Q8_0/Q4_0/Q4_1 "
        "blocks kept as stored). Activations and the KV cache stay in --dtype.",
        **f,
    )
    flags.DEFINE_string(
        "smoothquant",
        "auto",
        "SmoothQuant's migration strength alpha for --quantization w8a8 (activation outliers "
        "moved into the weights, scales calibrated at load on the bundled text's tail; "
        "llmjax/model/smooth.py): 'auto' (0.5 with w8a8), 'none' (plain W8A8), or a number in "
        "[0, 1].",
        **f,
    )
    flags.DEFINE_integer(
        "max_model_len", None, "Max prompt + generated tokens (default: min(context, 4096)).", **f
    )
    flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", **f)
    flags.DEFINE_enum(
        "kv_cache_dtype",
        "auto",
        list(KV_CACHE_DTYPES),
        "What the KV pages store (vLLM's names): auto = the model dtype; int8 / fp8_e4m3 / "
        "fp8_e5m2 with a float32 scale per token and kv head (CacheConfig.kv_cache_dtype).",
        **f,
    )
    flags.DEFINE_enum(
        "hybrid_kv_cache",
        "auto",
        list(HYBRID_KV_CACHE),
        "One page table per group of layers, sliding-window layers holding only their window's "
        "pages (Gemma 2/3; vLLM's hybrid KV cache manager): auto = where the model and the "
        "engine's features allow (CacheConfig.hybrid_kv_cache).",
        **f,
    )
    flags.DEFINE_integer(
        "num_pages", None, "KV cache pages (default: sized from the memory budget).", **f
    )
    flags.DEFINE_integer("max_num_seqs", 32, "Max running requests per step.", **f)
    flags.DEFINE_integer(
        "max_num_batched_tokens",
        None,
        "Token budget per step (Sarathi-Serve's chunk size; default 512 for the chunking "
        "policies, max_model_len for the whole-prompt ones).",
        **f,
    )
    flags.DEFINE_bool(
        "precompile",
        False,
        "Compile every step shape when the engine starts (EngineConfig.precompile), so that "
        "serving never compiles; JAX's persistent cache makes later starts fast.",
        **f,
    )
    flags.DEFINE_bool(
        "async_scheduling",
        None,
        "Schedule and pack the next step while the device runs this one "
        "(EngineConfig.async_scheduling; default: the backend's, see docs/engine.md).",
        **f,
    )
    flags.DEFINE_string(
        "speculative_config",
        None,
        "Speculative decoding as vLLM's --speculative-config, a JSON object, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(llmjax.config.SpeculativeConfig; or --config.speculative.<field>).",
        **f,
    )
    flags.DEFINE_bool(
        "enable_lora",
        False,
        "Serve LoRA adapters, many in one batch (LLM(enable_lora=True); LoRAConfig).",
        **f,
    )
    flags.DEFINE_integer("max_loras", 1, "LoRA adapters on the device at once.", **f)
    flags.DEFINE_integer("max_lora_rank", 16, "The largest LoRA rank a device slot holds.", **f)
    flags.DEFINE_integer(
        "max_cpu_loras", None, "LoRA adapters kept in host memory (default: max_loras).", **f
    )
    _define_kernel_flags(f)
    _define_parallel_flags(f)
    _define_sim_flags(f)
    _define_config_flag(flag_values)


def _define_sim_flags(f: dict) -> None:
    flags.DEFINE_enum(
        "device",
        "jax",
        ["jax", "sim"],
        "'jax': the real device; 'sim': a simulated one (llmjax/sim/: the engine's own scheduler "
        "on a virtual clock, each step's time from --cost_model; no weights, no JAX). With sim, "
        "use --dtype bfloat16 for an accelerator.",
        **f,
    )
    flags.DEFINE_string(
        "hardware",
        "a100-80gb",
        "--device sim: the simulated accelerator (a100-80gb, a100-80gb-pcie, a40, h100-sxm, h200, "
        "tpu-v5e, tpu-v5p; llmjax.sim.hardware.HARDWARE) or a profile JSON of "
        "scripts/profile_step.py --roofline (this CPU).",
        **f,
    )
    flags.DEFINE_enum(
        "cost_model",
        "roofline",
        ["roofline", "fitted"],
        "--device sim: 'roofline' (analytic, from --hardware and the model's shape) or 'fitted' "
        "(the linear model fitted to --cost_profile).",
        **f,
    )
    flags.DEFINE_string(
        "cost_profile", None, "--cost_model fitted: a JSON of scripts/profile_step.py.", **f
    )
    flags.DEFINE_bool(
        "sim_padded",
        False,
        "--device sim --cost_model roofline: charge each step's padded bucket shape (as llmjax's "
        "jitted steps run) instead of its real tokens (as an unpadded GPU engine runs).",
        **f,
    )
    flags.DEFINE_float(
        "memory_utilization",
        0.9,
        "--device sim: fraction of each device's memory for weights and KV pages.",
        **f,
    )


def _define_kernel_flags(f: dict) -> None:
    flags.DEFINE_enum(
        "attention_backend",
        "auto",
        list(ATTENTION_BACKENDS),
        "Attention: 'pallas' kernels (compiled on GPU/TPU, interpreted on the CPU: slow), "
        "'reference' (plain jnp), 'cpu' (kernels_cpu/'s C++ kernel, built at first use), 'auto' "
        "(pallas on GPU/TPU; on the CPU, cpu where it builds, else reference).",
        **f,
    )
    flags.DEFINE_enum(
        "flash_prefill",
        "auto",
        list(FLASH_PREFILL_MODES),
        "With the pallas backend, attend a step that is one fresh prompt with the flash prefill "
        "kernel: 'auto' where measured faster (GPU, >= 2048-token buckets), 'on' always, 'off' "
        "never.",
        **f,
    )
    flags.DEFINE_enum(
        "pallas_kernel",
        "auto",
        list(PALLAS_KERNELS),
        "With the pallas backend, the attention kernels (ragged paged attention and flash "
        "prefill): 'auto' (the platform's: gpu on CUDA, tpu on TPU and on the CPU), 'tpu' (Mosaic "
        "TPU), 'gpu' (Triton), 'mgpu' (Mosaic GPU for Hopper; needs --dtype bfloat16 or float16).",
        **f,
    )
    flags.DEFINE_string(
        "kernel_options",
        "",
        "With a named --pallas_kernel, that ragged paged attention kernel's arguments as "
        "key=value,... (integers or true/false), e.g. 'warp_specialized=true,num_consumers=2' "
        "or 'num_stages=2' for mgpu; see EngineConfig.kernel_options.",
        **f,
    )
    flags.DEFINE_enum(
        "layer_loop",
        "auto",
        list(LAYER_LOOPS),
        "How the step runs the decoder layers: 'scan' (lax.scan over stacked weights: compile "
        "time independent of depth), 'unroll' (one copy of the layer per layer in the program), "
        "'auto' (scan; unrolled on GPUs and with a sparse KV mode); see EngineConfig.layer_loop.",
        **f,
    )


def _define_parallel_flags(f: dict) -> None:
    flags.DEFINE_integer("tp", 1, "Tensor-parallel devices (ParallelConfig.tp).", **f)
    flags.DEFINE_integer("pp", 1, "Pipeline stages (ParallelConfig.pp).", **f)
    flags.DEFINE_integer(
        "ep",
        1,
        "Expert parallelism within the --tp devices (ParallelConfig.ep, a divisor of tp): a "
        "mixture of experts' experts split into ep groups, tokens sent to them by all-to-all.",
        **f,
    )
    flags.DEFINE_bool(
        "pad_heads",
        False,
        "Pad the kv heads with zero heads to a multiple of --tp when tp does not split them "
        "(e.g. SmolLM2's 3 kv heads at --tp 2).",
        **f,
    )
    flags.DEFINE_bool(
        "balance_micro_batches",
        False,
        "With --pp > 1, cap each micro-batch at ceil(decoding requests / pp) decodes "
        "(SchedulerConfig.balance_micro_batches; Sarathi-Serve's rule takes every decode).",
        **f,
    )
    flags.DEFINE_bool(
        "check_lockstep",
        False,
        "Multi-host debugging: compare sampled tokens across processes.",
        **f,
    )
    flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0, for a multi-process run.", **f
    )
    flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.", **f)
    flags.DEFINE_integer("process_id", 0, "This process's index in a multi-process run.", **f)


# ------------------------------------------------------------------------------------------------
# --config.*: EngineConfig by dotted path.


def _default_engine_config() -> EngineConfig:
    """EngineConfig with its defaults, over the default model's shape (the `model.*` entries
    only exist to be refused with a clear message)."""
    import configs

    return EngineConfig(model=configs.get_preset("smollm2-135m-instruct"))


def _leaf_hint(hint) -> type:
    """The type a mirror field holds: int, float, str and bool as they are (ml_collections parses
    them, booleans also as --config.X / --noconfig.X); optional, tuple and other fields as the
    command-line string, parsed by `apply_overrides` with the real type."""
    return hint if hint in (int, float, str, bool) else str


def _is_config(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _format(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _mirror(config) -> tuple[object, list[tuple[str, object, object]]]:
    """An unfrozen copy of the config dataclass tree `config` (same field names and defaults)
    and its leaves as (dotted path, real type, default value). Optional nested configs (the
    model's rope_scaling) are not leaves: they have no fields to set when absent."""
    leaves: list[tuple[str, object, object]] = []

    def build(obj, prefix: str):
        hints = typing.get_type_hints(type(obj))
        fields, values = [], {}
        for field in dataclasses.fields(obj):
            hint, value = hints[field.name], getattr(obj, field.name)
            if field.default is not dataclasses.MISSING and not _is_config(hint):
                value = field.default  # as declared (EngineConfig resolves max_model_len)
            path = prefix + field.name
            if _is_config(hint):
                sub = build(value, path + ".")
                fields.append((field.name, type(sub), dataclasses.field(default=None)))
                values[field.name] = sub
            elif typing.get_origin(hint) in (typing.Union, types.UnionType) and any(
                _is_config(a) for a in typing.get_args(hint)
            ):
                continue
            else:
                leaf = _leaf_hint(hint)
                leaves.append((path, hint, value))
                fields.append((field.name, leaf, dataclasses.field(default=None)))
                keep = leaf is not str or isinstance(value, str)
                values[field.name] = value if keep else _format(value)
        name = type(obj).__name__
        # Short repr: absl prints the flag's value in its errors.
        cls = dataclasses.make_dataclass(
            name + "Flags", fields, namespace={"__repr__": lambda self, n=name: f"{n}(...)"}
        )
        return cls(**values)

    return build(config, ""), leaves


_LEAVES: list[tuple[str, object, object]] = []


def _fields_help(leaves) -> str:
    lines = [
        "EngineConfig fields, each settable as --config.PATH=VALUE and applied after the short "
        "flags ('none' for an optional field; commas for a tuple). model.*, dtype, quantization "
        "and parallel.tp/pp/ep/pad_heads are fixed by the loaded weights: use --model, "
        "--dtype, --quantization, --tp, --pp, --ep, --pad_heads. Fields:"
    ]
    for path, hint, default in leaves:
        if path.startswith("model."):
            continue
        name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        lines.append(f"  {path} ({name}; default {_format(default)!r})")
    return "\n".join(lines)


def _define_config_flag(flag_values: flags.FlagValues) -> None:
    from ml_collections import config_flags

    mirror, leaves = _mirror(_default_engine_config())
    _LEAVES[:] = leaves
    every_leaf = ["llmjax"] + [f"--{CONFIG_FLAG}.{path}" for path, _, _ in leaves]
    config_flags.DEFINE_config_dataclass(
        CONFIG_FLAG, mirror, _fields_help(leaves), flag_values=flag_values, sys_argv=every_leaf
    )

    def valid(_) -> bool:
        try:
            check_overrides(config_overrides(flag_values))
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    flags.register_validator(CONFIG_FLAG, valid, flag_values=flag_values)


def config_overrides(values: flags.FlagValues) -> dict[str, object]:
    """The --config.PATH=VALUE flags given on the command line, {path: value} in the order of
    EngineConfig's fields (typed values for int/float/str/bool fields, the given strings for the
    others, which `apply_overrides` reads by their type)."""
    out = {}
    for path, _, _ in _LEAVES:
        flag = values[f"{CONFIG_FLAG}.{path}"]
        if flag.present:
            out[path] = flag.value
    return out


def check_overrides(overrides: dict[str, object]) -> None:
    """Raise ValueError for an override of a field the weights fix, or a value its config
    dataclass refuses (each sub-config checked on its own defaults; the fields of EngineConfig
    itself are checked when the engine is built, against the loaded model)."""
    for path in overrides:
        if any(path == f or path.startswith(f + ".") for f in FIXED_BY_WEIGHTS):
            short = {
                "dtype": "--dtype",
                "quantization": "--quantization",
                "parallel.pp": "--pp",
                "parallel.tp": "--tp",
                "parallel.ep": "--ep",
                "device": "--device",
                "sim": "--device sim and --hardware / --cost_model",
            }
            use = short.get(path, "--pad_heads" if path.endswith("pad_heads") else "--model")
            raise ValueError(
                f"--{CONFIG_FLAG}.{path} is fixed by the loaded weights; set it with {use}"
            )
    defaults = _default_engine_config()
    for name in _SUB_CONFIGS:
        mine = {p[len(name) + 1 :]: v for p, v in overrides.items() if p.startswith(name + ".")}
        for rest, value in mine.items():  # each alone, so the error names its flag
            try:
                apply_overrides(getattr(defaults, name), {rest: value})
            except ValueError as e:
                raise ValueError(f"--{CONFIG_FLAG}.{name}.{rest}={value}: {e}") from None
        try:
            apply_overrides(getattr(defaults, name), mine)
        except ValueError as e:
            raise ValueError(f"--{CONFIG_FLAG}.{name}.*: {e}") from None


# ------------------------------------------------------------------------------------------------
# Many instances (llmjax/cluster/): the scripts that serve or benchmark a cluster.

CLUSTER_FLAGS = (
    "num_instances",
    "instances",
    "router",
    "launcher",
    "kv_transport",
    "waiting_page_fraction",
)


def define_cluster_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """--num_instances, --instances, --router, --launcher, --kv_transport and
    --waiting_page_fraction (llmjax/cluster/; `instance_specs` and `launch_kwargs` read them)."""
    from llmjax.cluster.router import ROUTERS

    if "instances" in flag_values:
        return
    flags.DEFINE_integer(
        "num_instances",
        1,
        "Colocated engine instances behind a router; each variant gets this many fresh engines "
        "(--device sim: llmjax.sim.SimCluster, one simulated timeline; a real device: the local "
        "launcher, llmjax.cluster.launch, instance k on the k-th tp * pp devices).",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "instances",
        "",
        "Instances with roles, instead of --num_instances, e.g. 'prefill:tp=2,decode:tp=2' or "
        "'2xprefill,decode' (llmjax.cluster.InstanceSpec.parse): DistServe's disaggregation, the "
        "KV moved from prefill to decode instances by --kv_transport (--device sim: a "
        "SimCluster with roles, the transfer time modeled).",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "launcher",
        "local",
        ["local", "ray"],
        "Real instances: in this process, or Ray actors.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "kv_transport",
        "local",
        ["local", "transfer_server"],
        "How KV pages move between instances (llmjax/cluster/transfer.py).",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "waiting_page_fraction",
        0.05,
        "DistServe's pull condition: a decode instance takes a request while its waiting queue "
        "uses less than this fraction of its KV pages.",
        flag_values=flag_values,
    )
    flags.DEFINE_enum(
        "router",
        "round_robin",
        list(ROUTERS),
        "With --num_instances > 1: which instance each request goes to (llmjax.cluster.ROUTERS): "
        "round_robin, random, least_outstanding, power_of_two (the less loaded of two at "
        "random), cache_aware (sglang-router's: longest prefix match unless the load is "
        "imbalanced), mooncake (Mooncake's Conductor: with --instances prefill/decode, the "
        "(prefill, decode) pair by predicted TTFT and TBT, remote prefix fetch; colocated, the "
        "TTFT choice alone).",
        flag_values=flag_values,
    )


# ------------------------------------------------------------------------------------------------
# From flags to an engine.


def llm_kwargs(values: flags.FlagValues) -> dict:
    """The LLM(...) keyword arguments (all but `model`) the shared flags set, the --config.*
    overrides included (as `overrides`)."""
    kwargs = dict(
        dtype=values.dtype,
        quantization=values.quantization,
        smoothquant=values.smoothquant,
        load_format=values.load_format,
        tokenizer=values.tokenizer,
        max_model_len=values.max_model_len,
        page_size=values.page_size,
        num_pages=values.num_pages,
        kv_cache_dtype=values.kv_cache_dtype,
        hybrid_kv_cache=values.hybrid_kv_cache,
        max_num_seqs=values.max_num_seqs,
        max_num_batched_tokens=values.max_num_batched_tokens,
        precompile=values.precompile,
        async_scheduling=values.async_scheduling,
        attention_backend=values.attention_backend,
        flash_prefill=values.flash_prefill,
        pallas_kernel=values.pallas_kernel,
        kernel_options=values.kernel_options,
        layer_loop=values.layer_loop,
        tp=values.tp,
        pp=values.pp,
        ep=values.ep,
        pad_heads=values.pad_heads,
        balance_micro_batches=values.balance_micro_batches,
        check_lockstep=values.check_lockstep,
    )
    if values.enable_lora:
        kwargs.update(
            enable_lora=True,
            max_loras=values.max_loras,
            max_lora_rank=values.max_lora_rank,
            max_cpu_loras=values.max_cpu_loras,
        )
    if values.speculative_config:
        import json

        from llmjax.config import SpeculativeConfig

        try:
            spec = json.loads(values.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative_config is not JSON: {e}") from None
        kwargs["speculative_config"] = SpeculativeConfig.coerce(spec)
    if values.device == "sim":
        from llmjax.sim import SimConfig

        kwargs["device"] = "sim"
        kwargs["sim"] = SimConfig(
            cost_model=values.cost_model,
            hardware=values.hardware,
            profile=values.cost_profile,
            memory_utilization=values.memory_utilization,
            padded=values.sim_padded,
        )
        del kwargs["load_format"]  # a simulated device loads no weights
    overrides = config_overrides(values)
    if overrides:
        kwargs["overrides"] = overrides
    return kwargs


def argv(values: flags.FlagValues) -> list[str]:
    """The shared flags given on the command line, as arguments for another script (e.g.
    scripts/bench_serving.py starting scripts/serve.py with the same engine)."""
    names = [n for n in values.get_key_flags_for_module(__name__) if n.name != CONFIG_FLAG]
    out = [flag.serialize() for flag in names if flag.present]
    for path, value in config_overrides(values).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"--{CONFIG_FLAG}.{path}={text}")
    return out


def initialize(values: flags.FlagValues) -> None:
    """jax.distributed start-up from the flags (a no-op for one process)."""
    from llmjax.parallel.distributed import initialize as init

    init(values.coordinator_address, values.num_processes, values.process_id)


def instance_specs(values: flags.FlagValues):
    """--instances, or --num_instances colocated instances of --tp x --pp: a list of
    `llmjax.cluster.InstanceSpec`, or None for one engine. ValueError names a bad spec."""
    from llmjax.cluster.launch import InstanceSpec

    if values.instances:
        if values["num_instances"].present:
            raise ValueError("give --instances or --num_instances, not both")
        return InstanceSpec.parse(values.instances)
    if values.num_instances < 1:
        raise ValueError(f"--num_instances={values.num_instances} must be >= 1")
    if values.num_instances > 1:
        return [InstanceSpec("colocated", tp=values.tp, pp=values.pp)] * values.num_instances
    return None


def launch_kwargs(values: flags.FlagValues) -> dict:
    """`llmjax.cluster.launch` arguments from the cluster flags (but the model and specs)."""
    return dict(
        launcher=values.launcher,
        router=values.router,
        transport=values.kv_transport,
        waiting_page_fraction=values.waiting_page_fraction,
    )


def is_leader(values: flags.FlagValues) -> bool:
    """Whether this process prints and writes files (process 0)."""
    return values.process_id == 0

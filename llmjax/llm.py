"""`LLM`: the user-facing API (reads like vLLM's).

    llm = LLM()                                        # SmolLM2-135M-Instruct from its wheel
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].text)
    for piece in llm.stream("Once upon a time"):
        print(piece, end="", flush=True)

`model` is a preset name (`configs.PRESETS`), a .gguf file, an HF directory (config.json +
safetensors) or a directory saved by `llmjax.checkpoint.save_params`. With `load_format="dummy"`
any preset runs with random weights (for tests and shape experiments).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np

from llmjax.config import (
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SparseKVConfig,
    SpeculativeConfig,
    apply_overrides,
    layer_loop_scans,
    read_override,
)
from llmjax.engine.block_manager import pages_needed
from llmjax.engine.engine import LLMEngine
from llmjax.engine.request import RequestOutput
from llmjax.progress import progress_bar
from llmjax.sampling_params import SamplingParams
from llmjax.tokenizer import TextStream, Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Where JAX reports no device memory limit (the CPU), the KV cache gets at most this many bytes
# unless num_pages is given.
CPU_KV_CACHE_BYTES = 1 << 30

Prompt = str | Sequence[int]
Message = dict[str, str]


# EngineConfig fields that an LLM option sets: an override by path acts as the option.
OPTION_PATHS = {
    "max_model_len": "max_model_len",
    "cache.page_size": "page_size",
    "cache.num_pages": "num_pages",
    "cache.prefix_cache": "prefix_cache",
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
    wanted = config.scheduler.max_num_seqs * pages_needed(config.max_model_len, page_size) + 1
    parallel = config.parallel
    layout = tp_head_layout(config.model, parallel.tp, parallel.pad_heads)
    per_page = kv_cache_bytes(layout.model_config(config.model), 1, page_size, config.dtype)
    per_page //= parallel.num_devices
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
)


def _option_values(arguments: dict) -> dict:
    return {name: arguments[name] for name in ENGINE_OPTIONS}


class LLM:
    """Load a model and its tokenizer, and serve requests with continuous batching.

    Weights: `model` (a preset, a .gguf file, an HF or orbax directory), `dtype` (of the weights,
    activations and KV cache), `quantization` ('none'; 'int8': W8A8 dynamic int8 matmuls, the
    weights smoothed first by SmoothQuant with migration strength `smoothquant` ('auto': 0.5;
    None or 'none': plain W8A8; scales calibrated at load on the bundled text's last 512
    tokens, ~2 s on a CPU; llmjax/model/smooth.py), the LM head weight-only int8;
    'int8_wo': weight-only int8 (activations stay in `dtype`); 'q8_0', 'q4_0', 'q4_1': the
    weights quantized to those GGUF block formats; 'gguf': a GGUF file's Q8_0/Q4_0/Q4_1 blocks
    kept as stored; see EngineConfig and llmjax/model/quant.py), `tokenizer`, `load_format`
    ('dummy': random weights).

    Engine options: `max_model_len` (prompt + generated tokens per request; default the model's
    context, capped at 4096), `page_size`, `num_pages` (default: what the memory budget allows),
    `scheduler_policy` (sarathi | prefill_first | decode_first | splitfuse, see SchedulerConfig),
    `max_num_seqs`, `max_num_batched_tokens` (the token budget; default 512 for the chunking
    policies, max_model_len for the whole-prompt ones), `prefix_cache` ('radix' reuses the KV of
    shared prefixes, 'none' turns that off; see CacheConfig), `admission_order` ('fcfs' or 'lpm',
    longest cached prefix first; see SchedulerConfig), `balance_micro_batches` (pp > 1: decodes
    spread evenly over the micro-batches; see SchedulerConfig), `seed` (for requests without their
    own seed), `attention_backend` ('auto', 'reference' or 'pallas'; see EngineConfig),
    `flash_prefill` ('auto', 'on', 'off'; see EngineConfig), `pallas_kernel` ('auto', 'tpu', 'gpu',
    'mgpu': the attention kernels; see EngineConfig), `kernel_options` (that ragged kernel's
    arguments, 'key=value,...'; see EngineConfig), `layer_loop` ('auto', 'scan', 'unroll': the step
    scans over stacked layers or unrolls them; see EngineConfig), `precompile` (compile every step
    shape at start; see EngineConfig), `async_scheduling` (schedule the next step while the
    device runs this one; None: the backend's default; see EngineConfig), `tp` / `pp` / `ep` /
    `pad_heads` / `check_lockstep` (tensor, pipeline and, within the tp devices, expert
    parallelism over the first tp * pp devices; see ParallelConfig; in a multi-host run call
    `llmjax.parallel.distributed.initialize` first, in every process), `sparse_kv` ('none',
    'offload', 'infinigen', or a SparseKVConfig with InfiniGen's parameters: the KV cache in a
    host-memory pool, fetched whole or selectively; with 'infinigen' and no `skew_dir` the skewing
    matrices are calibrated at start-up on the first `calibration_tokens` tokens of a bundled
    public-domain text, llmjax/sparse/). `overrides`: any other EngineConfig field by dotted path,
    applied last (`{"scheduler.lpm_max_queue_len": 64, "cache.watermark": 0.02}`; see
    `llmjax.config.apply_overrides`).

    `role` ('colocated', 'prefill', 'decode') and `devices` (the engine runs on the first tp * pp
    of them; default all): an instance of a disaggregated cluster on its own sub-mesh
    (llmjax/cluster/: `llmjax.cluster.launch` builds those; see `LLMEngine`).

    `kv_store`: KV tiers below the device pages (Mooncake's KV-centric store, issue 22): a
    `llmjax.config.KVStoreConfig` (host memory, disk, Mooncake Store; write and load policies)
    or a `llmjax.kvstore.TieredStore` shared with other engines of the same model; see
    llmjax/engine/kv_tiers.py. Default: none.

    `speculative_config`: speculative decoding as vLLM spells it, a dict (`{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}`) or a `llmjax.config.
    SpeculativeConfig` (docs/speculative.md). Default: none.

    `device='sim'` runs the engine on a simulated device (llmjax/sim/, docs/simulator.md): only
    the model's shape is read (a preset, an HF config.json or GGUF metadata; no weights, no
    JAX), `sim` (a `llmjax.sim.SimConfig`: hardware, cost model, memory utilization) prices
    each step on the engine's virtual clock, and `num_pages` defaults to what the hardware's
    memory holds beside the weights. `dtype` defaults to float32 on a real device and bfloat16
    on a simulated one.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | None = None,
        quantization: str = "none",
        smoothquant: float | str | None = "auto",
        tokenizer: str | None = None,
        load_format: str = "auto",
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        scheduler_policy: str = "sarathi",
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        prefix_cache: str = "radix",
        admission_order: str = "fcfs",
        balance_micro_batches: bool = False,
        attention_backend: str = "auto",
        flash_prefill: str = "auto",
        pallas_kernel: str = "auto",
        kernel_options: str = "",
        layer_loop: str = "auto",
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        pad_heads: bool = False,
        check_lockstep: bool = False,
        sparse_kv: str | SparseKVConfig = "none",
        calibration_tokens: int = 2048,
        seed: int = 0,
        precompile: bool = False,
        async_scheduling: bool | None = None,
        compilation_cache_dir: str | None = None,
        overrides: dict | None = None,
        device: str = "jax",
        sim=None,
        role: str = "colocated",
        devices=None,
        kv_store=None,
        speculative_config=None,
    ):

        if load_format not in ("auto", "dummy"):
            raise ValueError(f"{load_format=} must be 'auto' or 'dummy'")
        t0 = time.perf_counter()
        if device == "sim":
            self._init_sim(model, dtype or "bfloat16", quantization, tokenizer, tp, pp, ep, sim)
            self._build_engine(dict(_option_values(locals())), t0)
            return
        if device != "jax":
            raise ValueError(f"unknown {device=}; choose 'jax' or 'sim'")
        if sim is not None:
            raise ValueError("sim= (a SimConfig) goes with device='sim'")
        dtype = dtype or "float32"
        sharded = tp * pp > 1  # then weights load one at a time, each device getting its shard
        parallel = ParallelConfig(
            tp=tp, pp=pp, ep=ep, pad_heads=pad_heads, check_lockstep=check_lockstep
        )
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown {quantization=}; choose one of {QUANTIZATIONS}")
        if quantization != "none" and sharded:
            raise ValueError(
                f"quantization={quantization!r} runs on one device for now (tp={tp}, pp={pp})"
            )
        alpha = _smoothquant_alpha(smoothquant, quantization)  # checked before the load
        self._model_config, params, self.tokenizer = _load(
            model, dtype, load_format, tokenizer, parallel if sharded else None, quantization
        )
        if alpha is not None and self._model_config.is_moe:
            if smoothquant != "auto":
                raise ValueError(
                    f"smoothquant={smoothquant!r}: SmoothQuant of a mixture of experts (its "
                    "router and experts share the MLP input) is not implemented; use "
                    "smoothquant='none'"
                )
            logger.info("SmoothQuant skipped: not implemented for a mixture of experts")
            alpha = None
        if alpha is not None:
            params = _smoothed(params, self._model_config, self.tokenizer, alpha)
        if not sharded:  # else ModelRunner places (and converts) each weight on the mesh
            params = _pack_weights(params, quantization, dtype)
            sparse = sparse_kv if isinstance(sparse_kv, str) else sparse_kv.mode
            if layer_loop_scans(layer_loop, sparse != "none"):
                from llmjax.model.params import stack_layers

                params = stack_layers(params)  # on the host, before the device holds them
            params = _to_device(params, dtype)
        self._weights = params
        self._fixed = dict(
            model=model,
            dtype=dtype,
            quantization=quantization,
            tp=tp,
            pp=pp,
            ep=ep,
            pad_heads=pad_heads,
        )
        self._fixed["smoothquant"] = alpha
        self._fixed["device"], self._fixed["sim"] = "jax", None
        self._build_engine(dict(_option_values(locals())), t0)

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

    def with_options(self, **options) -> LLM:
        """Another LLM over this one's loaded weights and tokenizer, with other engine options
        (any __init__ argument but WEIGHT_OPTIONS; the rest keep this LLM's values), e.g.

            fcfs = LLM()
            lpm = fcfs.with_options(admission_order="lpm", max_num_batched_tokens=256)

        Nothing is loaded or copied: both engines read the same weight arrays (each has its own
        KV cache, so give `num_pages` when memory is tight). With tp * pp > 1 the new engine
        places the weights again from what was loaded (for a GGUF/HF checkpoint: read again,
        one weight at a time)."""
        fixed = sorted(set(options) & set(self.WEIGHT_OPTIONS))
        if fixed:
            raise ValueError(
                f"{fixed} fix how the weights were loaded: load another LLM to change them"
            )
        unknown = sorted(set(options) - set(self._options))
        if unknown:
            choices = sorted(self._options)
            raise TypeError(f"unknown engine options {unknown}; choose from {choices}")
        other = object.__new__(type(self))
        other._model_config, other._weights, other.tokenizer = (
            self._model_config,
            self._weights,
            self.tokenizer,
        )
        other._fixed = self._fixed
        other._build_engine({**self._options, **options}, time.perf_counter())
        return other

    def _init_sim(self, model, dtype, quantization, tokenizer, tp, pp, ep, sim) -> None:
        """device='sim': the model's shape only (a preset, an HF directory's config.json or a
        GGUF file's metadata), no weights and no JAX; the tokenizer from `tokenizer` or the
        model's own file (a preset's: pass tokenizer=)."""
        import configs
        from llmjax.sim.runner import SimConfig

        if quantization != "none":
            raise ValueError(f"the simulated device models no quantization ({quantization=})")
        if model in configs.PRESETS:
            model_config, source = configs.get_preset(model), tokenizer
        elif os.path.isdir(model):
            model_config, source = ModelConfig.from_hf_config(model), tokenizer or model
        elif model.endswith(".gguf") and os.path.isfile(model):
            from llmjax.checkpoint.gguf import model_config_from_gguf

            model_config, source = model_config_from_gguf(model), tokenizer or model
        else:
            raise ValueError(
                f"model {model!r} is not a preset ({sorted(configs.PRESETS)}), an HF directory "
                "or a .gguf file"
            )
        tok = None
        if source is not None:
            if source.endswith(".gguf"):
                tok = Tokenizer.from_gguf(source)
            elif os.path.exists(os.path.join(source, "tokenizer.json")):
                tok = Tokenizer.from_hf_dir(source)
        self._model_config, self._weights, self.tokenizer = model_config, None, tok
        self._fixed = dict(
            model=model,
            dtype=dtype,
            quantization="none",
            tp=tp,
            pp=pp,
            ep=ep,
            pad_heads=False,
            device="sim",
            sim=sim if sim is not None else SimConfig(),
        )

    @property
    def smoothquant_alpha(self) -> float | None:
        """SmoothQuant's migration strength the int8 weights were smoothed with at load (the
        `smoothquant` argument resolved; llmjax/model/smooth.py), or None: not smoothed."""
        return self._fixed.get("smoothquant")

    @property
    def params(self):
        """The loaded weights (a pytree of arrays in the LLM's dtype; with tp * pp > 1, what was
        loaded before placement: see `engine.runner.params` for the placed ones). Their layers
        are stacked when the engine scans over them (`layer_loop`, llmjax/model/params.py:
        `layer_params(llm.params, i)` reads layer i in either layout)."""
        return self._weights

    def _build_engine(self, options: dict, t0: float) -> None:
        o, fixed, model_config = dict(options), self._fixed, self._model_config
        if o["overrides"]:
            # An override of a field that an option sets is that option, so the defaults that
            # derive from it (the token budget from the policy, num_pages) follow it.
            overrides = dict(o["overrides"])
            for path, name in OPTION_PATHS.items():
                if path in overrides:
                    o[name] = read_override(EngineConfig, path, overrides.pop(path))
            o["overrides"] = overrides
        self._options = dict(o)
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
                page_size=o["page_size"], num_pages=o["num_pages"], prefix_cache=o["prefix_cache"]
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
            **extra,
        )
        if o["overrides"]:  # any other field, by dotted path (the scripts' --override)
            config = apply_overrides(config, o["overrides"])
        if config.device == "sim":
            self.config = config
            self.engine = LLMEngine(
                config, None, config.cache.num_pages, self.tokenizer, role=o["role"]
            )
            logger.info(
                "simulated %s on %s (tp=%d, pp=%d, %s) with %d KV pages in %.3f s",
                fixed["model"],
                config.sim.hardware.name,
                config.parallel.tp,
                config.parallel.pp,
                fixed["dtype"],
                self.engine.block_manager.num_usable_pages,
                time.perf_counter() - t0,
            )
            return
        import jax.numpy as jnp

        from llmjax.model.params import num_params
        from llmjax.model.quant import weight_bytes

        itemsize = jnp.dtype(fixed["dtype"]).itemsize
        params_bytes = num_params(model_config) * itemsize
        if config.parallel.num_devices == 1:
            params_bytes = weight_bytes(self._weights)  # quantized weights as stored
        num_pages = config.cache.num_pages
        if num_pages is None:
            num_pages = default_num_pages(config, params_bytes, o["devices"])
        self.config = config
        skew = None
        if config.sparse_kv.mode == "infinigen":
            skew = _infinigen_skew(config, self._weights, self.tokenizer, o["calibration_tokens"])
        self.engine = LLMEngine(
            config,
            self._weights,
            num_pages,
            self.tokenizer,
            skew=skew,
            role=o["role"],
            devices=o["devices"],
            kv_store=kv_store,
        )
        if config.parallel.num_devices == 1 and not config.sparse_kv.enabled:
            # The runner converted the layers' layout if this engine loops the other way
            # (with_options): keep one copy of the weights, in the layout now used.
            self._weights = self.engine.runner.params
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

    @property
    def model_name(self) -> str:
        """The `model` this LLM was loaded from (a preset name or a path)."""
        return self._fixed["model"]

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @contextlib.contextmanager
    def profile(self, log_dir: str, *, create_perfetto_trace: bool = False):
        """Profile everything run inside (`jax.profiler.trace`) into `log_dir`: the devices'
        timeline (XLA ops, named by scope: `layers/while/body/attention/...` for the scanned
        layer, `layer_3/attention/...` with `layer_loop="unroll"`), the host's, and the engine's
        own ranges: one `llmjax_step` per engine step with its stages inside: `llmjax.schedule`,
        `llmjax.prepare`, `llmjax.launch` (with the step's token and sequence counts),
        `llmjax.collect` and `llmjax.update`.
        Open it with XProf / TensorBoard's profile plugin, or (`create_perfetto_trace`) in
        Perfetto. Compile outside it first (a warm-up), or the first steps show compilation.

            with llm.profile("out/profile"):
                llm.generate(prompts, params)
        """
        import jax

        with jax.profiler.trace(log_dir, create_perfetto_trace=create_perfetto_trace):
            yield

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. between timed runs, so the next starts cold).
        Returns False if running requests still share some cached pages (those stay)."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer; pass token ids")
        return self.tokenizer

    # ------------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.get_tokenizer().encode(prompt), prompt
        return [int(t) for t in prompt], None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt (a string or a list of token ids) to completion, batched continuously.
        Returns one `RequestOutput` per prompt, in order. `use_tqdm` shows a progress bar of
        finished requests with the input and output token rates (as vLLM's)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)=} must equal {len(prompts)=}")
        ids = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            token_ids, text = self._encode(prompt)
            ids.append(self.engine.add_request(token_ids, params, prompt=text))
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(len(ids), "Processed prompts", show=True) if use_tqdm else None
        num_in = num_out = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        num_in += len(out.prompt_token_ids)
                        num_out += len(out.token_ids)
                        seconds = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"input {num_in / seconds:.1f} tok/s, output {num_out / seconds:.1f} "
                            "tok/s",
                            refresh=False,
                        )
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate the reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens arrive (other requests added to
        `self.engine` keep running alongside). With stop strings, the last len(longest) - 1
        characters are held back until they cannot be the start of one, so the pieces join to
        the final `RequestOutput.text`."""
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(
                f"stream yields one sample's text; n={sampling_params.n} needs generate()"
            )
        token_ids, text = self._encode(prompt)
        request_id = self.engine.add_request(token_ids, sampling_params, prompt=text)
        pieces = TextStream(self.get_tokenizer(), sampling_params.stop if sampling_params else ())
        try:
            while True:
                outputs = [o for o in self.engine.step() if o.request_id == request_id]
                for out in outputs:
                    if out.error:
                        raise ValueError(f"request rejected: {out.error}")
                    piece = pieces.update(out.token_ids, out.finished, out.text)
                    if piece:
                        yield piece
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)


def _infinigen_skew(config: EngineConfig, params, tokenizer, num_tokens: int):
    """InfiniGen's skew for `config.model`: read from `sparse_kv.skew_dir` if it holds one, else
    calibrated on the bundled text (and written there when a skew_dir is given)."""
    from llmjax.model.params import unstack_layers
    from llmjax.sparse.skew import SKEW_FILE, calibrate_on_text, load_skew, save_skew

    params = unstack_layers(params)

    skew_dir = config.sparse_kv.skew_dir
    if skew_dir and os.path.exists(os.path.join(skew_dir, SKEW_FILE)):
        return load_skew(skew_dir, config.model)
    t = time.perf_counter()
    n = min(num_tokens, config.max_model_len)
    skew = calibrate_on_text(params, config.model, tokenizer, n)
    logger.info("InfiniGen skew calibrated on %d tokens in %.1f s", n, time.perf_counter() - t)
    if skew_dir:
        logger.info("wrote %s", save_skew(skew_dir, *skew, n))
    return skew


def _smoothquant_alpha(smoothquant, quantization: str) -> float | None:
    """LLM's `smoothquant` -> SmoothQuant's migration strength, or None (not smoothed)."""
    from llmjax.model.smooth import DEFAULT_ALPHA, check_alpha

    if smoothquant == "auto":
        return DEFAULT_ALPHA if quantization == "int8" else None
    if smoothquant is None or smoothquant == "none":
        return None
    try:
        alpha = float(smoothquant)
    except (TypeError, ValueError):
        raise ValueError(
            f"{smoothquant=} must be 'auto', None / 'none' or a migration strength in [0, 1]"
        ) from None
    if quantization != "int8":
        raise ValueError(
            f"smoothquant={smoothquant!r} smooths activations for W8A8 (quantization='int8'), "
            f"not for quantization={quantization!r}"
        )
    return check_alpha(alpha)


def _smoothed(params, model_config, tokenizer, alpha: float):
    """SmoothQuant (llmjax/model/smooth.py) of the loaded float weights: activation statistics
    from one prefill of the tail of the bundled text, then every layer's inputs smoothed."""
    from llmjax.model import smooth

    t = time.perf_counter()
    ids = smooth.calibration_tokens(tokenizer, model_config.vocab_size)
    params = smooth.smoothquant(params, model_config, ids, alpha)
    logger.info(
        "SmoothQuant (alpha %g) calibrated on %d tokens in %.1f s",
        alpha,
        len(ids),
        time.perf_counter() - t,
    )
    return params


def _pack_weights(params, quantization: str, dtype: str):
    """The loaded (list-layout, host) weights packed for `quantization` (llmjax/model/quant.py):
    'int8', 'int8_wo', 'q8_0', 'q4_0', 'q4_1' quantize every matrix; 'gguf' came packed from the
    loader.
    Unquantized weights on a CPU are packed [out, in] ('dense'): the C++ dense kernel
    (kernels_cpu/dense_matmul.py) takes them at decode-sized steps, and XLA:CPU's bf16 and f16
    dots run on their fast kernels only with both operands contracting their last dim."""
    import jax

    from llmjax.model.quant import quantize_params

    if quantization == "none":
        if jax.default_backend() == "cpu":
            return quantize_params(params, "dense")
        return params
    if quantization == "gguf":
        return params
    return quantize_params(params, quantization)


def _to_device(params, dtype: str):
    """Each weight as a jax array in `dtype` (a packed weight's dense values too; quantized
    values and their scales keep their own dtypes)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from llmjax.model.quant import is_packed

    def one(x):
        if not is_packed(x):
            return jnp.asarray(x, dtype)
        values = jnp.asarray(x.values, dtype if x.fmt == "dense" else None)
        return dataclasses.replace(
            x,
            values=values,
            **{k: jax.tree.map(jnp.asarray, getattr(x, k)) for k in ("scales", "mins")},
        )

    return jax.tree.map(one, params, is_leaf=is_packed)


def _load(
    model: str,
    dtype: str,
    load_format: str,
    tokenizer_path: str | None,
    parallel: ParallelConfig | None = None,
    quantization: str = "none",
):
    """-> (ModelConfig, params, Tokenizer | None). With `parallel` (a sharded run), GGUF/HF
    weights come as thunks that load one weight each (see `params_from_hf_tensors`) and orbax
    restores each device's shards directly; ModelRunner then places them on the mesh."""
    import jax

    import configs
    from llmjax.checkpoint import PRESET_WEIGHTS, load_gguf, load_model, resolve_model_path
    from llmjax.checkpoint.gguf import open_gguf
    from llmjax.model.params import init_params

    if load_format == "dummy":
        if quantization == "gguf":
            raise ValueError("quantization='gguf' keeps a GGUF file's blocks: not with 'dummy'")
        config = configs.get_preset(model)
        params = init_params(config, jax.random.key(0), dtype)
        if tokenizer_path is None and model in PRESET_WEIGHTS:
            # Random weights, but the preset's real tokenizer when its file is at hand.
            with contextlib.suppress(FileNotFoundError):
                tokenizer_path = resolve_model_path(model)
        tok = Tokenizer.from_gguf(tokenizer_path) if tokenizer_path else None
        return config, params, tok
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.float32
    path = resolve_model_path(model)
    if path.endswith(".gguf") and os.path.isfile(path):
        reader = open_gguf(path)  # read once for both weights and tokenizer
        config, params = load_gguf(
            reader, np_dtype, lazy=parallel is not None, quantized=quantization == "gguf"
        )
        kind, path = "gguf", reader
    elif quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf checkpoint; {model!r} is not one")
    else:
        config, params, kind = load_model(model, np_dtype, parallel=parallel)
    source = tokenizer_path or path
    if not isinstance(source, str) or source.endswith(".gguf"):
        tok = Tokenizer.from_gguf(source)
    elif os.path.exists(os.path.join(source, "tokenizer.json")):
        tok = Tokenizer.from_hf_dir(source)
    else:
        logger.warning("no tokenizer found for %s (%s); pass tokenizer=... for text", model, kind)
        tok = None
    return config, params, tok

"""`EngineConfig`: everything the engine needs besides the weights (the other configs, dtype,
quantization, attention backend and kernels, layer loop, device), and the choices only it uses.
Its validation checks the configs against each other (the tp head split: `tp_head_counts` in
parallel.py)."""

from __future__ import annotations

import dataclasses
import os

from llmjax.config.cache import CacheConfig, KVGroups, KVStoreConfig, kv_groups
from llmjax.config.checks import _check_positive
from llmjax.config.families import SIM_ONLY_ARCHITECTURES
from llmjax.config.lora import LoRAConfig
from llmjax.config.model import DTYPES, ModelConfig
from llmjax.config.parallel import ParallelConfig, tp_head_counts
from llmjax.config.scheduler import SchedulerConfig
from llmjax.config.sparse import SparseKVConfig
from llmjax.config.speculative import SpeculativeConfig

DEVICES = ("jax", "sim")
# weight quantizations (llmjax/model/quant.py)
QUANTIZATIONS = ("none", "int8", "w8a8", "int8_wo", "q8_0", "q4_0", "q4_1", "gguf")
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "cpu")
FLASH_PREFILL_MODES = ("auto", "on", "off")
PALLAS_KERNELS = ("auto", "tpu", "gpu", "mgpu")
LAYER_LOOPS = ("auto", "scan", "unroll")


def parse_kernel_options(text: str) -> dict[str, int | bool]:
    """EngineConfig.kernel_options -> keyword arguments: 'num_stages=2,warp_specialized=true'
    -> {'num_stages': 2, 'warp_specialized': True} (integers, or true/false)."""
    options: dict[str, int | bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not key.isidentifier():
            raise ValueError(f"kernel_options: want key=value items, got {item!r} in {text!r}")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
            continue
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(
                f"kernel_options: {key}={value!r} is not an integer or true/false"
            ) from None
    return options


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights.

    `dtype` is the compute and storage dtype of weights and KV cache. float32 is the CPU default:
    bf16 matrix-vector products run about 20x slower than f32 on x86 CPUs at small batch.
    `quantization` (QUANTIZATIONS; llmjax/model/quant.py): 'none'; 'int8', W8A16 (weights int8
    per output channel, every matmul's activations rounded to bfloat16, the products exact and
    the sums in float32; on CPUs with AMX the dense kernel's bfloat16 tiles; norms, biases and an
    untied embedding stay in `dtype`): on SmolLM2 nearly as close to float32 as weight-only int8,
    closer than OpenVINO's int8 and at or above its speed (docs/cpu_performance.md); 'w8a8',
    W8A8 dynamic (the same weights, activations int8 per token at run time, int32
    accumulation; the float weights SmoothQuant-smoothed at load unless
    `LLM(smoothquant=None)`, llmjax/model/smooth.py; the LM head weight-only): faster at
    batches, further from float32; 'int8_wo', weight-only int8 (the same weights, activations
    kept in `dtype`, float32 sums); 'q8_0', 'q4_0', 'q4_1', the float weights quantized into
    those GGUF block formats as llama.cpp does; 'gguf', a GGUF
    checkpoint's Q8_0 / Q4_0 / Q4_1 tensors kept in their blocks as stored (the rest loaded in
    `dtype`). Activations and the KV cache stay in `dtype`.
    `max_model_len` (prompt + generated tokens per request) defaults to the model's
    `max_position_embeddings`. `attention_backend` (ATTENTION_BACKENDS): 'reference' (plain jnp,
    llmjax/model/attention.py), 'pallas' (the ragged paged attention kernels of kernels_pallas/:
    compiled on GPU/TPU, interpret mode on the CPU, slow, for checking), 'cpu' (kernels_cpu/'s C++
    ragged paged attention, built at first use with the system compiler; CPU only) or 'auto'
    (pallas on GPU/TPU; on the CPU, cpu where its kernels build, else reference).
    `flash_prefill` (pallas backend only): a step whose batch is
    one fresh prompt (one sequence, nothing cached) attends with the flash prefill kernel instead
    of the ragged one: 'auto' where it was measured faster (token buckets from
    kernels_pallas/flash_prefill/tuning.py ENGINE_MIN_TOKENS: GPU >= 2048 with either kernel,
    TPU never), 'on' in every bucket (for checking and measuring), 'off' never. `pallas_kernel`
    (PALLAS_KERNELS, pallas backend only): which kernels (ragged paged attention and flash
    prefill), 'auto' the platform's (gpu on CUDA, tpu on TPU and, interpreted, on the CPU), or by
    name: 'tpu' (Mosaic TPU), 'gpu' (Triton), 'mgpu' (Mosaic GPU for Hopper: bfloat16/float16,
    head_dim % 64 == 0 (flash prefill: and <= 256), page_size % 8 == 0; interpreted on the CPU).
    `kernel_options` (with a named `pallas_kernel`): keyword arguments of that ragged paged
    attention kernel function, 'key=value,...' (integers or true/false; e.g. 'num_stages=2' or
    'warp_specialized=true,num_consumers=2' for mgpu; see kernels_pallas/ragged_paged_attention/
    kernel_*.py), to compare kernel variants and block sizes inside the engine; checked against
    the function's signature when the engine is built. With attention_backend='cpu' they are the
    C++ kernel's: 'int8_scores=false' scores an int8 KV cache with float32 dots of the
    dequantized keys instead of VNNI int8 dots of q rounded to int8 (the default where the CPU
    has VNNI; kernels_cpu/csrc/ragged_paged_attention.cc).
    `layer_loop` (LAYER_LOOPS): how the step runs the decoder layers: 'scan' (`lax.scan` over
    weights stacked [L, ...] and one KV cache of every layer's pages, [L * num_pages, ...]: one
    layer is compiled, so compile time does not grow with depth; a SmolLM2 decode bucket compiles
    in 1.0 s instead of 3.6-4.4 s on a 2-core CPU, and runs as fast), 'unroll' (a
    Python loop over a list of layers: L copies of the layer in the program, one named scope each
    in profiles) or 'auto': scan, except on GPUs (unrolled decode steps at batch 32 were 2.5x
    faster on an H200; UNROLL_BY_DEFAULT) and with sparse_kv, whose step treats layers one by one
    (InfiniGen speculates layer i + 1 during layer i). Both give the same numbers. With pp > 1
    each stage scans over its own layers.
    `compilation_cache_dir`
    enables JAX's persistent compilation cache ('' disables it). `sparse_kv` (SparseKVConfig): the
    KV cache in host memory with full or InfiniGen-selected fetches ('none' by default). `kv_store`
    (KVStoreConfig): host, disk and Mooncake tiers below the device pages (off by default).
    `speculative` (SpeculativeConfig): speculative decoding, ngram or early-exit draft (off by
    default; one device or tp, dense KV, a real device).
    `precompile` compiles every step shape at start (|token buckets| x |page buckets| variants;
    with pp > 1 the pipeline tick of each, and the carry's resizes) so that serving never
    compiles, and the first batch runs at the steady rate (on one device: ahead of time, in a
    thread per CPU, nothing run). Off by default: SmolLM2 on 2 CPUs then loads in 23-27 s
    instead of 7-9 s the first time (5 s more with the persistent cache filled), where a short
    script meets a few shapes; turn it on for servers and measurements. `compile_ahead`
    compiles, in a background thread, the step shapes the next steps are likely to meet (the
    next page bucket of the batch's contexts, the decode-only batch of the running requests:
    `Buckets.likely_next`), so that a cold start overlaps compilation with running steps
    instead of stopping for each new bucket (one device, one process; not with sparse_kv or
    pp > 1). Off by default: on this
    2-CPU machine the background compile takes a CPU from the running steps and a guess can be
    wasted (16 x (128+128), empty cache: 8.6 s with it, 8.4 s without); turn it on where the
    host has CPUs to spare (a GPU/TPU host).
    `token_buckets_per_octave`: the token counts a step is padded to (llmjax/engine/batch.py
    `token_buckets`): the powers of two and evenly spaced steps between them (multiples of 8),
    this many per octave. 1 is powers of two alone, which pays up to 100 % padding (16 decodes
    beside a 128-token chunk run as 256 tokens); 4, the default, at most 25 % (that step runs as
    160) for 23 token buckets instead of 10 at a 512-token budget, each compiled when first met.
    `device` (DEVICES): 'jax', the real device; 'sim', a simulated one (llmjax/sim/: the step's
    duration from `sim`'s cost model on the engine's virtual clock, no JAX).
    `async_scheduling` (vLLM's name): the host schedules and packs step N + 1 while the device
    runs step N (llmjax/engine/overlap.py); a running decode's newest token, not yet on the
    host, is taken from step N's output on the device. True, False, or None for the
    backend's default (`async_scheduling_on`; ASYNC_BY_DEFAULT). Outputs are the same either
    way. Engines with speculative decoding, pp > 1, sparse_kv, KV tiers or the prefill role
    run synchronously; a step whose in-flight predecessor holds a request with structured
    outputs or penalties (their next step needs the token on the host) waits for it.
    """

    model: ModelConfig
    # Frozen dataclasses, so shared defaults are safe (ruff cannot see that across modules).
    cache: CacheConfig = CacheConfig()  # noqa: RUF009
    scheduler: SchedulerConfig = SchedulerConfig()  # noqa: RUF009
    parallel: ParallelConfig = ParallelConfig()  # noqa: RUF009
    sparse_kv: SparseKVConfig = SparseKVConfig()  # noqa: RUF009
    kv_store: KVStoreConfig = KVStoreConfig()  # noqa: RUF009
    speculative: SpeculativeConfig = SpeculativeConfig()  # noqa: RUF009
    lora: LoRAConfig | None = None
    dtype: str = "float32"
    quantization: str = "none"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    flash_prefill: str = "auto"
    pallas_kernel: str = "auto"
    kernel_options: str = ""
    layer_loop: str = "auto"
    seed: int = 0
    precompile: bool = False
    compile_ahead: bool = False
    async_scheduling: bool | None = None
    token_buckets_per_octave: int = 4
    device: str = "jax"
    sim: object | None = None
    compilation_cache_dir: str = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmjax", "jax"
    )

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"unknown {self.device=}; choose one of {DEVICES}")
        if (self.device == "sim") != (self.sim is not None):
            raise ValueError("device='sim' and a SimConfig (`sim`, llmjax/sim/) go together")
        if self.device == "jax" and self.model.architecture in SIM_ONLY_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.model.architecture!r} ({self.model.name or 'this model'}) "
                "is a shape for the simulated device only: use device='sim'"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported {self.dtype=}; choose one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown {self.quantization=}; choose one of {QUANTIZATIONS}")
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_position_embeddings)
        _check_positive(self, "max_model_len")
        sched = self.scheduler
        if not sched.chunks_prefills and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"policy {sched.policy!r} runs whole prompts, so max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} must be >= max_model_len={self.max_model_len}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown {self.attention_backend=}; choose one of {ATTENTION_BACKENDS}"
            )
        if self.flash_prefill not in FLASH_PREFILL_MODES:
            raise ValueError(f"unknown {self.flash_prefill=}; choose one of {FLASH_PREFILL_MODES}")
        if self.pallas_kernel not in PALLAS_KERNELS:
            raise ValueError(f"unknown {self.pallas_kernel=}; choose one of {PALLAS_KERNELS}")
        named = self.pallas_kernel != "auto" or self.attention_backend == "cpu"
        if parse_kernel_options(self.kernel_options) and not named:
            raise ValueError(
                f"kernel_options={self.kernel_options!r} are one kernel's arguments: name the "
                "kernel with pallas_kernel ('tpu', 'gpu' or 'mgpu') or attention_backend='cpu'"
            )
        if self.pallas_kernel == "mgpu":
            from kernels_pallas.ragged_paged_attention.kernel_mgpu import check_supported

            if self.cache.kv_cache_dtype != "auto":
                raise ValueError(
                    f"pallas_kernel='mgpu' does not read a {self.cache.kv_cache_dtype} KV cache; "
                    "use pallas_kernel='gpu' (Triton) or 'auto'"
                )

            m = self.model
            check_supported(
                self.dtype, m.head_dim, self.cache.page_size, m.num_heads // m.num_kv_heads
            )
            if self.flash_prefill != "off":
                from kernels_pallas.flash_prefill.kernel_mgpu import (
                    check_supported as check_flash_supported,
                )

                check_flash_supported(self.dtype, m.head_dim)
        tp_head_counts(  # the tp split of the heads (llmjax/parallel/heads.py): raises if uneven
            self.model.num_heads, self.model.num_kv_heads, self.parallel.tp, self.parallel.pad_heads
        )
        if self.sparse_kv.enabled:
            if self.parallel.num_devices > 1:
                raise ValueError(
                    f"sparse_kv={self.sparse_kv.mode!r} runs on one device; got tp="
                    f"{self.parallel.tp} pp={self.parallel.pp}"
                )
            if self.sparse_kv.num_dense_layers > self.model.num_layers:
                raise ValueError(
                    f"sparse_kv.num_dense_layers={self.sparse_kv.num_dense_layers} exceeds the "
                    f"model's {self.model.num_layers} layers"
                )
            if self.sparse_kv.mode == "h2o" and self.cache.prefix_cache != "none":
                raise ValueError(
                    "sparse_kv='h2o' evicts tokens from the pages a request owns, so its pages "
                    f"cannot be shared: set prefix_cache='none' (got {self.cache.prefix_cache!r})"
                )
        if not (
            isinstance(self.token_buckets_per_octave, int) and self.token_buckets_per_octave >= 1
        ):
            raise ValueError(f"{self.token_buckets_per_octave=} must be an integer >= 1")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"unknown {self.layer_loop=}; choose one of {LAYER_LOOPS}")
        if self.layer_loop == "scan" and self.sparse_kv.enabled:
            raise ValueError(
                f"layer_loop='scan' does not run with sparse_kv={self.sparse_kv.mode!r}, whose "
                "step treats layers one by one: use 'auto' or 'unroll'"
            )
        if self.parallel.pp > self.model.num_layers:
            raise ValueError(
                f"pp={self.parallel.pp} stages need at least as many layers, the model has "
                f"{self.model.num_layers}"
            )
        ep = self.parallel.ep
        if ep > 1 and not self.model.is_moe:
            raise ValueError(f"ep={ep} splits a mixture of experts; this model has no experts")
        if ep > 1 and self.model.num_experts % ep:
            raise ValueError(
                f"ep={ep} must divide the model's {self.model.num_experts} experts (each device "
                "group holds num_experts / ep whole experts)"
            )
        if self.lora is not None:
            why = [
                f"{what} (got {got})"
                for what, got, bad in (
                    ("pp == 1", self.parallel.pp, self.parallel.pp > 1),
                    (
                        "kernel='masked' or 'auto' with tp > 1",
                        "kernel='grouped'",
                        self.parallel.tp > 1 and self.lora.kernel == "grouped",
                    ),
                    ("sparse_kv='none'", repr(self.sparse_kv.mode), self.sparse_kv.enabled),
                )
                if bad
            ]
            if why:
                raise ValueError(f"LoRA adapters (lora=LoRAConfig) need {', '.join(why)} for now")
        spec = self.speculative
        if spec.enabled:
            why = []
            if self.parallel.pp > 1:
                why.append(f"pp == 1 (got {self.parallel.pp})")
            if self.sparse_kv.enabled:
                why.append(f"sparse_kv='none' (got {self.sparse_kv.mode!r})")
            if self.device != "jax":
                why.append("a real device (the simulator computes no logits to verify)")
            if why:
                raise ValueError("speculative decoding needs " + ", ".join(why))
            if spec.method == "draft" and spec.num_draft_layers > self.model.num_layers:
                raise ValueError(
                    f"speculative num_draft_layers={spec.num_draft_layers} exceeds the model's "
                    f"{self.model.num_layers} layers"
                )
        if self.cache.hybrid_kv_cache == "on" and (why := self.hybrid_kv_blockers()):
            raise ValueError("hybrid_kv_cache='on' needs " + ", ".join(why))
        kv = self.kv_store
        if kv.enabled:
            if kv.block_size % self.cache.page_size:
                raise ValueError(
                    f"kv_store.block_size={kv.block_size} must be a multiple of the page size "
                    f"{self.cache.page_size}"
                )
            why = []
            if self.cache.prefix_cache != "radix":
                why.append(f"prefix_cache='radix' (got {self.cache.prefix_cache!r})")
            if self.parallel.pp > 1:
                why.append(f"pp == 1 (got {self.parallel.pp})")
            if self.sparse_kv.enabled:
                why.append(f"sparse_kv='none' (got {self.sparse_kv.mode!r})")
            if self.device != "jax":
                why.append("a real device (the simulator does not model KV tiers)")
            if why:
                raise ValueError("the KV tiers (kv_store) need " + ", ".join(why))

    def hybrid_kv_blockers(self) -> list[str]:
        """What keeps this engine on one page table for every layer (`CacheConfig.
        hybrid_kv_cache`): none where the hybrid layout can run."""
        why = []
        if not self.model.sliding_layers or self.model.sliding_layers == self.model.num_layers:
            why.append("a model with both sliding-window and full-attention layers")
        for what, bad in (
            (f"sparse_kv='none' (got {self.sparse_kv.mode!r})", self.sparse_kv.enabled),
            ("no KV tiers (kv_store)", self.kv_store.enabled),
            (
                "pp == 1 or the scanned layer loop (layer_loop='scan')",
                self.parallel.pp > 1 and not self.scans_layers,
            ),
        ):
            if bad:
                why.append(what)
        return why

    @property
    def kv_groups(self) -> KVGroups:
        """The KV layout the engine runs (`CacheConfig.hybrid_kv_cache` resolved)."""
        hybrid = self.cache.hybrid_kv_cache != "off" and not self.hybrid_kv_blockers()
        return kv_groups(self.model, hybrid, self.parallel.pp if hybrid else 1)

    def async_scheduling_on(self, platform: str | None = None) -> bool:
        """`async_scheduling` resolved: None is on where the platform (default: JAX's default
        backend; the simulator's 'sim') is in ASYNC_BY_DEFAULT."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if platform is None:
            if self.device == "sim":
                platform = "sim"
            else:
                import jax

                platform = jax.default_backend()
        return platform in ASYNC_BY_DEFAULT

    @property
    def scans_layers(self) -> bool:
        """Whether the step scans over stacked layers (`layer_loop` resolved)."""
        return layer_loop_scans(self.layer_loop, self.sparse_kv.enabled)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# Platforms whose 'auto' layer loop is unrolled: on one H200 (2026-12-04, SmolLM2 shapes, bf16,
# scripts/bench_decode.py in scripts/device_check.sh) a decode step at batch 32 took 4.26 ms
# unrolled against 10.60 ms scanned (batch 1: 3.36 against 2.41; compile 6.9 s against 1.8 s).
UNROLL_BY_DEFAULT = ("gpu", "cuda", "rocm")
# Platforms where `EngineConfig.async_scheduling` None means on (measured: docs/engine.md, "The
# engine step, and async scheduling"; scripts/bench_async.py).
ASYNC_BY_DEFAULT: tuple[str, ...] = ()


def layer_loop_scans(layer_loop: str, sparse_kv: bool, platform: str | None = None) -> bool:
    """`EngineConfig.layer_loop` resolved: True for 'scan'; for 'auto', True unless a sparse KV
    mode is on or `platform` (default: JAX's default backend) is a GPU (UNROLL_BY_DEFAULT)."""
    if layer_loop != "auto":
        return layer_loop == "scan"
    if sparse_kv:
        return False
    if platform is None:
        import jax

        platform = jax.default_backend()
    return platform not in UNROLL_BY_DEFAULT

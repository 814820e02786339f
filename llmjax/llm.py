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
import time
from collections.abc import Iterator, Sequence

from llmjax.config import ModelConfig, ParallelConfig, SparseKVConfig
from llmjax.engine.request import RequestOutput
from llmjax.llm_options import WEIGHT_OPTIONS, build_engine, engine_config, option_values
from llmjax.loading import load_weights, sim_model
from llmjax.lora import LoRARequest
from llmjax.progress import progress_bar
from llmjax.sampling_params import SamplingParams
from llmjax.tokenizer import TextStream, Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """Load a model and its tokenizer, and serve requests with continuous batching.

    Weights: `model` (a preset, a .gguf file, an HF or orbax directory), `dtype` (of the weights,
    activations and KV cache), `quantization` ('none'; 'int8': W8A16, int8 weights per output
    channel with the matmuls' activations rounded to bfloat16 and float32 sums; 'w8a8': W8A8
    dynamic int8 matmuls, the weights smoothed first by SmoothQuant with migration strength
    `smoothquant` ('auto': 0.5; None or 'none': plain W8A8; scales calibrated at load on the
    bundled text's last 512 tokens, ~2 s on a CPU; llmjax/model/smooth.py), the LM head
    weight-only int8; 'int8_wo': weight-only int8 (activations stay in `dtype`); 'q8_0', 'q4_0',
    'q4_1': the weights quantized to those GGUF block formats; 'gguf': a GGUF file's
    Q8_0/Q4_0/Q4_1 blocks kept as stored; see EngineConfig and llmjax/model/quant.py),
    `tokenizer`, `load_format` ('dummy': random weights).

    Engine options: `max_model_len` (prompt + generated tokens per request; default the model's
    context, capped at 4096), `page_size`, `num_pages` (default: what the memory budget allows),
    `scheduler_policy` (sarathi | prefill_first | decode_first | splitfuse, see SchedulerConfig),
    `max_num_seqs`, `max_num_batched_tokens` (the token budget; default 512 for the chunking
    policies, max_model_len for the whole-prompt ones), `prefix_cache` ('radix' reuses the KV of
    shared prefixes, 'none' turns that off; see CacheConfig), `kv_cache_dtype` ('auto': the
    model dtype; 'int8', 'fp8_e4m3', 'fp8_e5m2': quantized pages with a scale per token and kv
    head, vLLM's names; see CacheConfig), `hybrid_kv_cache` ('auto', 'on', 'off': one page table
    per group of layers, the sliding-window layers' holding their window's pages only: Gemma 2
    and 3; see CacheConfig), `admission_order` ('fcfs' or 'lpm',
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

    `enable_lora` (vLLM's names): serve LoRA adapters, each request naming its own
    (`generate(..., lora_request=LoRARequest(name, id, path))`, PEFT directories), many in one
    batch: `max_loras` adapter slots on the device of rank up to `max_lora_rank`, filled from a
    host cache of `max_cpu_loras` (default max_loras); see `llmjax.config.LoRAConfig` and
    docs/lora.md.

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
        kv_cache_dtype: str = "auto",
        hybrid_kv_cache: str = "auto",
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
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ):

        if load_format not in ("auto", "dummy"):
            raise ValueError(f"{load_format=} must be 'auto' or 'dummy'")
        t0 = time.perf_counter()
        if device == "sim":
            self._model_config, self.tokenizer, self._fixed = sim_model(
                model, dtype or "bfloat16", quantization, tokenizer, tp, pp, ep, sim
            )
            self._weights = None
            self._build_engine(dict(option_values(locals())), t0)
            return
        if device != "jax":
            raise ValueError(f"unknown {device=}; choose 'jax' or 'sim'")
        if sim is not None:
            raise ValueError("sim= (a SimConfig) goes with device='sim'")
        dtype = dtype or "float32"
        parallel = ParallelConfig(
            tp=tp, pp=pp, ep=ep, pad_heads=pad_heads, check_lockstep=check_lockstep
        )
        self._model_config, params, self.tokenizer, alpha = load_weights(
            model,
            dtype,
            quantization,
            smoothquant,
            tokenizer,
            load_format,
            parallel,
            layer_loop,
            sparse_kv,
        )
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
        self._build_engine(dict(option_values(locals())), t0)

    WEIGHT_OPTIONS = WEIGHT_OPTIONS  # what `with_options` cannot change

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
        o, config, kv_store = engine_config(options, self._fixed, self._model_config)
        self._options = dict(o)
        self.config = config
        self.engine = build_engine(
            config, o, self._fixed, self._weights, self.tokenizer, kv_store, t0
        )
        if (
            config.device != "sim"
            and config.parallel.num_devices == 1
            and not config.sparse_kv.enabled
        ):
            # The runner converted the layers' layout if this engine loops the other way
            # (with_options): keep one copy of the weights, in the layout now used.
            self._weights = self.engine.runner.params

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

    # ---- weights that change (issue 43: an RL loop's rollout engine; llmjax/engine/weights.py) --

    def update_weights(self, params, *, source_format: str = "llmjax") -> int:
        """Serve `params` from now on; returns the new weight version (`RequestOutput.
        weight_version` says which version made a request's last token).

        `params`: a pytree in llmjax's layout (as `LLM.params`: {'embed', 'layers' (a list of
        per-layer dicts, or stacked), 'final_norm', ('lm_head')}), or named arrays (a mapping,
        or an iterable of (name, array) pairs for weights that arrive layer by layer) with
        llmjax's flat names ('layers.3.wq') or, with `source_format='hf'`, HF's checkpoint
        names ('model.layers.3.self_attn.q_proj.weight'). Arrays of any dtype (cast to the
        LLM's) and any sharding: jax arrays are converted and resharded into the engine's
        layout on the devices (tp's heads and shards; pp's stages go through the host), then
        quantized as the LLM's weights were (`quantization`, SmoothQuant recalibrated). Shapes
        are checked against the model (the error names the weight); nothing recompiles.

        Running requests recompute their KV under the new weights; the prefix cache and the KV
        tiers' keys start over, so nothing computed before is served after."""
        if self.config.device == "sim":
            raise ValueError("update_weights on a simulated device: it has no weights")
        if self._fixed["quantization"] == "gguf":
            raise ValueError(
                "update_weights: quantization='gguf' serves a GGUF file's blocks as stored; load "
                "with quantization='q8_0', 'q4_0' or 'q4_1' to quantize new float weights"
            )
        from llmjax.checkpoint.named import params_from_source
        from llmjax.loading import prepare_weights

        params = params_from_source(self.model_config, params, source_format)
        f, cfg = self._fixed, self.config
        prepared = prepare_weights(
            params,
            self.model_config,
            f["dtype"],
            f["quantization"],
            f.get("smoothquant"),
            self.tokenizer,
            cfg.parallel,
            "scan" if cfg.scans_layers else "unroll",
            cfg.sparse_kv,
        )
        version = self.engine.update_weights(prepared)
        if cfg.parallel.num_devices == 1:
            self._weights = self.engine.runner.params  # (one copy: the engine's)
        else:
            self._weights = params
        return version

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Pause serving (vLLM's modes): 'abort' every live request now, 'wait' for the running
        ones to finish (stepping the engine until they have), or 'keep' them frozen where they
        are (an update recomputes their KV). Returns the outputs that ended meanwhile: the
        aborted requests' (finish_reason 'abort') or the finished ones'. Requests added while
        paused wait; `generate` refuses to run until `resume_generation`."""
        outs = self.engine.pause_generation(mode)
        if mode == "wait":
            while self.engine.can_step:  # until what ran at the pause has finished
                outs += self.engine.step()
        return outs

    def resume_generation(self) -> None:
        self.engine.resume_generation()

    def sleep(self, level: int = 1) -> dict:
        """Free device memory while the trainer uses it: level 1 the KV pages, level 2 the
        weights too (give new ones with `update_weights` after `wake_up`). Returns the bytes
        freed (`LLMEngine.sleep`)."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict:
        return self.engine.wake_up()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def _check_serving(self) -> None:
        e = self.engine
        if e.is_paused:
            raise RuntimeError(f"generation is paused ({e.paused!r}): resume_generation() first")
        if e.sleep_level:
            raise RuntimeError(f"the engine sleeps (level {e.sleep_level}): wake_up() first")
        if getattr(e.runner, "weights_released", False):
            raise RuntimeError("sleep(level=2) discarded the weights: update_weights(...) first")

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (a string or a list of token ids) to completion, batched continuously.
        Returns one `RequestOutput` per prompt, in order. `use_tqdm` shows a progress bar of
        finished requests with the input and output token rates (as vLLM's). `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), with an
        LLM built with `enable_lora=True`; adapters are read from their directories on first
        use, and many run in one batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)=} must equal {len(prompts)=}")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)=} must equal {len(prompts)=}")
        self._check_serving()
        ids = []
        for prompt, params, lora in zip(prompts, sampling_params, lora_request, strict=True):
            token_ids, text = self._encode(prompt)
            ids.append(self.engine.add_request(token_ids, params, prompt=text, lora_request=lora))
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate the reply
        (`lora_request` as in `generate`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens arrive (other requests added to
        `self.engine` keep running alongside). With stop strings, the last len(longest) - 1
        characters are held back until they cannot be the start of one, so the pieces join to
        the final `RequestOutput.text`."""
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(
                f"stream yields one sample's text; n={sampling_params.n} needs generate()"
            )
        self._check_serving()
        token_ids, text = self._encode(prompt)
        request_id = self.engine.add_request(
            token_ids, sampling_params, prompt=text, lora_request=lora_request
        )
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

"""`ModelRunner`: weights, KV pages, the jitted step and its sampling programs; `launch` /
`collect`; compiling (`precompile`, compiling ahead). Its parts for page transfer, pipeline
parallelism and sparse KV are the mixins of pages.py, pipeline_ticks.py and sparse_step.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import EngineConfig
from llmjax.engine.batch import SamplingInput, SpecInput, spec_rows, step_shape
from llmjax.engine.runner.launched import Launched, greedy_sampling
from llmjax.engine.runner.pages import PageTransfer
from llmjax.engine.runner.pipeline_ticks import PipelineTicks
from llmjax.engine.runner.sparse_step import SparseStep
from llmjax.engine.runner.weights import RunnerWeights
from llmjax.model import lora as lora_slots
from llmjax.model.attention import make_attention_fn, resolve_attention_backend
from llmjax.model.draft import draft_proposals
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import Params, stack_layers, unstack_layers
from llmjax.model.quant import is_packed
from llmjax.model.sampler import (
    greedy_ids,
    prompt_logprobs,
    sample_processed,
    sample_random,
    verify_proposals,
)
from llmjax.model.step_input import StepInput, with_groups
from llmjax.parallel import pipeline
from llmjax.parallel.distributed import check_lockstep, to_host
from llmjax.parallel.heads import tp_head_layout, transform_lora
from llmjax.parallel.mesh import (
    kv_pages_sharding,
    lora_shardings,
    make_mesh,
    place,
    place_params,
    replicated,
)
from llmjax.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str) -> None:
    """Point JAX's persistent compilation cache at `cache_dir` unless the user configured one."""
    if not cache_dir or jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class ModelRunner(PageTransfer, PipelineTicks, SparseStep, RunnerWeights):
    """Weights, KV pages and the jitted step, on one device or on a (pp, ep, tp / ep) mesh
    (`config.parallel`, llmjax/parallel/). `params` come in the model's own layout (numpy or jax
    arrays, or thunks that load a weight); with a mesh each weight is converted to the
    tensor-parallel head layout and placed shard by shard. `model_config` is the model the
    devices run (heads repeated or padded for tp; the same as `config.model` otherwise)."""

    def __init__(
        self, config: EngineConfig, params: Params, num_pages: int, skew=None, devices=None
    ):
        """`devices`: the devices to run on (the first tp * pp of them; default all of the
        processes' devices, and on one device JAX's default one)."""
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        self._ahead: dict[tuple[int, int, int], concurrent.futures.Future] = {}
        self._ahead_pool = None  # see compile_ahead
        self._kv_structs = None  # the KV pages' shapes and shardings, for compiling ahead
        self._ran_shapes: set[tuple[int, int, int]] = set()  # (with compiled-ahead steps)
        self._tracing = threading.local()
        self.num_compiled_ahead = 0
        self.dtype = jnp.dtype(config.dtype)
        parallel = config.parallel
        self.mesh = make_mesh(parallel, devices) if parallel.num_devices > 1 else None
        # one device: the given one (None: JAX's default)
        self.device = next(iter(devices)) if devices is not None and self.mesh is None else None
        self.num_pages = num_pages
        self.num_transfer_compiles = 0
        self._transfer_fns = None
        self.host_memory = config.kv_store.host_memory  # see host_memory_kind
        page_size = config.cache.page_size
        self.num_compiles = 0
        self.num_steps = 0
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.attention_backend = resolve_attention_backend(config.attention_backend)
        attention_fn = make_attention_fn(
            self.attention_backend,
            flash_prefill=config.flash_prefill,
            pallas_kernel=config.pallas_kernel,
            kernel_options=config.kernel_options,
            mesh=self.mesh,
        )
        self.pipelined = parallel.pp > 1
        if parallel.num_devices > 1 and any(
            is_packed(x) for x in jax.tree.leaves(params, is_leaf=is_packed)
        ):
            raise ValueError(
                "packed (quantized) weights run on one device for now: tp * pp must be 1"
            )
        self.sparse = config.sparse_kv
        self.kv_groups = None  # the hybrid KV layout's groups (set below where it runs)
        self.lora_targets: tuple[str, ...] = ()  # LoRA slots' targets (`_init_lora`)
        self.last_sparse_stats = None
        # The CPU kernel walks each sequence's page table only as far as its kv_lens, so the
        # engine pads every table to the longest (Buckets.create(ragged_pages=True)): the page
        # count stops being a compiled dimension. The jnp reference gathers all P pages, and the
        # sparse path sizes its fetch buffers by P, so they keep P buckets.
        self.ragged_page_tables = self.attention_backend == "cpu" and not self.sparse.enabled
        if self.sparse.enabled:
            if self.device is not None and self.device != jax.devices()[0]:
                raise ValueError("sparse_kv runs on JAX's default device; devices= cannot move it")
            self._init_sparse(params, num_pages, skew)
            return
        # the KV layout: one page table for every layer, or the hybrid layout's groups
        groups = config.kv_groups
        self.kv_groups = groups if groups.hybrid else None
        if self.pipelined:
            self._init_pipeline(params, num_pages, attention_fn)
            return
        scan = config.scans_layers  # the layer loop: weights and KV cache stacked, or per layer
        if self.mesh is None:
            self.model_config = config.model
            self.params = stack_layers(params) if scan else unstack_layers(params)
            if self.device is not None:
                self.params = jax.device_put(self.params, self.device)

            def allocate_kv():
                with jax.default_device(self.device):
                    return allocate_kv_pages(
                        config.model, num_pages, page_size, self.dtype, scan, self.kv_cache_dtype,
                        groups,
                    )  # fmt: skip

            self._allocate_kv = allocate_kv  # (again at wake_up: weights.py)
            self.kv_pages = allocate_kv()
            out_shardings = None
        else:
            layout = tp_head_layout(config.model, parallel.tp, parallel.pad_heads)
            self.model_config = layout.model_config(config.model)
            self.params = place_params(
                params, config.model, layout, self.mesh, self.dtype, stacked=scan
            )
            kv_sharding = kv_pages_sharding(
                self.model_config, self.mesh, num_pages, page_size, scan, self.kv_cache_dtype,
                groups.num_slots,
            )  # fmt: skip
            kv_shardings = (kv_sharding, kv_sharding)  # per layer slot unless stacked
            if not scan:
                kv_shardings = [kv_shardings] * groups.num_slots
            allocate = functools.partial(
                allocate_kv_pages,
                self.model_config,
                num_pages,
                page_size,
                self.dtype,
                scan,
                self.kv_cache_dtype,
                groups,
            )
            self._allocate_kv = jax.jit(allocate, out_shardings=kv_shardings)
            self.kv_pages = self._allocate_kv()
            out_shardings = (
                replicated(self.mesh),
                replicated(self.mesh),
                jax.tree.map(lambda x: x.sharding, self.kv_pages),
            )
        if config.lora is not None:
            self._init_lora()
        self.num_compiles = 0
        self.num_steps = 0
        self._step = jax.jit(
            functools.partial(
                self._step_impl,
                model_config=self.model_config,
                attention_fn=attention_fn,
                kv_groups=self.kv_groups,
            ),
            donate_argnames=("kv_pages",),
            out_shardings=out_shardings,
        )

        # Async scheduling (llmjax/engine/overlap.py): the last launched step's sampled ids stay
        # on the device in a buffer of max_num_seqs rows (`_keep`, one compile per sequence
        # bucket), from which the next step's pending tokens are filled (`_fill`, one compile
        # per token bucket), with no round trip to the host.
        self.num_pending_compiles = 0
        self._last_ids = None  # the last launched step's sampled ids [S] (device)
        self._kept = None  # [max_num_seqs] (device)
        max_seqs = config.scheduler.max_num_seqs
        replicated_out = None if self.mesh is None else replicated(self.mesh)

        def keep_impl(buf, ids):
            self.num_pending_compiles += 1  # runs only while tracing
            return jax.lax.dynamic_update_slice(buf, ids.astype(buf.dtype), (0,))

        def fill_impl(buf, token_ids, rows):
            self.num_pending_compiles += 1  # runs only while tracing
            return jnp.where(rows >= 0, buf[jnp.clip(rows, 0, max_seqs - 1)], token_ids)

        self._keep = jax.jit(keep_impl, donate_argnums=0, out_shardings=replicated_out)
        self._fill = jax.jit(fill_impl, out_shardings=replicated_out)

        # Sampling is its own program over the step's logits, run only when a row samples: it
        # compiles once per S bucket instead of inside every (T, S, P) step (the sort, cumsum
        # and threefry were 0.35 s of a 0.55 s step compile on the CPU).
        def sample_impl(*args):
            if getattr(self._tracing, "ahead", None) != "precompile":  # (precompile counts its)
                self.num_sample_compiles += 1  # runs only while tracing
            return sample_random(*args)

        self.num_sample_compiles = 0
        self._samplers: dict[int, concurrent.futures.Future] = {}  # S -> compiled by precompile
        self._sample = jax.jit(
            sample_impl, out_shardings=None if self.mesh is None else replicated(self.mesh)
        )

        # Logits processing and logprobs (SamplingParams' penalties, bias, min_p, logprobs):
        # the same separate program, with more inputs, compiled per (S, B, L, K) only when a
        # step asks for it (batch.py's ProcessingInput keeps the variants few).
        def processed_impl(*args, num_logprobs):
            self.num_sample_compiles += 1  # runs only while tracing
            return sample_processed(*args, num_logprobs=num_logprobs)

        self._sample_processed = jax.jit(
            processed_impl,
            static_argnames=("num_logprobs",),
            out_shardings=None if self.mesh is None else replicated(self.mesh),
        )
        self.last_logprobs = None  # the last step's (top ids, top logprobs, sampled, rank)

        def prompt_impl(*args, num_logprobs):
            self.num_sample_compiles += 1  # runs only while tracing
            return prompt_logprobs(*args, num_logprobs=num_logprobs)

        self._prompt_logprobs = jax.jit(
            prompt_impl,
            static_argnames=("num_logprobs",),
            out_shardings=None if self.mesh is None else replicated(self.mesh),
        )
        self.last_prompt_logprobs = None  # (target logprob, rank, top ids, top logprobs) [T]

        # Speculative decoding's verification (llmjax/engine/speculative.py): its own program
        # over the step's logits rows, compiled per (R, S) only when a step has proposals.
        def verify_impl(*args):
            self.num_sample_compiles += 1  # runs only while tracing
            return verify_proposals(*args)

        self._verify = jax.jit(
            verify_impl, out_shardings=None if self.mesh is None else replicated(self.mesh)
        )
        self.last_spec = None  # the last step's (tokens [S, K + 1], accepted [S]), numpy
        spec = config.speculative
        self.num_draft_compiles = 0
        if spec.method == "draft":  # the early-exit draft (llmjax/model/draft.py)

            def draft_impl(params, kv_pages, tokens, positions, page_indices, num_proposals):
                self.num_draft_compiles += 1  # runs only while tracing
                with self._mesh_context():
                    return draft_proposals(
                        params,
                        kv_pages,
                        tokens,
                        positions,
                        page_indices,
                        num_proposals,
                        self.model_config,
                        attention_fn,
                        num_layers=spec.num_draft_layers,
                        max_proposals=spec.num_speculative_tokens,
                        page_size=page_size,
                        kv_groups=self.kv_groups,
                    )

            self._draft = jax.jit(
                draft_impl,
                donate_argnames=("kv_pages",),
                out_shardings=None if out_shardings is None else out_shardings[1:],
            )
        # Compiling ahead (`compile_ahead`): one background thread, one device, one process.
        if config.compile_ahead and self.mesh is None and jax.process_count() == 1:
            self._ahead_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="llmjax-compile-ahead"
            )

    def _init_lora(self) -> None:
        """LoRA adapter slots (llmjax/model/lora.py) in `params["lora"]`, all empty, and the
        jitted write of one slot."""
        cfg = self.config.lora
        self.lora_targets = cfg.targets_for(self.model_config.is_moe)
        with jax.default_device(self.device):
            slots = lora_slots.allocate_slots(
                self.model_config,
                self.lora_targets,
                cfg.max_loras,
                cfg.max_lora_rank,
                self.dtype,
                grouped=cfg.grouped(self.config.parallel.tp),
            )
        shardings = None
        if self.mesh is not None:  # split as the weights they attach to (tp)
            shardings = lora_shardings(slots, self.mesh)
            slots = jax.tree.map(jax.device_put, slots, shardings)
        self.params = {**self.params, "lora": slots}
        self.num_lora_writes = 0
        self._write_lora = jax.jit(
            functools.partial(lora_slots.write_slot, max_rank=cfg.max_lora_rank),
            donate_argnums=0,
            out_shardings=shardings,
        )

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Device slot `slot` now holds `adapter` (`llmjax.lora.LoRAWeights`), its ranks padded
        to max_lora_rank and absent targets zero on the host, so the write compiles once."""
        R = self.config.lora.max_lora_rank
        dims = lora_slots.projection_dims(self.config.model)  # the original heads
        L = self.model_config.num_layers
        layout = tp_head_layout(self.config.model, self.config.parallel.tp,
                                self.config.parallel.pad_heads)  # fmt: skip
        arrays = {}
        for name in lora_slots.weights(self.params["lora"]):
            n_in, n_out = dims[name]
            a = np.zeros((L, n_in, R), np.float32)
            b = np.zeros((L, R, n_out), np.float32)
            if name in adapter.weights:
                ai, bi = adapter.weights[name]
                a[:, :, : ai.shape[2]], b[:, : bi.shape[1]] = ai, bi
            arrays[name] = transform_lora(name, a, b, layout, self.config.model)  # tp's heads
        slot_arg = np.int32(slot)
        if self.mesh is not None:
            arrays = jax.tree.map(lambda x: place(x, replicated(self.mesh)), arrays)
            slot_arg = place(slot_arg, replicated(self.mesh))
        self.params["lora"] = self._write_lora(self.params["lora"], slot_arg, arrays)
        self.num_lora_writes += 1

    @staticmethod
    def annotate(name: str, **metadata):
        """A named range on the profiler's host timeline (jax.profiler.TraceAnnotation; next to
        free unless a trace is being taken, e.g. inside `LLM.profile`)."""
        return jax.profiler.TraceAnnotation(name, **metadata)

    @staticmethod
    def annotate_step(step_num: int):
        """One engine step, as a step marker for the profile viewers' step views."""
        return jax.profiler.StepTraceAnnotation("llmjax_step", step_num=step_num)

    def _step_impl(self, params, kv_pages, step, *, model_config, attention_fn, kv_groups=None):
        """One step's forward -> (greedy next ids [S], logits [S, V], kv_pages)."""
        ahead = getattr(self._tracing, "ahead", None)  # runs only while tracing
        if ahead == "compile_ahead":
            self.num_compiled_ahead += 1
        elif ahead is None:
            self.num_compiles += 1
        # (precompile's threads: counted by `precompile`, not from several threads here)
        with self._mesh_context():
            logits, kv_pages = forward(
                params, kv_pages, step, model_config, attention_fn, kv_groups=kv_groups
            )
        return greedy_ids(logits), logits, kv_pages

    def _mesh_context(self):
        """While tracing a step: the engine's mesh in context, for the model's parts that run
        per device by mesh axis (expert parallelism, llmjax/model/moe.py)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    @staticmethod
    def _sampling_arrays(sampling: SamplingInput) -> tuple:
        return (
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.seeds,
            sampling.counters,
            np.bool_(sampling.all_greedy),
        )

    def _inputs(self, step: StepInput, sampling: SamplingInput) -> tuple:
        """Host arrays -> the step's inputs: as they are on one device; replicated global
        arrays on a mesh (every process holds the same host arrays)."""
        if self.lora_targets and step.lora_slots is None:  # a step of the base model alone
            step = step._replace(lora_slots=np.full(len(step.token_ids), -1, np.int32))
        if self.kv_groups is not None and step.group_page_indices is None:
            step = with_groups(step, self.kv_groups.num_groups)  # (an all-padding step)
        arrays = (step, self._sampling_arrays(sampling))
        if self.mesh is None:
            return arrays
        sharding = replicated(self.mesh)
        return jax.tree.map(lambda x: place(np.asarray(x), sharding), arrays)

    def run(self, step: StepInput, sampling: SamplingInput) -> np.ndarray:
        """Run one step and wait for it: `collect(launch(...))`'s token ids."""
        return self.collect(self.launch(step, sampling))[1]

    def launch(self, step: StepInput | None, sampling: SamplingInput | None, tag=None) -> Launched:
        """Dispatch one step (pp > 1: one pipeline tick; `step` None enters no micro-batch):
        the jitted forward, then the sampler, verification or logprobs it needs. Returns before
        the device is done (JAX's asynchronous dispatch; the host computes a structured
        output's bitmask meanwhile); `collect` waits for the results. `tag` comes back from
        `collect` with the step's tokens (the engine passes the scheduled batch)."""
        if self.pipelined:
            return self._launch_tick(step, sampling, tag)
        if self.sparse.enabled:
            next_ids, self.kv_pages, self.partial_keys, stats = self._sparse_step(
                self.params,
                self.kv_pages,
                self.partial_keys,
                self.spec_weights,
                *self._inputs(step, sampling),
            )
            return Launched(tag, next_ids, sparse_stats=stats)
        step_fn = self._step
        if self._ahead or self._ahead_pool is not None:  # (precompile's, compile_ahead's)
            shape = step_shape(step)
            self._ran_shapes.add(shape)
            ahead = self._ahead.get(shape)
            if ahead is not None:
                if ahead.exception() is None:  # waits for it if it is still compiling
                    step_fn = ahead.result()
                else:
                    logger.warning("compiling %s ahead failed: %r", shape, ahead.exception())
        step_arg, sampling_args = self._inputs(step, sampling)
        if sampling.token_rows is not None:  # async scheduling: ids the host does not have
            step_arg = step_arg._replace(token_ids=self._pending_filled(step_arg, sampling))
        next_ids, logits, self.kv_pages = step_fn(self.params, self.kv_pages, step_arg)
        if sampling.spec is not None:  # verify proposals
            spec = sampling.spec.arrays()
            if self.mesh is not None:
                spec = tuple(place(x, replicated(self.mesh)) for x in spec)
            tokens, accepted = self._verify(logits, next_ids, *spec, *sampling_args)
            out = Launched(tag, None, spec=(tokens, accepted, None))
            if sampling.processing is not None:  # rows without proposals process their logits
                rows = jnp.take(logits, spec[0], axis=0)  # each sequence's first row
                processed, out.logprobs = self._processed(rows, sampling, sampling_args)
                out.spec = (tokens, accepted, (processed, sampling.spec.num_proposals == 0))
            return out
        out = Launched(tag, next_ids)
        if sampling.prompt is not None:  # logits came for every token row
            rows, targets = sampling.prompt.last_rows, sampling.prompt.targets
            if self.mesh is not None:
                rows, targets = (place(x, replicated(self.mesh)) for x in (rows, targets))
            logits, out.next_ids, out.prompt_logprobs = self._prompt_logprobs(
                logits, rows, targets, num_logprobs=MAX_LOGPROBS
            )
        if sampling.processing is not None:
            out.next_ids, out.logprobs = self._processed(logits, sampling, sampling_args)
        elif not sampling.all_greedy:
            sample = self._sample
            if (ahead := self._samplers.get(logits.shape[0])) is not None:
                sample = ahead.result()
            out.next_ids = sample(logits, *sampling_args[:-1])  # all but all_greedy
        self._last_ids = out.next_ids
        return out

    def _pending_filled(self, step: StepInput, sampling: SamplingInput):
        """The step's token ids with each pending token's (`SamplingInput.token_rows`) taken
        from the last launched step's sampled ids, on the device."""
        if self._last_ids is None:
            raise ValueError("a step with pending tokens needs a launched step before it")
        if self._kept is None:
            size = self.config.scheduler.max_num_seqs
            self._kept = jnp.zeros(size, jnp.int32)
            if self.mesh is not None:
                self._kept = place(np.zeros(size, np.int32), replicated(self.mesh))
        self._kept = self._keep(self._kept, self._last_ids)
        rows = sampling.token_rows
        if self.mesh is not None:
            rows = place(rows, replicated(self.mesh))
        return self._fill(self._kept, step.token_ids, rows)

    def collect(self, launched: Launched) -> tuple[object, np.ndarray] | None:
        """Wait for a launched step: (its tag, the next token id of every (padded) sequence
        row), or None for a pipeline tick that no micro-batch left. Sets the step's other
        results: `last_logprobs`, `last_prompt_logprobs`, `last_spec` (the verified tokens
        [S, K + 1] and accepted counts [S]), `last_sparse_stats` (numpy)."""
        self.last_logprobs = self.last_prompt_logprobs = self.last_spec = None
        if launched.sparse_stats is not None:
            self.last_sparse_stats = jax.tree.map(np.asarray, launched.sparse_stats)
        if launched.logprobs is not None:
            self.last_logprobs = tuple(to_host(x) for x in launched.logprobs)
        if launched.prompt_logprobs is not None:
            self.last_prompt_logprobs = tuple(to_host(x) for x in launched.prompt_logprobs)
        if launched.spec is not None:
            tokens, accepted, processed = launched.spec
            tokens, accepted = np.array(to_host(tokens)), to_host(accepted)
            if processed is not None:
                ids, plain = processed
                tokens[plain, 0] = to_host(ids)[plain]
            self.last_spec = (tokens, accepted)
            next_ids = tokens[:, 0]
        elif launched.next_ids is None:  # a pipeline tick that no micro-batch left
            return None
        else:
            next_ids = to_host(launched.next_ids)
        if not self.pipelined:
            self.num_steps += 1
        if self.config.parallel.check_lockstep:
            check_lockstep(next_ids, self.num_steps)
        return launched.tag, next_ids

    def time_step(self, step: StepInput, sampling: SamplingInput, repeats: int, warmup: int = 3):
        """Median seconds of the jitted model step alone on these inputs (no scheduling, input
        building or sampling on the host), each call waited for (the benchmarks' "device ms").
        Rerunning a step rewrites the same KV positions with the same values."""
        step_arg, _ = self._inputs(step, sampling)
        times = []
        for i in range(warmup + repeats):
            t = time.perf_counter()
            out = self._step(self.params, self.kv_pages, step_arg)
            jax.block_until_ready(out)
            self.kv_pages = out[2]
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return float(np.median(times))

    def draft(self, tokens, positions, page_indices, num_proposals) -> np.ndarray:
        """Speculative decoding's early-exit draft (`SpeculativeConfig.method == 'draft'`):
        each row's last token, its position, its page table (with pages for the drafted
        tokens; [groups, S, P] every group's in the hybrid KV layout) and how many tokens to
        draft -> proposals [S, K] (-1 past each row's count).
        Writes the first `num_draft_layers` layers' KV of the drafted positions."""
        args = (tokens, positions, page_indices, num_proposals)
        if self.mesh is not None:
            args = tuple(place(np.asarray(x), replicated(self.mesh)) for x in args)
        proposals, self.kv_pages = self._draft(self.params, self.kv_pages, *args)
        return to_host(proposals)

    def _processed(self, logits, sampling: SamplingInput, sampling_args):
        """The processed sampler over `logits` [S, V] (one row per sequence): (next ids,
        logprobs or None), on the device."""
        proc = sampling.processing
        arrays = proc.arrays()
        # structured outputs: the host fills the mask while the device runs the forward
        bitmask = sampling.bitmask_fn() if sampling.bitmask_fn is not None else None
        if self.mesh is not None:
            arrays = tuple(place(np.asarray(x), replicated(self.mesh)) for x in arrays)
            if bitmask is not None:
                bitmask = place(bitmask, replicated(self.mesh))
        return self._sample_processed(
            logits, *sampling_args[:-1], *arrays, bitmask, num_logprobs=proc.num_logprobs
        )

    def compile_ahead(self, shapes) -> None:
        """Compile the step for these (T, S, P) shapes in the background (those not yet run or
        queued), so that a step meeting one finds it ready instead of compiling it on the spot;
        the engine queues the shapes its next steps are likely to take (`Buckets.likely_next`).
        A no-op unless `EngineConfig.compile_ahead` (and one device, one process, no sparse_kv
        or pipeline)."""
        if self._ahead_pool is None:
            return
        for shape in shapes:
            shape = tuple(int(d) for d in shape)
            if shape not in self._ahead and shape not in self._ran_shapes:
                self._ahead[shape] = self._ahead_pool.submit(self._compile, shape)

    def _compile(self, shape: tuple[int, int, int], why: str = "compile_ahead"):
        """The step compiled for one (T, S, P) shape (AOT: lowered against the KV pages'
        shapes, so nothing runs), for `why` ('compile_ahead' or 'precompile', which count their
        compiles apart)."""
        T, S, P = shape
        if self._kv_structs is None:
            self._kv_structs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self.kv_pages,
            )
        self._tracing.ahead = why
        try:
            step, _ = self._inputs(pipeline.pad_step(None, T, S, P), greedy_sampling(S))
            lowered = self._step.lower(self.params, self._kv_structs, step)
        finally:
            self._tracing.ahead = None
        return lowered.compile()

    def _precompile_threads(self, shapes: list[tuple[int, int, int]], progress) -> None:
        todo = [s for s in dict.fromkeys(shapes) if s not in self._ahead]
        rows = sorted({S for _, S, _ in shapes} - set(self._samplers))
        workers = max(1, min(len(todo) + len(rows), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="llmjax-precompile"
        ) as pool:
            samplers = {S: pool.submit(self._compile_sampler, S) for S in rows}
            futures = {s: pool.submit(self._compile, s, "precompile") for s in todo}
            steps = set(futures.values())
            for future in concurrent.futures.as_completed([*samplers.values(), *steps]):
                future.result()  # raises a failed compile's error here
                if future in steps:
                    progress()
            self._samplers.update(samplers)
            self._ahead.update(futures)
        self.num_compiles += len(futures)
        self.num_sample_compiles += len(samplers)

    def _compile_sampler(self, S: int):
        """The sampler (`sample_random`, its own program) compiled ahead of time for S rows."""
        sampling = greedy_sampling(S)
        sampling.temperature[:], sampling.all_greedy = 1.0, False
        args = self._sampling_arrays(sampling)[:-1]  # all but all_greedy, as `launch` calls it
        logits = jax.ShapeDtypeStruct((S, self.model_config.vocab_size), jnp.float32)
        self._tracing.ahead = "precompile"
        try:
            return self._sample.lower(logits, *args).compile()
        finally:
            self._tracing.ahead = None

    def lower(self, step: StepInput, sampling: SamplingInput):
        """The lowered step for these shapes (for HLO inspection in tests)."""
        if self.sparse.enabled:
            return self._sparse_step.lower(
                self.params,
                self.kv_pages,
                self.partial_keys,
                self.spec_weights,
                *self._inputs(step, sampling),
            )
        return self._step.lower(self.params, self.kv_pages, self._inputs(step, sampling)[0])

    def precompile(self, shapes: list[tuple[int, int, int]], progress=None) -> None:
        """Compile (or load from the persistent cache) the step for every (T, S, P) shape by
        running it once on an all-padding input, which writes only to the reserved page. With
        pp > 1: one tick per shape with an all-padding micro-batch entering, drained by pp - 1
        empty ticks (a tick's bucket is its micro-batches' largest, itself one of `shapes`), and
        the hidden-state carry's resize between every pair of token buckets. The sampler runs
        once per S bucket, on one such step with a sampling row. `progress()` is called after
        each shape.

        On one device in one process (no sparse_kv or speculation) nothing runs: the steps and
        the sampler of each S compile ahead of time in a pool of threads, one per CPU, and
        `launch` calls those executables. SmolLM2 float32 on 2 CPUs (23 shapes, 7 samplers):
        29.4 s running every shape, 18.1-18.7 s so; with the persistent cache filled, 5.2 s."""
        progress = progress or (lambda: None)
        if self.pipelined:
            self._precompile_pipeline(shapes, progress)
            return
        if (
            self.mesh is None
            and jax.process_count() == 1
            and not self.sparse.enabled
            and not self.config.speculative.enabled
        ):
            self._precompile_threads(shapes, progress)
            return
        sampled, drafted = set(), set()
        K = self.config.speculative.num_speculative_tokens
        for T, S, P in shapes:
            sampling = greedy_sampling(S)
            if S not in sampled:
                sampled.add(S)
                sampling.temperature[0], sampling.all_greedy = 1.0, False
            step = pipeline.pad_step(None, T, S, P)
            self.run(step, sampling)
            if self.config.speculative.enabled:  # the variant that verifies proposals
                sampling.spec = SpecInput.empty(S, K, spec_rows(T, S, K))
                rows = np.zeros(spec_rows(T, S, K), np.int32)
                self.run(step._replace(logits_indices=rows), sampling)
                if self.config.speculative.method == "draft" and (S, P) not in drafted:
                    drafted.add((S, P))  # nothing drafted: every write lands in page 0
                    zeros = np.zeros(S, np.int32)
                    self.draft(zeros, zeros, np.zeros((S, P), np.int32), zeros)
            progress()

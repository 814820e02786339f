"""The device side of the engine: weights, KV pages and the jitted step (forward, greedy ids and
logits; then sampling, its own program, when a row samples), on one device or sharded over a mesh
(llmjax/parallel/).

This is the only module under `llmjax/engine/` that imports jax. The step is jitted once per shape
bucket (T tokens, S sequences, P pages per sequence), the sampler once per S; the KV pages are
donated, so they are updated in place. `num_compiles` counts step traces (`num_sample_compiles`
the sampler's), so tests can assert that steady-state serving does not recompile; `precompile`
compiles every bucket up front.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llmjax.config import EngineConfig
from llmjax.engine.batch import SamplingInput, SpecInput, spec_rows, step_shape
from llmjax.model.attention import make_attention_fn, resolve_attention_backend
from llmjax.model.draft import draft_proposals
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import Params, stack_layers, unstack_layers
from llmjax.model.quant import is_packed
from llmjax.model.sampler import (
    greedy_ids,
    prompt_logprobs,
    sample,
    sample_processed,
    sample_random,
    verify_proposals,
)
from llmjax.model.step_input import RESERVED_PAGE, StepInput
from llmjax.parallel import pipeline
from llmjax.parallel.distributed import check_lockstep, to_host
from llmjax.parallel.heads import tp_head_layout
from llmjax.parallel.mesh import (
    kv_pages_sharding,
    make_mesh,
    place,
    place_params,
    replicated,
)
from llmjax.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Launched:
    """A dispatched step (`ModelRunner.launch`): device arrays that `collect` waits for."""

    tag: object  # handed back by collect (the engine's scheduled batch)
    next_ids: jax.Array | None  # [S]; None: a pipeline tick that no micro-batch left
    logprobs: tuple | None = None  # the sampler's (top ids, top logprobs, sampled, rank)
    prompt_logprobs: tuple | None = None  # (target logprob, rank, top ids, top logprobs) [T]
    spec: tuple | None = None  # (tokens, accepted, (processed ids, plain rows) or None)
    sparse_stats: object = None  # sparse_kv's SparseStats


def enable_compilation_cache(cache_dir: str) -> None:
    """Point JAX's persistent compilation cache at `cache_dir` unless the user configured one."""
    if not cache_dir or jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class ModelRunner:
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
        if self.pipelined:
            self._init_pipeline(params, num_pages, attention_fn)
            return
        scan = config.scans_layers  # the layer loop: weights and KV cache stacked, or per layer
        if self.mesh is None:
            self.model_config = config.model
            self.params = stack_layers(params) if scan else unstack_layers(params)
            if self.device is not None:
                self.params = jax.device_put(self.params, self.device)
            with jax.default_device(self.device):
                self.kv_pages = allocate_kv_pages(
                    config.model, num_pages, page_size, self.dtype, stacked=scan
                )
            out_shardings = None
        else:
            layout = tp_head_layout(config.model, parallel.tp, parallel.pad_heads)
            self.model_config = layout.model_config(config.model)
            self.params = place_params(
                params, config.model, layout, self.mesh, self.dtype, stacked=scan
            )
            kv_sharding = kv_pages_sharding(
                self.model_config, self.mesh, num_pages, page_size, stacked=scan
            )
            kv_shardings = (kv_sharding, kv_sharding)  # per layer unless stacked
            if not scan:
                kv_shardings = [kv_shardings] * self.model_config.num_layers
            allocate = functools.partial(
                allocate_kv_pages, self.model_config, num_pages, page_size, self.dtype, stacked=scan
            )
            self.kv_pages = jax.jit(allocate, out_shardings=kv_shardings)()
            out_shardings = (
                replicated(self.mesh),
                replicated(self.mesh),
                jax.tree.map(lambda x: x.sharding, self.kv_pages),
            )
        self.num_compiles = 0
        self.num_steps = 0
        self._step = jax.jit(
            functools.partial(
                self._step_impl, model_config=self.model_config, attention_fn=attention_fn
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
            self.num_sample_compiles += 1  # runs only while tracing
            return sample_random(*args)

        self.num_sample_compiles = 0
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
            self._kv_structs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self.kv_pages,
            )
            self._ran_shapes: set[tuple[int, int, int]] = set()

    def _init_sparse(self, params, num_pages: int, skew) -> None:
        """sparse_kv != 'none': the KV pool in host memory, InfiniGen's partial keys and
        speculation weights, and the jitted sparse step (llmjax/sparse/infinigen.py)."""
        from llmjax.sparse import infinigen
        from llmjax.sparse.skew import load_skew

        config, sparse = self.config, self.sparse
        pallas = self.attention_backend == "pallas"
        if pallas and sparse.capacity < 1:
            raise ValueError(
                f"sparse_kv capacity={sparse.capacity} evicts pages (holes in the page tables), "
                "which only the jnp attention masks: use attention_backend='reference' or "
                "capacity=1.0"
            )
        self.model_config = config.model
        self.params = unstack_layers(params)
        page_size = config.cache.page_size
        self.pool_memory_kind = infinigen.pool_memory_kind(sparse.pool_memory)
        self.kv_pages = infinigen.allocate_pool(
            config.model, num_pages, page_size, self.dtype, self.pool_memory_kind
        )
        self.partial_keys = infinigen.allocate_partial_keys(
            config.model, sparse, num_pages, page_size, self.dtype
        )
        self.spec_weights = [None] * config.model.num_layers
        if sparse.mode == "infinigen":
            if skew is None:
                if sparse.skew_dir is None:
                    raise ValueError(
                        "sparse_kv='infinigen' needs the skewing matrices: pass skew=(A, energy) "
                        "(llmjax.sparse.skew.calibrate) or set SparseKVConfig.skew_dir (LLM "
                        "calibrates on a bundled text when neither is given)"
                    )
                skew = load_skew(sparse.skew_dir, config.model)
            self.spec_weights = infinigen.speculation_weights(*skew, config.model, sparse)
        host = self.pool_memory_kind is not None

        def step_impl(params, pool, partial, weights, step, sampling):
            self.num_compiles += 1  # runs only while tracing
            logits, pool, partial, stats = infinigen.sparse_forward(
                params,
                pool,
                partial,
                weights,
                step,
                config.model,
                sparse,
                host,
                pallas,
                implementation=None if config.pallas_kernel == "auto" else config.pallas_kernel,
            )
            return sample(logits, *sampling), pool, partial, stats

        self._sparse_step = jax.jit(step_impl, donate_argnames=("pool", "partial"))

    def fetch_rows_per_token(self, P: int) -> int:
        """sparse_kv='infinigen': rows per (token, kv head) of a sparse layer's fetch buffer, in
        a bucket of P pages per sequence."""
        from llmjax.sparse.infinigen import fetch_buffer_rows

        G = self.config.cache.page_size
        return fetch_buffer_rows(self.sparse, P * G, G)

    def _init_pipeline(self, params, num_pages: int, attention_fn) -> None:
        """pp > 1: weights and KV pages per stage, and the jitted pipeline tick
        (llmjax/parallel/pipeline.py)."""
        config, mesh = self.config, self.mesh
        layout = tp_head_layout(config.model, config.parallel.tp, config.parallel.pad_heads)
        self.model_config = layout.model_config(config.model)
        scan = config.scans_layers
        self.params = pipeline.place_pp_params(
            unstack_layers(params), config.model, layout, mesh, self.dtype, stacked=scan
        )
        num_slots = len(pipeline.stage_layers(config.model.num_layers, config.parallel.pp)[0])
        self.kv_pages = pipeline.allocate_pp_kv_pages(
            self.model_config,
            mesh,
            num_slots,
            num_pages,
            config.cache.page_size,
            self.dtype,
            stacked=scan,
        )
        pp = mesh.shape["pp"]
        carry = NamedSharding(mesh, PartitionSpec("pp"))
        self._h = jax.device_put(
            jnp.zeros((pp, 1, self.model_config.hidden_size), self.dtype), carry
        )
        self._slots: collections.deque = collections.deque()  # index = stage; None = empty
        tick = pipeline.make_tick(self.model_config, attention_fn, mesh, num_slots)

        def tick_impl(params, kv, h, metas, sampling):
            self.num_compiles += 1  # runs only while tracing
            return tick(params, kv, h, metas, sampling)

        self._tick = jax.jit(
            tick_impl,
            donate_argnames=("kv", "h"),
            out_shardings=(
                replicated(mesh),
                carry,
                jax.tree.map(lambda x: x.sharding, self.kv_pages),
            ),
        )

    @staticmethod
    def annotate(name: str, **metadata):
        """A named range on the profiler's host timeline (jax.profiler.TraceAnnotation; next to
        free unless a trace is being taken, e.g. inside `LLM.profile`)."""
        return jax.profiler.TraceAnnotation(name, **metadata)

    @staticmethod
    def annotate_step(step_num: int):
        """One engine step, as a step marker for the profile viewers' step views."""
        return jax.profiler.StepTraceAnnotation("llmjax_step", step_num=step_num)

    @property
    def num_in_flight(self) -> int:
        """Micro-batches in the pipeline (pp > 1)."""
        return sum(s is not None for s in self._slots) if self.pipelined else 0

    def tick(self, step: StepInput | None, sampling: SamplingInput | None, tag=None):
        """pp > 1: one pipeline tick, waited for. The micro-batch (`step`, `sampling`; None for
        none) enters stage 0. Returns (exited, tokens): exited = (tag, next token ids) of the
        micro-batch leaving the last stage, or None; tokens = each stage's token count this
        tick (0 for an empty stage), for the bubble statistics."""
        return self.collect(self.launch(step, sampling, tag)), self.last_stage_tokens

    def _launch_tick(self, step, sampling, tag) -> Launched:
        pp = self.mesh.shape["pp"]
        self._slots.appendleft(None if step is None else (tag, step, sampling))
        while len(self._slots) < pp:
            self._slots.append(None)
        steps = [None if s is None else s[1] for s in self._slots]
        T, S, P = pipeline.step_bucket(steps)
        padded = [pipeline.pad_step(x, T, S, P) for x in steps]
        metas = StepInput(*(np.stack(field) for field in zip(*padded, strict=True)))
        exiting = self._slots[pp - 1]
        arrays = self._sampling_arrays(exiting[2]) if exiting else None
        sampling_arrays = _pad_sampling(arrays, S)
        sharding = NamedSharding(self.mesh, PartitionSpec("pp"))
        metas = jax.tree.map(lambda x: place(x, sharding), metas)
        sampling_arrays = tuple(place(x, replicated(self.mesh)) for x in sampling_arrays)
        h = pipeline.resize_carry(self._h, T)
        next_ids, self._h, self.kv_pages = self._tick(
            self.params, self.kv_pages, h, metas, sampling_arrays
        )
        self._slots.pop()
        self.last_stage_tokens = [0 if x is None else int(x.cu_q_lens[-1]) for x in steps]
        self.num_steps += 1
        if exiting is None:
            return Launched(None, None)
        return Launched(exiting[0], next_ids)

    def lower_tick(self, T: int, S: int, P: int):
        """pp > 1: the lowered pipeline tick of one (T, S, P) bucket (for HLO inspection)."""
        pp = self.mesh.shape["pp"]
        padded = [pipeline.pad_step(None, T, S, P)] * pp
        metas = StepInput(*(np.stack(field) for field in zip(*padded, strict=True)))
        metas = jax.tree.map(
            lambda x: place(x, NamedSharding(self.mesh, PartitionSpec("pp"))), metas
        )
        sampling = tuple(place(x, replicated(self.mesh)) for x in _pad_sampling(None, S))
        h = pipeline.resize_carry(self._h, T)
        return self._tick.lower(self.params, self.kv_pages, h, metas, sampling)

    def _step_impl(self, params, kv_pages, step, *, model_config, attention_fn):
        """One step's forward -> (greedy next ids [S], logits [S, V], kv_pages)."""
        if getattr(self._tracing, "ahead", False):  # runs only while tracing
            self.num_compiled_ahead += 1
        else:
            self.num_compiles += 1
        with self._mesh_context():
            logits, kv_pages = forward(params, kv_pages, step, model_config, attention_fn)
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
        if self._ahead_pool is not None:
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
            out.next_ids = self._sample(logits, *sampling_args[:-1])  # all but all_greedy
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
        tokens) and how many tokens to draft -> proposals [S, K] (-1 past each row's count).
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

    # ---- KV page transfer (disaggregated serving, llmjax/cluster/transfer.py) -----------------

    @property
    def kv_transfer_sharding(self):
        """The sharding of `export_pages`' array [L, 2, n, page_size, K', H]: K' (the device
        layout's kv heads) split as the KV pages split them; the rest replicated."""
        if self.pipelined or self.sparse.enabled:
            raise ValueError("KV page transfer needs pp == 1 and sparse_kv='none'")
        if self.mesh is None:
            leaf = jax.tree.leaves(self.kv_pages)[0]
            return jax.sharding.SingleDeviceSharding(next(iter(leaf.devices())))
        spec = jax.tree.leaves(self.kv_pages)[0].sharding.spec
        kv_axis = spec[2] if len(spec) > 2 else None
        return NamedSharding(self.mesh, PartitionSpec(None, None, None, None, kv_axis, None))

    @property
    def kv_dtype(self) -> np.dtype:
        """The dtype of the KV pages (what `export_pages` returns)."""
        return np.dtype(jax.tree.leaves(self.kv_pages)[0].dtype)

    def transfer_shape(self, num_pages: int) -> tuple[int, ...]:
        """The shape `export_pages` returns for `num_pages` pages (bucketed)."""
        m = self.model_config
        G = self.config.cache.page_size
        return (m.num_layers, 2, transfer_bucket(num_pages), G, m.num_kv_heads, m.head_dim)

    def _transfer(self):
        if self._transfer_fns is not None:
            return self._transfer_fns
        out = self.kv_transfer_sharding
        kv_out = jax.tree.map(lambda x: x.sharding, self.kv_pages)
        stacked = not isinstance(self.kv_pages, list)
        L, N = self.model_config.num_layers, self.num_pages

        def rows(idx):  # stacked layout: layer l's page p is row l * N + p
            return (jnp.arange(L, dtype=jnp.int32)[:, None] * N + idx[None, :]).reshape(-1)

        def gather(kv_pages, idx):
            self.num_transfer_compiles += 1  # runs only while tracing
            if stacked:
                k, v = kv_pages
                r = rows(idx)
                out_shape = (L, len(idx), *k.shape[1:])
                return jnp.stack([k[r].reshape(out_shape), v[r].reshape(out_shape)], axis=1)
            return jnp.stack([jnp.stack([k[idx], v[idx]]) for k, v in kv_pages])

        def scatter(kv_pages, idx, data):
            self.num_transfer_compiles += 1
            data = data.astype(self.dtype)
            if stacked:
                k, v = kv_pages
                r = rows(idx)
                flat = (L * len(idx), *k.shape[1:])
                return k.at[r].set(data[:, 0].reshape(flat)), v.at[r].set(data[:, 1].reshape(flat))
            return [
                (k.at[idx].set(data[i, 0]), v.at[idx].set(data[i, 1]))
                for i, (k, v) in enumerate(kv_pages)
            ]

        host = out
        if self.host_memory_kind is not None:
            host = out.with_memory_kind(self.host_memory_kind)
        self._transfer_fns = (
            jax.jit(gather, out_shardings=out),
            jax.jit(scatter, donate_argnames=("kv_pages",), out_shardings=kv_out),
            jax.jit(gather, out_shardings=host) if host is not out else None,
        )
        return self._transfer_fns

    @property
    def host_memory_kind(self) -> str | None:
        """Where `export_host_pages` puts its gather: 'pinned_host' when every device of this
        runner has that memory (TPU, GPU and the CPU backend do), so the copy out of device
        memory is one DMA into page-locked host memory; None: device memory, copied to
        pageable host memory by `np.asarray`."""
        if self.host_memory == "numpy":
            return None
        leaf = jax.tree.leaves(self.kv_pages)[0]
        kinds = [{m.kind for m in d.addressable_memories()} for d in leaf.devices()]
        if all("pinned_host" in k for k in kinds):
            return "pinned_host"
        if self.host_memory == "pinned_host":
            raise ValueError(
                f"kv_store.host_memory='pinned_host' but the devices have only {sorted(kinds[0])}"
            )
        return None

    @staticmethod
    def _page_index(pages, bucket: int) -> np.ndarray:
        idx = np.full(bucket, RESERVED_PAGE, np.int32)  # padding reads / writes the reserved page
        idx[: len(pages)] = pages
        return idx

    def export_pages(self, pages) -> jax.Array:
        """The KV of `pages` (in order; all layers, K and V) gathered into one array
        [L, 2, bucket, page_size, K', H] with `kv_transfer_sharding`, padded to a power-of-two
        page bucket with the reserved page (one compile per bucket)."""
        idx = self._page_index(pages, transfer_bucket(len(pages)))
        return self._transfer()[0](self.kv_pages, idx)

    def import_pages(self, pages, data: jax.Array) -> None:
        """Write `data` (as `export_pages` returns it, placed with this runner's
        `kv_transfer_sharding`) into `pages`, in place (the pages are donated); the padded
        rows go to the reserved page."""
        want = self.transfer_shape(len(pages))
        bucket = data.shape[2] if data.ndim == 6 else 0
        if (
            data.ndim != 6
            or data.shape[:2] + data.shape[3:] != want[:2] + want[3:]
            or bucket < len(pages)
            or bucket != transfer_bucket(bucket)
        ):
            raise ValueError(
                f"KV data of shape {data.shape} does not fit {len(pages)} pages of this "
                f"instance (want {want})"
            )
        idx = self._page_index(pages, data.shape[2])
        self.kv_pages = self._transfer()[1](self.kv_pages, idx, data)

    def export_host_pages(self, pages) -> jax.Array:
        """`export_pages` for a lower KV tier (llmjax/engine/kv_tiers.py), gathered into
        `host_memory_kind` memory; the caller copies it out (`np.asarray`) after the step it
        overlaps."""
        fns = self._transfer()
        if fns[2] is None:
            return self.export_pages(pages)
        return fns[2](self.kv_pages, self._page_index(pages, transfer_bucket(len(pages))))

    def import_host_pages(self, pages, data: np.ndarray) -> None:
        """`import_pages` from host memory: `data` [L, 2, len(pages), page_size, K', H] (a
        lower KV tier's blocks, llmjax/engine/kv_tiers.py), padded to the page bucket and
        copied to the device with `kv_transfer_sharding` (asynchronously)."""
        bucket = transfer_bucket(len(pages))
        if data.shape[2] != len(pages):
            raise ValueError(f"KV data for {data.shape[2]} pages, {len(pages)} pages given")
        if bucket > len(pages):
            pad = np.zeros((*data.shape[:2], bucket - len(pages), *data.shape[3:]), data.dtype)
            data = np.concatenate([data, pad], axis=2)
        self.import_pages(pages, jax.device_put(data, self.kv_transfer_sharding))

    def precompile_transfer(self, max_pages: int, host: bool = False) -> None:
        """Compile the gather and the scatter for every page bucket up to `max_pages` (each
        runs once on the reserved page only); `host`: also `export_host_pages`' gather."""
        b = 1
        while True:
            idx = self._page_index([], b)
            if host and self._transfer()[2] is not None:
                self._transfer()[2](self.kv_pages, idx)
            self.import_pages([], self._transfer()[0](self.kv_pages, idx))
            if b >= max_pages:
                break
            b *= 2

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

    def _compile(self, shape: tuple[int, int, int]):
        T, S, P = shape
        self._tracing.ahead = True
        try:
            step, _ = self._inputs(pipeline.pad_step(None, T, S, P), _greedy_sampling(S))
            lowered = self._step.lower(self.params, self._kv_structs, step)
        finally:
            self._tracing.ahead = False
        return lowered.compile()

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
        each shape."""
        progress = progress or (lambda: None)
        if self.pipelined:
            self._precompile_pipeline(shapes, progress)
            return
        sampled, drafted = set(), set()
        K = self.config.speculative.num_speculative_tokens
        for T, S, P in shapes:
            sampling = _greedy_sampling(S)
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

    def _precompile_pipeline(self, shapes: list[tuple[int, int, int]], progress) -> None:
        if self.num_in_flight:
            raise RuntimeError("precompile needs an empty pipeline")
        pp = self.mesh.shape["pp"]
        for T, S, P in shapes:
            self.tick(pipeline.pad_step(None, T, S, P), _greedy_sampling(S))
            for _ in range(pp - 1):
                self.tick(None, None)
            progress()
        # The carry as ticks leave it (sharded over 'pp'), resized from every bucket to every other.
        carry = NamedSharding(self.mesh, PartitionSpec("pp"))
        token_buckets = sorted({T for T, _, _ in shapes})
        for old in token_buckets:
            h = jax.device_put(jnp.zeros((pp, old, self._h.shape[2]), self._h.dtype), carry)
            for new in token_buckets:
                pipeline.resize_carry(h, new).block_until_ready()


def transfer_bucket(num_pages: int) -> int:
    """Pages per KV transfer, padded: the next power of two (at least 1)."""
    return 1 << max(0, int(num_pages) - 1).bit_length()


def _greedy_sampling(S: int) -> SamplingInput:
    zeros = np.zeros(S, np.float32)
    return SamplingInput(
        zeros,
        zeros.astype(np.int32),
        zeros + 1,
        zeros.astype(np.uint32),
        zeros.astype(np.int32),
        all_greedy=True,
    )


def _pad_sampling(arrays: tuple | None, S: int) -> tuple:
    """The exiting micro-batch's sampling arrays padded to S rows (greedy rows for padding and
    for a tick with no micro-batch leaving)."""
    if arrays is None:
        z = np.zeros(S, np.float32)
        return (z, z.astype(np.int32), z + 1, z.astype(np.uint32), z.astype(np.int32), np.bool_(1))
    temperature, top_k, top_p, seeds, counters, all_greedy = arrays
    pad = lambda x, v=0: np.pad(np.asarray(x), (0, S - len(x)), constant_values=v)
    return (pad(temperature), pad(top_k), pad(top_p, 1), pad(seeds), pad(counters), all_greedy)

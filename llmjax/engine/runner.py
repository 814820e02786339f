"""The device side of the engine: weights, KV pages and the jitted step (forward + sample), on
one device or sharded over a mesh (llmjax/parallel/).

This is the only module under `llmjax/engine/` that imports jax. The step is jitted once per shape
bucket (T tokens, S sequences, P pages per sequence); the KV pages are donated, so they are
updated in place. `num_compiles` counts traces, so tests can assert that steady-state serving does
not recompile; `precompile` compiles every bucket up front.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import EngineConfig
from llmjax.engine.batch import SamplingInput
from llmjax.model.attention import make_attention_fn, resolve_attention_backend
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import Params
from llmjax.model.sampler import sample
from llmjax.model.step_input import StepInput
from llmjax.parallel.distributed import check_lockstep, to_host
from llmjax.parallel.heads import tp_head_layout
from llmjax.parallel.mesh import (
    kv_pages_sharding,
    make_mesh,
    place,
    place_params,
    replicated,
)

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str) -> None:
    """Point JAX's persistent compilation cache at `cache_dir` unless the user configured one."""
    if not cache_dir or jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class ModelRunner:
    """Weights, KV pages and the jitted step, on one device or on a (pp, tp) mesh
    (`config.parallel`, llmjax/parallel/). `params` come in the model's own layout (numpy or jax
    arrays, or thunks that load a weight); with a mesh each weight is converted to the
    tensor-parallel head layout and placed shard by shard. `model_config` is the model the
    devices run (heads repeated or padded for tp; the same as `config.model` otherwise)."""

    def __init__(self, config: EngineConfig, params: Params, num_pages: int):
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        self.dtype = jnp.dtype(config.dtype)
        parallel = config.parallel
        self.mesh = make_mesh(parallel) if parallel.num_devices > 1 else None
        page_size = config.cache.page_size
        if self.mesh is None:
            self.model_config = config.model
            self.params = params
            self.kv_pages = allocate_kv_pages(config.model, num_pages, page_size, self.dtype)
            out_shardings = None
        else:
            layout = tp_head_layout(config.model, parallel.tp, parallel.pad_heads)
            self.model_config = layout.model_config(config.model)
            self.params = place_params(params, config.model, layout, self.mesh, self.dtype)
            kv_sharding = kv_pages_sharding(self.model_config, self.mesh, num_pages, page_size)
            self.kv_pages = jax.jit(
                functools.partial(
                    allocate_kv_pages, self.model_config, num_pages, page_size, self.dtype
                ),
                out_shardings=[(kv_sharding, kv_sharding)] * self.model_config.num_layers,
            )()
            out_shardings = (
                replicated(self.mesh),
                jax.tree.map(lambda x: x.sharding, self.kv_pages),
            )
        self.num_compiles = 0
        self.num_steps = 0
        self.attention_backend = resolve_attention_backend(config.attention_backend)
        attention_fn = make_attention_fn(
            self.attention_backend, flash_prefill=config.flash_prefill, mesh=self.mesh
        )
        self._step = jax.jit(
            functools.partial(
                self._step_impl, model_config=self.model_config, attention_fn=attention_fn
            ),
            donate_argnames=("kv_pages",),
            out_shardings=out_shardings,
        )

    def _step_impl(self, params, kv_pages, step, sampling, *, model_config, attention_fn):
        self.num_compiles += 1  # runs only while tracing
        logits, kv_pages = forward(params, kv_pages, step, model_config, attention_fn)
        next_ids = sample(logits, *sampling)
        return next_ids, kv_pages

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
        """Run one step; returns the next token id of every (padded) sequence row."""
        next_ids, self.kv_pages = self._step(
            self.params, self.kv_pages, *self._inputs(step, sampling)
        )
        next_ids = to_host(next_ids)
        self.num_steps += 1
        if self.config.parallel.check_lockstep:
            check_lockstep(next_ids, self.num_steps)
        return next_ids

    def lower(self, step: StepInput, sampling: SamplingInput):
        """The lowered step for these shapes (for HLO inspection in tests)."""
        return self._step.lower(self.params, self.kv_pages, *self._inputs(step, sampling))

    def precompile(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile (or load from the persistent cache) the step for every (T, S, P) shape by
        running it once on an all-padding input, which writes only to the reserved page."""
        for T, S, P in shapes:
            step = StepInput(
                token_ids=np.zeros(T, np.int32),
                positions=np.zeros(T, np.int32),
                slot_mapping=np.zeros(T, np.int32),
                cu_q_lens=np.zeros(S + 1, np.int32),
                kv_lens=np.zeros(S, np.int32),
                page_indices=np.zeros((S, P), np.int32),
                num_seqs=np.zeros(1, np.int32),
                logits_indices=np.zeros(S, np.int32),
            )
            zeros = np.zeros(S, np.float32)
            sampling = SamplingInput(
                zeros,
                zeros.astype(np.int32),
                zeros + 1,
                zeros.astype(np.uint32),
                zeros.astype(np.int32),
                all_greedy=True,
            )
            self.run(step, sampling)

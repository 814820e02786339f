"""The device side of the engine: weights, KV pages and the jitted step (forward + sample).

This is the only module under `llmjax/engine/` that imports jax. The step is jitted once per shape
bucket (T tokens, S sequences, P pages per sequence, and greedy-only or not); the KV pages are
donated, so they are updated in place. `num_compiles` counts traces, so tests can assert that
steady-state serving does not recompile.
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
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import Params
from llmjax.model.sampler import sample
from llmjax.model.step_input import StepInput

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str) -> None:
    """Point JAX's persistent compilation cache at `cache_dir` unless the user configured one."""
    if not cache_dir or jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class ModelRunner:
    def __init__(self, config: EngineConfig, params: Params, num_pages: int):
        enable_compilation_cache(config.compilation_cache_dir)
        self.config = config
        self.dtype = jnp.dtype(config.dtype)
        self.params = params
        self.kv_pages = allocate_kv_pages(
            config.model, num_pages, config.cache.page_size, self.dtype
        )
        self.num_compiles = 0
        self._step = jax.jit(
            functools.partial(self._step_impl, model_config=config.model),
            static_argnames=("all_greedy",),
            donate_argnames=("kv_pages",),
        )

    def _step_impl(self, params, kv_pages, step, sampling, *, all_greedy, model_config):
        self.num_compiles += 1  # runs only while tracing
        logits, kv_pages = forward(params, kv_pages, step, model_config)
        next_ids = sample(logits, *sampling, all_greedy=all_greedy)
        return next_ids, kv_pages

    def run(self, step: StepInput, sampling: SamplingInput) -> np.ndarray:
        """Run one step; returns the next token id of every (padded) sequence row."""
        arrays = (
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.seeds,
            sampling.counters,
        )
        next_ids, self.kv_pages = self._step(
            self.params, self.kv_pages, step, arrays, all_greedy=sampling.all_greedy
        )
        return np.asarray(next_ids)

    def lower(self, step: StepInput, sampling: SamplingInput):
        """The lowered step for these shapes (for HLO inspection in tests)."""
        arrays = (
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            sampling.seeds,
            sampling.counters,
        )
        return self._step.lower(
            self.params, self.kv_pages, step, arrays, all_greedy=sampling.all_greedy
        )

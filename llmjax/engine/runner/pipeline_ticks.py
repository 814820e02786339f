"""Pipeline parallelism in the runner (`PipelineTicks`, a part of `ModelRunner`; pp > 1):
weights and KV pages per stage, and the jitted tick (llmjax/parallel/pipeline.py) that moves every
micro-batch one stage on."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from llmjax.engine.batch import SamplingInput
from llmjax.engine.runner.launched import Launched, greedy_sampling
from llmjax.model.params import unstack_layers
from llmjax.model.step_input import StepInput
from llmjax.parallel import pipeline
from llmjax.parallel.heads import tp_head_layout
from llmjax.parallel.mesh import place, replicated


class PipelineTicks:
    """The pipeline of a `ModelRunner` (its `config`, `mesh`, `dtype`, `num_compiles`,
    `num_steps`, `_sampling_arrays`)."""

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
        # the KV slots a stage's pages hold: its layers', or in the hybrid layout its groups'
        kv_slots = config.kv_groups.slots_per_device(config.model.num_layers, config.parallel.pp)
        self._allocate_kv = functools.partial(
            pipeline.allocate_pp_kv_pages,
            self.model_config,
            mesh,
            kv_slots if self.kv_groups is not None else num_slots,
            num_pages,
            config.cache.page_size,
            self.dtype,
            stacked=scan,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.kv_pages = self._allocate_kv()
        pp = mesh.shape["pp"]
        carry = NamedSharding(mesh, PartitionSpec("pp"))
        self._h = jax.device_put(
            jnp.zeros((pp, 1, self.model_config.hidden_size), self.dtype), carry
        )
        self._slots: collections.deque = collections.deque()  # index = stage; None = empty
        tick = pipeline.make_tick(
            self.model_config, attention_fn, mesh, num_slots, kv_groups=self.kv_groups
        )

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

    @property
    def _num_groups(self) -> int | None:
        """The hybrid KV layout's page-table groups (None: one table)."""
        return None if self.kv_groups is None else self.kv_groups.num_groups

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
        padded = [pipeline.pad_step(x, T, S, P, self._num_groups) for x in steps]
        metas = StepInput(*map(_stack, zip(*padded, strict=True)))
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
        padded = [pipeline.pad_step(None, T, S, P, self._num_groups)] * pp
        metas = StepInput(*map(_stack, zip(*padded, strict=True)))
        metas = jax.tree.map(
            lambda x: place(x, NamedSharding(self.mesh, PartitionSpec("pp"))), metas
        )
        sampling = tuple(place(x, replicated(self.mesh)) for x in _pad_sampling(None, S))
        h = pipeline.resize_carry(self._h, T)
        return self._tick.lower(self.params, self.kv_pages, h, metas, sampling)

    def _precompile_pipeline(self, shapes: list[tuple[int, int, int]], progress) -> None:
        if self.num_in_flight:
            raise RuntimeError("precompile needs an empty pipeline")
        pp = self.mesh.shape["pp"]
        for T, S, P in shapes:
            self.tick(pipeline.pad_step(None, T, S, P, self._num_groups), greedy_sampling(S))
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


def _pad_sampling(arrays: tuple | None, S: int) -> tuple:
    """The exiting micro-batch's sampling arrays padded to S rows (greedy rows for padding and
    for a tick with no micro-batch leaving)."""
    if arrays is None:
        z = np.zeros(S, np.float32)
        return (z, z.astype(np.int32), z + 1, z.astype(np.uint32), z.astype(np.int32), np.bool_(1))
    temperature, top_k, top_p, seeds, counters, all_greedy = arrays
    pad = lambda x, v=0: np.pad(np.asarray(x), (0, S - len(x)), constant_values=v)
    return (pad(temperature), pad(top_k), pad(top_p, 1), pad(seeds), pad(counters), all_greedy)


def _stack(field: tuple):
    """One StepInput field of the micro-batches, stacked [pp, ...] (None stays None: a field
    the engine does not use, e.g. lora_slots)."""
    return None if field[0] is None else np.stack(field)

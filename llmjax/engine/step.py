"""The engine step's named stages, and the protocol of the features that take part in them.

`LLMEngine.step` runs one step as six stages:

    schedule   host: who runs and how many tokens each (`Scheduler.schedule`)
    prepare    host: pack the batch into the step's arrays (`batch.pack`), plus feature inputs
    launch     device: dispatch the jitted forward and the sampler (returns before they finish)
    collect    wait for the step's token ids (and whatever else it computed) on the host
    update     host: append the tokens, finish requests, free their pages (`Scheduler.update`)
    emit       a `RequestOutput` for every request that got a token, finished or was rejected

A feature (speculation, structured outputs, logprobs, the KV tiers, sparse KV's accounting, n
samples, the prefill role, compile-ahead, the pipeline's in-flight set) is a `StepFeature`: an
object the engine builds from its config (`LLMEngine._features`) and calls at named stages, in
the order of that list. A new feature adds a component with the hooks it needs, not lines in
the step. A `Step` carries one step's state from stage to stage; every hook reads and writes it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np

from llmjax.config import kv_row_bytes
from llmjax.engine.batch import step_shape

if TYPE_CHECKING:
    from llmjax.engine.batch import SamplingInput, StepInput
    from llmjax.engine.request import Request, RequestOutput
    from llmjax.engine.scheduler import ScheduledBatch


@dataclasses.dataclass(eq=False)
class Step:
    """One engine step as it moves through the stages (the module doc).

    `batch` is what the scheduler chose; with pp > 1 the collect stage replaces it by the
    micro-batch that left the pipeline (None: none did, so nothing updates this tick).
    `new_tokens` is what `Scheduler.update` appends: one id per sequence row, or a list of ids
    (speculation's accepted proposals and the target's token). `sampled`: the requests that got
    a token this step (those that sample and had not finished). `outputs` starts with the
    outputs of requests rejected or failed since the last step."""

    batch: ScheduledBatch | None
    outputs: list[RequestOutput]
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    step_input: StepInput | None = None
    sampling: SamplingInput | None = None
    launched: object = None  # the runner's handle on the dispatched step (`runner.launch`)
    next_ids: np.ndarray | None = None  # the device's next token id per (padded) sequence row
    new_tokens: list | None = None
    sampled: list[Request] = dataclasses.field(default_factory=list)
    finished: list[Request] = dataclasses.field(default_factory=list)
    t_launch: float = 0.0  # wall time when the launch began
    c_launch: float = 0.0  # the engine's clock then (wall or simulated)
    t_collected: float = 0.0  # wall time when the tokens were on the host
    device_s: float = 0.0  # the device's time on the engine's clock (simulated or wall)
    draft_s: float = 0.0  # seconds of the early-exit draft (speculation), in the schedule stage
    compiles: tuple = ()  # the runner's compile counters before the launch

    @property
    def host_s(self) -> float:
        """The engine's own host seconds: everything but launch-to-collected."""
        return (self.t_launch - self.t_start) + (time.perf_counter() - self.t_collected)


class StepFeature:
    """A component the engine calls at named stages of every step (the module doc). Each hook
    does nothing unless overridden; hooks are called in the order of the engine's feature list.

    Contracts:
    - `scheduled(step)`: after `Scheduler.schedule`, before packing; called on every step, also
      when the batch is empty (then it is the only hook called). May shrink the batch (drop
      proposals) or fill in what packing reads (drafted proposals); may start host-side copies
      that must precede the step (KV tier write-backs of evicted pages).
    - `prepare(step)`: after packing, before the launch: may attach inputs to `step.sampling`
      (a bitmask to compute while the forward runs) and record what the step is before it runs.
    - `collect(step)`: after the step's token ids are on the host (`step.next_ids`,
      `step.new_tokens`), before the scheduler appends them: read the runner's other results
      (logprobs, verified proposals) and may rewrite `step.new_tokens`. Requests that finished
      earlier are still in `step.batch` (check `request.status.is_done`).
    - `update(step)`: after `Scheduler.update` appended the tokens, finished requests
      (`step.finished`) and freed their pages; `step.sampled` holds the requests that got a
      token. Bookkeeping that follows a step: park, release, evict, dispatch copies.
    - `emit(step)`: may rewrite `step.outputs` (n samples: one output per group)."""

    def scheduled(self, step: Step) -> None:
        pass

    def prepare(self, step: Step) -> None:
        pass

    def collect(self, step: Step) -> None:
        pass

    def update(self, step: Step) -> None:
        pass

    def emit(self, step: Step) -> None:
        pass


class CompileAhead(StepFeature):
    """`EngineConfig.compile_ahead`: hook `update` has the runner compile, in the background,
    the step shapes likely to come next (`Buckets.likely_next`) that it has not compiled."""

    def __init__(self, engine):
        self.engine = engine

    def update(self, step: Step) -> None:
        e = self.engine
        likely = e.buckets.likely_next(step_shape(step.step_input), len(e.scheduler.running))
        e.runner.compile_ahead(likely)


class PipelineInFlight(StepFeature):
    """pp > 1: a micro-batch's requests are in flight from the tick they enter the pipeline to
    the tick they leave it, and the scheduler does not schedule them meanwhile
    (`Scheduler.in_flight`). Hooks `prepare` (enter) and `collect` (leave)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def prepare(self, step: Step) -> None:
        if step.batch:
            self.scheduler.in_flight.update(s.request.request_id for s in step.batch.seqs)

    def collect(self, step: Step) -> None:
        self.scheduler.in_flight.difference_update(s.request.request_id for s in step.batch.seqs)


class SparseAccounting(StepFeature):
    """sparse_kv (llmjax/sparse/): hook `update` counts the step's host -> device KV bytes
    (`EngineStats.record_fetch`, from the runner's `last_sparse_stats`) and, with a host pool
    `capacity` < 1, bounds the pool: evicts pages of the requests over it (counter, LRU or
    FIFO; `llmjax.sparse.host_pool.PoolEvictor`)."""

    def __init__(self, engine):
        self.engine = engine
        config = engine.config
        self.evictor = None  # InfiniGen's host pool bound
        self._pool_tables: dict[str, list[int]] = {}
        sparse = config.sparse_kv
        if sparse.capacity < 1:
            from llmjax.sparse.host_pool import PoolEvictor

            self.evictor = PoolEvictor(sparse.eviction, sparse.capacity, config.cache.page_size)

    def update(self, step: Step) -> None:
        e = self.engine
        batch, step_input = step.batch, step.step_input
        st = e.runner.last_sparse_stats
        m, sparse = e.config.model, e.config.sparse_kv
        # one K and one V row as the pool stores them (a quantized cache: codes and a scale)
        row = 2 * kv_row_bytes(
            m.head_dim, np.dtype(e.config.dtype).itemsize, e.runner.kv_cache_dtype
        )
        cached_tokens = sum(seq.start + seq.num_new_tokens for seq in batch.seqs)
        is_sparse = bool(st.sparse)
        dense_layers = sparse.num_dense_layers if is_sparse else m.num_layers
        rows = dense_layers * cached_tokens * m.num_kv_heads + int(st.rows.sum())
        S, P = step_input.page_indices.shape
        G = e.block_manager.page_size
        buffer_rows = dense_layers * S * P * G * m.num_kv_heads
        if is_sparse:
            sparse_layers = m.num_layers - sparse.num_dense_layers
            per_token = e.runner.fetch_rows_per_token(P)
            buffer_rows += sparse_layers * S * m.num_kv_heads * per_token
        decode_only = all(s.is_decode for s in batch.seqs)
        e.stats.record_fetch(rows * row, buffer_rows * row, decode_only, is_sparse, len(batch.seqs))
        if self.evictor is None:
            return
        bm = e.block_manager
        for i, seq in enumerate(batch.seqs):
            rid = seq.request.request_id
            table = bm.page_tables.get(rid)
            if table is None:  # finished or aborted
                continue
            if self._pool_tables.get(rid) is not table:  # new, or recomputed after preemption
                self.evictor.forget(rid)
                self._pool_tables[rid] = table
            hits = st.page_hits[i] if is_sparse else None
            self.evictor.record_step(rid, len(table), hits, e.stats.num_steps)
            e.stats.num_pool_evictions += len(
                self.evictor.evict(bm, rid, seq.start + seq.num_new_tokens)
            )
        for rid in [r for r in self._pool_tables if r not in bm.page_tables]:
            self.evictor.forget(rid)
            del self._pool_tables[rid]

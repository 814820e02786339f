"""Scheduling policies, chosen by name (`SchedulerConfig.policy`). ALGORITHMS.md §3-4 gives the
authors' loops; each `schedule()` below is that loop over the shared moves of `Scheduler`."""

from __future__ import annotations

from llmjax.config import EngineConfig
from llmjax.engine.batch import token_buckets
from llmjax.engine.block_manager import BlockManager
from llmjax.engine.clock import WALL_CLOCK, Clock
from llmjax.engine.scheduler import ScheduledBatch, Scheduler


class SarathiScheduler(Scheduler):
    """Sarathi-Serve's stall-free batching under a token budget: every running decode first, then
    the next chunk of each partially prefilled request (FCFS), then new requests admitted FCFS with
    their first chunk cut to the budget left. Several chunks may share a step; a new request
    reserves pages for its whole prompt."""

    name = "sarathi"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._sort_running()
        self._schedule_decodes(batch)
        self._schedule_prefill_chunks(batch, allocate_per_chunk=False)
        self._admit(batch, chunked=True, allocate_per_chunk=False)
        self._fit_to_bucket(batch)
        return batch


class PrefillFirstScheduler(Scheduler):
    """vLLM's classic policy: if new requests can be admitted, run a prefill-only step of whole
    prompts (FCFS, sum of prompt lengths within the budget), pausing every decode; otherwise a
    decode-only step."""

    name = "prefill_first"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._sort_running()
        self._admit(batch, chunked=False, allocate_per_chunk=False)
        if not batch:
            self._schedule_decodes(batch)
        return batch


class DecodeFirstScheduler(Scheduler):
    """Request-level batching (FasterTransformer): while any request runs, decode-only steps; new
    requests (whole prompts) join only when none is running."""

    name = "decode_first"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._sort_running()
        if self.running:
            self._schedule_decodes(batch)
        else:
            self._admit(batch, chunked=False, allocate_per_chunk=False)
        return batch


class SplitFuseScheduler(Scheduler):
    """DeepSpeed-FastGen's Dynamic SplitFuse: decodes first, then prompt pieces (continuing ones,
    then new ones, FIFO) split so that the step is filled exactly to the token budget. Pages are
    taken per chunk; a prompt is admitted only if its whole rest fits in the free pages."""

    name = "splitfuse"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._sort_running()
        self._schedule_decodes(batch)
        self._schedule_prefill_chunks(batch, allocate_per_chunk=True)
        self._admit(batch, chunked=True, allocate_per_chunk=True)
        self._fit_to_bucket(batch)
        return batch


SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls
    for cls in (SarathiScheduler, PrefillFirstScheduler, DecodeFirstScheduler, SplitFuseScheduler)
}


def make_scheduler(
    config: EngineConfig, block_manager: BlockManager, clock: Clock = WALL_CLOCK
) -> Scheduler:
    cls = SCHEDULERS[config.scheduler.policy]
    scheduler = cls(
        config.scheduler,
        block_manager,
        config.max_model_len,
        config.cache.watermark,
        num_micro_batches=config.parallel.pp,
        clock=clock,
    )
    scheduler.token_buckets = token_buckets(
        config.scheduler.max_num_batched_tokens, config.token_buckets_per_octave
    )
    return scheduler

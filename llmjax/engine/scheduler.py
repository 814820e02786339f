"""The host-side scheduler: who runs this step and how many tokens each.

`Scheduler` holds the queues and the shared moves (decode every running request with preemption,
continue partial prefills, admit new requests); each policy in `policies.py` orders them. Chosen by
name: `make_scheduler(config, ...)` with `config.policy` in SCHEDULER_POLICIES.

Memory follows the vLLM block manager that Sarathi-Serve uses: a new request reserves pages for its
whole prompt at admission (unless the policy chunks its allocation, as SplitFuse does), keeping a
watermark of free pages; a decode appends a page when its last one fills. When a page cannot be
had, the running request that arrived last is preempted: its pages are freed, it goes to the front
of the waiting queue, and it is recomputed later with the tokens it already generated.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from llmjax.config import SchedulerConfig
from llmjax.engine.block_manager import BlockManager
from llmjax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache
    num_new_tokens: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # sum of the seqs' num_new_tokens, kept as they are added and removed

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.seqs.append(ScheduledSeq(request, request.num_computed_tokens, num_new_tokens))
        self.num_tokens += num_new_tokens

    def remove(self, request: Request) -> None:
        kept = [s for s in self.seqs if s.request is not request]
        self.num_tokens -= sum(s.num_new_tokens for s in self.seqs if s.request is request)
        self.seqs = kept

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Queues and shared moves; subclasses implement `schedule()` (see policies.py).

    Contract of `schedule()`: the returned batch has at most `max_num_seqs` sequences and
    `max_num_batched_tokens` tokens, every scheduled request owns pages for all its tokens after
    this step, and no request is dropped (preempted ones wait at the front of the queue).
    """

    name = "base"

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        watermark: float = 0.01,
    ):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * block_manager.num_usable_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.block_manager.free(request_id)
                    req.finish("abort", time.perf_counter(), RequestStatus.ABORTED)
                    return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # Shared moves. Each appends to `batch` and respects the token budget left in it.

    def _budget(self, batch: ScheduledBatch) -> int:
        return self.config.max_num_batched_tokens - batch.num_tokens

    def _sort_running(self) -> None:
        """FCFS priority: oldest arrival first, so the newest is the preemption victim."""
        self.running.sort(key=lambda r: r.metrics.arrival_time)

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        """One token for every running request whose prompt is done (preempting if needed)."""
        for req in [r for r in self.running if r.num_uncomputed_tokens == 1]:
            if req.status is not RequestStatus.RUNNING or self._budget(batch) < 1:
                continue
            if self._grow(req, req.num_tokens, batch):
                batch.add(req, 1)

    def _schedule_prefill_chunks(self, batch: ScheduledBatch, *, allocate_per_chunk: bool) -> None:
        """The next chunk of every running request still in prefill, in FCFS order."""
        for req in [r for r in self.running if r.num_uncomputed_tokens > 1]:
            n = min(req.num_uncomputed_tokens, self._budget(batch))
            if req.status is not RequestStatus.RUNNING or n <= 0:
                continue
            if not allocate_per_chunk or self._grow(req, req.num_computed_tokens + n, batch):
                batch.add(req, n)

    def _admit(self, batch: ScheduledBatch, *, chunked: bool, allocate_per_chunk: bool) -> None:
        """Admit waiting requests FCFS while the budget, `max_num_seqs` and pages allow.

        chunked: the last admitted prompt may be cut to the budget left (else whole prompts only).
        allocate_per_chunk: take pages for the scheduled chunk only (else for the whole prompt),
        but only admit a prompt whose whole rest fits in the free pages (no deadlock).
        """
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            budget = self._budget(batch)
            n = min(req.num_uncomputed_tokens, budget) if chunked else req.num_uncomputed_tokens
            if n <= 0 or n > budget:
                break
            keep_free = self.watermark_pages if self.running else 0  # alone, it must fit
            if not bm.can_allocate(req.request_id, req.num_tokens, keep_free):
                break
            self.waiting.popleft()
            bm.allocate(
                req.request_id,
                req.num_computed_tokens + n if allocate_per_chunk else req.num_tokens,
            )
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            batch.add(req, n)

    def _grow(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give `req` pages for `num_tokens` tokens, preempting the newest running requests if
        needed. Returns False if `req` itself had to be preempted."""
        while not self.block_manager.can_allocate(req.request_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        self.block_manager.allocate(req.request_id, num_tokens)
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.remove(req)
        batch.preempted.append(req)

    # ------------------------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, next_token_ids: list[int]) -> list[Request]:
        """Advance every scheduled request by its tokens; returns the requests that finished."""
        now = time.perf_counter()
        finished = []
        for seq, token_id in zip(batch.seqs, next_token_ids, strict=True):
            req = seq.request
            req.num_computed_tokens += seq.num_new_tokens
            if not seq.samples:
                continue
            req.append_token(int(token_id), now)
            if not req.status.is_done and req.num_tokens >= self.max_model_len:
                req.finish("length", now)
            if req.status.is_done:
                self.running.remove(req)
                self.block_manager.free(req.request_id)
                finished.append(req)
        return finished

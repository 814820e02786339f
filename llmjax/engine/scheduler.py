"""The host-side scheduler: who runs this step and how many tokens each.

Continuous batching with chunked prefill under a token budget, in Sarathi-Serve's stall-free order:
every running decode first (one token each), then partially prefilled requests, then new requests
first-come first-served, each prefill cut to the budget that is left. When pages run out the newest
running request is preempted: its pages are freed, it goes back to the front of the queue, and it
is recomputed later with the tokens it already generated.
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
    seqs: list[ScheduledSeq]
    preempted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
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

    # ------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch(seqs=[])
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for req in decodes + prefills:
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_uncomputed_tokens, budget)
            if num_new == 0:
                break
            if not self._reserve(req, num_new, batch):
                continue
            batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(
                req.request_id, req.num_computed_tokens + num_new
            ):
                break
            self.waiting.popleft()
            self.block_manager.allocate(req.request_id, req.num_computed_tokens + num_new)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, num_new))
            budget -= num_new
        return batch

    def _reserve(self, req: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Make room for `req`'s next `num_new` tokens, preempting the newest requests if needed.
        Returns False if `req` itself had to be preempted."""
        total = req.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(req.request_id, total):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        self.block_manager.allocate(req.request_id, total)
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        batch.seqs = [s for s in batch.seqs if s.request is not req]
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

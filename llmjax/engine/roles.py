"""The engine's roles in disaggregated serving (llmjax/cluster/; DistServe, Splitwise).

A 'colocated' engine runs requests from prompt to finish. A 'prefill' engine runs prompts
(chunked under the token budget as its policy says) and samples the first token; then it
*parks* the request (`PrefillParking`, at the step's update stage): out of the batch, its KV
pages still held (counted as used) until a decode instance takes it (`export_request`, then
`release_request`) or it is aborted. A 'decode' engine receives such requests in two phases:
`reserve_import` allocates the pages that the KV transfer writes, `commit_import` puts the
request in the running batch as if it had computed its prompt here (`cancel_import` gives the
pages back and recomputes it, or fails it with a reason). `can_accept` is DistServe's pull
condition. A request that finishes at its first token (EOS, max_tokens=1) never parks. A
request under a LoRA adapter moves with it (`MigratedRequest.lora_request`): the destination
registers the adapter and takes the request only while its adapter slots allow
(`max_loras` distinct adapters among its running and arriving requests).
"""

from __future__ import annotations

import dataclasses
import logging

from llmjax.engine.block_manager import pages_needed
from llmjax.engine.request import (
    MigratedRequest,
    Request,
    RequestMetrics,
    RequestStatus,
)
from llmjax.engine.step import Step, StepFeature
from llmjax.tokenizer.detokenizer import StopStringMatcher

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


class PrefillParking(StepFeature):
    """role 'prefill': hook `update` parks each request that got its first token and did not
    finish (`LLMEngine.parked`, in order: DistServe's queue of finished prefills)."""

    def __init__(self, engine):
        self.engine = engine

    def update(self, step: Step) -> None:
        running, parked = self.engine.scheduler.running, self.engine.parked
        for req in step.sampled:
            if not req.status.is_done and req.request_id not in parked:
                running.remove(req)
                parked[req.request_id] = req


class EngineRoles:
    """`LLMEngine`'s side of moving requests between instances (the module doc), mixed into
    it so that a cluster calls `engine.export_request(...)`. Reads the engine's scheduler,
    block manager, KV tiers, clock, tokenizer and `_live`; holds `parked` (role 'prefill': id ->
    request, first token sampled, pages held) and `_receiving` (role 'decode': id -> (request,
    KV tokens) for transfers in flight)."""

    def _init_roles(self) -> None:
        self.parked: dict[str, Request] = {}
        self._receiving: dict[str, tuple[Request, int]] = {}

    def _abort_moving(self, request_id: str) -> Request | None:
        """Free a parked or receiving request's pages; the request, or None if neither."""
        req = self.parked.pop(request_id, None)
        if req is not None:  # its prompt's KV stays in the prefix cache
            self.scheduler._free(req)
        elif request_id in self._receiving:  # the pages were never (fully) written
            req, _ = self._receiving.pop(request_id)
            self.block_manager.free(request_id)
        return req

    def export_request(self, request_id: str) -> tuple[MigratedRequest, list[int]]:
        """A parked request (role 'prefill') as it leaves: its state and the pages that hold
        its computed tokens' KV, in order (`BlockManager.kv_pages`). It stays parked (pages
        held) until `release_request`."""
        req = self.parked.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not parked here (role={self.role!r})")
        n = req.num_computed_tokens
        # every group's pages in the hybrid KV layout (a windowed group's window only)
        return _migrated(req, n), self.block_manager.kv_pages(request_id, n)

    def release_request(self, request_id: str) -> None:
        """The parked request's KV has moved on: free its pages here (its prompt's full pages
        stay in the prefix cache)."""
        req = self.parked.pop(request_id)
        self._live.discard(request_id)
        self.scheduler._free(req)

    def waiting_pages(self) -> int:
        """KV pages the waiting queue's requests will need (all their tokens)."""
        ps = self.block_manager.page_size
        return sum(pages_needed(r.num_tokens, ps) for r in self.scheduler.waiting)

    def can_accept(self, m: MigratedRequest, waiting_page_fraction: float = 0.05) -> bool:
        """DistServe's pull condition for a decode instance: its waiting queue uses less than
        `waiting_page_fraction` of its pages, a sequence slot is free, and `m`'s pages (all its
        tokens so far) fit beside the admission watermark."""
        bm, sched = self.block_manager, self.scheduler
        if len(sched.running) + len(self._receiving) >= self.config.scheduler.max_num_seqs:
            return False
        if self.waiting_pages() >= waiting_page_fraction * bm.num_usable_pages:
            return False
        if self._import_lora_full(m):
            return False
        keep_free = sched.watermark_pages if sched.running else 0
        return bm.can_allocate(m.request_id, m.num_tokens, keep_free)

    def _import_lora_full(self, m: MigratedRequest) -> bool:
        """Whether `m` would run one LoRA adapter more than `max_loras` beside the running and
        arriving requests (the scheduler's rule, `Scheduler._lora_full`, for a request that
        joins the batch without admission). An engine without adapters never takes one."""
        if m.lora_request is None:
            return False
        if self.lora is None:
            return True
        i = m.lora_request.lora_int_id
        live = (*self.scheduler.running, *(r for r, _ in self._receiving.values()))
        ids = {r.lora_int_id for r in live if r.lora_int_id}
        return i not in ids and len(ids) >= self.config.lora.max_loras

    def reserve_import(self, m: MigratedRequest) -> list[int]:
        """Take pages for `m` (all its tokens so far); returns those the KV transfer writes, in
        `export_request`'s order (its KV tokens' pages: in the hybrid KV layout group 0's, then
        each windowed group's window, `BlockManager.allocate_import`). The request is not
        scheduled until `commit_import`."""
        if m.request_id in self._live:
            raise ValueError(f"request_id={m.request_id!r} is already live here")
        if self._import_lora_full(m):
            raise ValueError(
                f"request {m.request_id!r}: adapter {m.lora_request.lora_name!r} would run one "
                f"more than this engine's adapter slots (can_accept says when it fits)"
            )
        req = self._request_from(m)
        pages = self.block_manager.allocate_import(m.request_id, m.num_tokens, m.num_kv_tokens)
        if self.kv_tiers is not None:
            self.kv_tiers.dispatch()  # write-backs of the evicted pages, before the import
        self._receiving[m.request_id] = (req, m.num_kv_tokens)
        self._live.add(m.request_id)
        return pages

    def commit_import(self, request_id: str) -> None:
        """The KV transfer into the reserved pages is done: the request joins the running batch
        with its KV tokens computed (its next step is a decode)."""
        req, num_kv_tokens = self._receiving.pop(request_id)
        req.num_computed_tokens = num_kv_tokens
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        if self.block_manager.caching:
            self.scheduler._cache_computed(req)

    def cancel_import(self, request_id: str, error: str | None = None) -> None:
        """The KV transfer failed: free the reserved pages and recompute the request here from
        its tokens (like a preempted one), or with `error`, fail it with that reason (its
        output comes with the next step)."""
        req, _ = self._receiving.pop(request_id)
        self.block_manager.free(request_id)
        if error is None:
            self.scheduler.add(req)
        else:
            self._fail(req, error)

    def recompute_request(self, m: MigratedRequest) -> None:
        """Take over `m` without its KV (its source died, or its transfer failed before any
        page was reserved): it waits here and recomputes prompt + output so far."""
        if m.request_id in self._live:
            raise ValueError(f"request_id={m.request_id!r} is already live here")
        self.scheduler.add(self._request_from(m))
        self._live.add(m.request_id)

    def _fail(self, req: Request, error: str) -> None:
        req.error = error
        req.finish("error", self.clock.now(), RequestStatus.REJECTED)
        self._live.discard(req.request_id)
        self._rejected.append(req)
        logger.warning("request %s failed: %s", req.request_id, error)

    def _request_from(self, m: MigratedRequest) -> Request:
        """The request `m` names, here (its adapter registered here, read from its directory
        the first time: a bad one raises `InvalidRequest`)."""
        params = m.sampling_params
        self._add_lora(m.lora_request)
        req = Request(
            request_id=m.request_id,
            prompt_token_ids=list(m.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=frozenset(self.config.model.eos_token_ids),
            seed=m.seed,
            prompt=m.prompt,
            output_token_ids=list(m.output_token_ids),
            num_cached_tokens=m.num_cached_tokens,
            loaded_tokens=dict(m.loaded_tokens),
            num_preemptions=m.num_preemptions,
            metrics=_copy_metrics(m.metrics),
            hints=m.hints,
            logprobs=None if m.logprobs is None else list(m.logprobs),
            cumulative_logprob=m.cumulative_logprob,
            prompt_logprobs=None if m.prompt_logprobs is None else list(m.prompt_logprobs),
            lora_request=m.lora_request,
        )
        if params.stop and self.tokenizer is not None:
            req.stop_matcher = StopStringMatcher(
                self.tokenizer, params.stop, params.include_stop_str_in_output
            )
            for t in req.output_token_ids:
                req.stop_matcher.add(t)
        return req


def _copy_metrics(m: RequestMetrics) -> RequestMetrics:
    return dataclasses.replace(m, token_times=list(m.token_times))


def _migrated(req: Request, num_kv_tokens: int) -> MigratedRequest:
    return MigratedRequest(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids),
        sampling_params=req.sampling_params,
        seed=req.seed,
        num_kv_tokens=num_kv_tokens,
        metrics=_copy_metrics(req.metrics),
        prompt=req.prompt,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
        loaded_tokens=dict(req.loaded_tokens),
        hints=req.hints,
        logprobs=None if req.logprobs is None else list(req.logprobs),
        cumulative_logprob=req.cumulative_logprob,
        prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        lora_request=req.lora_request,
    )

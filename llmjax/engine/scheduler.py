"""The host-side scheduler: who runs this step and how many tokens each.

`Scheduler` holds the queues and the shared moves (decode every running request with preemption,
continue partial prefills, admit new requests); each policy in `policies.py` orders them. Chosen by
name: `make_scheduler(config, ...)` with `config.policy` in SCHEDULER_POLICIES.

Memory follows the vLLM block manager that Sarathi-Serve uses: a new request reserves pages for its
whole prompt at admission (unless the policy chunks its allocation, as SplitFuse does), keeping a
watermark of free pages; a decode appends a page when its last one fills. When a page cannot be
had, the running request that arrived last is preempted: its pages are freed, it goes to the front
of the waiting queue, and it is recomputed later with the tokens it already generated.

Prefix caching (SGLang's rules, ALGORITHMS.md §8 and §13.1) is the block manager's: on admission
a request takes the longest cached prefix of its tokens and only the rest is charged to the token
budget and computed (at least one token, for the logits); before each further prefill chunk it
takes any longer prefix that another request has inserted meanwhile; after every step each
request's new full pages go into the cache, so a second request can reuse a prefix before the
first finishes. The cache evicts (LRU) before anyone is preempted, and a preempted request's
computed pages stay cached, so its recomputation is mostly a cache hit.

Steps land on their token buckets (`SchedulerConfig.fit_to_buckets`, `_fit_to_bucket`): a step
below the budget whose padding to the next bucket would cost more than moving a few of its last
prefill chunk's tokens to the next step gives those tokens up; decodes are never cut.

Admission order (`SchedulerConfig.admission_order`): FCFS, or longest-prefix-match with SGLang's
guards (see `_admission_order`); running requests are never reordered.

Requests from a program's executor (llmjax/program/, Parrot) may carry `ProgramHints`: FCFS then
orders them by their application's arrival (app-level FIFO), and with
`SchedulerConfig.latency_token_budget` set, while a request tagged LATENCY runs, LATENCY requests
go first (decodes, prefill chunks, admission) and every other request shares at most
`latency_token_budget` tokens of the step (their decodes included), inside the step's budget.
That is how Parrot's criteria compose with Sarathi's token budget (ALGORITHMS.md §13.5): the
budget bounds a step, LATENCY work takes it first, THROUGHPUT work fills what the latency cap
leaves.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections import deque

from llmjax.config import SchedulerConfig
from llmjax.engine.block_manager import BlockManager
from llmjax.engine.clock import WALL_CLOCK, Clock
from llmjax.engine.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache
    num_new_tokens: int  # tokens computed this step (a decode's proposals included)
    # speculative decoding: tokens proposed after the request's last one, verified this step
    # (they follow it in the step's rows and count in num_new_tokens)
    spec: tuple[int, ...] = ()
    # fixed by `Scheduler.advance` (async scheduling), after which the request's tokens grow
    sampled: bool | None = None

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so a new token is sampled."""
        if self.sampled is not None:
            return self.sampled
        return self.start + self.num_new_tokens - len(self.spec) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt (not a prefill chunk, nor recomputation), with or
        without proposals to verify."""
        return self.num_new_tokens - len(self.spec) == 1 and self.start >= len(
            self.request.prompt_token_ids
        )


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # sum of the seqs' num_new_tokens, kept as they are added and removed
    num_other_tokens: int = 0  # of those, the tokens of requests not tagged LATENCY
    num_cached_tokens: int = 0  # tokens that prefix-cache hits spared this step
    blocked: Request | None = None  # the waiting request admission stopped at (did not fit)
    num_deferred: int = 0  # tokens cut off the last prefill chunk to land on a token bucket
    advanced: bool = False  # counted before its tokens came back (`Scheduler.advance`)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.seqs.append(ScheduledSeq(request, request.num_computed_tokens, num_new_tokens))
        self.num_tokens += num_new_tokens
        if not request.is_latency:
            self.num_other_tokens += num_new_tokens

    def extend(self, seq: ScheduledSeq, spec: tuple[int, ...]) -> None:
        """Give a scheduled decode proposals to verify (speculative decoding)."""
        n = len(spec) - len(seq.spec)
        seq.spec = spec
        seq.num_new_tokens += n
        self.num_tokens += n
        if not seq.request.is_latency:
            self.num_other_tokens += n

    def shrink(self, seq: ScheduledSeq, n: int) -> None:
        """Take `n` tokens off the end of a scheduled prefill chunk (they run in a later step)."""
        seq.num_new_tokens -= n
        self.num_tokens -= n
        if not seq.request.is_latency:
            self.num_other_tokens -= n

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens verified this step (speculative decoding)."""
        return sum(len(s.spec) for s in self.seqs)

    def remove(self, request: Request) -> None:
        kept = [s for s in self.seqs if s.request is not request]
        n = sum(s.num_new_tokens for s in self.seqs if s.request is request)
        self.num_tokens -= n
        if not request.is_latency:
            self.num_other_tokens -= n
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
        num_micro_batches: int = 1,
        clock: Clock = WALL_CLOCK,
    ):
        self.config = config
        self.clock = clock  # stamps the requests' metrics (llmjax/engine/clock.py)
        self.num_micro_batches = num_micro_batches  # pp: micro-batches in flight at most
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.watermark_pages = int(watermark * block_manager.num_usable_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests in a micro-batch still in the pipeline (pp > 1): not scheduled again and not
        # preempted until their tokens come back (Sarathi-Serve's "paused" sequences).
        self.in_flight: set[str] = set()
        # Async scheduling (llmjax/engine/overlap.py): requests in steps launched but not yet
        # collected (id -> how many such steps), advanced by `advance` when launched. They may
        # be scheduled again (a decode of their pending token) but are never preempted.
        self.unsettled: collections.Counter[str] = collections.Counter()
        # f(request, match_token_ids, PeekResult) -> pages loaded: the KV tiers below the
        # device pages extend the cached prefix before an admission (llmjax/engine/kv_tiers.py)
        self.prefix_loader = None
        # This step's: a LATENCY-tagged request runs and latency_token_budget caps the others.
        self._latency_active = False
        # Speculative decoding (llmjax/engine/speculative.py): proposals for decoding requests
        self.speculator = None
        # The token counts the engine pads a step to (llmjax/engine/batch.py `token_buckets`);
        # with `SchedulerConfig.fit_to_buckets`, `_fit_to_bucket` trims a step's last prefill
        # chunk down to one of them where that defers fewer tokens than the padding it saves.
        self.token_buckets: tuple[int, ...] | None = None
        # LoRAConfig.max_loras (set by the engine with adapters): at most this many distinct
        # adapters run at a time (`_lora_full`)
        self.max_loras: int | None = None
        # paused generation (llmjax/engine/weights.py): the waiting requests admission skips
        self.held = None  # (Request) -> bool, or None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)
                    req.finish("abort", self.clock.now(), RequestStatus.ABORTED)
                    return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # Shared moves. Each appends to `batch` and respects the token budget left in it.

    def _budget(self, batch: ScheduledBatch, req: Request | None = None) -> int:
        """Tokens `req` may still get this step: the token budget left, and for a request not
        tagged LATENCY while one is (`_latency_active`), `latency_token_budget` shared by all
        of them."""
        left = self.config.max_num_batched_tokens - batch.num_tokens
        if self._latency_active and (req is None or not req.is_latency):
            left = min(left, self.config.latency_token_budget - batch.num_other_tokens)
        return left

    def _sort_running(self) -> None:
        """FCFS priority: oldest arrival first (a program's request: its application's arrival,
        `Request.priority_time`), so the newest is the preemption victim; with
        `latency_token_budget` and a LATENCY request running (or waiting and admissible now),
        those first. Called at the start of every `schedule()`."""
        self._latency_active = self.config.latency_token_budget is not None and (
            any(r.is_latency for r in self.running) or self._latency_admissible()
        )
        if self._latency_active:
            key = lambda r: (not r.is_latency, r.priority_time, r.metrics.arrival_time)
        else:
            key = lambda r: (r.priority_time, r.metrics.arrival_time)
        self.running.sort(key=key)

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        """One token for every running request whose prompt is done (preempting if needed); with
        `balance_micro_batches` and pp > 1, at most ceil(decoding requests / pp) of them."""
        decoding = [r for r in self.running if r.num_uncomputed_tokens == 1]
        cap = len(decoding)
        if self.config.balance_micro_batches and self.num_micro_batches > 1:
            cap = -(-len(decoding) // self.num_micro_batches)  # in flight ones counted too
        num_decodes = 0
        spec = self.speculator
        bound = spec.config.disable_by_batch_size if spec is not None else None
        if bound is not None and len(self.running) > bound:
            spec = None
        for req in decoding:
            if req.status is not RequestStatus.RUNNING or self._budget(batch, req) < 1:
                continue
            if req.request_id in self.in_flight or num_decodes >= cap:
                continue
            if req.num_pending_tokens and self._ends_by_length(req):
                continue  # its pending token is its last: its decode would be discarded
            if self._grow(req, req.num_tokens, batch):
                batch.add(req, 1)
                num_decodes += 1
        if spec is not None:
            self._speculate(batch)

    def _speculate(self, batch: ScheduledBatch) -> None:
        """Proposals for the step's decodes (speculative decoding): each decode is offered as
        many as its max_tokens, max_model_len and the token budget leave; the speculator keeps
        those worth verifying (`Speculator.select`), then each kept one gets pages as far as the
        free ones beside the watermark allow (never preempting or evicting for them) and the
        budget still left."""
        offers = []
        for seq in batch.seqs:
            req = seq.request
            if seq.num_new_tokens != 1 or req.num_uncomputed_tokens != 1:
                continue
            params = req.sampling_params
            max_k = min(
                self._budget(batch, req),
                params.max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            proposals = self.speculator.propose(req, max_k) if max_k > 0 else []
            if proposals:
                offers.append((seq, proposals))
        if not offers:
            return
        num_decodes = sum(s.num_new_tokens == 1 for s in batch.seqs)
        counts = self.speculator.select(
            [(s.request, p) for s, p in offers], batch.num_tokens, num_decodes
        )
        bm = self.block_manager
        for (seq, proposals), k in zip(offers, counts, strict=True):
            req = seq.request
            k = min(k, self._budget(batch, req))
            while k and bm.num_missing_pages(req.request_id, req.num_tokens + k) > max(
                0, bm.num_free_pages - self.watermark_pages
            ):
                k -= 1
            if k > 0:
                bm.allocate(req.request_id, req.num_tokens + k)
                batch.extend(seq, tuple(proposals[:k]))

    def drop_speculation(self, batch: ScheduledBatch) -> None:
        """Turn this step's verifications back into plain decodes (the step computes prompt
        logprobs, whose logits rows leave no room for them), giving back the proposals'
        budget and pages."""
        for seq in batch.seqs:
            k = len(seq.spec)
            if not k:
                continue
            seq.num_new_tokens -= k
            seq.spec = ()
            batch.num_tokens -= k
            if not seq.request.is_latency:
                batch.num_other_tokens -= k
            self.block_manager.truncate(seq.request.request_id, seq.request.num_tokens)

    def _schedule_prefill_chunks(self, batch: ScheduledBatch, *, allocate_per_chunk: bool) -> None:
        """The next chunk of every running request still in prefill, in FCFS order (first taking
        a longer cached prefix if another request inserted one meanwhile)."""
        for req in [r for r in self.running if r.num_uncomputed_tokens > 1]:
            if req.status is not RequestStatus.RUNNING or self._budget(batch, req) <= 0:
                continue
            if req.request_id in self.in_flight:
                continue
            self._match_prefix(req, batch)
            n = min(req.num_uncomputed_tokens, self._budget(batch, req))
            end = req.num_computed_tokens + n
            if allocate_per_chunk:
                grown = self._grow(req, end, batch)
            elif self.block_manager.groups is not None:  # windowed groups take pages per chunk
                grown = self._grow(req, req.num_tokens, batch, window_tokens=end)
            else:
                grown = True  # (its whole prompt's pages were taken at admission)
            if grown:
                batch.add(req, n)

    def _fit_to_bucket(self, batch: ScheduledBatch) -> None:
        """Land the step on its token bucket where a prefill chunk can give way. A step of T
        tokens between buckets lo < T < hi is padded to hi; its last prefill chunk's last
        T - lo tokens move to the next step instead when (0) lo >= `fit_min_tokens` (smaller
        steps cost about the same padded or not), (1) the chunk keeps a token, (2) that
        defers fewer tokens than the padding it saves (T - lo < hi - T), and (3) there is a next
        step anyway, which they grow by less than this one shrinks: another sequence of this step
        runs again (a decode, or a chunk whose prompt ends now), and with one token for each of
        them the next step's bucket grows by less than hi - lo. Decodes and proposals are never
        cut, so the step stays stall-free; the cut chunk keeps its pages (the deferred tokens are
        its request's next ones to compute)."""
        buckets = self.token_buckets
        if not (self.config.fit_to_buckets and buckets and len(batch.seqs) > 1):
            return
        T = batch.num_tokens
        bucket = lambda n: buckets[bisect.bisect_left(buckets, n)]  # n padded (sorted buckets)
        i = bisect.bisect_left(buckets, T)
        lo, hi = buckets[i - 1] if i else 0, buckets[i]
        seq = batch.seqs[-1]
        cut = T - lo
        if lo < self.config.fit_min_tokens or hi == T or seq.spec or seq.is_decode:
            return
        if seq.num_new_tokens <= cut or cut >= hi - T:
            return
        nxt = len(batch.seqs) - 1  # tokens of the next step at least: a decode per other sequence
        if bucket(nxt + cut) - bucket(nxt) >= hi - lo:
            return
        batch.shrink(seq, cut)
        batch.num_deferred = cut

    def _admit(self, batch: ScheduledBatch, *, chunked: bool, allocate_per_chunk: bool) -> None:
        """Admit waiting requests in admission order while the budget, `max_num_seqs` and pages
        allow; the first that does not fit stops admission (no overtaking).

        A request's cached prefix is reused, so only its uncached tokens count against the budget.
        chunked: the last admitted prompt may be cut to the budget left (else whole prompts only).
        allocate_per_chunk: take pages for the scheduled chunk only (else for the whole prompt),
        but only admit a prompt whose whole rest fits in the available pages (no deadlock).
        """
        bm = self.block_manager
        for req in self._admission_order():
            if len(self.running) >= self.config.max_num_seqs:
                break
            if self.held is not None and self.held(req):  # paused: it waits for the resume
                continue
            if self._lora_full(req):  # it waits for an adapter to finish; nothing overtakes it
                batch.blocked = req
                break
            match_ids = self._match_token_ids(req)
            prefix = bm.peek_prefix(match_ids, req.cache_namespace)
            keep_free = self.watermark_pages if self.running else 0  # alone, it must fit
            if (
                self.prefix_loader is not None
                and bm.can_allocate(req.request_id, req.num_tokens, keep_free, prefix)
                and self.prefix_loader(req, match_ids, prefix)
            ):  # a lower KV tier's blocks now extend the cached prefix (engine/kv_tiers.py)
                prefix = bm.peek_prefix(match_ids, req.cache_namespace)
            uncached = req.num_tokens - prefix.num_tokens
            budget = self._budget(batch, req)
            n = min(uncached, budget) if chunked else uncached
            if (
                n <= 0
                or n > budget
                or not bm.can_allocate(req.request_id, req.num_tokens, keep_free, prefix)
            ):
                batch.blocked = req
                break
            self.waiting.remove(req)
            self._match_prefix(req, batch)
            end = req.num_computed_tokens + n  # (windowed groups: this chunk's pages only)
            bm.allocate(req.request_id, end if allocate_per_chunk else req.num_tokens, end)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = self.clock.now()
            self.running.append(req)
            batch.add(req, n)

    def _admission_order(self) -> list[Request]:
        """The waiting queue in the order admission tries it: preempted requests first (they
        wait at the front; while `_latency_active`, behind the LATENCY requests:
        `_program_order`), then FCFS or longest-prefix-match (SGLang's `calc_priority`: most
        cached tokens first; with more than `lpm_max_queue_len` waiting, FCFS; a request with a
        cache hit of at most `in_batch_prefix_len` tokens whose first `in_batch_prefix_len` tokens
        equal an earlier waiting request's goes last, so that one fills the cache first).

        One addition to SGLang's rule (`_waits_for_prefill`): a request whose next
        `in_batch_prefix_len` uncached tokens are what a running prefill is about to compute also
        goes last. Without it LPM admits a request with a partial hit (a prefix the running
        prefill inserted after its first chunk) and recomputes the rest of that prefix beside
        the prefill that is computing it."""
        cfg = self.config
        waiting = list(self.waiting)
        if self._latency_active or any(r.hints is not None for r in waiting):
            waiting = self._program_order(waiting)
        if (
            cfg.admission_order == "fcfs"
            or not self.block_manager.caching
            or len(waiting) > cfg.lpm_max_queue_len
        ):
            return waiting
        preempted = [r for r in waiting if r.num_preemptions]
        fresh = [r for r in waiting if not r.num_preemptions]
        k = cfg.in_batch_prefix_len
        prefilling = [r for r in self.running if r.num_uncomputed_tokens > 1]
        heads: set[tuple[int, ...]] = set()
        keys = {}
        for i, req in enumerate(fresh):
            cached = self._peek(req).num_tokens
            deferred = False
            if cached <= k and len(req.prompt_token_ids) >= k:
                head = (req.cache_namespace, *req.prompt_token_ids[:k])
                deferred = head in heads
                heads.add(head)
            deferred = deferred or any(self._waits_for_prefill(req, cached, r) for r in prefilling)
            keys[req.request_id] = (deferred, -cached, i)
        fresh.sort(key=lambda r: keys[r.request_id])
        if self._latency_active:  # LATENCY requests first, as `_program_order` says
            return sorted(preempted + fresh, key=lambda r: not r.is_latency)
        return preempted + fresh

    def _latency_admissible(self) -> bool:
        """Whether a waiting LATENCY request can be admitted now (a sequence slot and its pages
        are free), so capping the others this step makes room for it rather than stalling
        them for nothing."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        latency = [r for r in self.waiting if r.is_latency]
        if not latency:
            return False
        req = min(latency, key=lambda r: (not r.num_preemptions, r.priority_time))  # its first
        bm = self.block_manager
        prefix = self._peek(req)
        keep_free = self.watermark_pages if self.running else 0
        return bm.can_allocate(req.request_id, req.num_tokens, keep_free, prefix)

    def _program_order(self, waiting: list[Request]) -> list[Request]:
        """With program requests waiting (`ProgramHints`): preempted requests first, as always,
        then by application arrival (app-level FIFO); while `_latency_active`, LATENCY requests
        ahead of all the others, preempted ones included (capped by `latency_token_budget`, a
        preempted request at the front could get no tokens at all and, admission taking no
        overtaking, stall the LATENCY request behind it and every step after). A stable sort,
        so plain requests keep FCFS among themselves."""
        lat = self._latency_active
        return sorted(
            waiting,
            key=lambda r: (lat and not r.is_latency, not r.num_preemptions, r.priority_time),
        )

    def _waits_for_prefill(self, req: Request, cached: int, running: Request) -> bool:
        """Whether `running`, still in prefill, has yet to compute `req`'s next
        `in_batch_prefix_len` tokens after its `cached` ones (the same tokens at the same
        positions, under the same adapter), so waiting lets `req` take them from the cache."""
        end = cached + self.config.in_batch_prefix_len
        return (
            req.cache_namespace == running.cache_namespace
            and cached <= running.num_computed_tokens < end <= len(running.prompt_token_ids)
            and end <= len(req.prompt_token_ids)
            and req.prompt_token_ids[cached:end] == running.prompt_token_ids[cached:end]
        )

    def _lora_full(self, req: Request) -> bool:
        """Whether running `req` would run one LoRA adapter more than `max_loras` (vLLM's
        rule: the running requests' distinct adapters fit the device slots)."""
        if self.max_loras is None or not req.lora_int_id:
            return False
        running = {r.lora_int_id for r in self.running if r.lora_int_id}
        return req.lora_int_id not in running and len(running) >= self.max_loras

    def _peek(self, req: Request):
        """What `req`'s admission would take from the prefix cache now (its adapter's tree)."""
        return self.block_manager.peek_prefix(self._match_token_ids(req), req.cache_namespace)

    def _free(self, req: Request) -> None:
        """Release `req`'s pages, offering its computed tokens to the prefix cache."""
        self.block_manager.free(req.request_id, self._computed_token_ids(req), req.cache_namespace)

    def _match_token_ids(self, req: Request) -> list[int]:
        """The tokens a cache match may cover: all but the last (which must be computed to get
        logits); none when nothing is cached, or when the request wants its prompt's logprobs
        (every prompt token must be computed for its logits)."""
        if not self.block_manager.caching or req.sampling_params.prompt_logprobs is not None:
            return []
        return req.token_ids_slice(0, req.num_tokens - 1)

    def _computed_token_ids(self, req: Request) -> list[int]:
        """The tokens whose KV is in `req`'s pages (offered to the cache); none when not
        caching."""
        if not self.block_manager.caching:
            return []
        return req.token_ids_slice(0, req.num_computed_tokens)

    def _match_prefix(self, req: Request, batch: ScheduledBatch) -> None:
        """Reuse the longest cached prefix of `req`'s tokens, if longer than what it computed."""
        if not self.block_manager.caching:
            return
        cached = self.block_manager.match_prefix(
            req.request_id, self._match_token_ids(req), req.cache_namespace
        )
        if cached > req.num_computed_tokens:
            saved = cached - req.num_computed_tokens
            batch.num_cached_tokens += saved
            if not req.output_token_ids:  # the prompt's first pass: the request's cache hit
                req.num_cached_tokens += saved
            req.num_computed_tokens = cached

    def _grow(
        self,
        req: Request,
        num_tokens: int,
        batch: ScheduledBatch,
        window_tokens: int | None = None,
    ) -> bool:
        """Give `req` pages for `num_tokens` tokens (its windowed groups' for `window_tokens`:
        `BlockManager.allocate`), preempting the newest running requests if needed (never one in
        flight). Returns False if `req` itself had to be preempted, or if only requests in
        flight could free pages (`req` then waits for them)."""
        bm = self.block_manager
        while not bm.can_allocate(req.request_id, num_tokens, window_tokens=window_tokens):
            victims = [
                r
                for r in self.running
                if r.request_id not in self.in_flight and r.request_id not in self.unsettled
            ]
            if not victims:
                return False
            victim = victims[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        bm.allocate(req.request_id, num_tokens, window_tokens)
        return True

    def requeue(self, req: Request, offer_cache: bool = True) -> None:
        """Running `req` back to the front of the waiting queue, its pages freed (its computed
        tokens offered to the prefix cache unless not `offer_cache`: KV the engine must not
        reuse, llmjax/engine/weights.py): it recomputes prompt + output so far."""
        self.running.remove(req)
        if offer_cache:
            self._free(req)
        else:
            self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        batch.remove(req)
        batch.preempted.append(req)

    # ------------------------------------------------------------------------------------------

    def advance(self, batch: ScheduledBatch) -> None:
        """Async scheduling: `batch` was launched and the next step is scheduled before its
        tokens come back. Each of its requests counts its new tokens as computed now, and one
        that samples one more (pending) token, so that the next step can decode it; `update`
        fills the tokens in."""
        for seq in batch.seqs:
            if seq.spec:
                raise ValueError("a step with proposals cannot be advanced before it returns")
            req = seq.request
            seq.sampled = seq.samples
            req.num_computed_tokens += seq.num_new_tokens
            if seq.sampled:
                req.num_pending_tokens += 1
            self.unsettled[req.request_id] += 1
        batch.advanced = True

    def _ends_by_length(self, req: Request) -> bool:
        """Whether `req`'s tokens so far, the pending ones included, already finish it by
        max_tokens or max_model_len."""
        return (
            req.num_output_tokens >= req.sampling_params.max_tokens
            or req.num_tokens >= self.max_model_len
        )

    def update(self, batch: ScheduledBatch, next_token_ids: list) -> list[Request]:
        """Advance every scheduled request by its tokens; returns the requests that finished.
        `next_token_ids` has one entry per sequence: its new token, or for a sequence that
        verified proposals (`ScheduledSeq.spec`) the list of its new tokens (its accepted
        proposals, then the target's token): the KV of the rejected ones is dropped (their
        pages given back) and the request stops at the first token that finishes it. A batch
        that was `advance`d (async scheduling) has its tokens counted already: its pending
        tokens are filled in, and a request that finishes gives up what later steps in flight
        computed for it (their rows are discarded)."""
        now = self.clock.now()
        finished = []
        advanced = batch.advanced
        for seq, token_id in zip(batch.seqs, next_token_ids, strict=True):
            req = seq.request
            if advanced:
                self.unsettled[req.request_id] -= 1
                if self.unsettled[req.request_id] <= 0:
                    del self.unsettled[req.request_id]
            if req.status.is_done:  # aborted (or finished) while its step was in flight
                continue
            if seq.spec:
                tokens = list(token_id)
                # the last token's KV and the accepted proposals' are now in the cache
                req.num_computed_tokens += len(tokens)
            else:
                tokens = [token_id]
                if not advanced:
                    req.num_computed_tokens += seq.num_new_tokens
            if seq.samples:
                if advanced:
                    req.num_pending_tokens -= 1
                for token in tokens:
                    req.append_token(int(token), now)
                    if (
                        not req.status.is_done
                        and req.num_tokens - req.num_pending_tokens >= self.max_model_len
                    ):
                        req.finish("length", now)
                    if req.status.is_done:
                        break
                if seq.spec and not req.status.is_done:
                    self.block_manager.truncate(req.request_id, req.num_tokens)
            if req.status.is_done:
                # async: the decodes of later steps in flight computed its pending tokens
                req.num_computed_tokens -= req.num_pending_tokens
                req.num_pending_tokens = 0
                self.running.remove(req)
                self._free(req)
                finished.append(req)
            else:
                if self.block_manager.caching:
                    self._cache_computed(req)
                if self.block_manager.groups is not None:  # windowed layers' passed pages
                    self.block_manager.release_window(
                        req.request_id, req.num_computed_tokens - req.num_pending_tokens
                    )
        return finished

    def _cache_computed(self, req: Request) -> None:
        bm = self.block_manager
        num_full = req.num_computed_tokens // bm.page_size
        if num_full > bm.num_offered_pages(req.request_id):
            bm.cache_computed(req.request_id, self._computed_token_ids(req), req.cache_namespace)

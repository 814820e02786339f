"""One engine instance with a role, and the calls a `Cluster` makes on it (issue 21, item 1).

An instance is an `LLMEngine` (llmjax/engine/engine.py) with a role ('colocated', 'prefill',
'decode') on its own devices. `LocalInstance` holds one in this process (the local launcher's
sub-meshes, llmjax/cluster/launch.py); the Ray launcher's actor holds a `LocalInstance` in its
own process and forwards these same calls, so the `Cluster` drives both alike. Every call's
arguments and results are plain data (they pickle), apart from `engine` itself.

The migration calls (DistServe's pull-based protocol; the Cluster runs it):

    parked()                     prefill side: requests whose first token is out, KV still held,
                                 oldest first
    offer(request_id)            prefill side: (MigratedRequest, Offer): the KV gathered and
                                 offered through the transport; still parked
    can_accept(m, fraction)      decode side: DistServe's condition (`LLMEngine.can_accept`)
    begin_import(m, offer, ...)  decode side: reserve pages, start pulling
    poll_imports()               decode side: finish arrived pulls (scatter into the reserved
                                 pages, join the batch), fail the ones past their deadline
                                 (recompute here, or fail with the reason)
    release(request_id, offer)   prefill side: free the pages (prefix cache keeps the prompt)

The Conductor's prefix fetch (`Cluster.fetch_prefix`) between two prefill instances:

    export_prefix(token_ids)     source: (Offer, tokens) of its longest cached prefix
    import_prefix(ids, offer)    dest: write it into fresh pages and insert them into its
                                 prefix cache; returns the prefix tokens cached there now
"""

from __future__ import annotations

import dataclasses
import logging
import time

from llmjax.cluster.transfer import KVTransport, Offer, TransferError
from llmjax.engine.request import MigratedRequest, RequestOutput

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """An instance's load after its last step (what routers read; `InstanceLoad`)."""

    num_waiting: int
    num_running: int
    num_parked: int
    num_receiving: int
    num_free_pages: int
    num_available_pages: int
    num_usable_pages: int
    has_unfinished: bool
    # what the Conductor reads (llmjax.cluster.conductor.ConductorLoad): (id, tokens, tokens
    # computed) of requests not past their prefill; (id, context, output tokens) of requests
    # decoding, preempted or being received; usable pages x page size
    queued_prefills: tuple[tuple[str, int, int], ...] = ()
    decode_requests: tuple[tuple[str, int, int], ...] = ()
    kv_capacity_tokens: int = 0
    # the LoRA adapter (name) of each running / waiting request under one (vLLM's metric)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """A finished pull on a decode instance: 'done' (the request now decodes here),
    'recomputed' (the transfer failed; the request recomputes its prompt here) or 'failed'
    (the transfer failed and the policy fails it; its error output follows)."""

    request_id: str
    status: str
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclasses.dataclass
class _Import:
    message: MigratedRequest
    offer: Offer
    pages: list[int]
    handle: object
    deadline: float
    on_failure: str
    start: float
    timeout_s: float


class LocalInstance:
    """An engine instance in this process (the module doc). `transport` moves KV pages in
    and out of it."""

    def __init__(
        self, engine, transport: KVTransport | None = None, name: str = "", time_fn=time.time
    ):
        """`time_fn`: the clock of transfer deadlines (seconds; tests pass a fake one)."""
        self.engine = engine
        self.time_fn = time_fn
        self.transport = transport
        self.name = name
        self._imports: dict[str, _Import] = {}
        self._offers: dict[str, Offer] = {}  # prefill side: offered and not released
        self._num_prefix_offers = 0

    # ---- what it is ------------------------------------------------------------------------

    @property
    def role(self) -> str:
        return self.engine.role

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def describe(self) -> dict:
        """Role, parallelism and devices, for logs and the benchmark's table."""
        runner = self.engine.runner
        mesh = getattr(runner, "mesh", None)
        if mesh is not None:
            devices = [str(d) for d in mesh.devices.flat]
        else:
            device = getattr(runner, "device", None)
            devices = [str(device)] if device is not None else ["default"]
        p = self.config.parallel
        return dict(name=self.name, role=self.role, tp=p.tp, pp=p.pp, devices=devices)

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids,
        sampling_params,
        request_id,
        prompt,
        arrival_time,
        hints=None,
        lora_request=None,
    ):
        return self.engine.add_request(
            prompt_token_ids, sampling_params, request_id, prompt, arrival_time, hints, lora_request
        )

    def validate_request(self, prompt_token_ids, sampling_params) -> None:
        """Raise `InvalidRequest` if this instance could never run the request."""
        self.engine.validate_request(list(prompt_token_ids), sampling_params)

    def recompute_request(self, m: MigratedRequest) -> None:
        self.engine.recompute_request(m)

    def step(self) -> tuple[list[RequestOutput], LoadReport]:
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        return outputs, self.load()

    def abort_request(self, request_id: str) -> bool:
        self._imports.pop(request_id, None)
        offer = self._offers.pop(request_id, None)
        if offer is not None and self.transport is not None:
            self.transport.release(offer)
        return self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def load(self) -> LoadReport:
        e = self.engine
        bm, sched = e.block_manager, e.scheduler
        return LoadReport(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_parked=len(e.parked),
            num_receiving=len(self._imports),
            num_free_pages=bm.num_free_pages,
            num_available_pages=bm.num_available_pages,
            num_usable_pages=bm.num_usable_pages,
            has_unfinished=e.has_unfinished_requests(),
            queued_prefills=tuple(
                (r.request_id, r.num_tokens, r.num_computed_tokens)
                for r in (*sched.running, *sched.waiting)
                if not r.output_token_ids or r.num_uncomputed_tokens > 1
            ),
            decode_requests=tuple(
                (r.request_id, r.num_tokens, len(r.output_token_ids))
                for r in (*sched.running, *sched.waiting, *(x for x, _ in e._receiving.values()))
                if r.output_token_ids
            ),
            kv_capacity_tokens=bm.num_usable_pages * bm.page_size,
            **dict(zip(("running_loras", "waiting_loras"), e.lora_names(), strict=True)),
        )

    def cached_prefix_tokens(self, prompt_token_ids, namespace: bytes | None = None) -> int:
        """Prompt tokens (all but the last) whose KV the prefix cache holds under `namespace`
        (a LoRA adapter's, `RouteRequest.cache_namespace`; None: the base model's)."""
        ids = list(prompt_token_ids)[:-1]
        return self.engine.block_manager.peek_prefix(ids, namespace).num_tokens

    # ---- prefix fetch (the Conductor; the module doc) ---------------------------------------

    def export_prefix(self, token_ids, namespace: bytes | None = None) -> tuple[Offer | None, int]:
        """Offer the KV of the longest cached prefix of `token_ids` (whole pages) under
        `namespace` (an adapter's; None: the base model's) through the transport: (offer, its
        tokens), or (None, 0) when nothing is cached. The pages are gathered at once, so the
        cache may evict them afterwards."""
        bm = self.engine.block_manager
        if not bm.caching or self.transport is None:
            return None, 0
        bm.prefix_cache.match(list(token_ids), namespace)  # (its recency)
        # in the hybrid KV layout: group 0's pages, then each windowed group's window
        num_tokens, pages = bm.prefix_kv_pages(list(token_ids), namespace)
        if not num_tokens:
            return None, 0
        self._num_prefix_offers += 1
        offer = self.transport.offer(
            self.engine.runner, f"__prefix__{self._num_prefix_offers}", pages
        )
        return offer, num_tokens

    def import_prefix(
        self, token_ids, offer: Offer, timeout_s: float = 30.0, namespace: bytes | None = None
    ) -> int:
        """Write the offered prefix KV of `token_ids` (`export_prefix`'s tokens; longer ones
        are cut to the offer's) into fresh pages here and insert them into the prefix cache
        under `namespace` (LRU pages evicted to make room); releases the offer. Returns the
        prefix tokens cached here now (those already cached when there is no room)."""
        bm = self.engine.block_manager
        groups = self.engine.config.kv_groups if bm.groups is not None else None
        ids = list(token_ids)[: len(token_ids) // bm.page_size * bm.page_size]
        if groups is None:
            ids = ids[: offer.num_pages * bm.page_size]
        elif groups.kv_pages(len(ids), bm.page_size) != offer.num_pages:
            self.transport.release(offer)
            raise ValueError(
                f"a prefix offer of {offer.num_pages} pages is not the KV of {len(ids)} tokens "
                "in this instance's hybrid KV layout (pass export_prefix's tokens)"
            )
        holder = f"__prefix_fetch__{offer.transfer_id}"
        try:
            if not bm.caching or not bm.can_allocate(holder, len(ids)):
                return bm.peek_prefix(ids, namespace).num_tokens
            deadline = self.time_fn() + timeout_s
            handle = self.transport.pull(offer, self.engine.runner, deadline)
            data = self.transport.poll(handle)
            while data is None:
                if self.time_fn() > deadline:
                    raise TransferError(f"prefix fetch passed its deadline ({timeout_s:g} s)")
                time.sleep(0.001)
                data = self.transport.poll(handle)
            pages = bm.allocate_import(holder, len(ids), len(ids))
            if self.engine.kv_tiers is not None:  # write-backs of evicted pages go first
                self.engine.kv_tiers.dispatch()
            try:
                self.engine.runner.import_pages(pages, data)
            except Exception:
                bm.free(holder)  # nothing cached from pages that were not written
                raise
            bm.free(holder, ids, namespace)  # offers the full pages to the prefix cache
            return bm.peek_prefix(ids, namespace).num_tokens
        finally:
            self.transport.release(offer)

    # ---- migration (the module doc) --------------------------------------------------------

    def parked(self) -> list[MigratedRequest]:
        """Parked requests not yet offered, oldest first."""
        return [
            self.engine.export_request(rid)[0]
            for rid in self.engine.parked
            if rid not in self._offers
        ]

    def offer(self, request_id: str) -> tuple[MigratedRequest, Offer]:
        m, pages = self.engine.export_request(request_id)
        offer = self.transport.offer(self.engine.runner, request_id, pages)
        self._offers[request_id] = offer
        return m, offer

    def release(self, request_id: str) -> None:
        """The request left (moved, or its decode side gave up): free its pages here."""
        offer = self._offers.pop(request_id, None)
        if offer is not None:
            self.transport.release(offer)
        if request_id in self.engine.parked:
            self.engine.release_request(request_id)

    def can_accept(self, m: MigratedRequest, waiting_page_fraction: float) -> bool:
        return self.engine.can_accept(m, waiting_page_fraction)

    def begin_import(
        self, m: MigratedRequest, offer: Offer, timeout_s: float, on_failure: str
    ) -> None:
        pages = self.engine.reserve_import(m)
        start = time.perf_counter()
        deadline = self.time_fn() + timeout_s
        try:
            handle = self.transport.pull(offer, self.engine.runner, deadline)
        except TransferError as e:
            handle = e
        self._imports[m.request_id] = _Import(
            m, offer, pages, handle, deadline, on_failure, start, timeout_s
        )

    def poll_imports(self) -> list[ImportResult]:
        results = []
        for rid, imp in list(self._imports.items()):
            try:
                data = self.transport.poll(imp.handle)
                if data is None and self.time_fn() > imp.deadline:
                    raise TransferError(
                        f"KV transfer of request {rid!r} passed its deadline "
                        f"({imp.timeout_s:g} s) before the KV arrived"
                    )
            except TransferError as e:
                del self._imports[rid]
                results.append(self._failed(rid, imp, str(e)))
                continue
            if data is None:
                continue
            del self._imports[rid]
            try:
                self.engine.runner.import_pages(imp.pages, data)
            except Exception as e:  # a malformed array: the request must not decode garbage
                results.append(self._failed(rid, imp, f"KV import failed: {e!r}"))
                continue
            self.engine.commit_import(rid)
            results.append(
                ImportResult(rid, "done", imp.offer.nbytes, time.perf_counter() - imp.start, None)
            )
        return results

    def _failed(self, rid: str, imp: _Import, error: str) -> ImportResult:
        logger.warning("KV transfer of request %s failed: %s", rid, error)
        if imp.on_failure == "fail":
            self.engine.cancel_import(rid, error=f"KV transfer failed: {error}")
            return ImportResult(rid, "failed", 0, time.perf_counter() - imp.start, error)
        self.engine.cancel_import(rid)
        return ImportResult(rid, "recomputed", 0, time.perf_counter() - imp.start, error)

    # ---- counters --------------------------------------------------------------------------

    @property
    def stats(self):
        return self.engine.stats

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def add_lora(self, lora_request) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> dict:
        return self.engine.list_loras()

    @property
    def num_compiles(self) -> int:
        return self.engine.num_compiles

    def shutdown(self) -> None:
        """Drop this instance's offers (its KV arrays): pulls of them fail from now on."""
        for offer in self._offers.values():
            self.transport.release(offer)
        self._offers.clear()
        self._imports.clear()

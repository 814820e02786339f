"""Many simulated instances on one virtual timeline, behind a router (issue 20, item 4), colocated
or disaggregated (DistServe, issue 21: prefill and decode instances with KV migration).

    engines = [LLMEngine(config, params=None, num_pages=N) for _ in range(4)]  # device="sim"
    cluster = SimCluster(engines, "least_outstanding")
    outputs = replay(cluster, specs)        # llmjax.bench.replay, unchanged; then summarize(...)

    # disaggregated: engines built with role='prefill' / 'decode'
    cluster = SimCluster([prefill_engine, decode_engine, decode_engine2], "round_robin")
    cluster.transfer_stats                  # KV moved: count, bytes, modeled seconds

The policies -- routing, the Conductor's placement, DistServe's pull rule -- are the real
cluster's (`llmjax.cluster.core.ClusterCore`, `llmjax.cluster.migration.ParkedQueue`); what is
simulated is how instances run (virtual clocks) and how long KV takes to move.

Each instance is a real simulated `LLMEngine` with its OWN `VirtualClock`; `SimCluster` is a
conservative discrete-event simulation over them (arrivals, prefix-fetch ends, transfer ends,
pulls, steps, in that order at one time) and duck-types as one engine for `replay`. The events,
what a routing may see, the cluster's clock and the Conductor's placement are specified in
docs/simulator.md, "The simulated cluster's events".

What a router sees of an instance as of the arrival time (`InstanceView`, with the rule for what
a step in progress shows) is in views.py; how long KV takes to move, in transfers.py.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from llmjax.cluster.conductor import SimCostModel
from llmjax.cluster.core import ClusterCore, ended_output
from llmjax.cluster.migration import ParkedQueue
from llmjax.cluster.router import (  # re-exported: the router interface moved there
    ROUTERS,
    CacheAware,
    InstanceLoad,
    LeastOutstanding,
    PowerOfTwo,
    RoundRobin,
    Router,
    RouteRequest,
    make_router,
)
from llmjax.cluster.stats import TransferStats
from llmjax.engine.request import RequestOutput
from llmjax.sampling_params import SamplingParams
from llmjax.sim.fetches import Fetch, PrefixFetches
from llmjax.sim.kvpool import SimKVPool
from llmjax.sim.pulls import SimPulls, Transfer
from llmjax.sim.transfers import TransferModel, pack_nodes
from llmjax.sim.views import InstanceState, InstanceView

__all__ = [  # with the router interface of llmjax.cluster.router, re-exported
    "ROUTERS",
    "CacheAware",
    "ClusterClock",
    "InstanceLoad",
    "InstanceView",
    "LeastOutstanding",
    "PowerOfTwo",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "SimCluster",
    "TransferStats",
    "make_router",
]


class ClusterClock:
    """The cluster's simulated time (docs/simulator.md): `now()`, and `advance_to(t)`, which says
    that every arrival up to t has been added (the replay's call while all instances idle)."""

    def __init__(self, cluster: SimCluster):
        self._cluster = cluster

    def now(self) -> float:
        c = self._cluster
        t = c._next_event()[1]
        if t != math.inf:
            c._time = max(c._time, t)
        return c._time

    def advance_to(self, t: float) -> float:
        if t != t:
            raise ValueError("advance_to(nan)")
        c = self._cluster
        c._time = max(c._time, float(t))
        return c._time

    def __repr__(self) -> str:
        return f"ClusterClock(now={self._cluster._time})"


class SimCluster(PrefixFetches, SimPulls):
    """Simulated engines on one timeline, behind `router` (a `Router` or a name of ROUTERS):
    the engine interface `llmjax.bench.replay` drives (docs/simulator.md gives the events).

    Engines of role 'prefill' need at least one of role 'decode' (and vice versa); arrivals go
    to the 'colocated' and 'prefill' ones. `decode_router` picks among the decode instances that
    can pull a request; `waiting_page_fraction` is DistServe's pull threshold (5 %).
    `node_of(i)` (a sequence or a callable) says which node instance i is on (default
    `pack_nodes`); `transfer_bandwidth` (bytes/s per device) and `transfer_latency_s` override
    the hardware's link or network figures for every transfer.

    The KV pool (Mooncake Store's DRAM pool, `llmjax.sim.kvpool.SimKVPool`; default off):
    `kv_pool_bytes_per_node` (e.g. `DEFAULT_POOL_BYTES_PER_NODE`, 1 TB) sizes one over the
    nodes the entry instances are on, in tokens of the model's full KV (all layers and KV
    heads); or `kv_pool` gives one (its page size and salt must be the entry engines'). Fetches
    from it take `kv_pool_bandwidth` (bytes/s per receiving device) and `kv_pool_latency_s`
    (default: as `transfer_bandwidth` / `transfer_latency_s`, else the network's)."""

    def __init__(
        self,
        engines: Sequence,
        router: Router | str = "round_robin",
        *,
        decode_router: Router | str = "least_outstanding",
        waiting_page_fraction: float = 0.05,
        transfer_bandwidth: float | None = None,
        transfer_latency_s: float | None = None,
        node_of: Sequence[int] | Callable[[int], int] | None = None,
        kv_pool_bytes_per_node: float | None = None,
        kv_pool: SimKVPool | None = None,
        kv_pool_bandwidth: float | None = None,
        kv_pool_latency_s: float | None = None,
    ):
        engines = list(engines)
        if not engines:
            raise ValueError("a SimCluster needs at least one engine")
        first = engines[0].config.model
        for i, e in enumerate(engines):
            if e.config.device != "sim":
                raise ValueError(
                    f"engine {i} has device={e.config.device!r}: a SimCluster runs simulated "
                    "engines only (EngineConfig(device='sim', sim=SimConfig(...)))"
                )
            m = e.config.model
            if (m.vocab_size, tuple(m.eos_token_ids)) != (first.vocab_size, first.eos_token_ids):
                raise ValueError(
                    f"engine {i}: vocab_size={m.vocab_size}, eos={m.eos_token_ids} differ from "
                    f"engine 0's ({first.vocab_size}, {first.eos_token_ids}); a request must "
                    "be valid on every instance"
                )
            if e.has_unfinished_requests() or getattr(e, "parked", None):
                raise ValueError(f"engine {i} has unfinished requests; give idle engines")
        distinct = {id(e) for e in engines}, {id(e.clock) for e in engines}
        if min(map(len, distinct)) < len(engines):
            raise ValueError("each instance needs its own engine and its own VirtualClock")
        self.roles = tuple(getattr(e, "role", "colocated") for e in engines)
        # the routing and migration policies, shared with the real cluster
        loras = [e.config.lora for e in engines]
        self.core = ClusterCore(self.roles, router, decode_router, waiting_page_fraction, loras)
        if kv_pool is not None and kv_pool_bytes_per_node is not None:
            raise ValueError("give kv_pool or kv_pool_bytes_per_node, not both")
        if kv_pool_bytes_per_node is not None and not kv_pool_bytes_per_node >= 0:
            raise ValueError(f"{kv_pool_bytes_per_node=} must be >= 0")
        self.router, self.decode_router = self.core.router, self.core.decode_router
        self.conductor_stats = self.core.conductor_stats
        self.waiting_page_fraction = waiting_page_fraction
        self.transfer_bandwidth = transfer_bandwidth
        self.transfer_latency_s = transfer_latency_s
        if node_of is None:
            node_of = pack_nodes(engines)
        self.nodes = [node_of(i) if callable(node_of) else node_of[i] for i in range(len(engines))]
        # how long KV takes to move (llmjax/sim/transfers.py): the simulated transports
        self.transfers = TransferModel(
            engines,
            self.nodes,
            transfer_bandwidth,
            transfer_latency_s,
            kv_pool_bandwidth,
            kv_pool_latency_s,
        )
        self.transfer_seconds = self.transfers.transfer_seconds
        self.kv_transfer_seconds = self.transfers.kv_transfer_seconds
        self.kv_pool_seconds = self.transfers.kv_pool_seconds
        self.instances = tuple(engines)
        self._instances = [InstanceState(i, e) for i, e in enumerate(engines)]
        self._entry, self._decode = self.core.entry, self.core.decode
        self.config = engines[0].config
        self.tokenizer = engines[0].tokenizer
        self.clock = ClusterClock(self)
        self.transfer_stats = TransferStats()
        self._time = min(e.clock.now() for e in engines)  # the horizon the clock has shown
        self._routed_at = self._time  # the last routing time
        # queued arrivals: (arrival, seq, RouteRequest, prompt text), routed in arrival order
        self._pending: list[tuple[float, int, RouteRequest, str | None]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._where: dict[str, int | None] = {}  # request id -> instance (None: not routed yet)
        self._path: dict[str, list[int]] = {}  # request id -> the instances it ran on, in order
        self._open: set[str] = set()  # ids queued or live on an instance
        # parked requests not pulled yet (llmjax/cluster/migration.py: the pull policy)
        self._queue = ParkedQueue()
        self._transfers: list[tuple[float, int, Transfer]] = []  # by end time
        self._moving: dict[str, Transfer] = {}
        self._errors: list[RequestOutput] = []  # failed at routing, out with the next step
        # instances whose last step scheduled nothing (pages all held by parked requests or
        # reserved for transfers): not busy until an event there may let them run (the doc)
        self._blocked: set[int] = set()
        self._last_event = self._time  # the time of the last event processed
        # the Conductor (a router with `schedule`): decode pins (the core's), and prefix
        # fetches in flight by end time
        self._pinned = self.core.pins
        self._fetching: list[tuple[float, int, Fetch]] = []
        self._fetches: dict[str, Fetch] = {}
        self.kv_pool_bandwidth = kv_pool_bandwidth
        self.kv_pool_latency_s = kv_pool_latency_s
        self.kv_pool = self._make_pool(kv_pool, kv_pool_bytes_per_node)
        if getattr(self.router, "schedule", None) is not None and self.router.cost_model is None:
            prefill = [i for i in self._entry if self.roles[i] == "prefill"] or self._entry
            self.router.cost_model = SimCostModel(
                engines[prefill[0]].config,
                engines[self._decode[0]].config if self._decode else None,
                transfer_bandwidth=transfer_bandwidth,
                transfer_latency_s=transfer_latency_s,
                pool_bandwidth=kv_pool_bandwidth or transfer_bandwidth,
                pool_latency_s=transfer_latency_s
                if kv_pool_latency_s is None
                else kv_pool_latency_s,
            )

    # ---- the engine interface --------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        hints=None,
        instance: int | None = None,
        lora_request=None,
    ) -> str:
        """Queue a request arriving at `arrival_time` (default `clock.now()`); it is routed when
        its arrival is the next event. Returns its cluster-wide id (given or 0, 1, ...).
        `instance`: the entry instance (an index into the entry instances, as the router's
        views number them) chosen by the caller (a program's scheduler, llmjax/program/)
        instead of the router; `hints`: the engine's `ProgramHints`; `lora_request`: its LoRA
        adapter (`LLMEngine.add_request`'s)."""
        if instance is not None and not 0 <= instance < len(self._entry):
            raise ValueError(f"{instance=} is not an entry instance (0..{len(self._entry) - 1})")
        if request_id is None:
            request_id = next(r for r in map(str, self._ids) if r not in self._open)
        elif request_id in self._open:
            raise ValueError(f"{request_id=} is already queued, waiting or running")
        arrival = self.clock.now() if arrival_time is None else float(arrival_time)
        req = RouteRequest(
            request_id,
            tuple(int(t) for t in prompt_token_ids),
            arrival,
            sampling_params or SamplingParams(),
            hints,
            instance,
            lora_request,
        )
        heapq.heappush(self._pending, (arrival, next(self._seq), req, prompt))
        self._where[request_id] = None
        self._path[request_id] = []
        self._open.add(request_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Process the events due before the next step (arrivals, transfer ends, pulls), then
        run that step (the busy instance with the smallest clock, if within `clock.now()`);
        returns its outputs. Else move the clock to the next event and return [] (or the
        requests that failed at routing)."""
        outputs, self._errors = self._errors, []
        while True:
            kind, t, arg = self._next_event()
            if kind is None:
                if self.has_unfinished_requests() and not self._errors:
                    raise RuntimeError(
                        "SimCluster: parked requests that no decode instance can ever take"
                    )
                return outputs + self._take_errors()
            if t > self._time:
                self.clock.now()
                return outputs + self._take_errors()
            self._last_event = max(self._last_event, t)
            if kind == "arrival":
                _, _, req, prompt = heapq.heappop(self._pending)
                self._route(req, prompt)
            elif kind == "fetch":
                heapq.heappop(self._fetching)
                self._finish_fetch(arg)
            elif kind == "transfer":
                heapq.heappop(self._transfers)
                self._finish_transfer(arg)
            elif kind == "pull":
                self._start_transfer(t, arg)
            else:
                return outputs + self._take_errors() + self._step_instance(arg)

    def has_unfinished_requests(self) -> bool:
        return bool(
            self._pending or self._errors or self._queue or self._moving or self._fetches
        ) or any(e.has_unfinished_requests() for e in self.instances)

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued (not yet routed) or live request, wherever it is (on a prefill
        instance, parked, in transfer: both sides free its pages, decoding); False if it is
        neither."""
        if request_id not in self._open:
            return False
        i = self._where[request_id]
        if i is None:
            self._pending = [p for p in self._pending if p[2].request_id != request_id]
            heapq.heapify(self._pending)
            self._open.discard(request_id)
            return True
        inst = self._instances[i]
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None:  # not on its instance's engine yet
            fetch.cancelled = True
            inst.fetching.pop(request_id, None)
            inst.live.discard(request_id)
            self._open.discard(request_id)
            self._left(request_id)
            return True
        move = self._moving.pop(request_id, None)
        if move is not None:  # both sides hold pages: the source its KV, the dest the reserve
            move.cancelled = True
            self.instances[move.source].abort_request(request_id)
            self._unblock(move.source, self._last_event)
        if not inst.engine.abort_request(request_id):
            return False  # e.g. rejected: its error output is still to come
        self._unblock(i, self._last_event)
        inst.live.discard(request_id)
        self._queue.discard(request_id)
        self._open.discard(request_id)
        self._left(request_id)
        return True

    @property
    def num_compiles(self) -> int:
        return sum(e.num_compiles for e in self.instances)

    @property
    def stats(self) -> list:
        """Each instance's `EngineStats`, in index order."""
        return [e.stats for e in self.instances]

    def reset_stats(self) -> None:
        for e in self.instances:
            e.reset_stats()
        self.transfer_stats = TransferStats()

    @property
    def total_stats(self):
        """Every instance's counters summed (`EngineStats.merge`)."""
        from llmjax.engine.stats import EngineStats

        return EngineStats.merge(self.stats)

    def reset_prefix_cache(self) -> bool:
        """Empty every instance's prefix cache (`LLMEngine.reset_prefix_cache`); True if all
        are empty now), and the KV pool."""
        if self.kv_pool is not None:
            self.kv_pool.reset()
        return all([e.reset_prefix_cache() for e in self.instances])

    # ---- inspection ------------------------------------------------------------------------

    def instance_of(self, request_id: str) -> int | None:
        """The index of the instance `request_id` is on (its decode instance once pulled);
        None while it is queued for its arrival's turn (KeyError for an id never added)."""
        return self._where[request_id]

    def path_of(self, request_id: str) -> tuple[int, ...]:
        """The instances `request_id` ran on, in order: (its colocated one,) or (prefill,
        decode) once pulled; () before routing (KeyError for an id never added)."""
        return tuple(self._path[request_id])

    def state_of(self, request_id: str) -> str:
        """Where `request_id` is: 'queued' (for its arrival's turn), 'fetching' (its prefix,
        before it joins its prefill instance: the Conductor), 'running' (on a colocated
        or prefill instance, waiting or computing), 'parked' (first token done, waiting to be
        pulled), 'transfer' (its KV moving), 'decoding' (on a decode instance) or 'done'
        (finished, failed or aborted; KeyError for an id never added)."""
        i = self._where[request_id]
        if request_id not in self._open:
            return "done"
        if i is None:
            return "queued"
        if request_id in self._fetches:
            return "fetching"
        if request_id in self._moving:
            return "transfer"
        if request_id in self._queue:
            return "parked"
        return "decoding" if self.roles[i] == "decode" else "running"

    def views(self, now: float | None = None) -> list[InstanceView]:
        """Every instance as a router sees it at `now` (default the last routing time; never
        earlier than that, whose older finishes are forgotten)."""
        return [
            InstanceView(inst, self._routed_at if now is None else now) for inst in self._instances
        ]

    # ---- events ------------------------------------------------------------------------------

    def _busy_clock(self) -> tuple[float, int | None]:
        """(clock, index) of the busy instance to step next; (inf, None) when all are idle."""
        busy = [
            (e.clock.now(), i)
            for i, e in enumerate(self.instances)
            if e.has_unfinished_requests() and i not in self._blocked
        ]
        return min(busy, default=(math.inf, None))

    def _next_event(self) -> tuple[str | None, float, object]:
        """(kind, time, what) of the next event: at one time an arrival, then a transfer end,
        then a pull, then a step (docs/simulator.md); (None, inf, None) when there is none."""
        events = []
        if self._pending:
            events.append((self._pending[0][0], 0, "arrival", None))
        while self._fetching and self._fetching[0][2].cancelled:
            heapq.heappop(self._fetching)
        if self._fetching:
            events.append((self._fetching[0][0], 1, "fetch", self._fetching[0][2]))
        while self._transfers and self._transfers[0][2].cancelled:
            heapq.heappop(self._transfers)
        if self._transfers:
            events.append((self._transfers[0][0], 2, "transfer", self._transfers[0][2]))
        pull = self._next_pull()
        if pull is not None:
            events.append((pull.time, 3, "pull", pull))
        t, i = self._busy_clock()
        if i is not None:
            events.append((t, 4, "step", i))
        if not events:
            return None, math.inf, None
        t, _, kind, arg = min(events, key=lambda e: e[:2])
        return kind, t, arg

    def _step_instance(self, i: int) -> list[RequestOutput]:
        inst = self._instances[i]
        engine = inst.engine
        before = engine.clock.now(), engine.stats.num_steps, engine.stats.num_pipeline_ticks
        outputs = engine.step()
        after = engine.clock.now(), engine.stats.num_steps, engine.stats.num_pipeline_ticks
        if after == before and engine.has_unfinished_requests():
            self._blocked.add(i)  # it scheduled nothing: wait for pages (docs/simulator.md)
        parked = engine.parked if engine.role == "prefill" else {}
        for out in outputs:
            rid = out.request_id
            if out.finished and rid in inst.live:
                inst.live.discard(rid)
                self._open.discard(rid)
                inst.finished_at.append(out.metrics.finished_time)
                self._left(rid, None if out.error is not None else len(out.token_ids))
            elif rid in parked and rid in inst.live and rid not in self._queue:
                m, _ = engine.export_request(rid)
                self._queue.park(rid, m.metrics.first_token_time, i, m, self._pinned.get(rid))
        return outputs

    def _left(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """`request_id` left the cluster (ClusterCore.left: its pin dropped, the router told)."""
        self.core.left(request_id, num_output_tokens)

    def _unblock(self, i: int, t: float) -> None:
        """Instance i, blocked since its clock, may run again from time t."""
        if i in self._blocked:
            self._blocked.discard(i)
            self.instances[i].clock.advance_to(t)

    def _take_errors(self) -> list[RequestOutput]:
        out, self._errors = self._errors, []
        return out

    def _route(self, req: RouteRequest, prompt: str | None) -> None:
        # Arrivals are routed in time order; one added late (below the last routing time) is
        # routed, and its idle instance started, at that time, so no instance steps back.
        now = self._routed_at = max(self._routed_at, req.arrival_time)
        for inst in self._instances:  # finishes every later routing sees as done
            while inst.finished_at and inst.finished_at[0] <= now:
                inst.finished_at.popleft()
        if self._decode and (error := self._undecodable(req)) is not None:
            self._fail(req, prompt, error, now)
            return
        views = lambda idx: [InstanceView(self._instances[i], now, k) for k, i in enumerate(idx)]
        placement = self.core.place(req, views, now, can_pin=self._can_hold, pool=self.kv_pool)
        self.core.commit(placement, req)
        if placement.rejected is not None:
            self._fail(req, prompt, placement.rejected, now, finish_reason="rejected")
        elif placement.fetches:
            self._fetch(req, prompt, placement, now)
        else:
            self._admit(placement.prefill, req, prompt, now)

    def _can_hold(self, j: int, req: RouteRequest) -> bool:
        """Whether decode instance j could hold `req` to its last token (else the Conductor's
        pin is dropped: any decode instance pulls it)."""
        from llmjax.engine.engine import InvalidRequest

        try:
            self.instances[j].validate_request(list(req.prompt_token_ids), req.sampling_params)
            return True
        except InvalidRequest:
            return False

    def _admit(self, i: int, req: RouteRequest, prompt: str | None, now: float) -> None:
        """Put `req` on instance i's engine at `now`."""
        engine = self.instances[i]
        if not engine.has_unfinished_requests():
            engine.clock.advance_to(now)  # an idle instance's clock may lag: it starts at now
        self._unblock(i, now)
        engine.add_request(
            list(req.prompt_token_ids),
            req.sampling_params,
            request_id=req.request_id,
            prompt=prompt,
            arrival_time=req.arrival_time,
            hints=req.hints,
            lora_request=req.lora_request,
        )
        if req.request_id not in self._instances[i].live:
            self._instances[i].live.add(req.request_id)
            self._where[req.request_id] = i
            self._path[req.request_id].append(i)

    def _undecodable(self, req: RouteRequest) -> str | None:
        """Why no decode instance could ever hold `req` to its last token, or None."""
        from llmjax.engine.engine import InvalidRequest

        errors = []
        for j in self._decode:
            try:
                self.instances[j].validate_request(list(req.prompt_token_ids), req.sampling_params)
                return None
            except InvalidRequest as e:
                errors.append(f"decode instance {j}: {e}")
        return "; ".join(errors)

    def _fail(
        self,
        req: RouteRequest,
        prompt: str | None,
        error: str,
        now: float,
        finish_reason: str = "error",
    ) -> None:
        self._open.discard(req.request_id)
        self._errors.append(ended_output(req, prompt, error, now, finish_reason))

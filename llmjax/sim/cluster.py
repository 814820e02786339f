"""Many simulated instances on one virtual timeline, behind a router (issue 20, item 4).

    engines = [LLMEngine(config, params=None, num_pages=N) for _ in range(4)]  # device="sim"
    cluster = SimCluster(engines, "least_outstanding")
    outputs = replay(cluster, specs)        # llmjax.bench.replay, unchanged; then summarize(...)

Each instance is a real simulated `LLMEngine` (its scheduler, block manager and radix cache)
with its OWN `VirtualClock`, which reads the time the instance is free to start its next step
(when its last step ends). `SimCluster` is a conservative discrete-event simulation over them and
duck-types as one engine for `replay`. The events, processed in time order, are:

  arrival at a   the router picks an instance for the request (`Router.route`, seeing every
                 instance as of a, below); an idle instance's clock is first moved up to a.
  step at t      the busy instance with the smallest clock t (ties: lowest index) runs one
                 engine step: it schedules at t, with exactly the requests that arrived <= t,
                 and its clock moves on by the cost model's step time.

An arrival at the same time as a step goes first. `add_request` only queues a request until its
arrival is the next event: routing at add time would be wrong when one replay iteration adds
several arrivals (everything due by `clock.now()`) while instances are idle. Say instance 1 is
idle at 0 while instance 0 runs a 10 s step; at now = 10 the replay adds arrivals at 1 and 3.
Routed at once, both could land on instance 1, whose step at 1 would then schedule the request
that only arrives at 3. In event order, instance 1 steps at 1 with the first alone, and the
second is routed at 3 seeing that step in progress.

The cluster's clock (`clock.now()`) is the time up to which the caller has been asked for
arrivals: the next event's time (the smallest busy clock or queued arrival), but never less than
a value already returned (a replay asked up to t adds every arrival <= t, so the cluster may then
step any instance whose clock is <= t; `clock.advance_to(t)` says the same when all are idle).
It never decreases. A `step()` that finds no event within that time moves the clock to the next
event and returns [] (so a caller adding late arrivals can still add them first).

What a router sees (`InstanceView`), as of the arrival time a: every instance's last step
started at or before a but may end after it (its clock > a). That step's effects are not yet
visible at a, and for the request counts the view undoes them: a request counts as outstanding
on its instance from its routing until routings at times a >= its `metrics.finished_time` (not
from when the cluster simulated the step that finishes it), so the requests that the step in
progress will finish still count, as running. An abort (`abort_request`) takes effect at once.
The page and prefix-cache views (`num_free_pages`, `num_available_pages`,
`cached_prefix_tokens`) read the block manager as it is, i.e. with the in-progress step's frees
and cache inserts already made: at most one step ahead (the engine has no hook to read its state
between schedule and update).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Sequence

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
from llmjax.engine.request import RequestOutput
from llmjax.sampling_params import SamplingParams

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
    "make_router",
]


class InstanceView:
    """Instance `index` as a router sees it at time `now` (the rule in the module doc)."""

    def __init__(self, instance: _Instance, now: float):
        self._instance = instance
        self.index = instance.index
        self.now = now

    @property
    def _engine(self):
        return self._instance.engine

    @property
    def num_outstanding(self) -> int:
        """Requests routed here and not finished by `now` (finished_time <= now); an aborted
        one stops counting at once."""
        return len(self._instance.live) + self._finishing

    @property
    def _finishing(self) -> int:
        """Requests whose finish (by the step in progress at `now`) lies after `now`."""
        return sum(t > self.now for t in self._instance.finished_at)

    @property
    def num_waiting(self) -> int:
        """Requests queued here, not admitted (or preempted back into the queue)."""
        return len(self._engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted here (holding KV pages) as of `now`, including those the step in
        progress finishes after `now`."""
        return len(self._engine.scheduler.running) + self._finishing

    @property
    def free_at(self) -> float:
        """When the instance can start its next step (its clock; > `now` while a step runs)."""
        return self._engine.clock.now()

    @property
    def num_free_pages(self) -> int:
        """KV pages on the free list (one step ahead at most, see the module doc)."""
        return self._engine.block_manager.num_free_pages

    @property
    def num_available_pages(self) -> int:
        """Free pages plus prefix-cache pages no request holds (evicted on demand)."""
        return self._engine.block_manager.num_available_pages

    def cached_prefix_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV this instance's prefix cache holds now (what admission would
        reuse: whole pages of all but the last token); reads the radix tree without touching
        its LRU order (`BlockManager.peek_prefix`)."""
        ids = list(prompt_token_ids)[:-1]
        return self._engine.block_manager.peek_prefix(ids).num_tokens

    def __repr__(self) -> str:
        return (
            f"InstanceView(index={self.index}, now={self.now}, "
            f"outstanding={self.num_outstanding}, free_at={self.free_at})"
        )


@dataclasses.dataclass
class _Instance:
    index: int
    engine: object  # a simulated LLMEngine
    live: set[str] = dataclasses.field(default_factory=set)  # routed here, not finished/aborted
    # finished_time of finished requests that a routing may still see as outstanding (> the last
    # routing time), in finishing order (the engine's clock never goes back)
    finished_at: deque[float] = dataclasses.field(default_factory=deque)


class ClusterClock:
    """The cluster's simulated time (the module doc): `now()`, and `advance_to(t)`, which says
    that every arrival up to t has been added (the replay's call while all instances idle)."""

    def __init__(self, cluster: SimCluster):
        self._cluster = cluster

    def now(self) -> float:
        c = self._cluster
        t = c._next_event_time()
        if t is not None:
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


class SimCluster:
    """Simulated engines on one timeline, behind `router` (a `Router` or a name of ROUTERS):
    the engine interface `llmjax.bench.replay` drives (see the module doc for the events)."""

    def __init__(self, engines: Sequence, router: Router | str = "round_robin"):
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
            if e.has_unfinished_requests():
                raise ValueError(f"engine {i} has unfinished requests; give idle engines")
        distinct = {id(e) for e in engines}, {id(e.clock) for e in engines}
        if min(map(len, distinct)) < len(engines):
            raise ValueError("each instance needs its own engine and its own VirtualClock")
        self.router = make_router(router) if isinstance(router, str) else router
        if not callable(getattr(self.router, "route", None)):
            raise ValueError(f"router {router!r} has no route(request, instances, now)")
        self.instances = tuple(engines)
        self._instances = [_Instance(i, e) for i, e in enumerate(engines)]
        self.config = engines[0].config
        self.tokenizer = engines[0].tokenizer
        self.clock = ClusterClock(self)
        self._time = min(e.clock.now() for e in engines)  # the horizon the clock has shown
        self._routed_at = self._time  # the last routing time
        # queued arrivals: (arrival, seq, RouteRequest, prompt text), routed in arrival order
        self._pending: list[tuple[float, int, RouteRequest, str | None]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._where: dict[str, int | None] = {}  # request id -> instance (None: not routed yet)
        self._open: set[str] = set()  # ids queued or live on an instance

    # ---- the engine interface --------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request arriving at `arrival_time` (default `clock.now()`); it is routed when
        its arrival is the next event. Returns its cluster-wide id (given or 0, 1, ...)."""
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
        )
        heapq.heappush(self._pending, (arrival, next(self._seq), req, prompt))
        self._where[request_id] = None
        self._open.add(request_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Route the arrivals due before the next step, then run that step (the busy instance
        with the smallest clock, if within `clock.now()`); returns its outputs. Else move the
        clock to the next event and return []."""
        while self._pending and self._pending[0][0] <= min(self._time, self._busy_clock()[0]):
            _, _, req, prompt = heapq.heappop(self._pending)
            self._route(req, prompt)
        t, i = self._busy_clock()
        if i is None or t > self._time:
            self.clock.now()
            return []
        inst = self._instances[i]
        outputs = inst.engine.step()
        for out in outputs:
            if out.finished and out.request_id in inst.live:
                inst.live.discard(out.request_id)
                self._open.discard(out.request_id)
                inst.finished_at.append(out.metrics.finished_time)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(e.has_unfinished_requests() for e in self.instances)

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued (not yet routed) or live request; False if it is neither."""
        if request_id not in self._open:
            return False
        i = self._where[request_id]
        if i is None:
            self._pending = [p for p in self._pending if p[2].request_id != request_id]
            heapq.heapify(self._pending)
            self._open.discard(request_id)
            return True
        inst = self._instances[i]
        if not inst.engine.abort_request(request_id):
            return False  # e.g. rejected: its error output is still to come
        inst.live.discard(request_id)
        self._open.discard(request_id)
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

    @property
    def total_stats(self):
        """Every instance's counters summed (`EngineStats.merge`)."""
        from llmjax.engine.stats import EngineStats

        return EngineStats.merge(self.stats)

    def reset_prefix_cache(self) -> bool:
        """Empty every instance's prefix cache (`LLMEngine.reset_prefix_cache`); True if all
        are empty now."""
        return all([e.reset_prefix_cache() for e in self.instances])

    # ---- inspection ------------------------------------------------------------------------

    def instance_of(self, request_id: str) -> int | None:
        """The index of the instance `request_id` was routed to; None while it is queued for its
        arrival's turn (KeyError for an id never added)."""
        return self._where[request_id]

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
            (e.clock.now(), i) for i, e in enumerate(self.instances) if e.has_unfinished_requests()
        ]
        return min(busy, default=(float("inf"), None))

    def _next_event_time(self) -> float | None:
        t = min(self._busy_clock()[0], self._pending[0][0] if self._pending else float("inf"))
        return None if t == float("inf") else t

    def _route(self, req: RouteRequest, prompt: str | None) -> None:
        # Arrivals are routed in time order; one added late (below the last routing time) is
        # routed, and its idle instance started, at that time, so no instance steps back.
        now = self._routed_at = max(self._routed_at, req.arrival_time)
        for inst in self._instances:  # finishes every later routing sees as done
            while inst.finished_at and inst.finished_at[0] <= now:
                inst.finished_at.popleft()
        choice = self.router.route(req, self.views(now), now)
        n = len(self.instances)
        if isinstance(choice, bool) or not hasattr(choice, "__index__") or not 0 <= choice < n:
            raise ValueError(
                f"router {getattr(self.router, 'name', self.router)!r} returned {choice!r} for "
                f"request {req.request_id}; need an instance index in [0, {n})"
            )
        i = int(choice)
        engine = self.instances[i]
        if not engine.has_unfinished_requests():
            engine.clock.advance_to(now)  # an idle instance's clock may lag: it starts at now
        engine.add_request(
            list(req.prompt_token_ids),
            req.sampling_params,
            request_id=req.request_id,
            prompt=prompt,
            arrival_time=req.arrival_time,
        )
        self._instances[i].live.add(req.request_id)
        self._where[req.request_id] = i

"""DistServe's pull-based migration (ALGORITHMS.md §7.1) as ONE policy, run by both clusters:
the real one (cluster.py: instances stepped in turn, on the wall clock) and the simulated one
(llmjax/sim/cluster.py: a discrete-event loop over virtual clocks). What differs between them is
only when a decode instance could pull (now, or the time its clock and the request allow) and how
the KV then moves (a transport, or a modeled delay); which request moves, and to which decode
instances, is decided here.

    queue = ParkedQueue()
    queue.park("r1", ready=2.5, instance=0, request=m)        # its first token at 2.5 s
    queue.park("r2", ready=2.7, instance=1, request=m2, pin=4)  # the Conductor pinned it to 4
    pull = queue.next_pull(decode=[3, 4], accept_time=when)   # Pull(time, parked, candidates)
    queue.take(pull)                                          # it moves: off the queue
    j = choose(decode_router, route, views, pull.time)        # one of pull.candidates

The rule. A prefill instance parks each request after its first token (its KV pages held).
Parked requests queue in one FIFO across the prefill instances, ordered by first-token time
(ties: lower instance index, then parking order), and only the head may move: nothing overtakes
it, however much smaller. A request the Conductor pinned to a decode instance queues instead in
that instance's own FIFO (same order) and moves only there. A decode instance pulls when
`accept_time(j, parked)` says it can (DistServe's condition is `can_accept`: its waiting queue
uses < `waiting_page_fraction` of its pages and the request's pages fit) and at what time; the
next pull is the earliest over the unpinned head (any decode instance) and each pinned head
(its instance), ties by the FIFO order; its candidates are the decode instances that can pull
the unpinned head at that time, from which the decode router picks (`choose`).

In/Out example: r1 (ready 1.0, instance 0) and r2 (ready 0.5, instance 1) parked, unpinned;
decode instances 2 and 3, accept_time(j, p) = p.ready if j == 3 else None -> Pull(0.5, r2, (3,)).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Parked:
    """A request parked on prefill instance `instance` since `ready` (its first-token time):
    what a decode instance may pull. Ordered as the FIFO is (ready, instance, seq)."""

    ready: float
    instance: int
    seq: int  # parking order, the last tie-break
    request_id: str = dataclasses.field(compare=False)
    request: object = dataclasses.field(compare=False)  # what `accept_time` reads (MigratedRequest)
    pin: int | None = dataclasses.field(default=None, compare=False)  # the Conductor's decode


@dataclasses.dataclass(frozen=True)
class Pull:
    """The next move: `parked` leaves its prefill instance at `time` for one of `candidates`
    (decode instances, in the order given to `next_pull`; just the pin for a pinned request)."""

    time: float
    parked: Parked
    candidates: tuple[int, ...]


class ParkedQueue:
    """The parked requests of a cluster: one FIFO for unpinned requests and one per decode
    instance for the requests pinned to it (the module doc)."""

    def __init__(self):
        self._fifo: list[Parked] = []  # heaps, by Parked's order
        self._pinned: dict[int, list[Parked]] = {}
        self._live: dict[str, Parked] = {}
        self._seq = itertools.count()

    def park(
        self, request_id: str, ready: float, instance: int, request, pin: int | None = None
    ) -> Parked:
        """Queue a request that just parked; ValueError if it is queued already."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is parked already")
        p = Parked(float(ready), int(instance), next(self._seq), request_id, request, pin)
        heapq.heappush(self._fifo if pin is None else self._pinned.setdefault(pin, []), p)
        self._live[request_id] = p
        return p

    def discard(self, request_id: str) -> bool:
        """Drop a request (aborted, failed, or its prefill instance died); whether it was
        queued. (Lazy: the heaps drop it when it reaches their top.)"""
        return self._live.pop(request_id, None) is not None

    def unpin(self, decode: int) -> None:
        """Decode instance `decode` is gone: its pinned requests join the unpinned FIFO (their
        order kept)."""
        for p in self._pinned.pop(decode, []):
            if self._live.get(p.request_id) is p:
                q = dataclasses.replace(p, pin=None)
                self._live[p.request_id] = q
                heapq.heappush(self._fifo, q)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def get(self, request_id: str) -> Parked | None:
        return self._live.get(request_id)

    def _head(self, heap: list[Parked]) -> Parked | None:
        while heap and self._live.get(heap[0].request_id) is not heap[0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def heads(self) -> list[Parked]:
        """The requests that may move next: the unpinned head and each decode instance's
        pinned head."""
        out = [self._head(self._fifo)]
        out += [self._head(heap) for heap in self._pinned.values()]
        return [p for p in out if p is not None]

    def next_pull(
        self, decode: Sequence[int], accept_time: Callable[[int, Parked], float | None]
    ) -> Pull | None:
        """The earliest pull (the module doc), or None. `decode`: the live decode instances;
        `accept_time(j, parked)`: when instance j can take it, or None if it cannot."""
        best = None
        head = self._head(self._fifo)
        if head is not None:
            times = {j: accept_time(j, head) for j in decode}
            times = {j: t for j, t in times.items() if t is not None}
            if times:
                t = min(times.values())
                best = Pull(t, head, tuple(j for j in decode if times.get(j) == t))
        live = set(decode)
        for j, heap in self._pinned.items():
            p = self._head(heap) if j in live else None
            if p is None:
                continue
            t = accept_time(j, p)
            if t is not None and (best is None or (t, p) < (best.time, best.parked)):
                best = Pull(t, p, (j,))
        return best

    def take(self, pull: Pull) -> Parked:
        """`pull.parked` moves: off the queue (it must be a head)."""
        p = pull.parked
        heap = self._fifo if p.pin is None else self._pinned[p.pin]
        if self._head(heap) is not p:
            raise ValueError(f"request {p.request_id!r} is not at the head of its queue")
        heapq.heappop(heap)
        del self._live[p.request_id]
        return p


def checked_choice(router, choice, n: int, request_id: str) -> int:
    """A router's answer as an index into its n candidates; ValueError naming the router and
    the request otherwise."""
    if isinstance(choice, bool) or not hasattr(choice, "__index__") or not 0 <= choice < n:
        raise ValueError(
            f"router {getattr(router, 'name', router)!r} returned {choice!r} for "
            f"request {request_id}; need an instance index in [0, {n})"
        )
    return int(choice)


def choose(router, route, views: Sequence, now: float) -> int:
    """The router's pick among `views` (each an InstanceLoad of one candidate), checked."""
    return checked_choice(router, router.route(route, views, now), len(views), route.request_id)

"""DistServe's pull-based migration in the simulated cluster (`SimPulls`, a part of `SimCluster`):
the next pull by migration.py's rule (the real cluster's), at the time the decode instance's
clock and the request allow; the KV's move taking its modeled time (transfers.py); at its end
the prefill side frees the pages and the decode side commits the request."""

from __future__ import annotations

import dataclasses
import heapq

from llmjax.cluster.migration import Pull, choose
from llmjax.cluster.routing import RouteRequest
from llmjax.sim.views import InstanceView


@dataclasses.dataclass
class Transfer:
    """A KV migration in flight: pulled at `start`, committed at `end`."""

    request_id: str
    source: int  # the prefill instance
    dest: int  # the decode instance
    start: float
    end: float
    nbytes: int
    cancelled: bool = False  # aborted meanwhile


class SimPulls:
    """The migration of a `SimCluster` (its `instances`, `_instances`, `_queue`, `_decode`,
    `_pinned`, `_transfers`, `_moving`, `_where`, `_path`, `_seq`, `_last_event`,
    `decode_router`, `waiting_page_fraction`, `transfer_seconds`, `transfer_stats`,
    `_unblock`)."""

    def _next_pull(self) -> Pull | None:
        """The next pull (llmjax/cluster/migration.py's policy): a decode instance j can take a
        parked request p when `can_accept` holds on its state, at max(p's first-token time,
        j's clock, the last event's time): between its steps or while idle."""

        def accept_time(j: int, p) -> float | None:
            e = self.instances[j]
            if not e.can_accept(p.request, self.waiting_page_fraction):
                return None  # (never before an event done)
            return max(p.ready, e.clock.now(), self._last_event)

        return self._queue.next_pull(self._decode, accept_time)

    def _start_transfer(self, t: float, pull: Pull) -> None:
        p = self._queue.take(pull)
        i, rid, m = p.instance, p.request_id, p.request
        if rid in self._pinned:  # the Conductor's choice
            j = self._pinned.pop(rid)
        else:
            views = [InstanceView(self._instances[j], t, k) for k, j in enumerate(pull.candidates)]
            route = RouteRequest(
                rid,
                tuple(m.prompt_token_ids),
                m.metrics.arrival_time,
                m.sampling_params,
                lora_request=m.lora_request,
            )
            j = pull.candidates[choose(self.decode_router, route, views, t)]
        m, _ = self.instances[i].export_request(rid)
        self.instances[j].reserve_import(m)
        seconds, nbytes = self.transfer_seconds(i, j, m)
        move = Transfer(rid, i, j, t, t + seconds, nbytes)
        heapq.heappush(self._transfers, (move.end, next(self._seq), move))
        self._moving[rid] = move
        self._instances[i].live.discard(rid)
        self._instances[j].live.add(rid)
        self._where[rid] = j
        self._path[rid].append(j)

    def _finish_transfer(self, move: Transfer) -> None:
        del self._moving[move.request_id]
        self.instances[move.source].release_request(move.request_id)
        self._unblock(move.source, move.end)
        dest = self.instances[move.dest]
        if not dest.has_unfinished_requests():
            dest.clock.advance_to(move.end)  # an idle instance's clock may lag: it starts at e
        self._unblock(move.dest, move.end)
        dest.commit_import(move.request_id)
        self.transfer_stats.record(move.nbytes, move.end - move.start)

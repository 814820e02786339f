"""DistServe's pull-based migration in a `Cluster` (`Pulls`, a part of `Cluster`): first in each
step, finished pulls are committed, then parked requests move by the pull rule of
migration.py (`ParkedQueue`, the rule the simulated cluster runs too) through the instances'
transport: the prefill side offers the gathered pages, the decode side reserves pages and pulls."""

from __future__ import annotations

from llmjax.cluster.migration import ParkedQueue, choose
from llmjax.cluster.recovery import Record
from llmjax.cluster.views import LoadView


class Pulls:
    """The migration of a `Cluster` (its `instances`, `alive`, `_records`, `_outstanding`,
    `_loads`, `core`, `decode_router`, `waiting_page_fraction`, `transfer_timeout_s`,
    `on_transfer_failure`, `transfer_stats`, `clock`, `kill`, `_alive_with`)."""

    def _migrate(self) -> None:
        self._poll()
        self._start_transfers()  # each pull polled at once
        self._poll()  # and any that arrived meanwhile: decode can start this step

    def _poll(self) -> None:
        for j in self._alive_with(("decode",)):
            self._poll_instance(j)

    def _poll_instance(self, j: int) -> None:
        """Finish the pulls that arrived at decode instance j (a pull that arrives at once,
        as the local transport's do, commits before the next pull is decided, as a transfer
        that ends at once does in the simulated cluster)."""
        try:
            results = self.instances[j].poll_imports()
        except Exception as e:
            self.kill(j, reason=f"instance {j} failed: {e!r}")
            return
        for res in results:
            rec = self._records.get(res.request_id)
            if rec is not None and rec.source is not None:
                if self.alive[rec.source]:
                    self.instances[rec.source].release(res.request_id)
                    self._loads[rec.source] = self.instances[rec.source].load()
                rec.source = None
            st = self.transfer_stats
            if res.status == "done":
                st.record(res.nbytes, res.seconds)
            else:
                st.num_failures += 1
                if res.status == "recomputed":
                    st.num_recomputed += 1
                else:
                    st.num_failed_requests += 1
        self._loads[j] = self.instances[j].load()

    def _start_transfers(self) -> None:
        """Move parked requests while a decode instance can take them, by DistServe's pull rule
        (llmjax/cluster/migration.py, the policy the simulated cluster runs too), every decode
        instance able to pull now: the oldest first (by first-token time, across the prefill
        instances), an unpinned one to any decode instance that can take it (none overtakes an
        unpinned one that could not move), a pinned one (the Conductor) only to its decode
        instance, if that one is alive."""
        queue = ParkedQueue()
        decode = set(self._alive_with(("decode",)))
        for i in self._alive_with(("prefill",)):
            if self._loads[i].num_parked:
                try:
                    parked = self.instances[i].parked()
                except Exception as e:
                    self.kill(i, reason=f"instance {i} failed: {e!r}")
                    continue
                for m in parked:
                    rec = self._records.get(m.request_id)
                    if rec is not None:  # else aborted meanwhile
                        pin = self.core.pins.get(m.request_id)
                        pin = pin if pin in decode else None
                        queue.park(m.request_id, m.metrics.first_token_time or 0.0, i, m, pin)
        failed: list[tuple[int, Exception]] = []

        def accept_time(j: int, p) -> float | None:  # now, if j can take it
            try:
                return (
                    0.0
                    if self.instances[j].can_accept(p.request, self.waiting_page_fraction)
                    else None
                )
            except Exception as e:
                failed.append((j, e))
                return None

        while True:
            decode = self._alive_with(("decode",))
            if not decode:
                return
            pull = queue.next_pull(decode, accept_time)
            if failed:  # decode instances that died answering: drop them, decide again
                for j, e in failed:
                    self.kill(j, reason=f"instance {j} failed: {e!r}")
                    queue.unpin(j)
                failed.clear()
                continue
            if pull is None:
                return
            p = queue.take(pull)
            rec = self._records.get(p.request_id)
            if rec is None or not self.alive[p.instance]:  # aborted, or its instance died
                continue
            j = p.pin
            if j is None:
                views = [LoadView(k, self, c) for k, c in enumerate(pull.candidates)]
                j = pull.candidates[choose(self.decode_router, rec.route, views, self.clock.now())]
            self._move(p.instance, j, p.request, rec)

    def _move(self, i: int, j: int, m, rec: Record) -> None:
        """Start moving parked request `m` from prefill instance i to decode instance j."""
        try:
            m, offer = self.instances[i].offer(m.request_id)
        except Exception as e:
            self.kill(i, reason=f"instance {i} failed to offer KV: {e!r}")
            return
        self._outstanding[i] -= 1
        self._outstanding[j] += 1
        rec.instance, rec.source = j, i
        try:
            self.instances[j].begin_import(
                m, offer, self.transfer_timeout_s, self.on_transfer_failure
            )
            self._loads[j] = self.instances[j].load()
        except Exception as e:  # recovers the request from its source's KV-less state
            self.kill(j, reason=f"instance {j} failed: {e!r}")
            return
        self._poll_instance(j)

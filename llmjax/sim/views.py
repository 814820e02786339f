"""What a router sees of a simulated instance (`InstanceView`: the `InstanceLoad` and the
Conductor's `ConductorLoad` of llmjax/cluster/), and the cluster's record of each instance
(`InstanceState`: the requests routed there and not finished, its finishes a routing may still
count, its prefix fetches in flight). llmjax/sim/cluster.py's `SimCluster` keeps them.

The rule (as of the arrival time `now`): every instance's last step started at or before now but
may end after it (its clock > now). That step's effects are not yet visible at now, and for the
request counts the view undoes them: a request counts as outstanding on its instance from its
routing until routings at times >= its `metrics.finished_time` (not from when the cluster
simulated the step that finishes it), so the requests that the step in progress will finish
still count, as running. On a prefill instance a request counts until it is pulled (as running
until its first-token time, then as parked); on a decode instance from its pull (as running, also
while its KV is in transfer) until its finish. An abort takes effect at once. The page and
prefix-cache views (`num_free_pages`, `num_available_pages`, `cached_prefix_tokens`) read the
block manager as it is, i.e. with the in-progress step's frees and cache inserts already made: at
most one step ahead (the engine has no hook to read its state between schedule and update). So
do the Conductor's `queued_prefills` and `decode_requests`.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence


class InstanceView:
    """Instance `index` as a router sees it at time `now` (the rule in the module doc). `index`
    is its position in the list the router is given (the instance's own index by default)."""

    def __init__(self, instance: InstanceState, now: float, index: int | None = None):
        self._instance = instance
        self.index = instance.index if index is None else index
        self.now = now

    @property
    def _engine(self):
        return self._instance.engine

    @property
    def role(self) -> str:
        return self._engine.role

    @property
    def num_outstanding(self) -> int:
        """Requests routed (or pulled) here and not finished by `now` (finished_time <= now)
        nor pulled away; an aborted one stops counting at once."""
        return len(self._instance.live) + self._finishing

    @property
    def _finishing(self) -> int:
        """Requests whose finish (by the step in progress at `now`) lies after `now`."""
        return sum(t > self.now for t in self._instance.finished_at)

    def _parked(self) -> list[float]:
        """First-token times of the requests parked here and not pulled yet."""
        live = self._instance.live
        return [r.metrics.first_token_time for rid, r in self._engine.parked.items() if rid in live]

    @property
    def num_waiting(self) -> int:
        """Requests queued here, not admitted (or preempted back into the queue)."""
        return len(self._engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted here (holding KV pages) as of `now`, including those the step in
        progress finishes (or parks) after `now` and, on a decode instance, those whose KV is
        in transfer to it."""
        late_parked = sum(t > self.now for t in self._parked())
        receiving = len(getattr(self._engine, "_receiving", ()))
        return len(self._engine.scheduler.running) + self._finishing + late_parked + receiving

    @property
    def num_parked(self) -> int:
        """Prefill instance: requests past their first token by `now`, waiting for a decode
        instance to pull them (their KV pages held here)."""
        return sum(t <= self.now for t in self._parked())

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

    def cached_prefix_tokens(
        self, prompt_token_ids: Sequence[int], namespace: bytes | None = None
    ) -> int:
        """Prompt tokens whose KV this instance's prefix cache holds now under `namespace` (a
        LoRA adapter's; None: the base model's): what admission would reuse, whole pages of all
        but the last token; reads the radix tree without touching its LRU order
        (`BlockManager.peek_prefix`)."""
        ids = list(prompt_token_ids)[:-1]
        return self._engine.block_manager.peek_prefix(ids, namespace).num_tokens

    # ---- what the Conductor reads (llmjax.cluster.conductor.ConductorLoad) --------------------

    @property
    def instance_id(self) -> int:
        """The instance's index in the cluster."""
        return self._instance.index

    def queued_prefills(self) -> list[tuple[str, int, int]]:
        """(id, tokens to prefill, tokens computed) of the requests here not past their
        prefill (waiting, mid-prefill, or fetching a prefix for this instance)."""
        sched = self._engine.scheduler
        out = [(rid, n, 0) for rid, n in self._instance.fetching.items()]
        for r in (*sched.running, *sched.waiting):
            if not r.output_token_ids or r.num_uncomputed_tokens > 1:
                out.append((r.request_id, r.num_tokens, r.num_computed_tokens))
        return out

    def decode_requests(self) -> list[tuple[str, int, int]]:
        """(id, context tokens, output tokens) of the requests decoding here, waiting after a
        preemption, or whose KV is in transfer to here."""
        sched = self._engine.scheduler
        receiving = [r for r, _ in getattr(self._engine, "_receiving", {}).values()]
        return [
            (r.request_id, r.num_tokens, len(r.output_token_ids))
            for r in (*sched.running, *sched.waiting, *receiving)
            if r.output_token_ids
        ]

    @property
    def kv_capacity_tokens(self) -> int:
        bm = self._engine.block_manager
        return bm.num_usable_pages * bm.page_size

    @property
    def max_num_seqs(self) -> int:
        return self._engine.config.scheduler.max_num_seqs

    def __repr__(self) -> str:
        return (
            f"InstanceView(index={self.index}, now={self.now}, "
            f"outstanding={self.num_outstanding}, free_at={self.free_at})"
        )


@dataclasses.dataclass
class InstanceState:
    index: int
    engine: object  # a simulated LLMEngine
    live: set[str] = dataclasses.field(default_factory=set)  # routed here, not finished/aborted
    # finished_time of finished requests that a routing may still see as outstanding (> the last
    # routing time), in finishing order (the engine's clock never goes back)
    finished_at: deque[float] = dataclasses.field(default_factory=deque)
    # requests fetching a prefix for this instance (the Conductor): id -> prompt tokens
    fetching: dict[str, int] = dataclasses.field(default_factory=dict)

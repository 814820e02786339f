"""What a `ProgramExecutor` runs tasks on: one engine (real or simulated), or a cluster of
engines (simulated, or real: local instances or Ray actors) whose entry instances the program
scheduler places tasks on.

A target has `num_instances` slots, a `clock`, and: `add(instance, ids, params, request_id,
arrival_time, hints)`, `step()`, `abort(request_id)`, `has_unfinished()`, `cached_prefix(i, ids)`
(tokens of `ids` instance i's prefix cache holds), `capacity(i)` (max_num_seqs, KV tokens),
`wait_until(t)` (nothing to run before t: sleep on a wall clock, jump on a virtual one),
`virtual` and `engine_decodes` (the engine cuts text at stop strings itself).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from llmjax.engine.clock import VirtualClock


class EngineTarget:
    """One `LLMEngine` (the engine of an `LLM`, real or simulated)."""

    num_instances = 1

    def __init__(self, engine):
        self.engine = engine
        self.clock = engine.clock
        self.virtual = isinstance(engine.clock, VirtualClock)
        self.tokenizer = engine.tokenizer
        self.engine_decodes = engine.tokenizer is not None

    def add(self, instance, ids, params, request_id, arrival_time, hints) -> None:
        self.engine.add_request(ids, params, request_id, arrival_time=arrival_time, hints=hints)

    def step(self) -> list:
        return self.engine.step()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def cached_prefix(self, instance: int, ids: Sequence[int]) -> int:
        bm = self.engine.block_manager
        return bm.peek_prefix(list(ids[:-1])).num_tokens if bm.caching else 0

    def capacity(self, instance: int) -> tuple[int, int]:
        bm = self.engine.block_manager
        return self.engine.config.scheduler.max_num_seqs, bm.num_usable_pages * bm.page_size

    def page_size(self) -> int:
        return self.engine.block_manager.page_size

    def wait_until(self, t: float) -> None:
        if self.virtual:
            self.clock.advance_to(t)
        else:
            time.sleep(max(0.0, t - self.clock.now()))


class _Instances:
    """What the two cluster targets share: requests go through the cluster's own calls, to the
    entry instance named (`add_request(instance=...)`) or, with none, where its router says."""

    cluster = None

    def add(self, instance, ids, params, request_id, arrival_time, hints) -> None:
        self.cluster.add_request(
            ids, params, request_id, arrival_time=arrival_time, hints=hints, instance=instance
        )

    def step(self) -> list:
        return self.cluster.step()

    def abort(self, request_id: str) -> bool:
        return self.cluster.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.cluster.has_unfinished_requests()


class SimClusterTarget(_Instances):
    """A `llmjax.sim.SimCluster`: tasks go to the entry instance the program scheduler names
    (`add_request(instance=...)`), or, in request mode (no placement), where its router says."""

    virtual = True

    def __init__(self, cluster):
        self.cluster = cluster
        self.clock = cluster.clock
        self._entry = list(cluster._entry)
        self.num_instances = len(self._entry)
        first = cluster.instances[self._entry[0]]
        self.tokenizer = first.tokenizer
        self.engine_decodes = first.tokenizer is not None

    def _engine(self, instance: int):
        return self.cluster.instances[self._entry[instance]]

    def cached_prefix(self, instance: int, ids: Sequence[int]) -> int:
        bm = self._engine(instance).block_manager
        return bm.peek_prefix(list(ids[:-1])).num_tokens if bm.caching else 0

    def capacity(self, instance: int) -> tuple[int, int]:
        e = self._engine(instance)
        bm = e.block_manager
        return e.config.scheduler.max_num_seqs, bm.num_usable_pages * bm.page_size

    def page_size(self) -> int:
        return self._engine(0).block_manager.page_size

    def wait_until(self, t: float) -> None:
        self.clock.advance_to(t)


class ClusterTarget(_Instances):
    """A real `llmjax.cluster.Cluster` (local instances or Ray actors): tasks go to the entry
    instance the program scheduler names (`add_request(instance=...)`; a dead one's requests
    are recomputed elsewhere, hints kept), or where the router says in request mode."""

    virtual = False

    def __init__(self, cluster):
        self.cluster = cluster
        self.clock = cluster.clock
        self._entry = cluster.entry_instances
        self.num_instances = len(self._entry)
        self.tokenizer = cluster.tokenizer
        self.engine_decodes = cluster.instances[self._entry[0]].tokenizer is not None

    def cached_prefix(self, instance: int, ids: Sequence[int]) -> int:
        i = self._entry[instance]
        if not self.cluster.alive[i]:
            return 0
        try:
            return self.cluster.instances[i].cached_prefix_tokens(list(ids[:-1]))
        except Exception:  # a dead instance holds nothing
            return 0

    def capacity(self, instance: int) -> tuple[int, int]:
        i = self._entry[instance]
        load = self.cluster._loads[i]
        return self.cluster.instances[i].config.scheduler.max_num_seqs, load.kv_capacity_tokens

    def page_size(self) -> int:
        return self.cluster.config.cache.page_size

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.clock.now()))


def make_target(target):
    """An LLM, an LLMEngine, a SimCluster or a Cluster as a target (an object with `add`
    passes)."""
    if hasattr(target, "add") and hasattr(target, "num_instances"):
        return target
    if hasattr(target, "engine") and hasattr(target.engine, "scheduler"):  # an LLM
        return EngineTarget(target.engine)
    if hasattr(target, "scheduler") and hasattr(target, "block_manager"):  # an LLMEngine
        return EngineTarget(target)
    if hasattr(target, "views") and hasattr(target, "_entry"):  # llmjax.sim.SimCluster
        return SimClusterTarget(target)
    if hasattr(target, "entry_instances") and hasattr(target, "serving_view"):  # Cluster
        return ClusterTarget(target)
    raise TypeError(
        f"cannot run programs on {type(target).__name__}: give an LLM, an LLMEngine, a "
        "llmjax.sim.SimCluster or a llmjax.cluster.Cluster"
    )

"""InfiniGen's bounded KV pool (ALGORITHMS.md §11.4, §13.2), at page granularity.

Each running request's full KV cache lives in the paged pool (host memory in sparse-KV mode), in
the pages of its `BlockManager` table. InfiniGen bounds a request's pool to `capacity`, a fraction
of its tokens (1.0 = unlimited; its eviction study uses 0.8): while the request holds more, it
evicts, choosing among the OLDER HALF of its tokens (so that just-added ones stay) by policy:

    counter  fewest times selected (fetched) so far: InfiniGen's proposal, the default
    lru      least recently selected (never selected = oldest)
    fifo     first inserted

A paged pool can only free whole pages, so `PoolEvictor` keeps these statistics per page index of
a request's table and evicts whole pages: `BlockManager.evict_page` frees the page and leaves a
hole (RESERVED_PAGE) in the table, whose positions the attention masks. Never evicted: the pages
shared with the radix prefix cache (the table's shared head: other requests read them), page index
0 (it holds the attention-sink token), the newer half and the last page. Ties go to the lowest
index. Plain Python and numpy, no jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from llmjax.config import EVICTION_POLICIES  # the one list; SparseKVConfig checks it too
from llmjax.engine.block_manager import pages_needed
from llmjax.model.step_input import RESERVED_PAGE

if TYPE_CHECKING:
    from llmjax.engine.block_manager import BlockManager


@dataclasses.dataclass
class _PageStats:
    """One request's statistics, indexed by page index of its table."""

    fetch_count: np.ndarray  # int64: selections summed over layers, heads and steps
    last_fetch: np.ndarray  # int64: step of the last selection, -1 if never selected
    inserted: np.ndarray  # int64: step at which the page index entered the table
    evicted: set[int] = dataclasses.field(default_factory=set)

    @property
    def num_pages(self) -> int:
        return len(self.inserted)


def _empty_stats() -> _PageStats:
    return _PageStats(*(np.zeros(0, np.int64) for _ in range(3)))


class PoolEvictor:
    """Host-side eviction bookkeeping for every running request's KV pool (see the module doc).

    The engine calls, for each running request after each step: `record_step` (new pages and this
    step's selections), then `evict`; and `forget` when the request finishes, is aborted or
    preempted (a preempted request recomputes from scratch, so its statistics start over).
    """

    def __init__(self, policy: str, capacity: float, page_size: int, min_pages: int = 2):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction {policy=} is not one of {EVICTION_POLICIES}")
        if not isinstance(capacity, (int, float)) or not 0 < capacity <= 1:
            raise ValueError(f"{capacity=} must be in (0, 1] (a fraction of each request's tokens)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        if min_pages < 1:
            raise ValueError(f"{min_pages=} must be >= 1")
        self.policy = policy
        self.capacity = float(capacity)
        self.page_size = page_size
        self.min_pages = min_pages
        self.num_evictions = 0  # pages evicted since creation, all requests together
        self._stats: dict[str, _PageStats] = {}

    def record_step(
        self,
        request_id: str,
        num_table_pages: int,
        page_hits: np.ndarray | None,
        step: int,
    ) -> None:
        """Register the page indices of `request_id`'s table up to `num_table_pages` (new ones
        get `inserted = step`), then add `page_hits` to the counters: an int array of at least
        `num_table_pages` entries, how many times each page index was selected this step (summed
        over layers and heads); None when the step made no sparse selection (a prefill). Page
        indices with hits > 0 get `last_fetch = step`."""
        stats = self._stats.setdefault(request_id, _empty_stats())
        new = num_table_pages - stats.num_pages
        if new > 0:
            stats.fetch_count = np.concatenate([stats.fetch_count, np.zeros(new, np.int64)])
            stats.last_fetch = np.concatenate([stats.last_fetch, np.full(new, -1, np.int64)])
            stats.inserted = np.concatenate([stats.inserted, np.full(new, step, np.int64)])
        if page_hits is None:
            return
        hits = np.asarray(page_hits)
        if hits.ndim != 1 or len(hits) < num_table_pages:
            raise ValueError(
                f"page_hits of shape {hits.shape} must be 1-D with >= {num_table_pages=} entries"
            )
        hits = hits[:num_table_pages].astype(np.int64)
        if (hits < 0).any():
            raise ValueError(f"page_hits must be >= 0, got {hits.min()}")
        stats.fetch_count[:num_table_pages] += hits
        stats.last_fetch[:num_table_pages][hits > 0] = step

    def candidates(self, request_id: str, num_table_pages: int, num_shared: int) -> list[int]:
        """The evictable page indices of `request_id`, ascending: in the older half
        (`i < num_table_pages // 2`), not shared with the prefix cache (`i >= num_shared`), not
        index 0 (the attention sink), not already evicted, never the last page. Raises ValueError
        if `record_step` has not registered `num_table_pages` pages."""
        stats = self._stats.get(request_id)
        have = stats.num_pages if stats else 0
        if have < num_table_pages:
            raise ValueError(
                f"{request_id=}: {num_table_pages=} but record_step registered {have} pages"
            )
        start = max(1, num_shared)
        end = min(num_table_pages // 2, num_table_pages - 1)
        return [i for i in range(start, end) if i not in stats.evicted]

    def choose(self, request_id: str, candidates: list[int]) -> int:
        """The candidate page index the policy evicts: counter = fewest selections, lru = the
        oldest last selection, fifo = the oldest insertion; ties go to the lowest index."""
        if not candidates:
            raise ValueError(f"{request_id=}: no candidate to choose from")
        stats = self._stats[request_id]
        key = {"counter": stats.fetch_count, "lru": stats.last_fetch, "fifo": stats.inserted}[
            self.policy
        ]
        return min(candidates, key=lambda i: (int(key[i]), i))

    def pages_to_keep(self, num_tokens: int) -> int:
        """The most pages a request of `num_tokens` tokens keeps resident:
        `max(min_pages, ceil(capacity * pages_needed(num_tokens)))` (the product rounded to 9
        decimals first, so that 0.28 * 25 pages keeps 7, not 8)."""
        needed = pages_needed(num_tokens, self.page_size)
        return max(self.min_pages, math.ceil(round(self.capacity * needed, 9)))

    def evict(self, block_manager: BlockManager, request_id: str, num_tokens: int) -> list[int]:
        """While `request_id` has more resident (non-hole) pages than `pages_to_keep(num_tokens)`
        and a candidate is left, evict the policy's choice with `block_manager.evict_page`.
        Returns the evicted page indices, in eviction order; never evicts with capacity 1.0."""
        if self.capacity >= 1.0:
            return []
        table = block_manager.page_tables[request_id]
        keep = self.pages_to_keep(num_tokens)
        resident = block_manager.num_resident_pages(request_id)
        if resident <= keep:
            return []
        stats = self._stats.get(request_id)
        cands = self.candidates(request_id, len(table), block_manager.num_shared_pages(request_id))
        cands = [i for i in cands if table[i] != RESERVED_PAGE]  # (holes the evictor did not make)
        evicted: list[int] = []
        while resident > keep and cands:
            index = self.choose(request_id, cands)
            block_manager.evict_page(request_id, index)
            stats.evicted.add(index)
            cands.remove(index)
            evicted.append(index)
            resident -= 1
        self.num_evictions += len(evicted)
        return evicted

    def forget(self, request_id: str) -> None:
        """Drop `request_id`'s statistics (it finished, was aborted or preempted)."""
        self._stats.pop(request_id, None)

    def evicted(self, request_id: str) -> set[int]:
        """The page indices evicted from `request_id` since it was (re)admitted (a copy)."""
        stats = self._stats.get(request_id)
        return set(stats.evicted) if stats else set()

"""InfiniGen's bounded host KV pool at page granularity (llmjax/sparse/host_pool.py) and the holes
it leaves in `BlockManager` page tables (ALGORITHMS.md §11.4, §13.2).

Unit tests: each policy's choice on a hand-worked example; the candidates (older half, not shared,
not index 0, not the last page, not a hole); capacity 1.0 never evicts; argument errors;
`evict_page` errors; a request with holes frees cleanly and offers the prefix cache only the pages
before its first hole.

Property test: a hypothesis state machine drives a real `BlockManager` + `RadixCache` (requests
sharing prompt prefixes) and a `PoolEvictor` with a drawn policy, capacity and `min_pages`
through arrivals, decode growth with random page selections followed by eviction, cache_computed,
re-matching the prefix, finishes, aborts and preemptions. After every step: the block manager's
invariants; each running request's table equals a model of it (pages change only by eviction to a
hole or by swapping in the cache's copy of a shared-head page); no hole in a shared head; resident
pages within the budget unless the rest cannot be evicted; and every eviction equals a brute-force
choice from counters the test keeps itself. At the end, everything freed: no page held.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmjax.engine.block_manager import BlockManager, pages_needed
from llmjax.engine.radix_cache import RadixCache
from llmjax.model.step_input import RESERVED_PAGE
from llmjax.sparse.host_pool import EVICTION_POLICIES, PoolEvictor

HOLE = RESERVED_PAGE

# ---- unit tests ----------------------------------------------------------------------------------

# Hand-worked example: page_size 2, 10 pages (20 tokens), registered at step 0. Selections:
#   index:        0  1  2  3  4   5..9
#   fetch_count:  9  5  4  1  2   0       counter -> 3 (fewest among 1..4)
#   last_fetch:   9  9  1  8  7   -1      lru     -> 2 (oldest last selection among 1..4)
#   inserted:     0  0  0  0  0   0       fifo    -> 1 (all tied: the lowest index)
# Index 0 (the sink) and the newer half 5..9 would win every policy if they were candidates.
HITS = {1: {3: 2, 9: 3}, 2: {1: 4}, 3: {8: 1}, 4: {7: 2}, 0: {9: 9}}  # index -> {step: hits}
EXPECTED_CHOICE = {"counter": 3, "lru": 2, "fifo": 1}
EXPECTED_ORDER = {"counter": [3, 4, 2, 1], "lru": [2, 4, 3, 1], "fifo": [1, 2, 3, 4]}


def _example(policy, capacity=0.9, caching=False):
    bm = BlockManager(16, 2, RadixCache(2) if caching else None)
    ev = PoolEvictor(policy, capacity, page_size=2)
    bm.allocate("r", 20)
    ev.record_step("r", 10, None, step=0)
    for step in range(1, 10):
        hits = np.zeros(12, np.int64)  # longer than the table: allowed
        for index, by_step in HITS.items():
            hits[index] = by_step.get(step, 0)
        ev.record_step("r", 10, hits, step)
    return bm, ev


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_each_policy_evicts_the_hand_worked_choice(policy):
    bm, ev = _example(policy)
    assert ev.candidates("r", 10, 0) == [1, 2, 3, 4]
    assert ev.choose("r", [1, 2, 3, 4]) == EXPECTED_CHOICE[policy]
    table = list(bm.page_tables["r"])
    assert ev.pages_to_keep(20) == 9
    assert ev.evict(bm, "r", 20) == [EXPECTED_CHOICE[policy]]  # 10 resident > 9: one page
    i = EXPECTED_CHOICE[policy]
    assert bm.page_tables["r"] == [*table[:i], HOLE, *table[i + 1 :]]
    assert bm.num_resident_pages("r") == 9 and bm.num_free_pages == 15 - 9
    assert ev.evicted("r") == {i} and ev.num_evictions == 1
    assert ev.evict(bm, "r", 20) == []  # within budget now
    bm.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_eviction_stops_when_no_candidate_is_left(policy):
    bm, ev = _example(policy, capacity=0.3)  # keeps 3 of 10 pages, but only 4 are evictable
    assert ev.evict(bm, "r", 20) == EXPECTED_ORDER[policy]
    assert bm.num_resident_pages("r") == 6
    assert ev.candidates("r", 10, 0) == []
    assert ev.evict(bm, "r", 20) == []
    bm.check_invariants()


def test_ties_go_to_the_lowest_index():
    for policy in EVICTION_POLICIES:
        ev = PoolEvictor(policy, 0.5, page_size=4)
        ev.record_step("r", 8, None, step=5)
        assert ev.choose("r", [3, 2, 1]) == 1
        ev.record_step("r", 8, np.array([0, 1, 0, 1, 0, 0, 0, 0]), step=6)
        assert ev.choose("r", [3, 2, 1]) == (2 if policy in ("counter", "lru") else 1)


def test_candidates_exclude_shared_sink_newer_half_last_page_and_holes():
    ev = PoolEvictor("counter", 0.5, page_size=2)
    ev.record_step("r", 10, None, step=0)
    assert ev.candidates("r", 10, 0) == [1, 2, 3, 4]  # not 0, not 5..9
    assert ev.candidates("r", 10, 3) == [3, 4]  # not the shared head
    assert ev.candidates("r", 10, 7) == []
    assert ev.candidates("r", 9, 0) == [1, 2, 3]  # older half of 9 pages: 0..3
    for n in (1, 2, 3):
        assert ev.candidates("r", n, 0) == []  # the last page and index 0
    assert ev.candidates("r", 4, 0) == [1]
    bm = BlockManager(32, 2)
    bm.allocate("r", 20)
    assert ev.evict(bm, "r", 20) == [1, 2, 3, 4]
    assert ev.candidates("r", 10, 0) == []  # holes
    # A hole the evictor did not make is skipped as well.
    bm.allocate("s", 20)
    ev.record_step("s", 10, None, step=0)
    bm.evict_page("s", 1)
    assert ev.evict(bm, "s", 20) == [2, 3, 4]
    with pytest.raises(ValueError, match="registered 0 pages"):
        ev.candidates("unknown", 2, 0)
    with pytest.raises(ValueError, match="registered 10 pages"):
        ev.candidates("r", 11, 0)


def test_pages_to_keep():
    ev = PoolEvictor("counter", 0.7, page_size=4)
    assert ev.pages_to_keep(40) == 7  # 10 pages
    assert ev.pages_to_keep(41) == 8  # ceil(7.7)
    assert PoolEvictor("fifo", 0.28, 2).pages_to_keep(50) == 7  # 0.28 * 25 = 7.000000000000001
    assert ev.pages_to_keep(1) == 2  # min_pages
    assert PoolEvictor("lru", 0.1, 4, min_pages=1).pages_to_keep(4) == 1
    assert PoolEvictor("lru", 1.0, 4).pages_to_keep(400) == 100


def test_capacity_one_never_evicts():
    for policy in EVICTION_POLICIES:
        bm, ev = _example(policy, capacity=1.0)
        assert ev.evict(bm, "r", 2) == []  # even when told of fewer tokens than it holds
        assert bm.num_resident_pages("r") == 10 and ev.num_evictions == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(policy="random"), "policy='random'"),
        (dict(policy="LRU"), "policy='LRU'"),
        (dict(capacity=0.0), "capacity=0.0"),
        (dict(capacity=-0.5), "capacity=-0.5"),
        (dict(capacity=1.5), "capacity=1.5"),
        (dict(capacity=float("nan")), "capacity=nan"),
        (dict(capacity="0.8"), "capacity='0.8'"),
        (dict(min_pages=0), "min_pages=0"),
        (dict(page_size=0), "page_size=0"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    args = dict(policy="counter", capacity=0.8, page_size=4) | kwargs
    with pytest.raises(ValueError, match=match):
        PoolEvictor(**args)


def test_bad_page_hits_are_errors():
    ev = PoolEvictor("counter", 0.8, page_size=4)
    with pytest.raises(ValueError, match="num_table_pages=3"):
        ev.record_step("r", 3, np.zeros(2, np.int64), step=0)
    with pytest.raises(ValueError, match=">= 0"):
        ev.record_step("r", 3, np.array([0, -1, 0]), step=0)
    with pytest.raises(ValueError, match="no candidate"):
        ev.choose("r", [])


def test_forget_resets_the_statistics():
    bm, ev = _example("counter", capacity=0.5)
    ev.evict(bm, "r", 20)
    assert ev.evicted("r")
    bm.free("r")
    ev.forget("r")
    assert ev.evicted("r") == set()
    with pytest.raises(ValueError, match="registered 0 pages"):
        ev.candidates("r", 10, 0)
    ev.forget("never-seen")  # no error


def test_evict_page_errors():
    bm = BlockManager(16, 2, RadixCache(2))
    tokens = list(range(12))
    bm.allocate("a", 12)
    bm.free("a", tokens)  # caches 6 pages
    assert bm.match_prefix("r", tokens[:5]) == 4
    bm.allocate("r", 12)  # 2 shared pages + 4 private
    with pytest.raises(ValueError, match="unknown request_id='x'"):
        bm.evict_page("x", 0)
    for index in (-1, 6):
        with pytest.raises(ValueError, match="out of range"):
            bm.evict_page("r", index)
    with pytest.raises(ValueError, match="shared head"):
        bm.evict_page("r", 1)
    page = bm.page_tables["r"][3]
    assert bm.evict_page("r", 3) == page
    with pytest.raises(ValueError, match="already a hole"):
        bm.evict_page("r", 3)
    bm.check_invariants()


def test_a_request_with_holes_frees_cleanly_and_caches_only_before_its_first_hole():
    ps, tokens = 2, list(range(100, 120))  # 10 pages
    for computed in (False, True):
        bm = BlockManager(16, ps, RadixCache(ps))
        bm.allocate("r", 20)
        bm.evict_page("r", 3)
        bm.evict_page("r", 6)
        assert bm.num_resident_pages("r") == 8 and bm.num_free_pages == 15 - 8
        bm.check_invariants()
        if computed:
            bm.cache_computed("r", tokens)  # offers pages 0..2 only
            assert bm.num_shared_pages("r") == 3 == bm.num_offered_pages("r")
            assert bm.prefix_cache.num_cached_pages == 3
            bm.cache_computed("r", tokens)  # nothing more to offer
            bm.check_invariants()
        bm.free("r", tokens if computed else ())
        bm.check_invariants()
        assert RESERVED_PAGE not in bm._free
        assert bm.num_free_pages + bm.prefix_cache.num_cached_pages == bm.num_usable_pages
        assert bm.prefix_cache.peek(tokens).num_pages == (3 if computed else 0)
        assert bm.prefix_cache.num_locked_pages == 0


def test_a_hole_at_index_zero_offers_nothing():
    bm = BlockManager(8, 2, RadixCache(2))
    bm.allocate("r", 6)
    bm.evict_page("r", 0)  # (the evictor never does this; the block manager allows it)
    bm.free("r", list(range(6)))
    assert bm.prefix_cache.num_cached_pages == 0 and bm.num_free_pages == 7
    bm.check_invariants()


def test_matching_a_cached_prefix_fills_a_hole():
    ps, tokens = 2, list(range(8))
    bm = BlockManager(16, ps, RadixCache(ps))
    bm.allocate("a", 8)
    bm.free("a", tokens)  # caches 4 pages
    bm.allocate("r", 8)  # the same tokens computed privately
    bm.evict_page("r", 1)
    assert bm.match_prefix("r", tokens[:7]) == 6  # the cache's copies replace pages 0..2
    assert bm.page_tables["r"][:3] == bm.prefix_cache.match(tokens[:6]).pages
    assert bm.num_resident_pages("r") == 4
    bm.check_invariants()
    bm.free("r")
    assert bm.num_free_pages + bm.prefix_cache.num_cached_pages == bm.num_usable_pages
    bm.check_invariants()


# ---- property test: a state machine with a real block manager and radix cache -------------------

MAX_PAGES_PER_REQUEST = 12


class HostPoolMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(8, 48),
        policy=st.sampled_from(EVICTION_POLICIES),
        capacity=st.sampled_from([0.2, 0.5, 0.7, 0.8, 1.0]),
        min_pages=st.integers(1, 3),
    )
    def setup(self, page_size, num_pages, policy, capacity, min_pages):
        self.ps, self.policy, self.min_pages = page_size, policy, min_pages
        self.capacity = Fraction(str(capacity))
        self.bm = BlockManager(num_pages, page_size, RadixCache(page_size))
        self.ev = PoolEvictor(policy, capacity, page_size, min_pages)
        self.step = 0
        self.ids = itertools.count()
        self.tokens: dict[str, list[int]] = {}  # running requests: tokens (all computed)
        self.tables: dict[str, list[int]] = {}  # running requests: model of the page table
        self.counts: dict[str, dict[str, list[int]]] = {}  # the test's own counters
        self.prompts: list[list[int]] = [[]]
        self.waiting: list[list[int]] = []  # preempted requests' tokens

    # ---- the test's own bookkeeping -----------------------------------------------------------

    def record(self, rid, hits):
        n = len(self.tables[rid])
        c = self.counts[rid]
        while len(c["inserted"]) < n:
            c["count"].append(0)
            c["last"].append(-1)
            c["inserted"].append(self.step)
        if hits is not None:
            hits = np.array(hits, np.int64)
            for i in range(n):
                if self.tables[rid][i] == HOLE:
                    hits[i] = 0  # an evicted page cannot be selected
                c["count"][i] += int(hits[i])
                if hits[i] > 0:
                    c["last"][i] = self.step
        self.ev.record_step(rid, n, hits, self.step)

    def evictable(self, rid) -> set[int]:
        table, shared = self.tables[rid], self.bm.num_shared_pages(rid)
        n = len(table)
        return {
            i for i in range(1, n - 1) if i >= shared and 2 * i < n - n % 2 and table[i] != HOLE
        }

    def keep(self, rid) -> int:
        needed = pages_needed(len(self.tokens[rid]), self.ps)
        return max(self.min_pages, math.ceil(self.capacity * needed))

    def expected_evictions(self, rid) -> list[int]:
        if self.capacity == 1:
            return []
        c = self.counts[rid]
        key = {"counter": c["count"], "lru": c["last"], "fifo": c["inserted"]}[self.policy]
        cands = self.evictable(rid)
        resident = sum(p != HOLE for p in self.tables[rid])
        out = []
        while resident > self.keep(rid) and cands:
            best = min(cands, key=lambda i: (key[i], i))
            cands.remove(best)
            out.append(best)
            resident -= 1
        return out

    def evict(self, rid):
        expected = self.expected_evictions(rid)
        shared = self.bm.num_shared_pages(rid)
        got = self.ev.evict(self.bm, rid, len(self.tokens[rid]))
        assert got == expected, (self.policy, got, expected)
        for i in got:
            assert i >= shared, "a shared page was evicted"
            self.tables[rid][i] = HOLE
        if got:
            event(f"evicted {len(got)} pages at once" if len(got) > 1 else "evicted a page")

    def sync_swaps(self, rid):
        """After match_prefix / cache_computed: only the shared head may change, to the cache's
        pages for those tokens."""
        before, after = self.tables[rid], self.bm.page_tables[rid]
        shared = self.bm.num_shared_pages(rid)
        assert len(after) == len(before)
        assert after[shared:] == before[shared:], "a private page changed"
        assert after[:shared] == self.bm.prefix_cache.match(self.tokens[rid]).pages[:shared]
        if any(b == HOLE for b in before[:shared]):
            event("a cached prefix filled a hole")
        self.tables[rid] = list(after)

    def running(self, data) -> str | None:
        """A running request, or None after admitting one instead when none runs (rules without
        preconditions: most would be disabled while nothing runs)."""
        if not self.tokens:
            self.arrive(data)
            return None
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def release(self, rid, computed):
        tokens, table = self.tokens.pop(rid), self.tables.pop(rid)
        del self.counts[rid]
        self.bm.free(rid, tokens if computed else ())
        self.ev.forget(rid)
        assert self.ev.evicted(rid) == set()
        if computed:  # the full pages before the first hole are cached
            first_hole = next((i for i, p in enumerate(table) if p == HOLE), len(table))
            expected = min(first_hole, len(tokens) // self.ps)
            assert self.bm.prefix_cache.peek(tokens).num_pages >= expected
            if HOLE in table:
                event("freed a request with holes, computed")
        return tokens

    # ---- rules -------------------------------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data):
        self.arrive(data)

    def arrive(self, data):
        if self.waiting and data.draw(st.booleans()):
            tokens = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        else:  # often a prefix of an earlier prompt plus a few new tokens: prefix sharing
            base = data.draw(st.sampled_from(self.prompts))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4 * self.ps))
            tokens = (base[:cut] + tail)[: MAX_PAGES_PER_REQUEST * self.ps]
        rid = f"r{next(self.ids)}"
        peek = self.bm.peek_prefix(tokens[:-1])
        if not self.bm.can_allocate(rid, len(tokens), prefix=peek):
            event("arrival deferred: out of pages")
            self.waiting.append(tokens)
            return
        assert self.bm.match_prefix(rid, tokens[:-1]) == peek.num_tokens
        self.tables[rid] = list(self.bm.allocate(rid, len(tokens)))
        self.tokens[rid], self.counts[rid] = tokens, {"count": [], "last": [], "inserted": []}
        self.prompts.append(tokens)
        self.step += 1
        self.record(rid, None)  # the prefill makes no sparse selection
        if data.draw(st.booleans()):
            self.bm.cache_computed(rid, tokens)
            self.sync_swaps(rid)
        self.evict(rid)

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def decode(self, data, num_steps):
        if (rid := self.running(data)) is None:
            return
        tokens = self.tokens[rid]
        for _ in range(num_steps):
            if len(tokens) >= MAX_PAGES_PER_REQUEST * self.ps:
                return
            if not self.bm.can_allocate(rid, len(tokens) + 1):
                event("decode skipped: out of pages")
                return
            table = self.bm.allocate(rid, len(tokens) + 1)
            before = self.tables[rid]
            assert table[: len(before)] == before, "allocate changed existing entries"
            assert HOLE not in table[len(before) :]
            self.tables[rid] = list(table)
            tokens.append(data.draw(st.integers(0, 2)))
            self.step += 1
            n = len(table)
            sparse = data.draw(st.integers(0, 3)) > 0  # mostly sparse selections
            hits = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n + 2))
            self.record(rid, hits if sparse else None)
            self.evict(rid)
            self.consistent()

    @rule(data=st.data())
    def cache_computed(self, data):
        if (rid := self.running(data)) is None:
            return
        self.bm.cache_computed(rid, self.tokens[rid])
        self.sync_swaps(rid)

    @rule(data=st.data())
    def rematch(self, data):  # what the scheduler does before each prefill chunk
        if (rid := self.running(data)) is not None and len(self.tokens[rid]) > 1:
            self.bm.match_prefix(rid, self.tokens[rid][:-1])
            self.sync_swaps(rid)
            self.evict(rid)  # (a filled hole can take the request over budget again)

    @rule(data=st.data(), computed=st.booleans())
    def finish_or_abort(self, data, computed):
        if (rid := self.running(data)) is not None:
            self.release(rid, computed)

    @rule(data=st.data(), computed=st.booleans())
    def preempt(self, data, computed):
        if (rid := self.running(data)) is not None:
            self.waiting.append(self.release(rid, computed))

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check_invariants()
        assert set(bm.page_tables) == set(self.tables)
        for rid, model in self.tables.items():
            table = bm.page_tables[rid]
            assert table == model, f"{rid}: {table} != model {model}"
            shared = bm.num_shared_pages(rid)
            assert HOLE not in table[:shared], "a shared page was evicted"
            resident = bm.num_resident_pages(rid)
            assert resident == sum(p != HOLE for p in model)
            unevictable = resident - len(self.evictable(rid))
            assert resident <= max(self.keep(rid), unevictable), "over budget"
            if self.capacity == 1:
                assert HOLE not in table
            holes = {i for i, p in enumerate(table) if p == HOLE}
            evicted = self.ev.evicted(rid)
            assert holes <= evicted and all(i < shared for i in evicted - holes)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for rid in sorted(self.tokens):
            self.release(rid, computed=True)
        bm = self.bm
        bm.check_invariants()
        assert not bm.page_tables
        assert bm.prefix_cache.num_locked_pages == 0
        assert bm.num_free_pages + bm.prefix_cache.num_cached_pages == bm.num_usable_pages
        assert RESERVED_PAGE not in bm._free


HostPoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: deterministic CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_host_pool_state_machine = HostPoolMachine.TestCase

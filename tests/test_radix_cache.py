"""Tests of the prefix caches (`llmjax/engine/radix_cache.py`): host-only, no jax.

Unit tests pin the behaviour of `RadixCache` (matching, splitting, duplicates, locks, LRU and
cascading eviction, reset) and of `NoPrefixCache`. A hypothesis state machine drives random
inserts (fresh pages, or matched pages followed by fresh ones as a chunked prefill does), matches,
locks, unlocks, evictions and resets against a brute-force model: a dict from every cached
page-aligned prefix to the page holding its last page. After every step the tree's contents equal
the model, `check_invariants()` holds, every page ever offered is in exactly one of {cache,
returned by insert, evicted/reset}, the lock counters equal the model's, and every locked prefix is
still cached.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmjax.engine.radix_cache import (
    PREFIX_CACHES,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    make_prefix_cache,
)


def contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """{page-aligned prefix: the page of its last page} for every page in the tree."""
    out, ps = {}, cache.page_size
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, page in enumerate(node.pages):
            out[prefix + node.token_ids[: (i + 1) * ps]] = page
        stack.extend((c, prefix + node.token_ids) for c in node.children.values())
    return out


def node_lock_refs(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """{the prefix a node ends: its lock_ref} for every node but the root."""
    out, stack = {}, [(c, ()) for c in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        out[prefix + node.token_ids] = node.lock_ref
        stack.extend((c, prefix + node.token_ids) for c in node.children.values())
    return out


def test_registry():
    assert PREFIX_CACHES["none"] is NoPrefixCache and PREFIX_CACHES["radix"] is RadixCache
    assert isinstance(make_prefix_cache("radix", 4), RadixCache)
    assert make_prefix_cache("none", 4).page_size == 4
    with pytest.raises(ValueError, match="not one of"):
        make_prefix_cache("lru", 4)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(0)
    assert issubclass(RadixCache, PrefixCache) and issubclass(NoPrefixCache, PrefixCache)


def test_no_prefix_cache_adopts_nothing():
    c = NoPrefixCache(2)
    assert c.match([1, 2, 3, 4]) == MatchResult(0, [], None)
    assert c.insert([1, 2, 3, 4, 5], [7, 8]) == [7, 8]
    assert c.match([1, 2, 3, 4]).num_tokens == 0
    c.lock(None)
    c.unlock(None)
    assert c.evict(10) == [] and c.reset() == []
    assert (c.num_cached_pages, c.num_locked_pages, c.num_evictable_pages) == (0, 0, 0)
    c.check_invariants()
    with pytest.raises(ValueError, match="partial last page"):
        c.insert([1, 2, 3, 4], [7])


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_empty_exact_and_partial(page_size):
    ps = page_size
    c = RadixCache(ps)
    m = c.match(list(range(3 * ps)))
    assert (m.num_tokens, m.pages, m.node) == (0, [], c.root)
    seq = list(range(1, 3 * ps + 1))
    assert c.insert(seq + [99] * (ps - 1), [10, 11, 12]) == []  # partial tail not inserted
    assert c.num_cached_pages == 3
    m = c.match(seq)
    assert (m.num_tokens, m.pages) == (3 * ps, [10, 11, 12])
    assert c.match([*seq, 5, 6, 7, 8]).pages == [10, 11, 12]  # longer query: the cached part
    # a mismatch inside the second page matches only the first page
    q = list(seq)
    q[ps + ps - 1] = -1
    m = c.match(q)
    assert (m.num_tokens, m.pages) == (ps, [10])
    c.check_invariants()
    # the partial match split the edge at the page boundary: the node ends at the match
    assert m.node.token_ids == tuple(seq[:ps]) and m.node.pages == [10]
    assert [ch.pages for ch in m.node.children.values()] == [[11, 12]]
    assert c.match(seq).pages == [10, 11, 12]  # splits change no contents
    # a partial page never matches
    assert c.match(seq[:-1]).pages == [10, 11, 12][: (3 * ps - 1) // ps]
    c.check_invariants()


def test_insert_splits_and_sibling_branches():
    c = RadixCache(2)
    assert c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == []
    assert c.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == [20, 21]  # shared prefix: duplicates
    assert c.insert([9, 9], [30]) == []
    c.check_invariants()
    assert contents(c) == {
        (1, 2): 10,
        (1, 2, 3, 4): 11,
        (1, 2, 3, 4, 5, 6): 12,
        (1, 2, 3, 4, 7, 8): 22,
        (9, 9): 30,
    }
    (top,) = [n for n in c.root.children.values() if n.token_ids == (1, 2, 3, 4)]
    assert sorted(ch.token_ids for ch in top.children.values()) == [(5, 6), (7, 8)]
    assert c.match([1, 2, 3, 4, 7, 8, 1]).pages == [10, 11, 22]
    assert c.match([1, 2, 3, 5]).pages == [10]  # mismatch in the second page
    assert c.match([2, 1]).pages == []  # no child with that first page
    assert c.num_cached_pages == 5


def test_reinsert_returns_duplicates_and_matched_pages_are_kept():
    c = RadixCache(2)
    c.insert([1, 2, 3, 4], [10, 11])
    assert c.insert([1, 2, 3, 4], [20, 21]) == [20, 21]
    assert c.insert([1, 2, 3, 4], [10, 11]) == []  # offering the cache's own pages back is fine
    assert c.num_cached_pages == 2
    with pytest.raises(ValueError, match="another prefix"):
        c.insert([1, 2, 5, 6], [11, 40])  # page 11 is the cache's, at another position
    with pytest.raises(ValueError, match="already owned"):
        c.insert([7, 7], [10])
    with pytest.raises(ValueError, match="reserved"):
        c.insert([7, 7], [0])
    with pytest.raises(ValueError, match="repeat"):
        c.insert([7, 7, 8, 8], [5, 5])
    c.check_invariants()
    assert contents(c) == {(1, 2): 10, (1, 2, 3, 4): 11}


def test_multi_turn_chat_extends_the_prefix():
    """The chunked-prefill / multi-turn pattern: match, compute the rest, insert matched + new
    pages, re-match, move the lock to the new node."""
    c = RadixCache(2)
    pages = itertools.count(100)
    turn1 = [1, 2, 3, 4, 5]
    c.insert(turn1, [next(pages), next(pages)])  # the unaligned tail (5) stays private
    turn2 = [*turn1, 6, 7, 8, 9, 10]
    m = c.match(turn2)
    assert m.num_tokens == 4 and m.pages == [100, 101]
    c.lock(m.node)
    table = m.pages + [next(pages) for _ in range(3)]  # pages for tokens 4..9 (5 ... 10)
    assert c.insert(turn2, table[:5]) == []  # all new or the cache's own
    m2 = c.match(turn2)
    c.lock(m2.node)
    c.unlock(m.node)
    assert m2.num_tokens == 10 and m2.pages == table[:5]
    assert c.num_locked_pages == 5 and c.num_evictable_pages == 0
    assert c.evict(100) == []
    c.unlock(m2.node)
    c.check_invariants()
    assert c.num_evictable_pages == 5


def test_lock_prevents_eviction_and_unlock_errors():
    c = RadixCache(1)
    c.insert([1, 2, 3], [10, 11, 12])
    c.insert([1, 2, 4], [20, 21, 22])
    m = c.match([1, 2, 3])
    c.lock(m.node)
    assert c.num_locked_pages == 3 and c.num_evictable_pages == 1
    assert c.evict(10) == [22]  # only the unlocked branch
    assert c.match([1, 2, 3]).pages == [10, 11, 12]
    with pytest.raises(RuntimeError, match="locked"):
        c.reset()
    c.unlock(m.node)
    with pytest.raises(ValueError, match="unlock without"):
        c.unlock(m.node)
    c.check_invariants()
    assert c.evict(1) == [12]  # a leaf at a time, cascading only as far as needed
    assert c.num_evictions == 2
    with pytest.raises(ValueError, match="not in this cache"):
        c.lock(m.node)  # the evicted node is detached
    with pytest.raises(TypeError):
        c.lock(None)
    c.lock(c.match([]).node)  # the root: a no-op
    c.unlock(c.root)


def test_locks_nest_and_survive_splits():
    c = RadixCache(2)
    c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    m = c.match([1, 2, 3, 4, 5, 6])
    c.lock(m.node)
    c.lock(m.node)
    c.match([1, 2, 3, 4, 0, 0])  # splits the locked edge above the locked node
    c.check_invariants()
    assert c.num_locked_pages == 3
    c.unlock(m.node)
    assert c.evict(5) == [] and c.num_locked_pages == 3
    c.unlock(m.node)
    assert c.num_locked_pages == 0
    assert sorted(c.evict(5)) == [10, 11, 12]
    c.check_invariants()


def test_lru_order_and_cascade():
    c = RadixCache(1)
    c.insert([1, 1], [10, 11])
    c.insert([2, 2], [20, 21])
    c.insert([3, 3], [30, 31])
    c.match([1, 1])  # touch: now (2 2) is the least recently used
    assert c.evict(1) == [20, 21]  # a whole node goes: at least num_pages
    assert c.evict(1) == [30, 31]
    assert c.num_evictions == 4
    # cascade: a parent that becomes an unlocked leaf is evicted in the same call
    c = RadixCache(1)
    c.insert([1, 2, 3], [10, 11, 12])
    c.insert([1, 2, 4], [20, 21, 22])  # splits: (1 2) -> {(3), (4)}
    c.insert([5], [50])
    c.match([5])  # (5) is the most recent
    assert c.evict(3) == [12, 22, 10, 11]
    assert contents(c) == {(5,): 50}
    c.check_invariants()
    assert c.evict(0) == [] and c.evict(100) == [50] and c.evict(100) == []
    assert c.num_cached_pages == 0 and c.num_evictions == 5


def test_reset():
    c = RadixCache(2)
    c.insert([1, 2, 3, 4], [10, 11])
    c.insert([1, 2, 5, 6], [20, 21])
    old = c.match([1, 2, 5, 6]).node
    assert sorted(c.reset()) == [10, 11, 21]
    assert c.num_cached_pages == 0 and c.match([1, 2]).num_tokens == 0
    assert c.num_evictions == 0
    with pytest.raises(ValueError, match="not in this cache"):
        c.lock(old)
    c.insert([1, 2], [10])  # the pages are the caller's again
    c.check_invariants()


# ---- property test: a state machine against a brute-force model --------------------------------

ALPHABET = st.integers(0, 2)  # small, so that prefixes collide


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.ps = page_size
        self.cache = RadixCache(page_size)
        self.ref: dict[tuple[int, ...], int] = {}  # cached page-aligned prefix -> its last page
        self.fresh = itertools.count(1)  # page 0 is reserved
        self.given: set[int] = set()
        self.returned: set[int] = set()  # not adopted by insert
        self.freed: set[int] = set()  # evicted or reset
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (node, locked prefix)
        self.seqs: list[list[int]] = [[]]

    def draw_seq(self, data, min_tail: int = 0) -> list[int]:
        """A prefix of an earlier sequence (often cached) plus a few random tokens."""
        base = self.seqs[-1 - data.draw(st.integers(0, len(self.seqs) - 1))]  # recent first
        cut = len(base) - data.draw(st.integers(0, len(base)))  # shrinks towards the whole base
        tail = data.draw(st.lists(ALPHABET, min_size=min_tail, max_size=3 * self.ps + 1))
        return base[:cut] + tail

    def expected_match(self, seq) -> list[int]:
        pages = []
        for end in range(self.ps, len(seq) + 1, self.ps):
            if tuple(seq[:end]) not in self.ref:
                break
            pages.append(self.ref[tuple(seq[:end])])
        return pages

    def new_pages(self, n) -> list[int]:
        pages = [next(self.fresh) for _ in range(n)]
        self.given.update(pages)
        return pages

    @rule(data=st.data(), reuse_matched=st.booleans())
    def insert(self, data, reuse_matched):
        seq = self.draw_seq(data, min_tail=self.ps)
        n = len(seq) // self.ps
        head = self.cache.match(seq).pages if reuse_matched else []  # chunked-prefill pattern
        pages = head + self.new_pages(n - len(head))
        not_adopted = self.cache.insert(seq, pages)
        expected = []
        for i, page in enumerate(pages):
            prefix = tuple(seq[: (i + 1) * self.ps])
            if prefix not in self.ref:
                self.ref[prefix] = page
            elif self.ref[prefix] != page:
                expected.append(page)
        assert not_adopted == expected
        assert not self.returned.intersection(not_adopted)
        self.returned.update(not_adopted)
        matched = self.cache.match(seq).pages  # the tree's pages for the whole prefix
        assert len(matched) == n and matched == self.expected_match(seq)
        assert [p for p, mine in zip(matched, pages, strict=True) if p != mine] == [
            self.ref[tuple(seq[: (i + 1) * self.ps])]
            for i, mine in enumerate(pages)
            if mine in expected
        ]
        self.seqs.append(seq)

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        seq = self.draw_seq(data)
        m = self.cache.match(seq)
        assert m.pages == self.expected_match(seq)
        assert m.num_tokens == len(m.pages) * self.ps
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m.node, tuple(seq[: m.num_tokens])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(num_pages=st.sampled_from([0, 1, 2, 3, 5, 8, 10**9]))
    def evict(self, num_pages):
        before = self.cache.num_evictable_pages
        freed = self.cache.evict(num_pages)
        assert len(freed) >= min(num_pages, before)
        assert not self.freed.intersection(freed)
        self.freed.update(freed)
        gone = set(freed)
        self.ref = {k: p for k, p in self.ref.items() if p not in gone}
        assert set(freed) <= self.given
        if num_pages >= before:
            assert self.cache.num_evictable_pages == 0

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        pages = self.cache.reset()
        assert sorted(pages) == sorted(self.ref.values())
        self.freed.update(pages)
        self.ref = {}

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert contents(self.cache) == self.ref
        # prefix-closed: eviction only removes leaves
        assert all(k[: -self.ps] in self.ref for k in self.ref if len(k) > self.ps)
        cached = set(self.ref.values())
        assert len(cached) == len(self.ref) == self.cache.num_cached_pages
        assert cached | self.returned | self.freed == self.given
        assert not (cached & self.returned or cached & self.freed or self.returned & self.freed)
        locked = set()
        for _, prefix in self.locks:
            for end in range(self.ps, len(prefix) + 1, self.ps):
                assert prefix[:end] in self.ref, "a locked prefix was evicted"
                locked.add(prefix[:end])
        assert self.cache.num_locked_pages == len(locked)
        for end, lock_ref in node_lock_refs(self.cache).items():  # locks at or below the node
            assert lock_ref == sum(p[: len(end)] == end for _, p in self.locks)
        assert self.cache.num_evictable_pages == len(self.ref) - len(locked)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: deterministic CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_state_machine = RadixCacheMachine.TestCase

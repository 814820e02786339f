"""Routers: which engine instance each arriving request goes to (issue 21; ALGORITHMS.md §8.3,
§14's SGLang router row).

    router = make_router("cache_aware", cache_threshold=0.5)     # or a name of ROUTERS
    i = router.route(request, instances, now)                    # an index into `instances`

A router sees every instance as an `InstanceLoad` (the simulator's `llmjax.sim.cluster.
InstanceView` is one) and the request as a `RouteRequest` (both in routing.py, with the `Router`
protocol); `now` is the routing time (seconds on
the caller's timeline, non-decreasing from one call to the next). Routers by name (`ROUTERS`):

  round_robin        0, 1, ..., n - 1, 0, ... in arrival order.
  random             uniformly at random (a seeded numpy Generator).
  least_outstanding  the fewest outstanding requests (Vidur's 'lor'), ties to the lowest index.
  power_of_two       two distinct instances at random (a seeded numpy Generator), the one with
                     fewer outstanding requests wins, ties to the lower index (Mitzenmacher's
                     power of two choices).
  cache_aware        sglang-router's cache_aware: an approximate prefix tree per instance of the
                     prompts routed there; the longest match unless the load is imbalanced
                     (`CacheAware`).
  mooncake           Mooncake's Conductor (llmjax/cluster/conductor.py, ALGORITHMS.md §10.2):
                     over prefill and decode instances it picks a (prefill, decode) pair by
                     predicted TTFT (queue + prefix fetch + uncached prefill) and TBT, fetches
                     a longer remote prefix, and may reject early; as a plain router (`route`,
                     colocated instances) it is the TTFT choice alone.

The Conductor reads more of an instance than `InstanceLoad` (`conductor.ConductorLoad`): its
queued prefills (request id, tokens, tokens computed), its decode requests (request id, context
tokens, output tokens), its KV capacity in tokens, its max_num_seqs and a stable instance_id;
both clusters' views implement them.

Nothing here imports jax (or the engine).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from llmjax.cluster.routing import InstanceLoad, Router, RouteRequest

__all__ = [  # the routing types are re-exported from routing.py
    "ROUTERS",
    "CacheAware",
    "InstanceLoad",
    "LeastOutstanding",
    "PowerOfTwo",
    "PrefixTrie",
    "RandomRouter",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "make_router",
]


class RoundRobin:
    """Instance 0, 1, ..., n - 1, 0, ... in arrival order."""

    name = "round_robin"

    def __init__(self):
        self._next = 0

    def route(self, request, instances, now) -> int:
        i = self._next % len(instances)
        self._next += 1
        return i


class RandomRouter:
    """Uniformly at random: a numpy Generator seeded with `seed` (Mooncake's 'random'
    scheduling baseline)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def route(self, request, instances, now) -> int:
        return instances[int(self._rng.integers(len(instances)))].index


class LeastOutstanding:
    """Vidur's 'lor': the instance with the fewest outstanding requests, ties to the lowest
    index."""

    name = "least_outstanding"

    def route(self, request, instances, now) -> int:
        return min(instances, key=lambda v: (v.num_outstanding, v.index)).index


class PowerOfTwo:
    """Power of two choices: two distinct instances drawn uniformly by a numpy Generator seeded
    with `seed`; the one with fewer outstanding requests wins, ties to the lower index. With one
    instance it is that one (no draw)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def route(self, request, instances, now) -> int:
        if len(instances) == 1:
            return instances[0].index
        a, b = self._rng.choice(len(instances), size=2, replace=False)
        return min(instances[a], instances[b], key=lambda v: (v.num_outstanding, v.index)).index


# ---- cache_aware ---------------------------------------------------------------------------------


class _Node:
    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key, parent):
        self.key = key  # this node's page of token ids (a tuple of page_size ints)
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0.0


class PrefixTrie:
    """The approximate radix tree of one instance: a trie over whole pages (`page_size`-tuples)
    of the prompts inserted, each node with the time it was last inserted through. A prompt's
    last partial page is not stored, so a match is a multiple of `page_size` tokens.

    The nodes also sit in an LRU order (`_lru`, least recent first) that each insert refreshes
    deepest node first, so a node always comes after all of its descendants: the first node is a
    leaf, and evicting from the front removes leaves first. With non-decreasing insert times the
    front is also the oldest node, which makes both prunes O(nodes removed)."""

    def __init__(self, page_size: int = 16):
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        self.page_size = page_size
        self.root = _Node((), None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    @property
    def size(self) -> int:
        """Tokens stored (nodes x page_size)."""
        return len(self._lru) * self.page_size

    def __len__(self) -> int:
        return len(self._lru)

    def _pages(self, token_ids: Sequence[int]):
        p = self.page_size
        ids = tuple(token_ids)
        return (ids[k : k + p] for k in range(0, len(ids) - p + 1, p))

    def match(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest page-aligned prefix of `token_ids` in the trie (no LRU touch)."""
        node, pages = self.root, 0
        for page in self._pages(token_ids):
            node = node.children.get(page)
            if node is None:
                break
            pages += 1
        return pages * self.page_size

    def insert(self, token_ids: Sequence[int], now: float) -> None:
        """Add the whole pages of `token_ids`; every node on its path is accessed at `now`."""
        node, path = self.root, []
        for page in self._pages(token_ids):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(page, node)
            path.append(child)
            node = child
        for n in reversed(path):  # deepest first: ancestors end up after their descendants
            n.last_access = now
            self._lru[n] = None
            self._lru.move_to_end(n)

    def _evict_front(self) -> None:
        node, _ = self._lru.popitem(last=False)
        assert not node.children, "the LRU front is always a leaf"
        del node.parent.children[node.key]

    def prune_to_size(self, max_tokens: int) -> int:
        """Evict least recently used leaves until at most `max_tokens` are stored; returns the
        tokens evicted."""
        before = self.size
        while self._lru and self.size > max_tokens:
            self._evict_front()
        return before - self.size

    def prune_older_than(self, cutoff: float) -> int:
        """Evict every node last accessed before `cutoff` (a node's descendants are never
        accessed later than it, so whole stale subtrees go); returns the tokens evicted."""
        before = self.size
        while self._lru and next(iter(self._lru)).last_access < cutoff:
            self._evict_front()
        return before - self.size


class CacheAware:
    """sglang-router's cache_aware policy (ALGORITHMS.md §8.3), over token ids instead of text.
    One `PrefixTrie` per instance holds the prompts routed there. For each request, with
    load = `num_outstanding`:

      1. Prune: each tree drops the entries last accessed more than `eviction_interval_secs`
         before `now` (sglang prunes on a timer of that period; here it happens at routing,
         on the simulated time the router receives).
      2. Imbalanced load, i.e. max_load - min_load > `balance_abs_threshold` AND
         max_load > min_load * `balance_rel_threshold`: the least loaded instance (ties to the
         lowest index), cache ignored.
      3. Else the instance with the highest prefix match rate (matched tokens / prompt tokens,
         matched = the longest page-aligned prefix in its tree), if that rate > `cache_threshold`
         (ties to the lowest index).
      4. Else the instance with the smallest tree, "the most free cache" (ties to the lowest
         index).

    The chosen instance's tree then gets the prompt (at `now`) and is pruned, LRU leaves first,
    to `max_tree_size` tokens. Defaults are sglang-router's (ALGORITHMS.md §14); `page_size` is
    the trie's granularity (tokens a node)."""

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        eviction_interval_secs: float = 60.0,
        max_tree_size: int = 2**24,
        page_size: int = 16,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_secs = eviction_interval_secs
        self.max_tree_size = max_tree_size
        self.page_size = page_size
        self.trees: dict[int, PrefixTrie] = {}  # instance index -> its tree

    def tree(self, index: int) -> PrefixTrie:
        """Instance `index`'s tree (empty until a prompt is routed there)."""
        if index not in self.trees:
            self.trees[index] = PrefixTrie(self.page_size)
        return self.trees[index]

    def route(self, request, instances, now) -> int:
        for t in self.trees.values():
            t.prune_older_than(now - self.eviction_interval_secs)
        choice = self._choose(request.prompt_token_ids, instances)
        tree = self.tree(choice)
        tree.insert(request.prompt_token_ids, now)
        tree.prune_to_size(self.max_tree_size)
        return choice

    def _choose(self, prompt, instances) -> int:
        loads = [v.num_outstanding for v in instances]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return min(instances, key=lambda v: (v.num_outstanding, v.index)).index
        if prompt:
            rate, best = max(
                (self.tree(v.index).match(prompt) / len(prompt), -v.index) for v in instances
            )
            if rate > self.cache_threshold:
                return -best
        return min(instances, key=lambda v: (self.tree(v.index).size, v.index)).index


from llmjax.cluster.conductor import Conductor  # noqa: E402

ROUTERS = {
    r.name: r
    for r in (RoundRobin, LeastOutstanding, PowerOfTwo, CacheAware, RandomRouter, Conductor)
}


def make_router(name: str, **kwargs) -> Router:
    """A router of ROUTERS by name, built with `kwargs`."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    return ROUTERS[name](**kwargs)

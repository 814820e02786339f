"""Mooncake Store's DRAM pool in the simulator (ALGORITHMS.md §10.1): one cluster-wide pool of
KV pages, keyed by chained page keys, that every prefill instance writes its KV into and the
Conductor (llmjax/cluster/conductor.py) can fetch a prefix from.

    pool = SimKVPool(capacity_tokens=3 * 3_000_000, page_size=256, salt=salt)
    pool.insert_path(radix_cache.path_keys(leaf))   # what a prefill instance cached
    pool.match_tokens(prompt_token_ids)              # prefix tokens the pool holds (whole pages)

Only the bookkeeping: keys, their chain and their recency; no bytes (the simulator has none).
A page's key is `llmjax.kvstore.keys.chain_keys` of its tokens with the engines' salt
(`engine.block_manager.prefix_cache.salt`), the keys `RadixNode.page_keys` and
`RadixCache.path_keys` hold, so a key names its whole prefix.

The rules (what `check_invariants` asserts):

- **Prefix-closed.** A key is stored only with its parent (the key of the page before it;
  `ROOT_KEY` for a first page): `insert_path(keys)` takes a chain from the first page and
  stores its missing keys in order; eviction takes only leaves (keys no stored key chains
  from), so no stored key outlives its parent.
- **LRU, leaf first.** Every `insert_path` and `touch` of a chain stamps all its keys as used
  now. Eviction drops the least recently used leaf, then the next (a parent whose last child
  went may be next). Implementation: one `OrderedDict` in recency order where a touched chain
  is moved to the end from its last key to its first, so every key is more recent than all
  its descendants and the oldest key is always a leaf (O(1) an eviction).
- **Capacity.** At most `capacity_tokens // page_size` pages. An insert evicts least recently
  used leaves off its own chain to make room; a chain longer than the whole pool is stored up
  to the pool's size (its first pages).

`match_tokens` reads without touching recency (the Conductor evaluates every request; only a
fetch, `touch`, counts as a use). Plain Python, no jax.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from llmjax.kvstore.keys import ROOT_KEY, chain_keys

# Assumed DRAM a prefill node gives Mooncake Store (the FAST'25 paper does not state its nodes'
# DRAM; 1 TB is typical of an 8-GPU A800/H800 node with 2 TB): SimCluster's default
# `kv_pool_bytes_per_node`.
DEFAULT_POOL_BYTES_PER_NODE = 1e12


class SimKVPool:
    """A cluster-wide LRU pool of KV pages (the module doc): at most `capacity_tokens //
    page_size` pages of `page_size` tokens, keyed with `salt`."""

    def __init__(self, capacity_tokens: int, page_size: int, salt: bytes = b""):
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        if capacity_tokens < 0:
            raise ValueError(f"{capacity_tokens=} must be >= 0")
        self.page_size = int(page_size)
        self.capacity_pages = int(capacity_tokens) // self.page_size
        self.salt = salt
        self._parent: OrderedDict[bytes, bytes] = OrderedDict()  # key -> parent, LRU first
        self._children: dict[bytes, int] = {}  # key -> how many stored keys chain from it
        self.num_inserted = 0  # pages stored
        self.num_evicted = 0
        self.num_touches = 0

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def num_pages(self) -> int:
        return len(self._parent)

    def __contains__(self, key: bytes) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained keys of the full pages of `token_ids`."""
        return chain_keys(token_ids, self.page_size, self.salt)

    def match_keys(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain from the first page) the pool holds, from the first."""
        n = 0
        for k in keys:
            if k not in self._parent:
                break
            n += 1
        return n

    def match_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the pool holds: whole pages of all but the last token (what an
        instance could reuse: a prompt must compute its last token), as
        `InstanceView.cached_prefix_tokens` counts them. Does not touch recency."""
        ids = list(prompt_token_ids)[:-1]
        return self.match_keys(self.keys(ids)) * self.page_size

    def touch(self, keys: Sequence[bytes]) -> int:
        """Mark the stored head of the chain `keys` as used now (a read); returns its pages."""
        n = self.match_keys(keys)
        for k in reversed(keys[:n]):
            self._parent.move_to_end(k)
        if n:
            self.num_touches += 1
        return n

    def insert_path(self, keys: Sequence[bytes]) -> int:
        """Store the chain `keys` (from the first page; its missing keys in order, evicting
        least recently used leaves off the chain to make room; at most the pool's size) and
        mark it used now. Returns how many keys were new."""
        keys = list(keys[: self.capacity_pages])
        have = self.touch(keys)
        missing = len(keys) - have
        if missing <= 0:
            return 0
        over = len(self._parent) + missing - self.capacity_pages
        if over > 0:  # the chain's stored head is the newest: the oldest keys are off it
            self.evict(over)
        parent = keys[have - 1] if have else ROOT_KEY
        for k in keys[have:]:
            self._parent[k] = parent
            self._children[k] = 0
            if parent != ROOT_KEY:
                self._children[parent] += 1
            parent = k
        for k in reversed(keys[have:]):  # a parent more recent than its children
            self._parent.move_to_end(k)
        for k in reversed(keys[:have]):
            self._parent.move_to_end(k)
        self.num_inserted += missing
        return missing

    def evict(self, num_pages: int) -> list[bytes]:
        """Drop up to `num_pages` least recently used leaves (the module doc); their keys."""
        out = []
        while len(out) < num_pages and self._parent:
            key, parent = self._parent.popitem(last=False)
            assert not self._children.pop(key), "the oldest key had children"
            if parent != ROOT_KEY:
                self._children[parent] -= 1
            out.append(key)
        self.num_evicted += len(out)
        return out

    def reset(self) -> None:
        self._parent.clear()
        self._children.clear()

    def lru_order(self) -> list[bytes]:
        """The stored keys, least recently used first."""
        return list(self._parent)

    def check_invariants(self) -> None:
        assert len(self._parent) <= self.capacity_pages, "over capacity"
        assert set(self._children) == set(self._parent), "the child counts are out of sync"
        counts = dict.fromkeys(self._parent, 0)
        position = {k: i for i, k in enumerate(self._parent)}
        for k, parent in self._parent.items():
            if parent != ROOT_KEY:
                assert parent in self._parent, "a stored key outlived its parent"
                assert position[parent] > position[k], "a parent older than its child"
                counts[parent] += 1
        assert counts == self._children, "a child count is wrong"

    def __repr__(self) -> str:
        return (
            f"SimKVPool(pages={self.num_pages}/{self.capacity_pages}, page_size={self.page_size})"
        )

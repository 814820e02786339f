"""Prefix caching over the paged KV cache (SGLang RadixAttention): reuse the KV pages of shared
prefixes (system prompts, few-shot examples, earlier chat turns) instead of recomputing them.

`PrefixCache` is the interface; `NoPrefixCache` ("none") and `RadixCache` ("radix") implement it,
chosen by name with `make_prefix_cache(name, page_size)`. Plain Python, no jax.

Ownership. A KV page is owned by exactly one of: the block manager's free list, one request's
private pages, or the cache. `insert` moves the caller's private pages into the cache (the cache
*adopts* them) and returns the ones it did not adopt, which stay the caller's; `evict` and `reset`
hand cache pages back to the caller, who returns them to the free list. Pages in the cache may be
shared by many requests' page tables, read-only: the cache holds only whole pages, so a shared
page is full and never written again.

Radix tree. Each edge is a page-aligned run of token ids (a multiple of `page_size` tokens) and its
node owns one KV page per `page_size` tokens of the edge. Children are keyed by their edge's first
page of token ids. Example, page_size 2, after inserting [1 2 3 4 5 6] and [1 2 3 4 7 8]:

    root ── (1 2 3 4) pages [10 11] ─┬─ (5 6) pages [12]
                                     └─ (7 8) pages [20]
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import heapq
import itertools
from collections.abc import Sequence

from llmjax.kvstore.keys import ROOT_KEY, chain_keys
from llmjax.model.step_input import RESERVED_PAGE


@dataclasses.dataclass(eq=False)
class RadixNode:
    """One edge of the tree and the KV pages of its tokens. Compared by identity."""

    token_ids: tuple[int, ...]  # the edge; len == len(pages) * page_size (empty at the root)
    pages: list[int]
    parent: RadixNode | None  # None at the root and once the node is evicted (detached)
    node_id: int  # creation order: the LRU tie-break, for determinism
    children: dict[tuple[int, ...], RadixNode] = dataclasses.field(default_factory=dict)
    lock_ref: int = 0  # locks on this node or any descendant; > 0 means never evicted
    last_access: int = 0  # logical clock of the last match/insert through this node
    # with a salt: one key per page, chained from the parent's last key (llmjax/kvstore/keys.py)
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    # the lower tiers (llmjax/kvstore/tiered.py) holding the block that ends at each page: bit i
    # for tier i (0 for a page inside a block); kept by llmjax/engine/kv_tiers.py
    page_tiers: list[int] = dataclasses.field(default_factory=list)
    hits: int = 0  # matches that reused this node (write_through_selective's count)
    # a root (of the base model's tree, or of a namespace's): the salt of its pages' keys
    # (`RadixCache.salt_for`; None without keys), set on roots only
    is_root: bool = False
    salt: bytes | None = None


@dataclasses.dataclass(frozen=True)
class MatchResult:
    num_tokens: int  # cached prefix length, a multiple of page_size
    pages: list[int]  # its KV pages, len == num_tokens // page_size; owned by the cache
    node: RadixNode | None  # handle for lock/unlock; the root (or None) when nothing matched


@dataclasses.dataclass(frozen=True)
class PeekResult:
    num_tokens: int  # what `match` would return as num_tokens now
    num_pages: int  # == num_tokens // page_size
    num_unlocked_pages: int  # of those, pages that locking the match would take out of eviction


class PrefixCache(abc.ABC):
    """Contract shared by every prefix cache; the engine runs one code path for all of them.

    - `match(token_ids)`: the longest cached prefix of whole pages and the cache's pages for it.
      The pages stay the cache's; the caller may read them until it unlocks `node`.
    - `peek(token_ids)`: what `match` would find, without changing anything (no LRU touch, no
      split): for admission checks and cache-aware ordering.
    - `insert(token_ids, pages)`: offer the KV pages of `token_ids[: len(pages) * page_size]`,
      `len(pages) == len(token_ids) // page_size` (a partial last page is never inserted: it
      stays private to the caller). Returns the offered pages that the cache did NOT adopt: they
      are still the caller's (the adopted ones are the cache's from now on). A page the cache
      already owns may be offered back at the position where `match` returned it (it is neither
      adopted twice nor returned).
    - `lock(node)` / `unlock(node)`: pin / release the matched prefix ending at `node`; locked
      pages are never evicted. Locks nest; unlocking more than was locked is an error.
    - `evict(num_pages)`: free at least `num_pages` unlocked pages (fewer only if no more are
      evictable), least recently used first; returns them, now the caller's to free.
    - `reset()`: drop everything (an error while anything is locked); returns all pages.
    - `namespace` (match, peek, insert): bytes keying a separate tree (None: the base model's),
      so that a prefix computed under one LoRA adapter is never served to another or to the
      base model (`llmjax.lora.LoRARequest.cache_namespace`); with a salt its page keys are
      salted by the namespace too (`salt_for`), so the KV tiers' keys differ as well.

    Engine use (see `RadixCache` for why): on admission, `m = match(tokens)`; `lock(m.node)`;
    compute only the tokens after `m.num_tokens`. After a chunk (or at the end), with `n` full
    pages computed: `returned = insert(tokens[: n * page_size], table[:n])`; `m2 = match(...)`;
    `lock(m2.node)`; `unlock(old node)`; put `m2.pages` in `table[: len(m2.pages)]` and free the
    replaced entries that differ (exactly the duplicates). On finish, unlock and free every page
    of the table that the cache does not own: `returned` plus the private tail.
    """

    page_size: int

    @abc.abstractmethod
    def match(self, token_ids: Sequence[int], namespace: bytes | None = None) -> MatchResult: ...

    @abc.abstractmethod
    def peek(self, token_ids: Sequence[int], namespace: bytes | None = None) -> PeekResult: ...

    @abc.abstractmethod
    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], namespace: bytes | None = None
    ) -> list[int]: ...

    @abc.abstractmethod
    def lock(self, node: RadixNode | None) -> None: ...

    @abc.abstractmethod
    def unlock(self, node: RadixNode | None) -> None: ...

    @abc.abstractmethod
    def evict(self, num_pages: int) -> list[int]: ...

    @abc.abstractmethod
    def reset(self) -> list[int]: ...

    @property
    @abc.abstractmethod
    def num_cached_pages(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_locked_pages(self) -> int: ...

    @property
    def num_evictable_pages(self) -> int:
        """Pages that `evict` can free now (every unlocked page: eviction cascades upward)."""
        return self.num_cached_pages - self.num_locked_pages

    num_evictions: int  # pages freed by `evict` since creation (not counting `reset`)

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent (tests only)."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: `match` finds 0 tokens, `insert` adopts no page (returns them all)."""

    def __init__(self, page_size: int):
        _check_page_size(page_size)
        self.page_size = page_size
        self.num_evictions = 0

    def match(self, token_ids: Sequence[int], namespace: bytes | None = None) -> MatchResult:
        return MatchResult(0, [], None)

    def peek(self, token_ids: Sequence[int], namespace: bytes | None = None) -> PeekResult:
        return PeekResult(0, 0, 0)

    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], namespace: bytes | None = None
    ) -> list[int]:
        _check_insert_args(token_ids, pages, self.page_size)
        return list(pages)

    def lock(self, node: RadixNode | None) -> None:
        pass

    def unlock(self, node: RadixNode | None) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []

    def reset(self) -> list[int]:
        return []

    @property
    def num_cached_pages(self) -> int:
        return 0

    @property
    def num_locked_pages(self) -> int:
        return 0

    def check_invariants(self) -> None:
        assert self.num_evictions == 0


class RadixCache(PrefixCache):
    """The radix tree of SGLang's RadixAttention, page-granular, with LRU leaf eviction.

    `match` and `insert` split an edge at the page boundary where a match ends inside it, so the
    returned node ends exactly at the matched prefix and locking it pins exactly those pages.
    Recency is a logical clock bumped by every `match`/`insert` (deterministic), stamped on every
    node of the path, so a parent is never older than its children. A node's `lock_ref` counts
    the locks on it and on its descendants; only leaves with `lock_ref == 0` are evicted, and a
    parent that becomes such a leaf joins the same LRU heap (cascade). Evicting removes whole
    nodes, so `evict(n)` may free a few pages more than `n`. Node handles stay valid across
    splits (a split creates the new node above the old one); an evicted node is detached, and
    locking it is an error.

    `salt` (bytes, `llmjax.kvstore.KeySalt.digest`): every node also holds its pages' keys
    (`page_keys`, chained from the parent's last key: `llmjax.kvstore.chain_keys`), computed
    once, as the pages are inserted; `path_keys(node)` gives a matched prefix's keys. None: no
    keys. Each `namespace` has its own root (`roots`; `root` is the base model's, None's); the
    LRU and eviction span them all.
    """

    def __init__(self, page_size: int, salt: bytes | None = None):
        _check_page_size(page_size)
        self.page_size = page_size
        self.salt = salt
        self._ids = itertools.count()
        self._clock = 0
        self.root = self._new_root()
        self.roots: dict[bytes | None, RadixNode] = {None: self.root}
        self._pages: set[int] = set()  # every page the tree owns
        self._num_locked_pages = 0
        self.num_evictions = 0
        self._key_nodes: dict[bytes, RadixNode] = {}  # page key -> its node (with a salt)
        # hooks for the tiers below (llmjax/engine/kv_tiers.py): on_insert(leaf) after a new
        # leaf's pages are adopted; on_evict(node) just before an evicted node is detached
        self.on_insert = None
        self.on_evict = None

    def _new_root(self, namespace: bytes | None = None) -> RadixNode:
        return RadixNode((), [], None, next(self._ids), is_root=True, salt=self.salt_for(namespace))

    def salt_for(self, namespace: bytes | None) -> bytes | None:
        """The salt of the page keys of `namespace`'s tree: the cache's (the base model's), or
        that mixed with the namespace (None without a salt)."""
        if self.salt is None or namespace is None:
            return self.salt
        return hashlib.blake2b(namespace, key=self.salt, person=b"llmjax-kv-ns").digest()

    def _root(self, namespace: bytes | None) -> RadixNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = self._new_root(namespace)
        return root

    # ---- match / insert ------------------------------------------------------------------------

    def _edges(self, key: tuple[int, ...], root: RadixNode):
        """Yield (child, offset, k) along the longest cached page-aligned prefix of `key` under
        `root`: the edge at `offset` and how many of its pages match (fewer than all only on the
        last)."""
        ps = self.page_size
        node, pos = root, 0
        while pos < len(key) and (child := node.children.get(key[pos : pos + ps])) is not None:
            n = len(child.pages)
            edge = child.token_ids
            if key[pos : pos + len(edge)] == edge:  # the whole edge (one C-level comparison)
                k = n
            else:
                k = 1  # the first page matches (it is the child's key)
                while (
                    k < n and edge[k * ps : (k + 1) * ps] == key[pos + k * ps : pos + (k + 1) * ps]
                ):
                    k += 1
            partial = k < n  # (the caller may split `child` while we wait)
            yield child, pos, k
            if partial:
                return
            node, pos = child, pos + k * ps

    def _walk(self, key: tuple[int, ...], root: RadixNode):
        """Yield (node, offset) along the longest cached page-aligned prefix of `key` under
        `root`, splitting the last edge if the match ends inside it and touching every node of
        the path."""
        self._clock += 1
        root.last_access = self._clock
        for child, pos, k in self._edges(key, root):
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = self._clock
            yield child, pos

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node`'s edge after `num_pages` pages; returns the new upper node."""
        ps = self.page_size
        upper = RadixNode(
            node.token_ids[: num_pages * ps],
            node.pages[:num_pages],
            node.parent,
            next(self._ids),
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            page_keys=node.page_keys[:num_pages],
            page_tiers=node.page_tiers[:num_pages],
            hits=node.hits,
        )
        node.token_ids = node.token_ids[num_pages * ps :]
        node.pages = node.pages[num_pages:]
        node.page_keys = node.page_keys[num_pages:]
        node.page_tiers = node.page_tiers[num_pages:]
        for k in upper.page_keys:
            self._key_nodes[k] = upper
        node.parent = upper
        upper.children[node.token_ids[:ps]] = node
        upper.parent.children[upper.token_ids[:ps]] = upper
        return upper

    def _key(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(token_ids[: len(token_ids) // self.page_size * self.page_size])

    def match(self, token_ids: Sequence[int], namespace: bytes | None = None) -> MatchResult:
        node = root = self._root(namespace)
        pages = []
        for node, _ in self._walk(self._key(token_ids), root):
            pages.extend(node.pages)
        return MatchResult(len(pages) * self.page_size, pages, node)

    def match_pages(self, token_ids: Sequence[int], namespace: bytes | None = None) -> list[int]:
        """The pages `match` would return, changing nothing (no LRU touch, no split)."""
        pages: list[int] = []
        root = self.roots.get(namespace)
        for child, _, k in self._edges(self._key(token_ids), root) if root is not None else ():
            pages.extend(child.pages[:k])
        return pages

    def peek(self, token_ids: Sequence[int], namespace: bytes | None = None) -> PeekResult:
        num_pages = num_unlocked = 0
        root = self.roots.get(namespace)
        for child, _, k in self._edges(self._key(token_ids), root) if root is not None else ():
            num_pages += k
            num_unlocked += 0 if child.lock_ref else k
        return PeekResult(num_pages * self.page_size, num_pages, num_unlocked)

    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], namespace: bytes | None = None
    ) -> list[int]:
        _check_insert_args(token_ids, pages, self.page_size)
        ps, key = self.page_size, self._key(token_ids)
        not_adopted: list[int] = []
        node = root = self._root(namespace)
        end = 0
        for node, pos in self._walk(key, root):  # nothing is adopted before the walk ends: errors
            end = pos + len(node.token_ids)  # leave the tree unchanged (but for splits)
            for mine, cached in zip(pages[pos // ps : end // ps], node.pages, strict=True):
                if mine != cached:
                    if mine in self._pages:
                        raise ValueError(f"page {mine} is owned by the cache at another prefix")
                    not_adopted.append(mine)
        new_pages = list(pages[end // ps :])
        if owned := self._pages.intersection(new_pages):
            raise ValueError(f"pages {sorted(owned)} are already owned by the cache")
        if new_pages:
            leaf = RadixNode(key[end:], new_pages, node, next(self._ids))
            if self.salt is not None:
                leaf.page_keys = chain_keys(leaf.token_ids, ps, root.salt, self._last_key(node))
                for k in leaf.page_keys:
                    self._key_nodes[k] = leaf
            leaf.page_tiers = [0] * len(new_pages)
            leaf.last_access = self._clock
            node.children[leaf.token_ids[:ps]] = leaf
            self._pages.update(new_pages)
            if self.on_insert is not None:
                self.on_insert(leaf)
        return not_adopted

    def _last_key(self, node: RadixNode) -> bytes:
        return ROOT_KEY if node.is_root else node.page_keys[-1]

    def path_pages(self, node: RadixNode | None) -> list[int]:
        """The pages from the root down to `node` (a `match` result's node)."""
        if node is None:
            return []
        return [p for n in reversed(self._path(node)) for p in n.pages]

    def node_of_key(self, key: bytes) -> RadixNode | None:
        """The node holding the page whose key is `key`, if the tree has it (with a salt)."""
        return self._key_nodes.get(key)

    def set_tier(self, key: bytes, tier: int, present: bool) -> bool:
        """Record on the node holding page `key` (a block's last page) whether lower tier
        `tier` holds that block; False if the tree does not hold the page."""
        node = self._key_nodes.get(key)
        if node is None:
            return False
        i = node.page_keys.index(key)
        bit = 1 << tier
        node.page_tiers[i] = node.page_tiers[i] | bit if present else node.page_tiers[i] & ~bit
        return True

    def path_keys(self, node: RadixNode | None) -> list[bytes]:
        """The page keys from the root down to `node` (a `match` result's node), one per page
        of the matched prefix; [] without a salt."""
        if self.salt is None or node is None:
            return []
        return [k for n in reversed(self._path(node)) for k in n.page_keys]

    # ---- lock / unlock -------------------------------------------------------------------------

    def _path(self, node: RadixNode | None) -> list[RadixNode]:
        """The nodes from `node` up to (excluding) the root; errors if `node` is detached."""
        if node is None:
            raise TypeError("RadixCache.lock/unlock need a node from match(), got None")
        path = []
        while not node.is_root:
            if node.parent is None:
                raise ValueError("node is not in this cache (evicted, reset or foreign)")
            path.append(node)
            node = node.parent
        return path

    def lock(self, node: RadixNode | None) -> None:
        for n in self._path(node):
            if n.lock_ref == 0:
                self._num_locked_pages += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: RadixNode | None) -> None:
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError("unlock without a matching lock")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_locked_pages -= len(n.pages)

    # ---- evict / reset -------------------------------------------------------------------------

    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children (a list: safe to mutate the tree while
        iterating it). `llmjax.viz.radix.snapshot_tree` copies the tree with depths and offsets."""
        nodes = []
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        if num_pages <= 0:
            return freed
        heap = [
            (n.last_access, n.node_id, n) for n in self.nodes() if not n.children and not n.lock_ref
        ]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            if self.on_evict is not None:
                self.on_evict(node)
            parent = node.parent
            del parent.children[node.token_ids[: self.page_size]]
            node.parent = None
            for k in node.page_keys:
                self._key_nodes.pop(k, None)
            freed.extend(node.pages)
            if not parent.is_root and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._pages.difference_update(freed)
        self.num_evictions += len(freed)
        return freed

    def reset(self) -> list[int]:
        if self._num_locked_pages:
            raise RuntimeError(f"reset while {self._num_locked_pages} pages are locked")
        pages = [p for n in self.nodes() for p in n.pages]
        for n in self.nodes():
            n.parent = None
        self.root = self._new_root()
        self.roots = {None: self.root}
        self._pages.clear()
        self._key_nodes.clear()
        return pages

    # ---- stats and invariants ------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._pages)

    @property
    def num_locked_pages(self) -> int:
        return self._num_locked_pages

    def check_invariants(self) -> None:
        ps = self.page_size
        for namespace, root in self.roots.items():
            assert root.token_ids == () and root.pages == [] and root.parent is None
            assert root.is_root and root.salt == self.salt_for(namespace)
        owned, locked = [], 0
        for node in self.nodes():
            assert node.token_ids and len(node.token_ids) % ps == 0, f"edge {node.token_ids}"
            assert len(node.pages) == len(node.token_ids) // ps, "one page per page_size tokens"
            assert node.parent.children.get(node.token_ids[:ps]) is node, "child key / parent"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            assert node.last_access >= max(
                (c.last_access for c in node.children.values()), default=0
            )
            owned.extend(node.pages)
            locked += len(node.pages) if node.lock_ref else 0
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert set(owned) == self._pages, "page set out of sync"
        assert RESERVED_PAGE not in self._pages, "the reserved page is cached"
        assert locked == self._num_locked_pages, f"{locked=} != {self._num_locked_pages=}"
        if self.salt is not None:
            for node in self.nodes():
                root = node.parent
                while not root.is_root:
                    root = root.parent
                want = chain_keys(node.token_ids, ps, root.salt, self._last_key(node.parent))
                assert node.page_keys == want, "a page key does not chain from its parent"
                assert all(self._key_nodes.get(k) is node for k in node.page_keys), "key index"
            assert len(self._key_nodes) == len(self._pages), "the key index holds stale keys"
        for node in self.nodes():
            assert len(node.page_tiers) == len(node.pages), "one tier record per page"


def _check_page_size(page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")


def _check_insert_args(token_ids: Sequence[int], pages: Sequence[int], page_size: int) -> None:
    if len(pages) != len(token_ids) // page_size:
        raise ValueError(
            f"{len(pages)=} must equal len(token_ids) // page_size = "
            f"{len(token_ids)} // {page_size} (a partial last page is never inserted)"
        )
    if RESERVED_PAGE in pages:
        raise ValueError(f"the reserved page {RESERVED_PAGE} cannot be cached")
    if len(set(pages)) != len(pages):
        raise ValueError(f"{pages=} repeat a page")


PREFIX_CACHES: dict[str, type[PrefixCache]] = {"none": NoPrefixCache, "radix": RadixCache}


def make_prefix_cache(name: str, page_size: int, salt: bytes | None = None) -> PrefixCache:
    """The prefix cache `name` ('none', 'radix'); `salt`: the radix tree keys its pages."""
    if name not in PREFIX_CACHES:
        raise ValueError(f"prefix cache {name=} is not one of {sorted(PREFIX_CACHES)}")
    if name == "radix":
        return RadixCache(page_size, salt)
    return PREFIX_CACHES[name](page_size)

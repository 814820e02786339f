"""Host-side owner of the KV pages: the free list, each request's page table, and the prefix cache.

Ownership. Page 0 is reserved (padded writes land there) and never handed out. Every other page
is owned by exactly one of: the free list, one request (a *private* page), or the prefix cache.
A request's page table is a *shared* head of cache pages (the prefix it matched or inserted, all
full pages, locked in the cache so they are never evicted while it runs) followed by its private
pages. A page is written only by its owner's next tokens, and a request writes only at positions
>= its computed tokens, which lie past its shared head: a shared page is never written.

Reference counts: a cache page appears in the shared head of exactly as many page tables as its
radix node's `lock_ref` says (each request locks the node that ends its shared head, which pins
the whole path); `check_invariants` asserts it.

The request lifecycle, driven by the scheduler:
    peek_prefix / can_allocate   admission check: what a match would reuse, and whether the rest
                                 fits (free pages + evictable cache pages)
    match_prefix                 point the head of the table at the cached prefix and lock it
                                 (on admission, and again before each prefill chunk so that a
                                 prefix another request inserted meanwhile is reused)
    allocate                     grow the table; evicts LRU cache pages when the free list is short
    cache_computed               after a step: offer the request's new full pages to the cache;
                                 duplicates of pages the cache already had are freed and the table
                                 points at the cache's copies
    free                         on finish, abort or preemption: offer the computed full pages,
                                 unlock, and free the private rest

Holes (sparse KV, `llmjax/sparse/host_pool.py`). `evict_page` frees one private page of a running
request and leaves RESERVED_PAGE in its table slot: a *hole*, whose positions the attention masks.
A hole keeps its slot (table length still counts the request's tokens, so `allocate` never refills
it), is never freed again, and breaks the prefix: only the full pages before a request's first
hole are offered to the prefix cache, since a cached page must hold every token's KV.

Groups (the hybrid KV layout, `KVGroups` in llmjax/config/cache.py: Gemma 2 and 3). A request then
has one page table per group, all drawing on the one free list. Group 0 (the full-attention layers)
is `page_tables` and follows every rule above; its pages are the prefix cache's identity. The
windowed groups' tables (`group_tables`) are no longer than group 0's (as long once a request
decodes; a policy that takes a whole prompt's pages at admission, sarathi, grows them per chunk:
`allocate`'s `window_tokens`), and `release_window` turns the entries a request's window has passed
into holes, freeing their pages: a long sequence holds its windowed layers' pages for its last
window only (a windowed table is holes, then pages). A windowed
page is reference-counted (`_refs`): each table entry holding it and the prefix cache's *bundle* of
the group-0 page at its position (`_bundles`: what a cached page's windowed layers were, per group,
RESERVED_PAGE where released), so a cached prefix keeps its windowed pages after its requests moved
on. A windowed page only a bundle holds is *droppable*: counted as available and dropped (its bundle
entry becomes a hole) before any cached prefix is evicted, oldest first. A match is cut to its
longest prefix whose windowed pages cover the window before its end (`_usable`), so a hit never
reads a dropped page.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

from llmjax.config import KVGroups
from llmjax.engine.radix_cache import (
    NoPrefixCache,
    PeekResult,
    PrefixCache,
    RadixCache,
    RadixNode,
)
from llmjax.model.step_input import RESERVED_PAGE

NO_PREFIX = PeekResult(0, 0, 0)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclasses.dataclass
class _SharedHead:
    """The cache pages at the head of one request's page table."""

    node: RadixNode | None  # locked in the cache; ends the shared head
    num_pages: int  # table[:num_pages] are the cache's pages
    num_offered: int  # full pages offered to the cache so far (>= num_pages)


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_cache: PrefixCache | None = None,
        groups: KVGroups | None = None,
        step_tokens: int | None = None,
    ):
        """`groups`: the hybrid KV layout (see the module doc; None or one group: one table).
        `step_tokens`: the most tokens one allocation adds to a request (the scheduler's token
        budget when it chunks prefills; None: unbounded), which bounds what a windowed group
        needs at once in an admission check."""
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache if prefix_cache is not None else NoPrefixCache(page_size)
        if self.prefix_cache.page_size != page_size:
            raise ValueError(f"{self.prefix_cache.page_size=} != {page_size=}")
        self.caching = not isinstance(self.prefix_cache, NoPrefixCache)
        self._free: deque[int] = deque(p for p in range(num_pages) if p != RESERVED_PAGE)
        self.page_tables: dict[str, list[int]] = {}
        self._heads: dict[str, _SharedHead] = {}
        self.on_hit = None  # f(node): a request reused the cached prefix ending at node
        self.groups = groups if groups is not None and groups.hybrid else None
        if self.groups is not None and self.groups.windows[0] is not None:
            raise ValueError("group 0 of a hybrid KV layout must be full attention")
        # the windowed groups' windows in pages (groups 1..), and their tables per request
        self._window_pages = (
            [self.groups.window_pages(g, page_size) for g in range(1, self.groups.num_groups)]
            if self.groups is not None
            else []
        )
        self.step_pages = None if step_tokens is None else pages_needed(step_tokens, page_size) + 1
        self.group_tables: dict[str, list[list[int]]] = {}
        self._refs: dict[int, int] = {}  # windowed page -> table entries + bundles holding it
        self._bundles: dict[int, list[int]] = {}  # cached group-0 page -> its windowed pages
        self._bundled: dict[int, int] = {}  # windowed page -> the cached page whose bundle has it
        self._droppable: dict[int, None] = {}  # windowed pages only a bundle holds, oldest first

    @property
    def num_groups(self) -> int:
        return 1 + len(self._window_pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_available_pages(self) -> int:
        """Pages a request could get now: free ones plus unlocked cache pages (evicted on
        demand) and droppable windowed pages."""
        return len(self._free) + len(self._droppable) + self.prefix_cache.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        """Pages that running requests hold (private or locked in the cache)."""
        return self.num_usable_pages - self.num_available_pages

    def _missing_positions(self, request_id: str, num_tokens: int) -> int:
        """Page positions to add so that `request_id`'s tables hold `num_tokens` tokens."""
        have = len(self.page_tables.get(request_id, ()))
        return max(0, pages_needed(num_tokens, self.page_size) - have)

    def num_missing_pages(
        self, request_id: str, num_tokens: int, window_tokens: int | None = None
    ) -> int:
        """Pages to add so that `request_id` can hold `num_tokens` tokens in group 0 and
        `window_tokens` (None: `num_tokens`) in each windowed group."""
        return self._missing_positions(request_id, num_tokens) + sum(
            self._missing_window(request_id, num_tokens, window_tokens)
        )

    def _missing_window(
        self, request_id: str, num_tokens: int, window_tokens: int | None
    ) -> list[int]:
        """Page positions each windowed group's table lacks for `window_tokens` tokens (at most
        `num_tokens`: a windowed table is never longer than group 0's)."""
        if self.groups is None:
            return []
        end = num_tokens if window_tokens is None else min(window_tokens, num_tokens)
        end = pages_needed(end, self.page_size)
        tables = self.group_tables.get(request_id) or [[] for _ in self._window_pages]
        return [max(0, end - len(t)) for t in tables]

    def _at_most(self, positions: int, step: int | None) -> int:
        """Pages `positions` new page positions take at once in every group: all of them in
        group 0, a windowed group's window plus `step` (None: `positions`) at most."""
        step = positions if step is None else step
        return positions + sum(min(positions, w + step) for w in self._window_pages)

    def pages_to_hold(self, prompt_tokens: int, total_tokens: int) -> int:
        """The most pages a request of `prompt_tokens` holds on its way to `total_tokens` alone
        in the cache (every group; a windowed group's at most its window and one allocation's
        `step_tokens`; without those, all `total_tokens`' pages: a preempted request recomputes
        its prompt and output as one prompt, whose pages the scheduler takes at admission)."""
        return self._at_most(pages_needed(total_tokens, self.page_size), self.step_pages)

    # ---- admission -----------------------------------------------------------------------------

    def peek_prefix(self, token_ids: Sequence[int], namespace: bytes | None = None) -> PeekResult:
        """What `match_prefix` would reuse for a request with no pages yet (changes nothing).
        `namespace` (here and below): the prefix cache's tree the tokens belong to (a LoRA
        adapter's; None: the base model's; llmjax/engine/radix_cache.py)."""
        if not self.caching or not token_ids:
            return NO_PREFIX
        peek = self.prefix_cache.peek(token_ids, namespace)
        if self.groups is None or not peek.num_pages:
            return peek
        pages = self.prefix_cache.match_pages(token_ids, namespace)  # (no split, no touch)
        usable = self._usable(pages)
        if usable < peek.num_pages:
            peek = self.prefix_cache.peek(token_ids[: usable * self.page_size], namespace)
        # the windowed pages the match would hold: taken out of `_droppable`
        held = sum(p in self._droppable for p in self._window_entries(pages[:usable]))
        return PeekResult(peek.num_tokens, peek.num_pages, peek.num_unlocked_pages + held)

    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        keep_free: int = 0,
        prefix: PeekResult = NO_PREFIX,
        window_tokens: int | None = None,
    ) -> bool:
        """Whether `request_id` can grow to `num_tokens` tokens and leave `keep_free` pages
        available (the admission watermark). `prefix`: for a request not yet admitted, the
        `peek_prefix` it would match (its pages need no allocation, but locking them takes them
        out of eviction).

        With windowed groups, a request not yet admitted counts what it will hold at most (a
        windowed group's window plus one allocation: `release_window` frees the rest, `_at_most`),
        an admitted one exactly what `allocate(request_id, num_tokens, window_tokens)` takes."""
        if request_id in self.page_tables:
            missing = self.num_missing_pages(request_id, num_tokens, window_tokens)
        else:
            positions = max(0, pages_needed(num_tokens, self.page_size) - prefix.num_pages)
            missing = self._at_most(positions, self.step_pages)
        available = self.num_available_pages - prefix.num_unlocked_pages
        return missing + keep_free <= available

    def match_prefix(
        self, request_id: str, token_ids: Sequence[int], namespace: bytes | None = None
    ) -> int:
        """Make the head of `request_id`'s table the longest cached prefix of `token_ids` if that
        is longer than the head it shares now; returns the tokens its shared head covers.

        Private pages the cached ones replace are freed: they hold (or were reserved for) the
        same tokens' KV, so the caller may count every token of the returned prefix as computed.
        Pass tokens that leave at least one to compute (a prompt must produce logits)."""
        head = self._heads.get(request_id)
        have = head.num_pages if head else 0
        if not self.caching or not token_ids:
            return have * self.page_size
        m = self.prefix_cache.match(token_ids, namespace)
        if self.groups is not None and len(m.pages) > have:
            usable = self._usable(m.pages)
            if usable < len(m.pages):
                m = self.prefix_cache.match(token_ids[: usable * self.page_size], namespace)
        if len(m.pages) <= have:
            return have * self.page_size
        table = self.page_tables.setdefault(request_id, [])
        for i in range(have, len(m.pages)):
            if i < len(table):
                if table[i] != RESERVED_PAGE:  # a hole (evicted page) has nothing to free
                    self._free.append(table[i])
                table[i] = m.pages[i]
            else:
                table.append(m.pages[i])
        if self.groups is not None:
            self._share_windows(request_id, m.pages, have)
        self.prefix_cache.lock(m.node)
        if head is not None:
            self.prefix_cache.unlock(head.node)
        if self.on_hit is not None:
            self.on_hit(m.node)
        offered = max(head.num_offered if head else 0, len(m.pages))
        self._heads[request_id] = _SharedHead(m.node, len(m.pages), offered)
        return m.num_tokens

    def extend_cache(
        self, token_ids: Sequence[int], num_pages: int, namespace: bytes | None = None
    ) -> list[int]:
        """Give the prefix cache `num_pages` fresh pages for the full pages of `token_ids`
        that follow its cached prefix of them (a prefix loaded from a lower KV tier,
        llmjax/engine/kv_tiers.py: the caller writes their KV before any step reads them) and
        return those pages. The cached prefix is held while pages are evicted to make room.
        Raises RuntimeError if the pages cannot be had (check `num_available_pages` first)."""
        if self.groups is not None:
            raise NotImplementedError("the KV tiers with a hybrid KV layout")
        cache = self.prefix_cache
        m = cache.match(token_ids, namespace)
        end = (len(m.pages) + num_pages) * self.page_size
        if num_pages <= 0 or end > len(token_ids):
            raise ValueError(f"extend_cache: {num_pages=} past {len(token_ids)} tokens")
        if m.pages:
            cache.lock(m.node)
        try:
            if num_pages > len(self._free):
                self._free.extend(cache.evict(num_pages - len(self._free)))
        finally:
            if m.pages:
                cache.unlock(m.node)
        if num_pages > len(self._free):
            raise RuntimeError(f"out of KV pages: a load needs {num_pages}, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(num_pages)]
        not_adopted = cache.insert(token_ids[:end], m.pages + new, namespace)
        assert not not_adopted, "the cache held pages past its own match"
        return new

    # ---- allocate / free -----------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_tokens: int, window_tokens: int | None = None
    ) -> list[int]:
        """Grow `request_id`'s table to hold `num_tokens` tokens, and its windowed groups' tables
        `window_tokens` (None: `num_tokens`; a policy that takes a whole prompt's pages at
        admission grows the windowed tables per chunk: they hold a window, not a prompt),
        evicting unlocked cache pages (LRU) if the free list is short; returns group 0's table."""
        n = self._missing_positions(request_id, num_tokens)
        window = self._missing_window(request_id, num_tokens, window_tokens)
        missing = n + sum(window)
        self._make_room(missing)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of KV pages: {request_id=} needs {missing}, {len(self._free)} free"
            )
        table = self.page_tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(n))
        if self.groups is not None:
            tables = self.group_tables.setdefault(request_id, [[] for _ in self._window_pages])
            for t, k in zip(tables, window, strict=True):
                for _ in range(k):
                    t.append(self._free.popleft())
                    self._refs[t[-1]] = 1
        return table

    def allocate_import(self, request_id: str, num_tokens: int, num_kv_tokens: int) -> list[int]:
        """Tables for a request arriving with the KV of its first `num_kv_tokens` tokens (a KV
        transfer writes them: P/D, a prefix fetch), room for `num_tokens`: group 0 every page,
        a windowed group holes before its window's start, pages from there; returns the pages
        the transfer writes, in `kv_pages`' order. Raises RuntimeError if they cannot be had."""
        if request_id in self.page_tables:
            raise ValueError(f"allocate_import: {request_id=} already has pages")
        if self.groups is None:
            table = self.allocate(request_id, num_tokens)
            return table[: pages_needed(num_kv_tokens, self.page_size)]
        n = pages_needed(num_tokens, self.page_size)
        starts = [self._window_start(g, num_kv_tokens) for g in range(1, self.num_groups)]
        missing = n + sum(n - s for s in starts)
        self._make_room(missing)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of KV pages: {request_id=} needs {missing}, {len(self._free)} free"
            )
        self.page_tables[request_id] = [self._free.popleft() for _ in range(n)]
        tables = self.group_tables[request_id] = []
        for start in starts:
            t = [RESERVED_PAGE] * start
            for _ in range(n - start):
                t.append(self._free.popleft())
                self._refs[t[-1]] = 1
            tables.append(t)
        return self.kv_pages(request_id, num_kv_tokens)

    def kv_pages(self, request_id: str, num_tokens: int) -> list[int]:
        """The pages holding the KV of `request_id`'s first `num_tokens` tokens that its next
        steps read, in order: group 0's, then each windowed group's from its window's start
        (what a KV transfer of them moves; `KVGroups.kv_pages` counts them)."""
        k = pages_needed(num_tokens, self.page_size)
        tables = self.tables_of(request_id)
        out = list(tables[0][:k]) if tables else []
        for g, t in enumerate(tables[1:], 1):
            out += t[self._window_start(g, num_tokens) : k]
        assert RESERVED_PAGE not in out, f"{request_id}: a hole inside its window"
        return out

    def prefix_kv_pages(self, token_ids: Sequence[int], namespace: bytes | None = None):
        """The longest cached prefix of `token_ids` whose windows are resident: (its tokens,
        its pages in `kv_pages`' order: group 0's, then each windowed group's from the window
        before its end, out of the bundles). Changes nothing."""
        pages = self.prefix_cache.match_pages(token_ids, namespace) if self.caching else []
        if self.groups is not None:
            pages = pages[: self._usable(pages)]
        num_tokens = len(pages) * self.page_size
        out = list(pages)
        for g in range(1, self.num_groups):
            for i in range(self._window_start(g, num_tokens), len(pages)):
                out.append(self._bundles[pages[i]][g - 1])
        return num_tokens, out

    def _make_room(self, num_pages: int) -> None:
        """Free pages until `num_pages` are free (or nothing more can go): droppable windowed
        pages first, oldest first, then the prefix cache's LRU pages."""
        while len(self._free) < num_pages and self._droppable:
            self._drop(next(iter(self._droppable)))
        if len(self._free) < num_pages:
            self._free.extend(self._evicted(self.prefix_cache.evict(num_pages - len(self._free))))

    def _evicted(self, pages: list[int]) -> list[int]:
        """Group-0 pages the prefix cache evicted; their bundles' windowed pages are released
        (a page only the bundle held goes to the free list)."""
        for page in pages:
            for w in self._bundles.pop(page, ()):
                if w != RESERVED_PAGE:
                    del self._bundled[w]
                    self._unref(w)
        return pages

    def _unref(self, page: int) -> None:
        n = self._refs[page] - 1
        if n:
            self._refs[page] = n
            if n == 1 and page in self._bundled:
                self._droppable[page] = None
        else:
            del self._refs[page]
            self._droppable.pop(page, None)
            self._free.append(page)

    def _ref(self, page: int) -> None:
        self._refs[page] += 1
        self._droppable.pop(page, None)

    def _drop(self, page: int) -> None:
        """Take droppable windowed `page` out of its bundle and free it."""
        anchor = self._bundled.pop(page)
        bundle = self._bundles[anchor]
        bundle[bundle.index(page)] = RESERVED_PAGE
        self._unref(page)

    def _window_start(self, group: int, num_tokens: int) -> int:
        """The first page windowed group `group` (1..) may still read when the next token is at
        position `num_tokens` (`KVGroups.window_start`)."""
        return self.groups.window_start(group, num_tokens, self.page_size)

    def _usable(self, pages: Sequence[int]) -> int:
        """The longest prefix of the cached group-0 `pages` whose bundles hold every windowed
        page the window before its end reads."""
        bundles = [self._bundles.get(p) for p in pages]
        n = len(pages)
        while n:
            missing = [
                i
                for g in range(1, self.num_groups)
                for i in range(self._window_start(g, n * self.page_size), n)
                if bundles[i] is None or bundles[i][g - 1] == RESERVED_PAGE
            ]
            if not missing:
                return n
            n = max(missing)  # a prefix ending at or after a missing page cannot be used
        return 0

    def _window_entries(self, pages: Sequence[int]) -> list[int]:
        """The windowed pages a match of `pages` holds (those in each group's window)."""
        out = []
        n = len(pages)
        for g in range(1, self.num_groups):
            for i in range(self._window_start(g, n * self.page_size), n):
                out.append(self._bundles[pages[i]][g - 1])
        return out

    def _share_windows(self, request_id: str, pages: Sequence[int], have: int) -> None:
        """After a match of the group-0 `pages` (the request shared `have` of them before):
        the windowed tables take the bundles' pages in the match's window, holes before it."""
        tables = self.group_tables.setdefault(request_id, [[] for _ in self._window_pages])
        n = len(pages)
        for g, t in enumerate(tables, 1):
            start = self._window_start(g, n * self.page_size)
            for i in range(min(have, start)):  # the head shared before, now behind the window
                if t[i] != RESERVED_PAGE:
                    self._unref(t[i])
                    t[i] = RESERVED_PAGE
            for i in range(have, n):
                page = self._bundles[pages[i]][g - 1] if i >= start else RESERVED_PAGE
                if page != RESERVED_PAGE:
                    self._ref(page)
                if i < len(t):
                    if t[i] != RESERVED_PAGE:
                        self._unref(t[i])
                    t[i] = page
                else:
                    t.append(page)

    def release_window(self, request_id: str, num_tokens: int) -> int:
        """Turn the windowed tables' entries before their windows (the next token at position
        `num_tokens`) into holes, releasing their pages; returns how many were released. A
        windowed table is holes, then pages: the scan goes back from the window's start to the
        first hole (every step, for every running request: only what the window just passed)."""
        released = 0
        for g, t in enumerate(self.group_tables.get(request_id, ()), 1):
            i = min(self._window_start(g, num_tokens), len(t)) - 1
            while i >= 0 and t[i] != RESERVED_PAGE:
                self._unref(t[i])
                t[i] = RESERVED_PAGE
                released += 1
                i -= 1
        return released

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back `request_id`'s private pages beyond the first pages_needed(num_tokens) (a
        verification's rejected proposals); the cache's shared head is never cut."""
        table = self.page_tables.get(request_id)
        if table is None:
            return
        keep = max(pages_needed(num_tokens, self.page_size), self.num_shared_pages(request_id))
        while len(table) > keep:
            page = table.pop()
            if page != RESERVED_PAGE:
                self._free.append(page)
        for t in self.group_tables.get(request_id, ()):
            while len(t) > keep:
                page = t.pop()
                if page != RESERVED_PAGE:
                    self._unref(page)

    def cache_computed(
        self, request_id: str, computed_token_ids: Sequence[int], namespace: bytes | None = None
    ) -> None:
        """Offer the full pages of `computed_token_ids` (the request's tokens whose KV is in its
        pages) before its first hole to the prefix cache and share the cache's copy of each from
        now on."""
        if not self.caching:
            return
        num_full = len(computed_token_ids) // self.page_size
        head = self._heads.get(request_id)
        if num_full <= (head.num_offered if head else 0):
            return
        table = self.page_tables[request_id]
        num_full = min(num_full, _first_hole(table))  # a hole breaks the prefix
        if num_full <= (head.num_offered if head else 0):
            return
        tokens = computed_token_ids[: num_full * self.page_size]
        not_adopted = set(self.prefix_cache.insert(tokens, table[:num_full], namespace))
        m = self.prefix_cache.match(tokens, namespace)
        replaced = []
        for i, page in enumerate(m.pages):
            if table[i] != page:
                replaced.append(table[i])
                table[i] = page
        assert set(replaced) == not_adopted, "the cache kept a page it did not adopt"
        self._free.extend(replaced)
        if self.groups is not None:
            self._bundle(request_id, m.pages, head.num_offered if head else 0)
        self.prefix_cache.lock(m.node)
        if head is not None:
            self.prefix_cache.unlock(head.node)
        self._heads[request_id] = _SharedHead(m.node, len(m.pages), num_full)

    def free(
        self,
        request_id: str,
        computed_token_ids: Sequence[int] = (),
        namespace: bytes | None = None,
    ) -> None:
        """Release `request_id`'s pages. `computed_token_ids` (its tokens whose KV is in the
        pages) are offered to the prefix cache first, so a finished, aborted or preempted
        request's prefix stays reusable until evicted."""
        if request_id not in self.page_tables:
            return
        if computed_token_ids:
            self.cache_computed(request_id, computed_token_ids, namespace)
        table = self.page_tables.pop(request_id)
        head = self._heads.pop(request_id, None)
        shared = 0
        if head is not None:
            self.prefix_cache.unlock(head.node)
            shared = head.num_pages
        self._free.extend(p for p in table[shared:] if p != RESERVED_PAGE)  # not the holes
        for t in self.group_tables.pop(request_id, ()):
            for page in t:
                if page != RESERVED_PAGE:
                    self._unref(page)

    def _bundle(self, request_id: str, pages: Sequence[int], start: int) -> None:
        """The cached group-0 `pages` (the head of `request_id`'s table) from index `start` on
        (the ones offered before have their bundles) record the request's windowed pages at
        their positions: a new bundle takes them, an existing one fills its holes from them."""
        tables = self.group_tables[request_id]
        for i in range(start, len(pages)):
            anchor = pages[i]
            bundle = self._bundles.setdefault(anchor, [RESERVED_PAGE] * len(tables))
            for g, t in enumerate(tables):
                page = t[i]
                free_slot = bundle[g] == RESERVED_PAGE
                if free_slot and page != RESERVED_PAGE and page not in self._bundled:
                    bundle[g] = page
                    self._bundled[page] = anchor
                    self._ref(page)

    def evict_page(self, request_id: str, index: int) -> int:
        """Free the private page at `index` of `request_id`'s table and leave a hole
        (RESERVED_PAGE) in its slot; returns the freed page. Raises ValueError for an unknown
        request, an index out of range, in the shared head (the cache's pages are never evicted
        per request), or already a hole."""
        table = self.page_tables.get(request_id)
        if table is None:
            raise ValueError(f"evict_page: unknown {request_id=}")
        if self.groups is not None:
            raise NotImplementedError("sparse KV's page eviction with a hybrid KV layout")
        if not 0 <= index < len(table):
            raise ValueError(f"evict_page: {index=} out of range for {len(table)} pages")
        shared = self.num_shared_pages(request_id)
        if index < shared:
            raise ValueError(f"evict_page: {index=} is in the shared head ({shared} pages)")
        page = table[index]
        if page == RESERVED_PAGE:
            raise ValueError(f"evict_page: {index=} is already a hole")
        table[index] = RESERVED_PAGE
        self._free.append(page)
        return page

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache. Pages that running requests share stay (they are locked);
        returns whether the cache is now empty."""
        cache = self.prefix_cache
        if cache.num_locked_pages:
            self._free.extend(self._evicted(cache.evict(cache.num_evictable_pages)))
            for page in list(self._droppable):  # (locked prefixes keep what their requests hold)
                self._drop(page)
            return False
        self._free.extend(self._evicted(cache.reset()))
        return True

    def num_shared_pages(self, request_id: str) -> int:
        """Pages at the head of `request_id`'s table that the cache owns."""
        head = self._heads.get(request_id)
        return head.num_pages if head else 0

    def num_resident_pages(self, request_id: str) -> int:
        """Entries of `request_id`'s table that hold a page (not holes)."""
        return sum(p != RESERVED_PAGE for p in self.page_tables.get(request_id, ()))

    def tables_of(self, request_id: str) -> list[list[int]]:
        """`request_id`'s page table in every group (group 0 first; none without pages)."""
        if request_id not in self.page_tables:
            return []
        return [self.page_tables[request_id], *self.group_tables.get(request_id, ())]

    def num_offered_pages(self, request_id: str) -> int:
        """Full pages of `request_id` offered to the cache so far (`cache_computed` with no more
        full pages than this does nothing)."""
        head = self._heads.get(request_id)
        return head.num_offered if head else 0

    # ---- invariants ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every usable page has exactly one owner; shared heads are the cache's pages, pinned,
        and referenced exactly as often as their nodes' lock counts say; holes only among the
        private pages (tests only)."""
        cache = self.prefix_cache
        cache.check_invariants()
        private = [
            p
            for rid, t in self.page_tables.items()
            for p in t[self.num_shared_pages(rid) :]
            if p != RESERVED_PAGE  # a hole
        ]
        cached = _cache_pages(cache)
        windowed = list(self._refs)
        all_pages = private + list(self._free) + cached + windowed
        assert RESERVED_PAGE not in all_pages, "reserved page handed out"
        assert len(all_pages) == len(set(all_pages)), "a page is owned twice or freed twice"
        assert len(all_pages) == self.num_pages - 1, "a page leaked"
        assert set(self._heads) <= set(self.page_tables), "a shared head without a table"
        refs: dict[int, int] = {}
        for rid, head in self._heads.items():
            table = self.page_tables[rid]
            assert head.num_pages <= head.num_offered and head.num_pages <= len(table)
            path = _path_pages(cache, head.node)
            assert table[: head.num_pages] == path, f"{rid}'s shared head is not its locked path"
            for p in path:
                refs[p] = refs.get(p, 0) + 1
        if isinstance(cache, RadixCache):
            for node in cache.nodes():
                for p in node.pages:
                    assert refs.get(p, 0) == node.lock_ref, (
                        f"page {p}: {refs.get(p, 0)} tables share it, lock_ref {node.lock_ref}"
                    )
        else:
            assert not refs
        self._check_windows()

    def _check_windows(self) -> None:
        """Each windowed page's count is the table entries and bundles holding it; bundles are
        cached pages'; droppable pages are those only a bundle holds."""
        held: dict[int, int] = {}
        assert set(self.group_tables) <= set(self.page_tables), "group tables without a table"
        for rid, tables in self.group_tables.items():
            assert len(tables) == self.num_groups - 1
            for t in tables:
                assert len(t) <= len(self.page_tables[rid]), f"{rid}: a windowed table too long"
                pages = t[_last_hole(t) + 1 :]
                assert RESERVED_PAGE not in pages, f"{rid}: a windowed table with a hole in pages"
                for p in t:
                    if p != RESERVED_PAGE:
                        held[p] = held.get(p, 0) + 1
        cached = set(_cache_pages(self.prefix_cache))
        for anchor, bundle in self._bundles.items():
            assert anchor in cached, f"a bundle of page {anchor}, which is not cached"
            for p in bundle:
                if p != RESERVED_PAGE:
                    assert self._bundled[p] == anchor
                    held[p] = held.get(p, 0) + 1
        assert held == self._refs, "a windowed page's count is off"
        assert set(self._bundled) <= set(self._refs)
        only_bundled = {p for p in self._bundled if self._refs[p] == 1}
        assert set(self._droppable) == only_bundled, "droppable pages are off"


def _last_hole(table: Sequence[int]) -> int:
    """The index of the last hole in `table` (-1 if none)."""
    return next((i for i in range(len(table) - 1, -1, -1) if table[i] == RESERVED_PAGE), -1)


def _first_hole(table: Sequence[int]) -> int:
    """The index of the first hole in `table` (its length if none)."""
    return next((i for i, p in enumerate(table) if p == RESERVED_PAGE), len(table))


def _cache_pages(cache: PrefixCache) -> list[int]:
    if isinstance(cache, RadixCache):
        return [p for node in cache.nodes() for p in node.pages]
    return []


def _path_pages(cache: PrefixCache, node: RadixNode | None) -> list[int]:
    """The pages from the root down to `node`."""
    chunks = []
    while node is not None and node.parent is not None:
        chunks.append(node.pages)
        node = node.parent
    if node is not None and isinstance(cache, RadixCache):
        assert node.is_root, "a shared head ends at a detached node"
    return [p for chunk in reversed(chunks) for p in chunk]

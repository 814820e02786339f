"""Host-side owner of the KV pages: the free list and each request's page table.

Page 0 is reserved (padded writes land there) and never handed out. Invariant: every page other
than 0 is either free or in exactly one request's table.
"""

from __future__ import annotations

from collections import deque

from llmjax.model.step_input import RESERVED_PAGE


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(p for p in range(num_pages) if p != RESERVED_PAGE)
        self.page_tables: dict[str, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def num_missing_pages(self, request_id: str, num_tokens: int) -> int:
        """Pages to add so that `request_id` can hold `num_tokens` tokens."""
        have = len(self.page_tables.get(request_id, ()))
        return max(0, pages_needed(num_tokens, self.page_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int, keep_free: int = 0) -> bool:
        """Whether `request_id` can grow to `num_tokens` tokens and leave `keep_free` pages free
        (the admission watermark)."""
        return self.num_missing_pages(request_id, num_tokens) + keep_free <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow `request_id`'s table to hold `num_tokens` tokens; returns the whole table."""
        missing = self.num_missing_pages(request_id, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of KV pages: {request_id=} needs {missing}, {len(self._free)} free"
            )
        table = self.page_tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(missing))
        return table

    def free(self, request_id: str) -> None:
        for page in self.page_tables.pop(request_id, ()):
            self._free.append(page)

    def check_invariants(self) -> None:
        owned = [p for table in self.page_tables.values() for p in table]
        all_pages = owned + list(self._free)
        assert RESERVED_PAGE not in all_pages, "reserved page handed out"
        assert len(all_pages) == len(set(all_pages)), "a page is owned twice or freed twice"
        assert len(all_pages) == self.num_pages - 1, "a page leaked"

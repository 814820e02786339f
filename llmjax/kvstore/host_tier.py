"""T1: a preallocated host-memory pool of KV blocks keyed by chained page keys (issue 22, item 2;
the store interface the other tiers will share).

    tier = HostTier(num_blocks=1024, block_shape=(L, 2, page_size, K, H), dtype="float32")
    if tier.put(key, parent_key, block):        # two-phase inside: begin -> write -> commit
        ...
    n = tier.exists(keys)                       # how many leading keys are readable
    block = tier.get(keys[0])                   # a copy of the exact bytes, or None
    with tier.lease(keys[0]): ...               # a copy in flight: neither evicted nor removed

The rules (what `check_invariants` asserts):

- **Two-phase put.** `put_begin` reserves a slot and registers the key as *writing*: invisible
  to `get` and `exists` until `put_commit`; `put_abort` (or a writer that never commits: the next
  `put_begin` of that key, or `remove`) frees it. A half-written block is never readable.
- **Chains.** A key may be stored only under a parent that is readable here (or `ROOT_KEY`):
  `put_begin` refuses an orphan. `remove(key)` removes its whole subtree, so no chained key
  outlives its parent. Eviction takes only leaves (childless blocks), least recently used first,
  so suffixes go before the prefixes they extend.
- **Leases and pins.** A leased block (a copy in flight) is never evicted or removed (`remove`
  raises). A soft-pinned block is evicted only when no unpinned leaf is left.
- **Watermarks.** When a `put_begin` finds the pool above `high_watermark` (or full), it evicts
  down to `low_watermark`; if no slot can be freed (everything leased or holding children) the
  put is refused (False): the caller recomputes instead, nothing is lost.

The pool is one numpy array on the CPU (on TPU/GPU it will be a `pinned_host` array). Plain
Python + numpy, no jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from llmjax.kvstore.keys import ROOT_KEY


@dataclasses.dataclass
class _Block:
    slot: int
    parent: bytes
    ready: bool = False
    children: set[bytes] = dataclasses.field(default_factory=set)
    leases: int = 0
    pinned: bool = False
    last_access: int = 0


class HostTier:
    """T1 (the module doc): `num_blocks` slots of `block_shape` x `dtype` in host memory."""

    name = "host"

    def __init__(
        self,
        num_blocks: int,
        block_shape: Sequence[int],
        dtype="float32",
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
    ):
        if num_blocks < 1:
            raise ValueError(f"{num_blocks=} must be >= 1")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < {low_watermark=} <= {high_watermark=} <= 1")
        self.num_blocks = num_blocks
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.high_watermark, self.low_watermark = high_watermark, low_watermark
        self.pool = np.zeros((num_blocks, *self.block_shape), self.dtype)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low slots first
        self._blocks: dict[bytes, _Block] = {}
        self._clock = itertools.count(1)
        self.num_evictions = 0
        # Hooks for the tier above (llmjax/kvstore/tiered.py): `on_evict(key, parent)` just
        # before eviction drops a block (still readable: a write-back copies it down);
        # `on_drop(key)` after any readable block leaves (evicted, removed, reset).
        self.on_evict = None
        self.on_drop = None

    # ---- puts ------------------------------------------------------------------------------

    def put_begin(self, key: bytes, parent: bytes = ROOT_KEY) -> bool:
        """Reserve a slot for `key` under `parent` (readable here, or ROOT_KEY); False if the
        parent is missing or no slot can be freed. A key already readable stays as it is
        (True); one being written is restarted."""
        b = self._blocks.get(key)
        if b is not None:
            if b.ready:
                return True
            self._drop(key)  # a writer that never committed
        if parent != ROOT_KEY and not self._readable(parent):
            return False
        if self.num_used >= self.high_watermark * self.num_blocks or self._full():
            held = self._blocks.get(parent)  # the parent must survive the eviction
            if held is not None:
                held.leases += 1
            try:
                self.evict(self.num_used - int(self.low_watermark * self.num_blocks) or 1)
            finally:
                if held is not None:
                    held.leases -= 1
        slot = self._alloc(key)
        if slot is None:
            return False
        self._blocks[key] = _Block(slot, parent, last_access=next(self._clock))
        if parent != ROOT_KEY:
            self._blocks[parent].children.add(key)
        return True

    def write(self, key: bytes, data: np.ndarray) -> None:
        b = self._blocks.get(key)
        if b is None or b.ready:
            raise KeyError(f"write: key {key.hex()} has no put in progress")
        data = np.asarray(data)
        if data.shape != self.block_shape:
            raise ValueError(f"block of shape {data.shape}; this tier holds {self.block_shape}")
        self._write_slot(b, data)

    def put_commit(self, key: bytes) -> None:
        b = self._blocks.get(key)
        if b is None:
            raise KeyError(f"put_commit: key {key.hex()} has no put in progress")
        if self._blocks.get(b.parent) is None and b.parent != ROOT_KEY:
            raise KeyError(f"put_commit: the parent of {key.hex()} is gone")
        self._commit_slot(key, b)
        b.ready = True

    def put_abort(self, key: bytes) -> None:
        b = self._blocks.get(key)
        if b is not None and not b.ready:
            self._drop(key)

    def put(self, key: bytes, parent: bytes, data: np.ndarray) -> bool:
        """begin -> write -> commit; False (nothing stored) if the put was refused."""
        if key in self._blocks and self._blocks[key].ready:
            return True
        if not self.put_begin(key, parent):
            return False
        try:
            self.write(key, data)
        except Exception:
            self.put_abort(key)
            raise
        self.put_commit(key)
        return True

    # ---- reads -----------------------------------------------------------------------------

    def get(self, key: bytes) -> np.ndarray | None:
        """A copy of `key`'s block, or None if it is not readable here."""
        if not self._readable(key):
            return None
        b = self._blocks[key]
        b.last_access = next(self._clock)
        data = self._read_slot(key, b)
        if data is None and not b.leases:  # corrupt (disk): gone, with what chains below it
            self.remove(key)
        return data

    def peek(self, key: bytes) -> np.ndarray | None:
        """`get` without touching recency (a copy down to the next tier)."""
        if not self._readable(key):
            return None
        return self._read_slot(key, self._blocks[key])

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent `key` was stored under (ROOT_KEY for a first block); None if absent."""
        b = self._blocks.get(key)
        return b.parent if b is not None else None

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain, first to last) are readable here, from the first."""
        n = 0
        for k in keys:
            if not self._readable(k):
                break
            n += 1
        return n

    def __contains__(self, key: bytes) -> bool:
        return self._readable(key)

    # ---- leases, pins, removal, eviction ---------------------------------------------------

    @contextlib.contextmanager
    def lease(self, key: bytes):
        """Hold `key` (readable) against eviction and removal while a copy is in flight."""
        if not self._readable(key):
            raise KeyError(f"lease: key {key.hex()} is not readable here")
        b = self._blocks[key]
        b.leases += 1
        try:
            yield self._read_slot(key, b)
        finally:
            b.leases -= 1

    def pin(self, key: bytes, pinned: bool = True) -> None:
        """Soft-pin `key`: evicted only when no unpinned leaf is left."""
        if key not in self._blocks:
            raise KeyError(f"pin: key {key.hex()} is not here")
        self._blocks[key].pinned = pinned

    def remove(self, key: bytes) -> int:
        """Remove `key` and every block chained below it; returns how many. Raises if one of
        them is leased."""
        if key not in self._blocks:
            return 0
        subtree = self._subtree(key)
        leased = [k for k in subtree if self._blocks[k].leases]
        if leased:
            raise RuntimeError(f"remove: {len(leased)} block(s) under {key.hex()} are leased")
        for k in reversed(subtree):  # leaves first
            self._drop(k)
        return len(subtree)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` slots: leaves only (no chained key orphaned), never leased,
        unpinned before pinned, least recently used first; writes in progress are left alone.
        Returns how many were freed."""
        freed = 0
        while freed < num_blocks:
            leaves = [
                (b.pinned, b.last_access, k)
                for k, b in self._blocks.items()
                if b.ready and not b.children and not b.leases
            ]
            if not leaves:
                break
            _, _, k = min(leaves)
            if self.on_evict is not None:
                b = self._blocks[k]
                b.leases += 1  # the hook reads it; nothing may take it meanwhile
                try:
                    self.on_evict(k, b.parent)
                finally:
                    b.leases -= 1
            self._drop(k)
            freed += 1
        self.num_evictions += freed
        return freed

    def reset(self) -> None:
        """Drop every block (an error while one is leased)."""
        if any(b.leases for b in self._blocks.values()):
            raise RuntimeError("reset while blocks are leased")
        for k in list(self._blocks):
            if k in self._blocks:
                self._drop(k)

    # ---- accounting ------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def readable_keys(self) -> list[bytes]:
        """The readable keys."""
        return [k for k, b in self._blocks.items() if b.ready]

    def check_invariants(self) -> None:
        self._check_storage()
        for k, b in self._blocks.items():
            if b.parent != ROOT_KEY:
                parent = self._blocks.get(b.parent)
                assert parent is not None and parent.ready, "a chained key outlived its parent"
                assert k in parent.children, "a parent does not list its child"
            for c in b.children:
                assert self._blocks[c].parent == k, "a child names another parent"
            assert b.leases >= 0

    # ---- internals -------------------------------------------------------------------------

    def _readable(self, key: bytes) -> bool:
        b = self._blocks.get(key)
        return b is not None and b.ready

    def _subtree(self, key: bytes) -> list[bytes]:
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self._blocks[k].children)
        return out

    def _drop(self, key: bytes) -> None:
        b = self._blocks.pop(key)
        for c in list(b.children):  # a writer's children cannot exist; ready ones go too
            if c in self._blocks:
                self._drop(c)
        if b.parent in self._blocks:
            self._blocks[b.parent].children.discard(key)
        self._release_slot(key, b)
        if b.ready and self.on_drop is not None:
            self.on_drop(key)

    # ---- storage (a subclass keeps blocks elsewhere: DiskTier) -----------------------------

    def _full(self) -> bool:
        return not self._free

    def _alloc(self, key: bytes):
        return self._free.pop() if self._free else None

    def _write_slot(self, b: _Block, data: np.ndarray) -> None:
        self.pool[b.slot] = data

    def _commit_slot(self, key: bytes, b: _Block) -> None:
        pass

    def _read_slot(self, key: bytes, b: _Block) -> np.ndarray | None:
        return self.pool[b.slot].copy()

    def _release_slot(self, key: bytes, b: _Block) -> None:
        self._free.append(b.slot)

    def _check_storage(self) -> None:
        slots = [b.slot for b in self._blocks.values()]
        assert len(slots) == len(set(slots)), "a slot holds two blocks"
        assert not set(slots) & set(self._free), "a used slot is free"
        assert len(slots) + len(self._free) == self.num_blocks, "a slot leaked"

"""The tiers below the device pages as one store (issue 22, item 2): T1 host memory, T2 local
disk, T3 Mooncake Store, fastest first, each holding KV *blocks* under chained keys.

    store = TieredStore([HostTier(...), DiskTier(...)], write_policy="write_back")
    tiers = store.available(block_keys)        # per block of a chain: the fastest tier holding it
    data = store.read(block_keys[0], tiers[0]) # exact bytes, or None (then recompute)
    store.write(0, [(key, parent, data), ...]) # a chain into T1, parents first

A block is `block_pages` consecutive full KV pages of a prefix; its key is the page key of its
last page (`llmjax/kvstore/keys.py`: a page key chains every token before it, so a block key
names the whole prefix up to the block's end) and its parent is the previous block's key
(ROOT_KEY for the first). A partial block is never stored.

Each tier is prefix-closed (a block is stored only under a parent the same tier holds, and
eviction takes leaves first), so the longest prefix the store can give is the longest any one
tier holds: `available` asks each tier `exists` over the chain.

Moving blocks down (`write_policy`, SGLang HiCache's names; the engine applies the same to
T0 -> T1, `llmjax/engine/kv_tiers.py`):
  write_through            every block written to tier i is written to tier i + 1 too.
  write_through_selective  a block goes to tier i + 1 once it has been read from tier i
                           `write_through_threshold` times (default 2): hot blocks only.
  write_back               a block goes to tier i + 1 when tier i evicts it.
A write down copies the block's missing ancestors first (they are still in tier i, which
evicts leaves first), so the lower tier stays prefix-closed. A write that fails (a full disk,
an unreachable Mooncake master, a refused put) is logged with its reason and counted
(`num_errors`); the chain stops there and those blocks are simply recomputed later.
No jax.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from llmjax.kvstore.keys import ROOT_KEY

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class TieredStore:
    """The tiers below T0 (the module doc). `tiers`: objects with HostTier's interface, fastest
    first; their `name`s must differ."""

    def __init__(
        self,
        tiers: Sequence,
        block_pages: int = 1,
        write_policy: str = "write_through_selective",
        write_through_threshold: int = 2,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown {write_policy=}; choose one of {WRITE_POLICIES}")
        if block_pages < 1 or write_through_threshold < 1:
            raise ValueError(f"{block_pages=} and {write_through_threshold=} must be >= 1")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names {names} repeat")
        self.tiers = list(tiers)
        self.block_pages = block_pages
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.names = names
        self.num_errors = 0
        self.num_refused = 0  # puts a full tier turned down
        self.last_error: str | None = None
        self.bytes_written = dict.fromkeys(names, 0)
        self.bytes_read = dict.fromkeys(names, 0)
        self._reads: dict[tuple[int, bytes], int] = {}  # write_through_selective's hit counts
        self.listeners: list = []  # f(tier_index, key, present): a block came or went
        self.config = None  # the KVStoreConfig it was made from (make_store)
        for i, tier in enumerate(self.tiers):
            if i + 1 < len(self.tiers) and write_policy == "write_back":
                tier.on_evict = lambda key, parent, i=i: self._write_down(i, key)
            if hasattr(tier, "on_drop"):
                tier.on_drop = lambda key, i=i: self._dropped(i, key)

    def __len__(self) -> int:
        return len(self.tiers)

    # ---- reads ----------------------------------------------------------------------------

    def available(self, keys: Sequence[bytes]) -> list[int]:
        """For the longest prefix of the chain `keys` that some tier holds: the index of the
        fastest tier holding each block."""
        counts = [t.exists(keys) for t in self.tiers]
        return [
            next(i for i, c in enumerate(counts) if c > j) for j in range(max(counts, default=0))
        ]

    def read(self, key: bytes, tier: int) -> np.ndarray | None:
        """Block `key` from tier `tier` (leased while it is copied), or None if it is gone or
        fails its checksum (the caller recomputes). Counts the read for
        write_through_selective and copies a block that got hot to the next tier."""
        t = self.tiers[tier]
        try:
            data = t.get(key)
        except Exception as e:  # a tier must never fail the engine
            self._error(f"{t.name}: get failed: {e!r}")
            return None
        if data is None:
            return None
        self.bytes_read[t.name] += data.nbytes
        if self.write_policy == "write_through_selective" and tier + 1 < len(self.tiers):
            n = self._reads.get((tier, key), 0) + 1
            self._reads[(tier, key)] = n
            if n == self.write_through_threshold:
                self._write_down(tier, key)
        return data

    # ---- writes ---------------------------------------------------------------------------

    def write(self, tier: int, blocks: Sequence[tuple[bytes, bytes, np.ndarray]]) -> int:
        """Store a chain of (key, parent, data), parents first, in tier `tier`; blocks it
        holds already are skipped. Returns how many of the chain it now holds (it stops at the
        first refused or failed put). Under write_through the blocks go on down too."""
        t = self.tiers[tier]
        held = 0
        for key, parent, data in blocks:
            if key in t:
                held += 1
                continue
            try:
                ok = t.put(key, parent, data)
            except Exception as e:  # a full disk, an unreachable master, ...
                self._error(f"{t.name}: put failed: {e!r}")
                break
            if not ok:  # full of leased or chained blocks: a capacity limit, not a fault
                self.num_refused += 1
                break
            self.bytes_written[t.name] += data.nbytes
            held += 1
            for f in self.listeners:
                f(tier, key, True)
        if self.write_policy == "write_through" and tier + 1 < len(self.tiers):
            self.write(tier + 1, blocks)  # also what this tier refused
        return held

    def _write_down(self, tier: int, key: bytes) -> None:
        """Copy `key` (readable in tier `tier`) and its ancestors the next tier lacks there."""
        upper, lower = self.tiers[tier], self.tiers[tier + 1]
        chain, k = [], key
        while k != ROOT_KEY and k not in lower:
            parent = upper.parent_of(k)
            if parent is None:  # not in the upper tier (cannot happen: it is prefix-closed)
                return
            chain.append((k, parent))
            k = parent
        blocks = []
        for k, parent in reversed(chain):
            data = upper.peek(k)
            if data is None:
                break
            blocks.append((k, parent, data))
        if blocks:
            self.write(tier + 1, blocks)

    def _dropped(self, tier: int, key: bytes) -> None:
        self._reads.pop((tier, key), None)
        for f in self.listeners:
            f(tier, key, False)

    def _error(self, reason: str) -> None:
        self.num_errors += 1
        if reason != self.last_error:
            logger.warning("kv store: %s; those blocks will be recomputed", reason)
        self.last_error = reason

    # ---- maintenance ----------------------------------------------------------------------

    def reset(self) -> None:
        for t in self.tiers:
            t.reset()
        self._reads.clear()

    def check_invariants(self) -> None:
        for t in self.tiers:
            t.check_invariants()


def make_store(kv_config, block_shape, dtype, block_pages: int, namespace: str = "") -> TieredStore:
    """The store `kv_config` (`llmjax.config.KVStoreConfig`) describes: T1 host, T2 disk, T3
    Mooncake, each if configured, for blocks of `block_shape` x `dtype`. `namespace` (the key
    salt's hex, say) names this model and layout's subdirectory of `disk_dir` and prefixes its
    Mooncake keys, so engines of other models share the directory and the master safely."""
    import os

    from llmjax.kvstore.disk_tier import DiskTier
    from llmjax.kvstore.host_tier import HostTier

    tiers = []
    if kv_config.host_blocks:
        tiers.append(HostTier(kv_config.host_blocks, block_shape, dtype))
    if kv_config.disk_dir:
        directory = os.path.join(kv_config.disk_dir, namespace) if namespace else kv_config.disk_dir
        tiers.append(
            DiskTier(
                directory, kv_config.disk_blocks, block_shape, dtype, fsync=kv_config.disk_fsync
            )
        )
    if kv_config.mooncake_master:
        from llmjax.kvstore.mooncake_tier import MooncakeTier

        host = kv_config.mooncake_master.rsplit(":", 1)[0]
        tiers.append(
            MooncakeTier(
                block_shape,
                dtype,
                master_address=kv_config.mooncake_master,
                metadata_url=kv_config.mooncake_metadata or f"http://{host}:8080/metadata",
                namespace=f"{kv_config.mooncake_namespace}-{namespace}"
                if namespace
                else kv_config.mooncake_namespace,
            )
        )
    store = TieredStore(
        tiers, block_pages, kv_config.write_policy, kv_config.write_through_threshold
    )
    store.config = kv_config  # an engine given this store runs under its policies
    return store

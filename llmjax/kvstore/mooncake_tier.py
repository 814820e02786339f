"""T3: KV blocks in a Mooncake Store cluster, under the host tier's interface (issue 22, item 2).

    with start_master() as m:                  # llmjax/kvstore/mooncake_master.py
        tier = MooncakeTier(block_shape, master_address=m.master_address,
                            metadata_url=m.metadata_url, namespace="my-deployment")
        tier.put(key, parent, block)           # visible to every client of that master
        n = tier.exists(keys)                  # one batch RPC over the chain

Every client of one master shares the blocks: a prefix one instance saved, another reads
(`MooncakeDistributedStore` over TCP; each client also lends `global_segment_bytes` of its host
memory to the pool, 0 for a pure client). The rules, and how they map onto Mooncake:

- **Objects.** A block is the object `<namespace>/<key hex>` (so deployments, users and test
  runs sharing a master never collide; page keys are already salted by model, dtype, page size
  and layout). Its value is a header (magic, version, the key, the parent key, dtype, shape)
  and a blake2b checksum over header and payload, then the payload. `get` checks all of it: a
  flipped byte, a value under the wrong key or a parent other than the one this client stored
  reads as missing (logged; the object and what this client chained below it are removed); a
  value of another shape, dtype or version reads as missing and is left alone.
- **Two-phase put.** `put_begin` asks the store (one batch RPC) whether the parent is there
  (or is `ROOT_KEY`) and whether the key already is; it refuses an orphan and stages nothing
  remote; `write` builds the value locally; `put_commit` does the store put. Mooncake's put is
  itself two-phase at the master (PutStart allocates, the transfer writes, PutEnd marks the
  replica COMPLETE; its design doc: "ensures that other Clients do not read partially written
  values"), so a half-written block is never readable anywhere, and a writer that dies between
  the two is discarded by the master (`put_start_discard_timeout_sec`). Values are immutable
  (a put of a present key leaves it as it is); `pin` rewrites one with `upsert`.
- **Chains and eviction.** The master evicts on its own (approximate LRU past
  `eviction_high_watermark_ratio`, sparing leased and unfinished objects), so a chain can lose
  a middle block. The invariant: `exists` walks the chain from its first key and stops at the
  first missing one, so **an orphan is never reachable** (a block's bytes stay right: its key
  names its whole prefix). Locally this client indexes the blocks it put: parents, children,
  pins and last use; `remove(key)` removes the key and the children it knows of; with
  `num_blocks` set it also keeps its own budget with the host tier's watermark eviction
  (leaves, LRU, unpinned first). A block found missing is forgotten with its local subtree.
- **Leases.** `lease(key)` holds a local count: this client's `remove`, `evict` and `reset`
  spare (or refuse) a leased key. Mooncake has its own read lease: every ExistKey or
  GetReplicaList (so `exists`, `in` and `get` here) grants the object `default_kv_lease_ttl`
  (10 s in this build) during which the master neither evicts nor (non-forcibly) removes it,
  and a read that outlives its lease fails (LEASE_EXPIRED) instead of returning torn bytes;
  `exists` therefore also keeps a matched prefix alive while it is fetched. This tier removes
  with `force=True` (a normal remove fails for the lease TTL after every put or lookup), which
  bypasses other clients' read leases: such a reader gets a failed read or bytes that fail the
  checksum, a miss, never a wrong block (Mooncake issues #850, #4239 discuss reads that
  outlive their lease).
- **Pins.** `pin` records the flag locally (used by this client's eviction) and, where the
  client has soft pins (`ReplicateConfig.soft_pin_action`), re-upserts the verified value with
  ENABLE (DISABLE to unpin): the master then evicts it only when nothing unpinned is left
  (`allow_evict_soft_pinned_objects`), and the pin lapses after `default_kv_soft_pin_ttl`
  without access.
- **Degrade, never fail.** Before `setup` (which retries for about 90 s against a dead master)
  the master's RPC port and metadata server are probed. An unreachable master, a put or get
  that raises or returns an error code: the reason is logged (once per kind), counted
  (`num_errors`, `last_error`) and the call answers a miss (put False, get None, exists stops);
  a lost connection makes the tier `healthy = False` and skip the store until
  `retry_interval_s` has passed, then probe again. The first call after the master vanishes
  blocks for the client's RPC timeout (about 4 s measured); `close` takes 1-2 s (the client
  unmounts its segment), longer while the master is gone.

Not thread-safe (like HostTier). No jax; `mooncake` is imported when a tier is made.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import re
import struct
import time
from collections.abc import Sequence

import numpy as np

from llmjax.kvstore.keys import KEY_BYTES, ROOT_KEY
from llmjax.kvstore.mooncake_master import probe

logger = logging.getLogger(__name__)

MAGIC = b"LJMC"
VERSION = 1
_HEAD = struct.Struct(f"<4sH{KEY_BYTES}s{KEY_BYTES}s16sB")  # magic, version, key, parent, dtype,
# ndim; then the shape (int64 each)
_DIGEST = 16  # blake2b over header and payload, between them
# Mooncake error codes (mooncake-store/include/types.h)
_MISSING = {-703, -704, -707, -712}  # not ready, not found, lease expired, replica gone
_EXISTS = -705
_BUFFER_TOO_SMALL = -600  # get_into: INVALID_PARAMS (the object is larger: not ours)
_UNREACHABLE = {-900, -901}  # RPC_FAIL, RPC_TIMEOUT


@dataclasses.dataclass
class _Entry:
    parent: bytes
    ready: bool = False
    children: set[bytes] = dataclasses.field(default_factory=set)
    pinned: bool = False
    last_access: int = 0
    value: bytes | None = None  # staged by `write` until `put_commit`


class MooncakeTier:
    """T3 (the module doc): blocks of `block_shape` x `dtype` in a Mooncake Store cluster."""

    name = "mooncake"

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype="float32",
        *,
        master_address: str = "127.0.0.1:50051",
        metadata_url: str = "http://127.0.0.1:8080/metadata",
        namespace: str = "llmjax",
        num_blocks: int | None = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        global_segment_bytes: int = 256 << 20,
        local_buffer_bytes: int | None = None,
        local_hostname: str = "127.0.0.1",
        retry_interval_s: float = 5.0,
        connect_timeout_s: float = 1.0,
    ):
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"{num_blocks=} must be >= 1 (or None: no budget of its own)")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < {low_watermark=} <= {high_watermark=} <= 1")
        if not namespace or "/" in namespace:
            raise ValueError(f"{namespace=} must be non-empty, without '/'")
        try:
            import mooncake.store as store_module
        except ImportError as e:
            raise ImportError(
                f"MooncakeTier needs the mooncake wheel: pip install 'llmjax[mooncake]' "
                f"(mooncake-transfer-engine-non-cuda; it needs Debian's libibverbs1): {e}"
            ) from e
        self._mc = store_module
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.num_blocks = num_blocks
        self.high_watermark, self.low_watermark = high_watermark, low_watermark
        self.namespace = namespace
        self.master_address, self.metadata_url = master_address, metadata_url
        self.retry_interval_s, self.connect_timeout_s = retry_interval_s, connect_timeout_s
        self._shape_bytes = struct.pack(f"<{len(self.block_shape)}q", *self.block_shape)
        self.payload_bytes = math.prod(self.block_shape) * self.dtype.itemsize
        self._head_bytes = _HEAD.size + len(self._shape_bytes)
        self.value_bytes = self._head_bytes + _DIGEST + self.payload_bytes
        if local_buffer_bytes is None:  # the client stages a put's value there: room for two
            local_buffer_bytes = max(16 << 20, 2 * self.value_bytes)
        self._setup_args = (
            local_hostname, metadata_url, global_segment_bytes, local_buffer_bytes, "tcp", "",
            master_address,
        )  # fmt: skip
        self._recv = np.empty(self.value_bytes, np.uint8)  # registered with the client
        self._blocks: dict[bytes, _Entry] = {}
        self._foreign: dict[bytes, set[bytes]] = {}  # children under a parent not indexed here
        self._leases: collections.Counter[bytes] = collections.Counter()
        self._clock = itertools.count(1)
        self.num_evictions = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self._logged: set[str] = set()
        self._client = None
        self._healthy = self._closed = False
        self._retry_at = 0.0
        self._connect()

    # ---- connection ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Connected, and no call has lost the master since (then: misses until a retry)."""
        return self._healthy

    def _connect(self) -> bool:
        reason = probe(self.master_address, self.metadata_url, self.connect_timeout_s)
        if reason is None and self._client is None:
            client = self._mc.MooncakeDistributedStore()
            rc = client.setup(*self._setup_args)
            if rc == 0:
                rc = client.register_buffer(self._recv.ctypes.data, self._recv.nbytes)
            if rc == 0:
                self._client = client
            else:
                reason = f"setup with master {self.master_address} returned {rc}"
        elif reason is None and self._client.health_check() != 0:
            reason = f"master {self.master_address} fails its health check"
        if reason is not None:
            self._down(f"connect: {reason}")
            return False
        if not self._healthy:
            logger.info("kv mooncake tier: connected to master %s", self.master_address)
            self._logged.clear()  # a later outage is logged again
        self._healthy = True
        return True

    def _ready(self) -> bool:
        if self._healthy:
            return True
        if self._closed or time.monotonic() < self._retry_at:
            return False
        return self._connect()

    def _down(self, reason: str) -> None:
        self._healthy = False
        self._retry_at = time.monotonic() + self.retry_interval_s
        self._error("down", f"{reason}; answering misses, retrying every {self.retry_interval_s} s")

    def _error(self, kind: str, reason: str) -> None:
        self.num_errors += 1
        self.last_error = reason
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, "kv mooncake tier: %s", reason)

    def _call(self, op: str, fn, *args):
        """`fn(*args)` on the client; None if it raised (the tier goes down)."""
        try:
            return fn(*args)
        except Exception as e:
            self._down(f"{op} raised {e!r}")
            return None

    def _failed(self, op: str, rc: int) -> None:
        if rc in _UNREACHABLE:
            self._down(f"{op}: master {self.master_address} unreachable (error {rc})")
        else:
            self._error(f"{op}{rc}", f"{op} returned error {rc}")

    def object_name(self, key: bytes) -> str:
        """The store object holding `key`'s block."""
        return f"{self.namespace}/{key.hex()}"

    def close(self) -> None:
        """Leave the cluster (the blocks in this client's segment go with it)."""
        client, self._client, self._healthy, self._closed = self._client, None, False, True
        if client is not None:
            with contextlib.suppress(Exception):
                client.unregister_buffer(self._recv.ctypes.data)
            with contextlib.suppress(Exception):
                client.close()

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- puts ------------------------------------------------------------------------------

    def put_begin(self, key: bytes, parent: bytes = ROOT_KEY) -> bool:
        """Register `key` under `parent` (in the store, or ROOT_KEY); False if the parent is
        missing, the budget is full or the store is unreachable. A key already in the store
        stays as it is (True, nothing to write); one being written is restarted."""
        e = self._blocks.get(key)
        if e is not None and not e.ready:
            self._drop(key)  # a writer that never committed
        if not self._ready():
            return False
        p = self._blocks.get(parent)
        if p is not None and not p.ready:
            return False  # still being written here
        names = [self.object_name(key)] + ([self.object_name(parent)] if parent != ROOT_KEY else [])
        found = self._call("exists", self._client.batch_is_exist, names)
        if found is None or any(f < 0 for f in found):
            if found is not None:
                self._failed("exists", min(found))
            return False
        if parent != ROOT_KEY and found[1] != 1:
            self._forget(parent)
            return False
        if key in self._blocks:  # readable here: is it still in the store?
            if found[0] == 1:
                return True
            self._forget(key)
        if not self._reserve(parent):
            return False
        self._blocks[key] = _Entry(parent, last_access=next(self._clock))
        if parent in self._blocks:
            self._blocks[parent].children.add(key)
        elif parent != ROOT_KEY:
            self._foreign.setdefault(parent, set()).add(key)
        if found[0] == 1:
            self._mark_ready(key)
        return True

    def write(self, key: bytes, data: np.ndarray) -> None:
        e = self._blocks.get(key)
        if e is None or e.ready:
            raise KeyError(f"write: key {key.hex()} has no put in progress")
        data = np.asarray(data)
        if data.shape != self.block_shape:
            raise ValueError(f"block of shape {data.shape}; this tier holds {self.block_shape}")
        e.value = self._encode(key, e.parent, np.ascontiguousarray(data, self.dtype).tobytes())

    def put_commit(self, key: bytes) -> bool:
        """The store put; True once the block is readable cluster-wide, False (nothing kept,
        the reason logged) if the store refused or is unreachable."""
        e = self._blocks.get(key)
        if e is None:
            raise KeyError(f"put_commit: key {key.hex()} has no put in progress")
        if e.ready:
            return True
        if e.value is None:
            raise KeyError(f"put_commit: nothing was written for {key.hex()}")
        value, e.value = e.value, None
        rc = None
        if self._ready():
            rc = self._call("put", self._client.put, self.object_name(key), value)
        if rc in (0, _EXISTS):
            self._mark_ready(key)
            return True
        if rc is not None:
            self._failed("put", rc)
        self._drop(key)
        return False

    def put_abort(self, key: bytes) -> None:
        e = self._blocks.get(key)
        if e is not None and not e.ready:
            self._drop(key)

    def put(self, key: bytes, parent: bytes, data: np.ndarray) -> bool:
        """begin -> write -> commit; False (nothing stored) if the put was refused."""
        if not self.put_begin(key, parent):
            return False
        if self._blocks[key].ready:
            return True
        try:
            self.write(key, data)
        except Exception:
            self.put_abort(key)
            raise
        return self.put_commit(key)

    # ---- reads -----------------------------------------------------------------------------

    def get(self, key: bytes) -> np.ndarray | None:
        """A verified copy of `key`'s block (whoever stored it), or None."""
        data = self._read(key)
        e = self._blocks.get(key)
        if data is not None and e is not None:
            e.last_access = next(self._clock)
        return data

    def peek(self, key: bytes) -> np.ndarray | None:
        """`get` without touching recency."""
        return self._read(key)

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent this client stored `key` under; None if it did not."""
        e = self._blocks.get(key)
        return e.parent if e is not None else None

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain, first to last) are in the store, from the first."""
        if not keys or not self._ready():
            return 0
        found = self._call(
            "exists", self._client.batch_is_exist, [self.object_name(k) for k in keys]
        )
        n = 0
        for k, f in zip(keys, found or (), strict=False):
            if f != 1:
                if f == 0:
                    self._forget(k)
                else:
                    self._failed("exists", f)
                break
            n += 1
        return n

    def __contains__(self, key: bytes) -> bool:
        return self.exists([key]) == 1

    # ---- leases, pins, removal, eviction ---------------------------------------------------

    @contextlib.contextmanager
    def lease(self, key: bytes):
        """Hold `key` against this client's eviction and removal while a copy is in flight;
        yields the verified block (None if it failed its checks)."""
        if key not in self:
            raise KeyError(f"lease: key {key.hex()} is not readable here")
        self._leases[key] += 1
        try:
            yield self._read(key)
        finally:
            self._leases[key] -= 1
            if not self._leases[key]:
                del self._leases[key]

    def pin(self, key: bytes, pinned: bool = True) -> None:
        """Soft-pin `key` here and, where the client supports it, in the store (module doc)."""
        e = self._blocks.get(key)
        if e is None and key not in self:
            raise KeyError(f"pin: key {key.hex()} is not here")
        if e is not None:
            e.pinned = pinned
        action = getattr(self._mc, "SoftPinAction", None)
        if action is None or not hasattr(self._client, "upsert_from") or self._read(key) is None:
            return  # recorded locally only
        config = self._mc.ReplicateConfig()
        config.soft_pin_action = action.ENABLE if pinned else action.DISABLE
        rc = self._call(
            "pin", self._client.upsert_from, self.object_name(key), self._recv.ctypes.data,
            self.value_bytes, config,
        )  # fmt: skip
        if rc not in (None, 0):
            self._failed("pin", rc)

    def remove(self, key: bytes) -> int:
        """Remove `key` and every block this client chained below it, from the store and the
        index; returns how many. Raises if one of them is leased here."""
        subtree = self._subtree(key) if key in self._blocks else [key]
        leased = [k for k in subtree if self._leases[k]]
        if leased:
            raise RuntimeError(f"remove: {len(leased)} block(s) under {key.hex()} are leased")
        removed = self._remove_objects(subtree) | {k for k in subtree if k in self._blocks}
        if key in self._blocks:
            self._drop(key)
        return len(removed)

    def evict(self, num_blocks: int) -> int:
        """Remove up to `num_blocks` of this client's blocks from the store: leaves only, never
        leased, unpinned before pinned, least recently used first; writes in progress are left
        alone. Returns how many."""
        freed = 0
        while freed < num_blocks:
            leaves = [
                (e.pinned, e.last_access, k)
                for k, e in self._blocks.items()
                if e.ready and not e.children and not self._leases[k]
            ]
            if not leaves:
                break
            _, _, k = min(leaves)
            self._remove_objects([k])
            self._drop(k)
            freed += 1
        self.num_evictions += freed
        return freed

    def reset(self) -> None:
        """Remove every block of this namespace from the store, this client's or not (an error
        while one is leased here)."""
        if self._leases:
            raise RuntimeError("reset while blocks are leased")
        if self._ready():
            pattern = "^" + re.escape(self.namespace + "/")
            rc = self._call("reset", self._client.remove_by_regex, pattern, True)
            if rc is not None and rc < 0:
                self._failed("reset", rc)
        self._blocks.clear()
        self._foreign.clear()

    # ---- accounting ------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        """Blocks this client put (or is writing) that it has not seen go."""
        return len(self._blocks)

    def readable_keys(self) -> list[bytes]:
        """This client's blocks that the store still holds (one batch RPC)."""
        ready = [k for k, e in self._blocks.items() if e.ready]
        if not ready or not self._ready():
            return []
        found = self._call(
            "exists", self._client.batch_is_exist, [self.object_name(k) for k in ready]
        )
        out = []
        for k, f in zip(ready, found or (), strict=False):
            if f == 1:
                out.append(k)
            elif f == 0:
                self._forget(k)
            else:
                self._failed("exists", f)
                return []
        return [k for k in out if k in self._blocks]

    def check_invariants(self) -> None:
        """The local index: parent and child links agree, a parent here is readable here,
        nothing staged once committed, the budget kept."""
        for k, e in self._blocks.items():
            p = self._blocks.get(e.parent)
            if p is not None:
                assert p.ready and k in p.children, "a parent here does not list its child"
            elif e.parent != ROOT_KEY:
                assert k in self._foreign.get(e.parent, ()), "a child of a foreign parent is lost"
            for c in e.children:
                assert self._blocks[c].parent == k, "a child names another parent"
            assert not (e.ready and e.value is not None), "a committed block is still staged"
        for parent, children in self._foreign.items():
            assert parent not in self._blocks and children, "a foreign parent is indexed"
            assert all(self._blocks[c].parent == parent for c in children)
        assert all(n > 0 for n in self._leases.values())
        assert self.num_blocks is None or self.num_used <= self.num_blocks, "over budget"

    # ---- internals -------------------------------------------------------------------------

    def _encode(self, key: bytes, parent: bytes, payload: bytes) -> bytes:
        dtype = str(self.dtype).encode()  # "bfloat16", not bfloat16's "<V2"
        head = _HEAD.pack(MAGIC, VERSION, key, parent, dtype, len(self.block_shape))
        head += self._shape_bytes
        digest = hashlib.blake2b(head, digest_size=_DIGEST)
        digest.update(payload)
        return head + digest.digest() + payload

    def _read(self, key: bytes) -> np.ndarray | None:
        """The verified payload of `key` from the store, or None (missing, foreign, corrupt or
        unreachable: the module doc)."""
        if not self._ready():
            return None
        buf = self._recv
        rc = self._call(
            "get", self._client.get_into, self.object_name(key), buf.ctypes.data, buf.size
        )
        if rc is None:
            return None
        if rc in _MISSING:
            self._forget(key)
            return None
        if rc == _BUFFER_TOO_SMALL or (rc > 0 and rc != self.value_bytes):
            self._error("foreign", f"block {key.hex()} is not of this tier's size; a miss")
            return None
        if rc < 0:
            self._failed("get", rc)
            return None
        head, digest = buf[: self._head_bytes].tobytes(), buf[self._head_bytes :][:_DIGEST]
        payload = buf[self._head_bytes + _DIGEST :]
        check = hashlib.blake2b(head, digest_size=_DIGEST)
        check.update(payload)
        magic, version, stored_key, parent, dtype, _ = _HEAD.unpack(head[: _HEAD.size])
        e = self._blocks.get(key)
        if magic != MAGIC or check.digest() != digest.tobytes() or stored_key != key:
            problem = "fails its checksum"
        elif e is not None and parent != e.parent:
            problem = "names another parent"
        elif (
            version != VERSION
            or dtype.rstrip(b"\0").decode() != str(self.dtype)
            or (head[_HEAD.size :] != self._shape_bytes)
        ):
            self._error("foreign", f"block {key.hex()} is another version, dtype or shape")
            return None
        else:
            return payload.view(self.dtype).reshape(self.block_shape).copy()
        self._error("corrupt", f"block {key.hex()} {problem}; removed, recompute it")
        with contextlib.suppress(RuntimeError):  # leased here: left until the lease ends
            self.remove(key)
        return None

    def _reserve(self, parent: bytes) -> bool:
        """Room for one more block in this client's budget (watermark eviction, the parent
        spared)."""
        n = self.num_blocks
        if n is None or (self.num_used < self.high_watermark * n and self.num_used < n):
            return True
        self._leases[parent] += 1
        try:
            self.evict(self.num_used - int(self.low_watermark * n) or 1)
        finally:
            self._leases[parent] -= 1
            if not self._leases[parent]:
                del self._leases[parent]
        return self.num_used < n

    def _mark_ready(self, key: bytes) -> None:
        self._blocks[key].ready = True
        for c in self._foreign.pop(key, ()):  # children this client put before it held `key`
            self._blocks[key].children.add(c)

    def _remove_objects(self, keys: list[bytes]) -> set[bytes]:
        """Remove `keys` from the store (force: module doc); the ones it held."""
        if not keys or not self._ready():
            return set()
        rcs = self._call(
            "remove", self._client.batch_remove, [self.object_name(k) for k in keys], True
        )
        removed = set()
        for k, rc in zip(keys, rcs or (), strict=False):
            if rc == 0:
                removed.add(k)
            elif rc not in _MISSING:
                self._failed("remove", rc)
        return removed

    def _forget(self, key: bytes) -> None:
        """The store no longer holds `key`: drop it and its local subtree from the index (a
        write in progress stays)."""
        e = self._blocks.get(key)
        if e is not None and e.ready:
            self._drop(key)

    def _subtree(self, key: bytes) -> list[bytes]:
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self._blocks[k].children)
        return out

    def _drop(self, key: bytes) -> None:
        e = self._blocks.pop(key)
        for c in list(e.children):
            if c in self._blocks:
                self._drop(c)
        if e.parent in self._blocks:
            self._blocks[e.parent].children.discard(key)
        elif e.parent in self._foreign:
            self._foreign[e.parent].discard(key)
            if not self._foreign[e.parent]:
                del self._foreign[e.parent]

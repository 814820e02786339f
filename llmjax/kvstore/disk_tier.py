"""T2: KV blocks as immutable files on local disk, under the host tier's rules (issue 22, item 2).

    tier = DiskTier("/tmp/llmjax-kv", num_blocks=10_000, block_shape=(L, 2, 256, K, H))
    tier.put(key, parent, block)          # written to a temporary name, then renamed
    DiskTier("/tmp/llmjax-kv", ...)       # a new process finds the same blocks (cold restart)

Every rule of `HostTier` holds (two-phase puts, chains that never orphan, leases, soft pins,
leaf-first watermark eviction); only where a block lives differs. A block is one file,
`<key hex>.kv`: a header (magic, version, parent key, dtype, shape, payload length, a blake2b
checksum of the payload) and the payload. `put_begin` + `write` write `.<key hex>.<pid>.tmp`
(fsynced with `fsync=True`); `put_commit` renames it into place (atomic on POSIX), so a writer
killed mid-put leaves only a temporary file, never a readable block. Without fsync a power loss may
leave a renamed file whose bytes did not all reach the disk: its checksum then fails on load and
the block is recomputed (a miss, never a wrong KV), so fsync buys durability across power loss,
not correctness, and costs a disk flush per block (off by default). Temporary files are swept
when a tier opens the directory. `get` checks the header and the checksum: a flipped byte makes
the block unreadable (logged, the file and its chain removed) and the caller recomputes, never a
wrong KV. Opening a directory indexes the files it holds; a file whose header is bad, whose
shape or dtype is not this tier's, or whose parent is missing is removed (its chain is
incomplete).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import struct

import numpy as np

from llmjax.kvstore.host_tier import HostTier, _Block
from llmjax.kvstore.keys import KEY_BYTES, ROOT_KEY

logger = logging.getLogger(__name__)

MAGIC = b"LJKV"
VERSION = 1
_HEAD = struct.Struct("<4sH16s16sQ16s")  # magic, version, parent, dtype, payload bytes, checksum
SUFFIX = ".kv"


class DiskTier(HostTier):
    """T2 (the module doc): at most `num_blocks` block files of `block_shape` x `dtype` in
    `directory`."""

    name = "disk"

    def __init__(
        self,
        directory: str,
        num_blocks: int,
        block_shape,
        dtype="float32",
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        fsync: bool = False,
    ):
        self.directory = directory
        self.fsync = fsync
        os.makedirs(directory, exist_ok=True)
        super().__init__(1, block_shape, dtype, high_watermark, low_watermark)
        self.num_blocks = num_blocks
        self.pool = None  # no host pool: the blocks are files
        self._free = []
        self.shape_bytes = ",".join(map(str, self.block_shape)).encode()
        self._open()

    # ---- files -----------------------------------------------------------------------------

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + SUFFIX)

    def _tmp(self, key: bytes) -> str:
        return os.path.join(self.directory, f".{key.hex()}.{os.getpid()}.tmp")

    def _open(self) -> None:
        """Sweep temporary files; index the blocks (parents first); drop the unreadable."""
        for tmp in glob.glob(os.path.join(self.directory, ".*.tmp")):
            _unlink(tmp)
        found: dict[bytes, bytes] = {}
        for path in glob.glob(os.path.join(self.directory, "*" + SUFFIX)):
            name = os.path.basename(path)[: -len(SUFFIX)]
            try:
                key = bytes.fromhex(name)
                parent = self._read_header(path)[0]
            except (ValueError, OSError) as e:
                logger.warning("kv disk tier: dropping %s: %s", path, e)
                _unlink(path)
                continue
            if len(key) != KEY_BYTES:
                _unlink(path)
                continue
            found[key] = parent
        placed: set[bytes] = set()
        pending = dict(found)
        while pending:  # parents before children; a chain without its parent is dropped
            ready = [k for k, p in pending.items() if p == ROOT_KEY or p in placed]
            if not ready:
                break
            for k in ready:
                p = pending.pop(k)
                self._blocks[k] = _Block(None, p, ready=True, last_access=next(self._clock))
                if p != ROOT_KEY:
                    self._blocks[p].children.add(k)
                placed.add(k)
        for k in pending:
            logger.warning("kv disk tier: dropping %s (its parent is gone)", k.hex())
            _unlink(self.path(k))
        excess = len(self._blocks) - self.num_blocks
        if excess > 0:
            self.evict(excess)

    def _read_header(self, path: str) -> tuple[bytes, int, bytes]:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            shape = f.readline()
        if len(head) != _HEAD.size:
            raise ValueError("short header")
        magic, version, parent, dtype, n, checksum = _HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise ValueError("not a block file")
        if dtype.rstrip(b"\0").decode() != self.dtype.str or shape.rstrip(b"\n") != (
            self.shape_bytes
        ):
            raise ValueError("another dtype or shape than this tier's")
        return parent, n, checksum

    def read_file(self, key: bytes) -> np.ndarray | None:
        """The block file of `key`, checked, or None; touches no bookkeeping, so another
        thread may call it (a prefetch, llmjax/engine/kv_tiers.py) while this one serves."""
        return self._read_slot(key, None)

    # ---- storage hooks ---------------------------------------------------------------------

    def _full(self) -> bool:
        return len(self._blocks) >= self.num_blocks

    def _alloc(self, key: bytes):
        return None if self._full() else self._tmp(key)

    def _write_slot(self, b: _Block, data: np.ndarray) -> None:
        payload = np.ascontiguousarray(data, self.dtype).tobytes()
        checksum = hashlib.blake2b(payload, digest_size=16).digest()
        head = _HEAD.pack(MAGIC, VERSION, b.parent, self.dtype.str.encode(), len(payload), checksum)
        with open(b.slot, "wb") as f:
            f.write(head + self.shape_bytes + b"\n" + payload)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())

    def _commit_slot(self, key: bytes, b: _Block) -> None:
        if not os.path.exists(b.slot):
            raise KeyError(f"put_commit: nothing was written for {key.hex()}")
        os.replace(b.slot, self.path(key))  # atomic: the block appears whole or not at all
        b.slot = None

    def _read_slot(self, key: bytes, b: _Block) -> np.ndarray | None:
        path = self.path(key)
        try:
            _, n, checksum = self._read_header(path)
            with open(path, "rb") as f:
                f.seek(_HEAD.size)
                f.readline()
                payload = f.read()
        except (OSError, ValueError) as e:
            logger.warning("kv disk tier: block %s unreadable (%s); recompute it", key.hex(), e)
            return None
        if len(payload) != n or hashlib.blake2b(payload, digest_size=16).digest() != checksum:
            logger.warning("kv disk tier: block %s fails its checksum; recompute it", key.hex())
            return None
        return np.frombuffer(payload, self.dtype).reshape(self.block_shape).copy()

    def _release_slot(self, key: bytes, b: _Block) -> None:
        _unlink(b.slot if b.slot is not None else self.path(key))

    def _check_storage(self) -> None:
        on_disk = {
            bytes.fromhex(os.path.basename(p)[: -len(SUFFIX)])
            for p in glob.glob(os.path.join(self.directory, "*" + SUFFIX))
        }
        ready = {k for k, b in self._blocks.items() if b.ready}
        assert ready == on_disk, "the index and the directory disagree"
        assert len(self._blocks) <= self.num_blocks, "over capacity"


def _unlink(path) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

"""Page keys: a name for the KV of one full page that any process can compute from the tokens.

    salt = KeySalt.for_engine(config).digest        # model, dtype, page size, KV layout
    keys = chain_keys(token_ids, page_size, salt)   # one 16-byte key per *full* page

Page i's key is blake2b(key=salt, digest_size=16) over page i-1's key and page i's token ids
(little-endian int32), page 0's parent being `ROOT_KEY`: Mooncake's chained block hashes, so a
key names its whole prefix, not only its own tokens, and equal keys mean equal KV bytes. A
partial last page gets no key (it is never stored). Python's `hash` is never used: the keys are
the same in every process and on every host.

The salt covers what changes a page's bytes: the model (its name and shape), the KV dtype (the
model dtype, and a quantized cache's `kv_cache_dtype`: an int8 or fp8 page never serves an engine
that stores another dtype), the page size and the KV layout (kv heads as the devices hold them,
tp). Per-device shards of a tensor-parallel page are separate objects: `shard_key(key, rank)`.

`RadixCache` (llmjax/engine/radix_cache.py) computes the keys as it inserts pages: each node
holds `page_keys`, one per page, chained from its parent's last key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)  # the parent of every prefix's first page


def page_key(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The key of one full page of `token_ids` after the page whose key is `parent`."""
    h = hashlib.blake2b(key=salt, digest_size=KEY_BYTES)
    h.update(parent)
    h.update(_int32_bytes(token_ids))
    return h.digest()


def _int32_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as little-endian int32 bytes (the same on every host)."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def chain_keys(
    token_ids: Sequence[int], page_size: int, salt: bytes, parent: bytes = ROOT_KEY
) -> list[bytes]:
    """The keys of every full page of `token_ids` (a partial last page gets none), the first
    chained from `parent` (default: the start of a sequence)."""
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")
    n = len(token_ids) // page_size
    buf = _int32_bytes(token_ids[: n * page_size])
    step = 4 * page_size
    keys = []
    for i in range(n):
        h = hashlib.blake2b(key=salt, digest_size=KEY_BYTES)
        h.update(parent)
        h.update(buf[i * step : (i + 1) * step])
        parent = h.digest()
        keys.append(parent)
    return keys


def shard_key(key: bytes, rank: int) -> bytes:
    """The object key of tp rank `rank`'s shard of the page named `key`."""
    if rank < 0:
        raise ValueError(f"{rank=} must be >= 0")
    return hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=KEY_BYTES).digest()


@dataclasses.dataclass(frozen=True)
class KeySalt:
    """What makes a page's bytes; `digest` salts its keys (blake2b's 32-byte key)."""

    model: str  # name and shape
    dtype: str  # the model dtype; '<dtype>+kv:<kv_cache_dtype>' for a quantized cache
    page_size: int
    kv_layout: str  # e.g. 'tp=2,kv_heads=4,head_dim=64'

    @property
    def digest(self) -> bytes:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=32, person=b"llmjax-kv-salt").digest()

    @classmethod
    def for_engine(cls, config) -> KeySalt:
        """The salt of an `EngineConfig`: its model's name and shape, KV dtype (and quantized
        cache dtype), page size, and the kv heads per layer as its tp layout holds them
        (llmjax/parallel/heads.py)."""
        from llmjax.parallel.heads import tp_head_layout

        m = config.model
        tp = config.parallel.tp
        try:
            heads = tp_head_layout(m, tp, config.parallel.pad_heads).num_kv_heads
        except ValueError:  # a layout the engine would refuse anyway
            heads = m.num_kv_heads
        shape = (
            f"{m.name or 'model'}:{m.architecture}:L{m.num_layers}:D{m.hidden_size}:"
            f"K{m.num_kv_heads}:H{m.head_dim}:V{m.vocab_size}"
        )
        dtype = str(config.dtype)
        kv_cache_dtype = config.cache.kv_cache_dtype
        if kv_cache_dtype != "auto":
            dtype += f"+kv:{kv_cache_dtype}"
        return cls(
            model=shape,
            dtype=dtype,
            page_size=int(config.cache.page_size),
            kv_layout=f"tp={tp},kv_heads={heads},head_dim={m.head_dim},pp={config.parallel.pp}",
        )

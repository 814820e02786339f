"""Moving one request's KV pages from a prefill instance to a decode instance (DistServe's
migration; issue 21, item 3).

The unit moved is one request's pages after its last prefill chunk: every layer's K and V of its
first `num_kv_tokens` tokens, gathered on the prefill side into one array
`[L, 2, bucket, page_size, K', H]` (`ModelRunner.export_pages`: a jitted gather, the page count
padded to a power-of-two bucket with the reserved page, K' the device layout's kv heads, split
over tp as the pages are) and scattered on the decode side into the pages it reserved
(`ModelRunner.import_pages`: jitted, the pages donated). A transport moves that array between
the two; the protocol around it is two-sided so that the sides may live in different processes:

    offer = transport.offer(prefill_runner, request_id, pages)   # prefill side: gather, keep
    handle = transport.pull(offer, decode_runner, deadline)       # decode side: start moving
    data = transport.poll(handle)        # None while in flight; the array placed for the decode
                                         # runner; TransferError when failed or past `deadline`
    transport.release(offer)             # prefill side: drop the array (after the decode side
                                         # acknowledged, or when its lease expired)

Transports by name (`TRANSPORTS`, `make_transport`):

  local            both sides in this process (the local launcher's sub-meshes): the offer holds
                   the gathered array; the pull is one `jax.device_put` onto the decode runner's
                   sharding when both use the same kv-head layout (device to device), else shard
                   by shard (`reshard_kv`: each destination device's heads sliced from the source
                   shard that holds them, copied device to device, assembled with
                   `jax.make_array_from_single_device_arrays`; never through the host).
  transfer_server  across processes and hosts, with `jax.experimental.transfer`
                   (llmjax/cluster/transfer_server.py).

An `Offer` is plain data (it crosses process boundaries through the control plane).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Protocol

import numpy as np


class TransferError(RuntimeError):
    """A KV transfer that failed or passed its deadline (the decode side then recomputes the
    request, or fails it, as the cluster's `on_transfer_failure` says)."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """One request's KV, offered by a prefill instance."""

    transfer_id: int
    request_id: str
    num_pages: int  # real pages (the array holds `shape[2]`, padded)
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # of the array moved (padding included)
    kv_heads: tuple[int, ...]  # the source layout's kv heads: original head index, -1 for padding
    lease_deadline: float  # time.time() after which the prefill side may drop it
    address: str | None = None  # transfer_server: where to pull from
    kv_cache_dtype: str = "auto"  # the source's CacheConfig.kv_cache_dtype (the bytes' meaning)


class KVTransport(Protocol):
    name: str

    def offer(self, runner, request_id: str, pages: list[int]) -> Offer: ...

    def pull(self, offer: Offer, runner, deadline: float): ...

    def poll(self, handle): ...

    def release(self, offer: Offer) -> None: ...


def kv_cache_dtype_error(offer: Offer, runner) -> TransferError | None:
    """The error of pulling `offer` into `runner` when their caches store different KV dtypes
    (an int8 page's bytes read as fp8 would decode garbage), else None."""
    want = getattr(runner, "kv_cache_dtype", "auto")
    if offer.kv_cache_dtype != want:
        return TransferError(
            f"KV of request {offer.request_id!r} is stored as {offer.kv_cache_dtype!r}; this "
            f"instance's cache stores {want!r} (kv_cache_dtype must match across instances)"
        )
    return None


def kv_head_map(runner) -> tuple[int, ...]:
    """For each kv head of `runner`'s device layout (llmjax/parallel/heads.py): the original
    model's kv head it holds, -1 for a zero padding head."""
    from llmjax.parallel.heads import tp_head_layout

    config = runner.config
    layout = tp_head_layout(config.model, config.parallel.tp, config.parallel.pad_heads)
    K = config.model.num_kv_heads
    if layout.kind == "replicate":
        return tuple(h // layout.kv_repeats for h in range(layout.num_kv_heads))
    return tuple(h if h < K else -1 for h in range(layout.num_kv_heads))


def reshard_kv(x, src_heads: tuple[int, ...], runner):
    """The exported KV array `x` (source kv-head layout `src_heads`, `kv_head_map`) placed for
    `runner`: its `kv_transfer_sharding` and its own head layout. Same layout: one device_put.
    Different (another tp): shard by shard, device to device, never through the host."""
    import jax
    import jax.numpy as jnp

    dst_heads = kv_head_map(runner)
    sharding = runner.kv_transfer_sharding
    shape = (*x.shape[:4], len(dst_heads), *x.shape[5:])
    if tuple(src_heads) == dst_heads:
        return jax.device_put(x, sharding)
    where: dict[int, list[tuple[object, int]]] = {}  # original head -> [(shard, local index)]
    for shard in x.addressable_shards:
        lo = shard.index[4].start or 0
        for j in range(shard.data.shape[4]):
            o = src_heads[lo + j]
            if o >= 0:
                where.setdefault(o, []).append((shard, j))
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        # runs [shard or None (padding), a, b) of consecutive heads from one source shard
        runs: list[list] = []
        for h in range(*index[4].indices(len(dst_heads))):
            o = dst_heads[h]
            if o < 0:
                shard, j = None, 0
            else:
                options = where[o]
                shard, j = next((s for s in options if s[0].device == device), options[0])
            last = runs[-1] if runs else None
            if last is not None and last[0] is shard and (shard is None or last[2] == j):
                last[2] += 1
            else:
                runs.append([shard, j, j + 1])
        pieces = []
        with jax.default_device(device):
            for shard, a, b in runs:
                if shard is None:  # padding heads: zeros made on the device itself
                    pieces.append(jnp.zeros((*x.shape[:4], b - a, *x.shape[5:]), x.dtype))
                else:
                    pieces.append(jax.device_put(shard.data[:, :, :, :, a:b], device))
            arrays.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=4))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


class LocalTransport:
    """Both sides in one process (see the module doc). `lease_s`: how long an offer stays
    alive without a release."""

    name = "local"

    def __init__(self, lease_s: float = 60.0):
        self.lease_s = lease_s
        self._offers: dict[int, tuple[Offer, object]] = {}
        self._ids = itertools.count()

    def offer(self, runner, request_id: str, pages: list[int]) -> Offer:
        data = runner.export_pages(pages)
        heads = kv_head_map(runner) if hasattr(runner, "kv_transfer_sharding") else ()
        offer = Offer(
            transfer_id=next(self._ids),
            request_id=request_id,
            num_pages=len(pages),
            shape=tuple(data.shape),
            dtype=str(data.dtype),
            nbytes=int(data.nbytes),
            kv_heads=heads,
            lease_deadline=time.time() + self.lease_s,
            kv_cache_dtype=getattr(runner, "kv_cache_dtype", "auto"),
        )
        self._offers[offer.transfer_id] = (offer, data)
        return offer

    def pull(self, offer: Offer, runner, deadline: float):
        """Moves at once (one process): the handle is the placed array, or the error."""
        entry = self._offers.get(offer.transfer_id)
        if entry is None:
            return TransferError(
                f"KV of request {offer.request_id!r} is no longer offered (released, expired, "
                "or its prefill instance died)"
            )
        data = entry[1]
        error = kv_cache_dtype_error(offer, runner)
        if error is not None:
            return error
        if isinstance(data, np.ndarray) or not hasattr(runner, "kv_transfer_sharding"):
            return data  # a host-side fake runner (tests)
        try:
            return reshard_kv(data, offer.kv_heads, runner)
        except Exception as e:  # e.g. a device gone
            return TransferError(f"KV of request {offer.request_id!r}: {e!r}")

    def poll(self, handle):
        if isinstance(handle, TransferError):
            raise handle
        return handle

    def release(self, offer: Offer) -> None:
        self._offers.pop(offer.transfer_id, None)

    def expire(self, now: float | None = None) -> list[Offer]:
        """Drop the offers whose lease passed; returns them."""
        now = time.time() if now is None else now
        gone = [o for o, _ in self._offers.values() if o.lease_deadline < now]
        for o in gone:
            self.release(o)
        return gone

    @property
    def num_offers(self) -> int:
        """Offers alive (their arrays held)."""
        return len(self._offers)

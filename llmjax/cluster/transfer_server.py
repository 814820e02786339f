"""KV transfer across processes and hosts with `jax.experimental.transfer` (issue 21, item 3):
the `transfer_server` transport of llmjax/cluster/transfer.py.

    transport = TransferServerTransport()              # or make_transport("transfer_server")
    offer = transport.offer(prefill_runner, rid, pages)      # prefill process
    ... send `offer` to the decode process (plain data: it pickles) ...
    handle = transport.pull(offer, decode_runner, deadline)  # decode process; returns at once
    data = transport.poll(handle)     # None until it arrived, then the array for import_pages;
                                      # TransferError when it failed or passed `deadline`
    transport.release(offer)          # prefill process, once the decode side acknowledged

The server. Each process runs one transfer server (`start_transfer_server` on the devices'
backend client), started on first use, shared by every transport in the process and bound to
`address`: default '127.0.0.1:0' (loopback, any free port). Across hosts give an address of this
host that the others reach ('10.0.0.5:0'); a wildcard host ('0.0.0.0:0') is replaced by
`socket.gethostbyname(socket.gethostname())` before binding, since the offers carry the address.

Prefill side. `offer` gathers the request's pages (`ModelRunner.export_pages`), keeps one device
shard per distinct set of kv heads (a layout that repeats heads over tp sends each once; shards
of padding heads only are not sent) and schedules them for one pull under a random 63-bit uuid
(`TransferServer.await_pull`). The Offer (a `ServerOffer`) carries the uuid as `transfer_id`, the
server's `address`, the shards' head ranges (`shards`) and `nbytes` of what is sent. The arrays
stay alive until `release(offer)` or until the lease (`lease_s`) passes: `expire()`, also run by
every `offer`, releases those. Releasing deletes the device buffers (the server's table holds its
own reference: dropping ours would not free them); a pull that comes later fails at once.

Decode side. `pull` connects to the offer's address (one cached connection per address) and
starts `TransferConnection.pull` of the shards onto this runner's devices. The pull is
asynchronous: it returns at once with arrays that become ready when the data arrived, so no
thread is needed and nothing blocks the engine's thread; `poll` only checks readiness. When all
shards arrived, `poll` places them with the runner's `kv_transfer_sharding`: each device whose
heads arrived as one shard gets that shard (pulled onto it, or copied device to device); another
layout (e.g. another tp) is resharded device to device with `reshard_kv`.

Failures (never a hang, never a crash of the decode process):
  * the prefill process dies: pulls on its connection fail ('Connection closed'): `poll` raises
    TransferError; a pull started after (nothing listens) runs into its deadline;
  * released or expired before the pull: the pull fails at once;
  * deadline: jax's own pull timeout has no effect (below), so `poll` raises TransferError once
    `deadline` passed, as LocalInstance.poll_imports' check does;
  * a failed or timed-out pull retires its connection (new pulls connect afresh); once no pull
    uses it any more it is poisoned (`_poison_connection`), which frees the destination buffers
    jax keeps allocated for pulls that would otherwise stay pending forever. Pulls that nobody
    polls any more (an aborted import) are ended once past their deadline by the next `pull`.

What jax.experimental.transfer does (jax 0.11.2, CPU backend, measured; see the tests):
  * a pull may start before its offer: it completes once the offer is made;
  * a pull of an offer never made, or of an address where nothing listens, stays pending
    forever (its destination buffers allocated); `pull`'s `timeout` argument has no effect
    (a pull past it still completes once offered);
  * `await_pull`'s `timeout` drops the offer once passed, but a pull after that stays pending
    instead of failing: not used here (a lease deletes the buffers: a later pull fails at once);
  * an offer is consumed by its first pull; a second pull of the same uuid stays pending
    forever. This transport refuses a second pull of an offer it pulled (TransferError at once);
    a second pull from another process runs into its deadline;
  * a pull with another shape fails; with another dtype it silently reinterprets the bytes (so
    the decode side pulls exactly the Offer's shapes and dtype);
  * a pulled array must have the offered array's sharding structure (shard count and shapes):
    hence one single-device array per shard, placed and resharded on arrival.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict

from llmjax.cluster.transfer import (
    Offer,
    TransferError,
    kv_cache_dtype_error,
    kv_head_map,
    reshard_kv,
)

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:0"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")

# this process's servers: id(backend client) -> (client, address asked for, server, its address)
_servers: dict[int, tuple[object, str, object, str]] = {}
_servers_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ServerOffer(Offer):
    """An `Offer` with the kv-head range (axis 4 of `shape`) of each array scheduled for the
    pull, in pull order."""

    shards: tuple[tuple[int, int], ...] = ()


def _split_host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"transfer server address {address!r} is not host:port")
    return host, port


def transfer_server(client, address: str = DEFAULT_ADDRESS, transport_addresses=None):
    """This process's transfer server on `client` (started on first call, bound to `address`;
    a wildcard host is replaced by this host's IP) and the address peers connect to. A later
    call with another `address` is an error: one server per process."""
    from jax.experimental import transfer

    with _servers_lock:
        entry = _servers.get(id(client))
        if entry is not None and entry[0] is client:
            if address != entry[1]:
                raise ValueError(
                    f"this process's transfer server is bound to {entry[1]!r}; "
                    f"cannot bind another at {address!r} (one server per process)"
                )
            return entry[2], entry[3]
        host, port = _split_host_port(address)
        try:
            if host in _WILDCARD_HOSTS:  # what the offers carry must reach this host
                host = socket.gethostbyname(socket.gethostname())
            if transport_addresses is None:  # bulk-data sockets, one per local device
                transport_addresses = [f"{host}:0"] * len(client.local_devices())
            server = transfer.start_transfer_server(
                client, f"{host}:{port}", list(transport_addresses)
            )
        except Exception as e:
            raise TransferError(f"could not start a transfer server at {address!r}: {e!r}") from e
        _servers[id(client)] = (client, address, server, server.address())
        logger.info("KV transfer server listening on %s", server.address())
        return server, server.address()


@dataclasses.dataclass(eq=False)
class _Connection:
    """A cached connection to one peer, with its pulls in flight. A failed or timed-out pull
    retires it (new pulls get a fresh one); once its last pull ended it is poisoned, which
    frees the destination buffers that jax keeps for pulls still pending on it."""

    conn: object
    address: str
    inflight: int = 0
    retired: bool = False


@dataclasses.dataclass(eq=False)
class _Pull:
    """A pull (the handle `pull` returns)."""

    offer: ServerOffer
    runner: object
    connection: _Connection
    arrays: list  # one per shard, on the destination devices (not ready while in flight)
    deadline: float
    error: TransferError | None = None  # once it failed or passed its deadline
    done: bool = False  # arrived, failed or timed out


@dataclasses.dataclass
class _Failed:
    error: TransferError


def _runner_client(runner):
    return next(iter(runner.kv_transfer_sharding.device_set)).client


class TransferServerTransport:
    """The cross-process transport (the module doc). `address`: where this process's transfer
    server binds (host:port; port 0 = any); `lease_s`: how long an offer stays alive without
    a release; `transport_addresses`: the server's bulk-data sockets (default one per local
    device on the bind host)."""

    name = "transfer_server"

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        lease_s: float = 60.0,
        transport_addresses: list[str] | None = None,
    ):
        _split_host_port(address)
        self.address = address
        self.lease_s = lease_s
        self.transport_addresses = transport_addresses
        self._lock = threading.Lock()
        self._offers: dict[int, tuple[ServerOffer, list]] = {}  # uuid -> (offer, its arrays)
        self._connections: dict[str, _Connection] = {}  # address -> the one new pulls use
        self._inflight: dict[int, _Pull] = {}  # id -> pull not yet done
        self._pulled: OrderedDict[int, None] = OrderedDict()  # uuids pulled here (bounded)
        self._max_pulled = 1 << 16

    def server(self, runner):
        """(this process's transfer server, the address peers reach it at)."""
        return transfer_server(_runner_client(runner), self.address, self.transport_addresses)

    # ---- prefill side ----------------------------------------------------------------------

    def offer(self, runner, request_id: str, pages: list[int]) -> ServerOffer:
        self.expire()
        server, address = self.server(runner)
        data = runner.export_pages(pages)
        heads = kv_head_map(runner)
        shards, seen = [], set()  # one shard per distinct set of heads, none of padding only
        for shard in sorted(data.addressable_shards, key=lambda sh: _range(sh.index, data.shape)):
            lo, hi = _range(shard.index, data.shape)
            key = heads[lo:hi]
            if key not in seen and any(h >= 0 for h in key):
                seen.add(key)
                shards.append((lo, hi, shard.data))
        uuid = secrets.randbits(63)
        arrays = [a for _, _, a in shards]
        offer = ServerOffer(
            transfer_id=uuid,
            request_id=request_id,
            num_pages=len(pages),
            shape=tuple(data.shape),
            dtype=str(data.dtype),
            nbytes=sum(int(a.nbytes) for a in arrays),
            kv_heads=heads,
            lease_deadline=time.time() + self.lease_s,
            address=address,
            kv_cache_dtype=runner.kv_cache_dtype,
            shards=tuple((lo, hi) for lo, hi, _ in shards),
        )
        server.await_pull(uuid, arrays)
        with self._lock:
            self._offers[uuid] = (offer, [data, *arrays])
        return offer

    def release(self, offer: Offer) -> None:
        """Drop the offer's arrays (their device buffers are deleted: a later pull fails)."""
        with self._lock:
            entry = self._offers.pop(offer.transfer_id, None)
        if entry is None:
            return
        for a in entry[1]:
            with contextlib.suppress(Exception):  # a shard shares the whole's buffers
                a.delete()

    def expire(self, now: float | None = None) -> list[Offer]:
        """Release the offers whose lease passed; returns them."""
        now = time.time() if now is None else now
        with self._lock:
            gone = [o for o, _ in self._offers.values() if o.lease_deadline < now]
        for o in gone:
            logger.warning("KV offer of request %s expired unpulled", o.request_id)
            self.release(o)
        return gone

    @property
    def num_offers(self) -> int:
        """Offers alive (their arrays held)."""
        return len(self._offers)

    # ---- decode side -----------------------------------------------------------------------

    def _connection(self, runner, address: str) -> _Connection:
        with self._lock:
            c = self._connections.get(address)
        if c is None:
            server, _ = self.server(runner)
            new = _Connection(server.connect(address), address)
            with self._lock:
                c = self._connections.setdefault(address, new)
        return c

    def _finish(self, pull: _Pull, error: TransferError | None = None, retire=None) -> None:
        """`pull` arrived (error None), failed or timed out: it leaves its connection, which a
        failure retires (`retire`; default: when failed), poisoned once no other pull uses it."""
        with self._lock:
            if pull.done:
                return
            pull.done, pull.error = True, error
            self._inflight.pop(id(pull), None)
            c = pull.connection
            c.inflight -= 1
            if (error is not None if retire is None else retire) and not c.retired:
                c.retired = True
                if self._connections.get(c.address) is c:
                    del self._connections[c.address]
            poison = c.retired and c.inflight == 0
        if error is not None:
            pull.arrays = []
        if poison:
            _poison(c)

    def _sweep(self, now: float) -> None:
        """End the pulls past their deadline that nobody polled (an aborted import): arrived
        ones drop their arrays; pending ones retire their connection, poisoned once idle (that
        frees the buffers jax holds for them)."""
        with self._lock:
            late = [p for p in self._inflight.values() if now > p.deadline]
        for p in late:
            pending = not all(a.is_ready() for a in p.arrays)
            self._finish(p, _deadline_error(p), retire=pending)

    @property
    def num_pulls(self) -> int:
        """Pulls in flight (started, not yet arrived, failed or timed out)."""
        return len(self._inflight)

    def pull(self, offer: Offer, runner, deadline: float):
        """Start pulling `offer` into `runner`'s devices; returns the handle for `poll` at once
        (a failed handle when the offer cannot be pulled: `poll` raises its TransferError)."""
        import jax
        import jax.numpy as jnp

        self._sweep(time.time())
        what = f"KV of request {offer.request_id!r}"
        if not isinstance(offer, ServerOffer) or offer.address is None or not offer.shards:
            return _Failed(TransferError(f"{what}: not offered through a transfer server"))
        error = kv_cache_dtype_error(offer, runner)
        if error is not None:
            return _Failed(error)
        with self._lock:
            if offer.transfer_id in self._pulled:
                return _Failed(TransferError(f"{what}: already pulled (one pull per offer)"))
            self._pulled[offer.transfer_id] = None
            while len(self._pulled) > self._max_pulled:
                self._pulled.popitem(last=False)
        try:
            dtype = jnp.dtype(offer.dtype)
            specs = [
                jax.ShapeDtypeStruct(
                    (*offer.shape[:4], hi - lo, *offer.shape[5:]),
                    dtype,
                    sharding=jax.sharding.SingleDeviceSharding(device),
                )
                for (lo, hi), device in zip(offer.shards, _targets(offer, runner), strict=True)
            ]
            c = self._connection(runner, offer.address)
            pull = _Pull(offer, runner, c, [], deadline)
            with self._lock:
                c.inflight += 1
                self._inflight[id(pull)] = pull
        except Exception as e:  # a bad address, a runner without a transfer layout
            return _Failed(TransferError(f"{what}: could not start the pull: {e!r}"))
        try:
            pull.arrays = list(c.conn.pull(offer.transfer_id, specs))
        except Exception as e:
            self._finish(pull, TransferError(f"{what}: could not start the pull: {e!r}"))
        return pull

    def poll(self, handle):
        """None while in flight; the array placed for the decode runner once every shard
        arrived; TransferError when the pull failed or passed its deadline."""
        if isinstance(handle, _Failed):
            raise handle.error
        if handle.error is None and not all(a.is_ready() for a in handle.arrays):
            if time.time() > handle.deadline:
                self._finish(handle, _deadline_error(handle))
            else:
                return None
        if handle.error is not None:
            raise handle.error
        what = f"KV of request {handle.offer.request_id!r} from {handle.offer.address}"
        try:
            for a in handle.arrays:
                a.block_until_ready()  # ready; raises the transfer's error, if any
        except Exception as e:
            self._finish(
                handle,
                TransferError(
                    f"{what} failed (released, expired, or its prefill instance died): {e}"
                ),
            )
            raise handle.error from e
        self._finish(handle)
        try:
            return _assemble(handle.offer, handle.arrays, handle.runner)
        except Exception as e:
            raise TransferError(f"{what}: placing the pulled KV failed: {e!r}") from e


def _deadline_error(pull: _Pull) -> TransferError:
    o = pull.offer
    return TransferError(
        f"KV of request {o.request_id!r} from {o.address} did not arrive by its deadline"
    )


def _poison(c: _Connection) -> None:
    """Close a retired connection: its pending pulls fail and their buffers are freed
    (`TransferConnection._poison_connection`, private in jax 0.11; without it they stay)."""
    poison = getattr(c.conn, "_poison_connection", None)
    if poison is None:
        logger.warning(
            "cannot close the KV transfer connection to %s: pending pulls keep their buffers",
            c.address,
        )
        return
    try:
        poison()
    except Exception as e:  # already closed
        logger.debug("closing the KV transfer connection to %s: %r", c.address, e)


def _range(index, shape) -> tuple[int, int]:
    """The kv-head range (axis 4) of a shard's index."""
    return index[4].start or 0, shape[4] if index[4].stop is None else index[4].stop


def _destination(runner, offer: ServerOffer):
    """(destination shape, {device: the original kv heads it holds}) for `runner`."""
    heads = kv_head_map(runner)
    shape = (*offer.shape[:4], len(heads), *offer.shape[5:])
    index_map = runner.kv_transfer_sharding.addressable_devices_indices_map(shape)
    keys = {d: heads[slice(*_range(i, shape))] for d, i in index_map.items()}
    return shape, dict(sorted(keys.items(), key=lambda kv: kv[0].id))


def _shard_heads(offer: ServerOffer) -> list[tuple[int, ...]]:
    return [tuple(offer.kv_heads[lo:hi]) for lo, hi in offer.shards]


def _targets(offer: ServerOffer, runner) -> list:
    """The destination device each offered shard is pulled onto: one that holds exactly the
    shard's heads (then no copy follows), else a destination device not yet used (round robin
    once all are)."""
    _, keys = _destination(runner, offer)
    devices, used, out = list(keys), set(), []
    for i, key in enumerate(_shard_heads(offer)):
        fits = [d for d in devices if keys[d] == key and d not in used]
        free = [d for d in devices if d not in used]
        d = fits[0] if fits else free[0] if free else devices[i % len(devices)]
        used.add(d)
        out.append(d)
    return out


def _assemble(offer: ServerOffer, arrays: list, runner):
    """The pulled shards as one array with `runner.kv_transfer_sharding`, device to device.
    Every destination device's heads pulled as one shard (the same layout, or a replicating
    one): that shard, copied where it is needed twice. Otherwise the pulled shards form a
    source-like layout on the destination devices (heads: theirs, in order) that `reshard_kv`
    slices per destination device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sharding = runner.kv_transfer_sharding
    shape, keys = _destination(runner, offer)
    by_heads = dict(zip(_shard_heads(offer), arrays, strict=True))
    if all(k in by_heads for k in keys.values()):
        index_map = sharding.addressable_devices_indices_map(shape)
        pieces = []
        for device in index_map:
            piece = by_heads[keys[device]]
            pieces.append(piece if device in piece.devices() else jax.device_put(piece, device))
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)
    src_heads = tuple(h for key in _shard_heads(offer) for h in key)
    src_shape = (*offer.shape[:4], len(src_heads), *offer.shape[5:])
    devs = [next(iter(a.devices())) for a in arrays]
    if len(arrays) == 1:
        src = arrays[0]
    elif len(set(devs)) == len(devs):  # equal widths: the source's shards are an even split
        mesh = jax.sharding.Mesh(np.array(devs), ("kv",))
        spec = jax.sharding.PartitionSpec(None, None, None, None, "kv", None)
        src = jax.make_array_from_single_device_arrays(
            src_shape, jax.sharding.NamedSharding(mesh, spec), arrays
        )
    else:  # more shards than destination devices: joined on one device
        with jax.default_device(devs[0]):
            src = jnp.concatenate([jax.device_put(a, devs[0]) for a in arrays], axis=4)
    return reshard_kv(src, src_heads, runner)

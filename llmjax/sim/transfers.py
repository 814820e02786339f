"""How long moving KV takes in the simulated cluster (what a transport does in the real one): a
request's KV pages from a prefill to a decode instance (DistServe's migration), a prefix's pages
between instances or from the KV pool (Mooncake's fetches).

    model = TransferModel(engines, nodes)            # nodes[i]: instance i's node (pack_nodes)
    seconds, nbytes = model.transfer_seconds(i, j, migrated_request)

A transfer takes  latency + max(KV bytes per sending device, per receiving device) / bandwidth
(each side's pages in its own layout, `kv_bytes_per_device`): the node's links
(`Hardware.link_bandwidth`, `link_latency_s`) when both instances are in one node, else the
network (`network_bandwidth`, `network_latency_s`); `transfer_bandwidth` / `transfer_latency_s`
override both. From the pool: latency + the receiving instance's bytes per device / the pool's
bandwidth (`kv_pool_bandwidth` / `kv_pool_latency_s`, by default as the transfer overrides, else
the network's). `nbytes` is what the receiving devices get.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmjax.engine.request import MigratedRequest
from llmjax.sim.roofline import kv_page_bytes_per_device


def pack_nodes(engines: Sequence) -> list[int]:
    """The default `node_of`: instances packed in index order into nodes of their hardware's
    `devices_per_node`, `tp * pp` devices each (one that does not fit in what its node has
    left starts the next node; one larger than a node spans nodes of its own)."""
    nodes, node, used = [], 0, 0
    for e in engines:
        per = e.config.sim.hardware.devices_per_node
        devices = e.config.parallel.tp * e.config.parallel.pp
        if used and used + devices > per:
            node, used = node + 1, 0
        nodes.append(node)
        used += devices
        if used >= per:  # full (or spanning): the next instance starts past it
            node, used = node + math.ceil(used / per), 0
    return nodes


def kv_bytes_per_device(config, num_tokens: int) -> int:
    """Each device's bytes of the KV pages that hold `num_tokens` tokens for the steps after
    them, in `config`'s layout: its page size, KV dtype, tp and pp, and in the hybrid KV layout
    (`EngineConfig.kv_groups`) pages of `num_slots` layers, group 0's and each windowed
    group's window (`KVGroups.kv_pages`: what the real transfer moves)."""
    c, groups = config, config.kv_groups
    ps = c.cache.page_size
    page = kv_page_bytes_per_device(
        c.model,
        ps,
        c.dtype,
        c.parallel.tp,
        c.parallel.pp,
        c.cache.kv_cache_dtype,
        groups.slots_per_device(c.model.num_layers, c.parallel.pp) if groups.hybrid else None,
    )
    return groups.kv_pages(num_tokens, ps) * page


class TransferModel:
    """The modeled KV transfer times of a simulated cluster (the module doc)."""

    def __init__(
        self,
        engines: Sequence,
        nodes: Sequence[int],
        transfer_bandwidth: float | None = None,
        transfer_latency_s: float | None = None,
        kv_pool_bandwidth: float | None = None,
        kv_pool_latency_s: float | None = None,
    ):
        if transfer_bandwidth is not None and not transfer_bandwidth > 0:
            raise ValueError(f"{transfer_bandwidth=} must be > 0 bytes/s (math.inf: instant)")
        if transfer_latency_s is not None and not transfer_latency_s >= 0:
            raise ValueError(f"{transfer_latency_s=} must be >= 0")
        if kv_pool_bandwidth is not None and not kv_pool_bandwidth > 0:
            raise ValueError(f"{kv_pool_bandwidth=} must be > 0 bytes/s (math.inf: instant)")
        if kv_pool_latency_s is not None and not kv_pool_latency_s >= 0:
            raise ValueError(f"{kv_pool_latency_s=} must be >= 0")
        self.engines = list(engines)
        self.nodes = list(nodes)
        self.transfer_bandwidth = transfer_bandwidth
        self.transfer_latency_s = transfer_latency_s
        self.kv_pool_bandwidth = kv_pool_bandwidth
        self.kv_pool_latency_s = kv_pool_latency_s

    def transfer_seconds(self, source: int, dest: int, m: MigratedRequest) -> tuple[float, int]:
        """The modeled time of moving `m`'s KV from instance `source` to `dest` (the module
        doc) and the bytes the receiving devices get."""
        return self._kv_seconds(source, dest, m.num_kv_tokens)

    def kv_transfer_seconds(self, source: int, dest: int, num_tokens: int) -> tuple[float, int]:
        """The modeled time of moving the KV pages of `num_tokens` tokens from instance
        `source` to `dest` (the module doc) and the bytes the receiving devices get."""
        return self._kv_seconds(source, dest, num_tokens)

    def kv_pool_seconds(self, dest: int, num_tokens: int) -> tuple[float, int]:
        """The modeled time of moving the KV pages of `num_tokens` tokens from the KV pool to
        instance `dest` (the module doc) and the bytes its devices get."""
        c = self.engines[dest].config
        tp, pp = c.parallel.tp, c.parallel.pp
        per_device = kv_bytes_per_device(c, num_tokens)
        hw = c.sim.hardware
        bandwidth = self.kv_pool_bandwidth or self.transfer_bandwidth or hw.network_bandwidth
        latency = self.kv_pool_latency_s
        if latency is None:
            latency = self.transfer_latency_s
        if latency is None:
            latency = hw.network_latency_s
        return latency + per_device / bandwidth, int(per_device * tp * pp)

    def _kv_seconds(self, source: int, dest: int, num_tokens: int) -> tuple[float, int]:
        """`transfer_seconds` of `num_tokens` tokens' KV pages on each side."""
        per_device, total = [], 0
        for k in (source, dest):
            c = self.engines[k].config
            per_device.append(kv_bytes_per_device(c, num_tokens))
            total = per_device[-1] * c.parallel.tp * c.parallel.pp  # the receiving side's
        hw = self.engines[dest].config.sim.hardware
        local = self.nodes[source] == self.nodes[dest] and all(
            self.engines[k].config.parallel.tp * self.engines[k].config.parallel.pp
            <= hw.devices_per_node
            for k in (source, dest)
        )
        bandwidth = self.transfer_bandwidth or (
            hw.link_bandwidth if local else hw.network_bandwidth
        )
        latency = self.transfer_latency_s
        if latency is None:
            latency = hw.link_latency_s if local else hw.network_latency_s
        return latency + max(per_device) / bandwidth, int(total)

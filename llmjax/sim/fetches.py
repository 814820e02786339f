"""The Conductor's prefix fetches in the simulated cluster (`PrefixFetches`, a part of
`SimCluster`): a fetch in flight (`Fetch`), its modeled time from another prefill instance's
cache or the KV pool (llmjax/sim/kvpool.py), and the pool hooked to the entry instances' radix
caches (every page they insert is written to it)."""

from __future__ import annotations

import dataclasses
import heapq

from llmjax.cluster.routing import RouteRequest
from llmjax.sim.kvpool import SimKVPool
from llmjax.sim.roofline import kv_page_bytes_per_device


@dataclasses.dataclass
class Fetch:
    """A prefix fetch in flight (the Conductor): the request joins `dest` at `end`."""

    request: RouteRequest
    prompt: str | None
    source: int | None  # None: the KV pool
    dest: int
    num_tokens: int  # the prefix dest holds once it arrives
    start: float
    end: float
    nbytes: int
    cancelled: bool = False


def pool_writer(pool: SimKVPool, cache, inner):
    """A radix cache's `on_insert` that writes the new leaf's path to `pool` (after `inner`,
    the hook it had, if any)."""

    def inserted(leaf):
        if inner is not None:
            inner(leaf)
        pool.insert_path(cache.path_keys(leaf))

    return inserted


class PrefixFetches:
    """The prefix fetches of a `SimCluster` (its `instances`, `_instances`, `_entry`, `nodes`,
    `kv_pool`, `_fetching`, `_fetches`, `_seq`, `conductor_stats`, `_admit`)."""

    def _make_pool(self, pool: SimKVPool | None, bytes_per_node: float | None):
        """The KV pool (the class doc), hooked to every entry instance's radix cache: each page
        it inserts (a prefill chunk's, a fetched prefix's) is written to the pool."""
        if pool is None and bytes_per_node is None:
            return None
        caches = [self.instances[i].block_manager.prefix_cache for i in self._entry]
        salts = {getattr(c, "salt", None) for c in caches}
        sizes = {self.instances[i].config.cache.page_size for i in self._entry}
        if None in salts or len(salts) > 1 or len(sizes) > 1:
            raise ValueError(
                "a KV pool needs every entry instance to keep a radix prefix cache "
                "(CacheConfig(prefix_cache='radix')) with the same page keys (model, dtype, "
                "page size, KV layout)"
            )
        (salt,), (page_size,) = salts, sizes
        if pool is None:
            c = self.instances[self._entry[0]].config
            per_token = kv_page_bytes_per_device(
                c.model, 1, c.dtype, 1, 1, c.cache.kv_cache_dtype
            )  # the full KV
            num_nodes = len({self.nodes[i] for i in self._entry})
            pool = SimKVPool(int(bytes_per_node * num_nodes // per_token), page_size, salt)
        elif (pool.page_size, pool.salt) != (page_size, salt):
            raise ValueError(
                f"kv_pool has page_size={pool.page_size} and its own salt; the entry instances "
                f"have page_size={page_size} and salt {salt.hex()[:16]}..."
            )
        for cache in caches:
            cache.on_insert = pool_writer(pool, cache, cache.on_insert)
        return pool

    def _fetch(self, req: RouteRequest, prompt: str | None, placement, now: float) -> None:
        """The Conductor's prefix fetch (docs/simulator.md): the request waits for the missing
        tokens' KV (from another prefill instance's cache, or the pool) before it joins its
        prefill instance's queue."""
        rid, p, missing = req.request_id, placement.prefill, placement.missing_tokens
        source = placement.fetch_from
        if placement.from_pool:  # read now (recency), not held: as an instance's cache below
            self.kv_pool.touch(self.kv_pool.keys(req.prompt_token_ids[: placement.fetch_tokens]))
            seconds, nbytes = self.kv_pool_seconds(p, missing)
        else:
            seconds, nbytes = self.kv_transfer_seconds(source, p, missing)
        fetch = Fetch(req, prompt, source, p, placement.fetch_tokens, now, now + seconds, nbytes)
        heapq.heappush(self._fetching, (fetch.end, next(self._seq), fetch))
        self._fetches[rid] = fetch
        inst = self._instances[p]
        inst.fetching[rid] = len(req.prompt_token_ids)
        inst.live.add(rid)
        self._where[rid] = p
        self._path[rid].append(p)
        st = self.conductor_stats
        st.num_fetches += 1
        st.fetched_tokens += missing
        st.fetch_bytes += nbytes
        st.fetch_seconds += seconds
        if placement.from_pool:
            st.num_pool_fetches += 1
            st.pool_fetched_tokens += missing

    def _finish_fetch(self, fetch: Fetch) -> None:
        """The prefix arrived at `fetch.dest`: into its prefix cache, and the request into its
        queue."""
        rid = fetch.request.request_id
        del self._fetches[rid]
        self._instances[fetch.dest].fetching.pop(rid, None)
        engine = self.instances[fetch.dest]
        bm = engine.block_manager
        tokens = list(fetch.request.prompt_token_ids[: fetch.num_tokens])
        holder = f"__prefix_fetch__{rid}"  # a page table only for the insert
        tokens = tokens[: len(tokens) // bm.page_size * bm.page_size]
        while tokens and not bm.can_allocate(holder, len(tokens)):
            tokens = tokens[: len(tokens) - bm.page_size]  # what fits (LRU pages evicted)
        if tokens:
            bm.allocate_import(holder, len(tokens), len(tokens))  # (hybrid: the windows only)
            # offers its full pages to the prefix cache (its adapter's tree, if it has one)
            bm.free(holder, tokens, fetch.request.cache_namespace)
        self._admit(fetch.dest, fetch.request, fetch.prompt, fetch.end)

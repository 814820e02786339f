"""T0, the engine's device pages, over the lower KV tiers (issue 22, item 2; Mooncake's
KV-centric store, SGLang HiCache's policies): `KVTiers` moves full blocks of the radix cache's
pages down to T1/T2/T3 (`llmjax/kvstore/tiered.py`) and, when a prompt is admitted, loads the
prefix the tiers hold beyond the device's, or lets the engine recompute it, whichever the cost
model says is faster.

    engine = LLMEngine(config.replace(kv_store=KVStoreConfig(host_blocks=4096,
                                                             disk_dir="/tmp/kv")), ...)
    out.num_cached_tokens_per_tier     # {'device': 512, 'host': 256, 'disk': 0}

Blocks. A block is `block_size // page_size` consecutive full pages of a prefix, keyed by its
last page's key (the radix tree keys every page: `RadixNode.page_keys`). What each node's
pages have below is recorded on it: `RadixNode.page_tiers[i]` has bit t set while lower tier t
holds the block ending at page i (tier listeners keep it exact for T1 and T2, which report
their evictions; T3's master evicts on its own, so its bit means "written", and a load checks
`exists` anyway).

Writes down (`KVStoreConfig.write_policy`), T0 -> T1:
  write_through            every block as soon as its pages are inserted in the radix tree;
  write_through_selective  a block once requests reused it `write_through_threshold` times
                           (`RadixNode.hits`, counted on each match that reused the node);
  write_back               a block when the radix tree evicts its last page.
A block's missing ancestors go first (the tiers are prefix-closed). T1 -> T2 follows the same
policy (`TieredStore`).

Device order. A write is a jitted gather of the pages (`ModelRunner.export_host_pages`), a load
a jitted scatter (`import_host_pages`); both are queued as the scheduler decides them and dispatched
in that order, right before the step that may reuse (write_back: the evicted pages were just
handed to other requests) or read (loads) those pages, so JAX's in-order execution on the
device makes the gather read the old KV and the step read the loaded KV. The gathered array is
copied to the host while the step runs (`copy_to_host_async`) and stored after it: the writes
overlap the running batch. A load reads the blocks on the host at admission (T2: a file read
and checksum; T3: a TCP get) and its copy to the device overlaps the host's scheduling.

Load or recompute (`KVStoreConfig.load_policy`, 'cost' by default): loading k tokens costs
sum over their blocks of (tier latency + block bytes / tier bandwidth); recomputing them costs
k / (the engine's measured prefill tokens per second, `KVStoreConfig.prefill_tokens_per_s`
until a prefill step was timed). A block that fails its checksum or has vanished ends the
load there: the rest is recomputed, never a wrong KV.

Prefetch (with T1 above a disk tier): after each step the blocks that the first
`PREFETCH_REQUESTS` waiting prompts will want from disk are read by a background thread
(`DiskTier.read_file`, checked, touching no bookkeeping) and stored in T1 at the next step, so
a disk read overlaps the running batch and the admission finds the blocks in host memory.

Plain Python + numpy (the runner does the jax).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from llmjax.engine.step import StepFeature
from llmjax.kvstore.keys import ROOT_KEY, chain_keys
from llmjax.kvstore.tiered import TieredStore

logger = logging.getLogger(__name__)

PREFETCH_REQUESTS = 4  # waiting prompts whose disk blocks are read ahead into T1


@dataclasses.dataclass
class TierStats:
    """Counters of the tiers' traffic (since the engine started or `reset_stats`)."""

    blocks_written: dict[str, int] = dataclasses.field(default_factory=dict)
    blocks_loaded: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens_loaded: dict[str, int] = dataclasses.field(default_factory=dict)
    num_loads: int = 0  # admissions that loaded a prefix
    num_recomputes: int = 0  # admissions whose stored prefix the cost model chose to recompute
    num_load_failures: int = 0  # blocks that vanished or failed their checksum while loading
    blocks_prefetched: int = 0  # disk blocks read ahead into T1 for waiting prompts
    load_seconds: float = 0.0  # host seconds spent reading blocks for loads
    write_seconds: float = 0.0  # host seconds spent storing exported blocks

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Export:
    pages: list[int]
    blocks: list[tuple[bytes, bytes]]  # (key, parent) of each block, in chain order
    array: object = None  # the gathered jax.Array once dispatched


@dataclasses.dataclass
class _Import:
    pages: list[int]
    data: np.ndarray  # [L, 2, len(pages), page_size, K', H]


class KVTiers:
    """The engine's T0 over a `TieredStore` (the module doc). `block_manager`'s prefix cache
    must be a salted RadixCache; `runner` must have `export_host_pages` / `import_host_pages`
    (`ModelRunner`, or tests' fake runner)."""

    def __init__(self, store: TieredStore, block_manager, runner, kv_config):
        cache = block_manager.prefix_cache
        if getattr(cache, "salt", None) is None:
            raise ValueError("the KV tiers need the radix prefix cache with page keys")
        self.store = store
        self.bm = block_manager
        self.cache = cache
        self.runner = runner
        self.config = kv_config
        self.page_size = block_manager.page_size
        self.block_pages = store.block_pages
        self.policy = store.write_policy
        self.stats = TierStats()
        self._ops: list[_Export | _Import] = []  # queued device work, in decision order
        self._in_flight: list[_Export] = []  # dispatched exports not yet stored
        self._queued: set[bytes] = set()  # block keys queued or in flight for T1
        self._keys: OrderedDict[str, tuple[int, list[bytes]]] = OrderedDict()  # prompts' keys
        self._prefill_rate: float | None = None  # measured tokens/s
        self._loading: list | None = None  # leaves inserted by a load in progress
        self._prefetch_pool = None  # one thread reading disk blocks ahead (see prefetch)
        self._prefetching: dict[bytes, tuple[bytes, object]] = {}  # key -> (parent, future)
        self._disk = next(
            (i for i, t in enumerate(store.tiers) if i and hasattr(t, "read_file")), None
        )
        self._latency = [getattr(kv_config, f"{t.name}_latency", 1e-3) for t in store.tiers]
        self._bandwidth = [getattr(kv_config, f"{t.name}_bandwidth", 1e9) for t in store.tiers]
        cache.on_insert = self._inserted  # records the tiers; write_through also writes
        if self.policy == "write_through_selective":
            block_manager.on_hit = self._hit
        elif self.policy == "write_back":
            cache.on_evict = self._evicted
        store.listeners.append(self._tier_changed)

    # ---- T0 -> T1 -------------------------------------------------------------------------

    def _inserted(self, leaf) -> None:
        """A new leaf: record which tiers already hold its blocks (a prefix recomputed or
        loaded after its pages left the device); write_through: queue its blocks."""
        bp = self.block_pages
        start = len(self.cache.path_keys(leaf)) - len(leaf.page_keys)
        for i, key in enumerate(leaf.page_keys):
            if (start + i + 1) % bp == 0:
                bits = 0
                for t, tier in enumerate(self.store.tiers):
                    if hasattr(tier, "on_drop") and key in tier:
                        bits |= 1 << t
                leaf.page_tiers[i] = bits
        if self.policy == "write_through":
            if self._loading is not None:
                self._loading.append(leaf)  # queued after the load's scatter, not before
            else:
                self._queue_blocks(leaf)

    def _hit(self, node) -> None:
        n, hot = node, None
        while not n.is_root:  # ancestors' counts are >= their descendants'
            n.hits += 1
            if hot is None and n.hits >= self.config.write_through_threshold:
                hot = n
            n = n.parent
        if hot is not None:
            self._queue_blocks(hot)

    def _evicted(self, node) -> None:
        self._queue_blocks(node)

    def _queue_blocks(self, node) -> None:
        """Queue the export of every full block from the root down to the end of `node` that
        T1 lacks (its ancestors first)."""
        keys = self.cache.path_keys(node)
        num_blocks = len(keys) // self.block_pages
        if not num_blocks:
            return
        t1, bp = self.store.tiers[0], self.block_pages
        todo = [
            j
            for j in range(num_blocks)
            if keys[(j + 1) * bp - 1] not in self._queued and keys[(j + 1) * bp - 1] not in t1
        ]
        if not todo:
            return
        pages = self.cache.path_pages(node)
        op = _Export([], [])
        for j in todo:
            key = keys[(j + 1) * bp - 1]
            op.pages.extend(pages[j * bp : (j + 1) * bp])
            op.blocks.append((key, keys[j * bp - 1] if j else ROOT_KEY))
            self._queued.add(key)
        self._ops.append(op)

    # ---- device order ---------------------------------------------------------------------

    def dispatch(self) -> None:
        """Send the queued gathers and scatters to the device, in the order they were decided
        (call before any step that may reuse or read their pages)."""
        for op in self._ops:
            if isinstance(op, _Import):
                self.runner.import_host_pages(op.pages, op.data)
            else:
                op.array = self.runner.export_host_pages(op.pages)
                start = getattr(op.array, "copy_to_host_async", None)
                if start is not None:
                    start()
                self._in_flight.append(op)
        self._ops.clear()

    def finish(self) -> None:
        """Store the dispatched gathers in T1 (they ran before the step just run)."""
        if not self._in_flight:
            return
        t = time.perf_counter()
        bp, t1 = self.block_pages, self.store.tiers[0].name
        for op in self._in_flight:
            data = np.asarray(op.array)
            chain = [
                (key, parent, np.ascontiguousarray(data[:, :, j * bp : (j + 1) * bp]))
                for j, (key, parent) in enumerate(op.blocks)
            ]
            held = self.store.write(0, chain)
            self.stats.blocks_written[t1] = self.stats.blocks_written.get(t1, 0) + held
            self._queued.difference_update(k for k, _ in op.blocks)
        self._in_flight.clear()
        self.stats.write_seconds += time.perf_counter() - t

    def flush(self) -> None:
        self.dispatch()
        self.finish()

    def _tier_changed(self, tier: int, key: bytes, present: bool) -> None:
        self.cache.set_tier(key, tier, present)

    # ---- loads ----------------------------------------------------------------------------

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` tokens took `seconds` (the cost model's rate: an
        exponential moving average)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self._prefill_rate = (
            rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate
        )

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_rate or self.config.prefill_tokens_per_s

    def load_seconds(self, tiers: Sequence[int]) -> float:
        """The cost model's seconds to copy blocks from `tiers` (one tier index per block)."""
        nbytes = self.block_nbytes
        return sum(self._latency[t] + nbytes / self._bandwidth[t] for t in tiers)

    @property
    def block_nbytes(self) -> int:
        t = self.store.tiers[0]
        return int(np.prod(t.block_shape)) * np.dtype(t.dtype).itemsize

    def _page_keys(self, req, token_ids: Sequence[int]) -> list[bytes]:
        """The page keys of `req`'s tokens (salted by its LoRA adapter's tree, if any)."""
        n = len(token_ids) // self.page_size
        got = self._keys.get(req.request_id)
        if got is None or got[0] != n:
            salt = self.cache.salt_for(req.cache_namespace)
            got = (n, chain_keys(token_ids, self.page_size, salt))
            self._keys[req.request_id] = got
            if len(self._keys) > 256:  # the waiting requests retried most
                self._keys.popitem(last=False)
        return got[1]

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def forget_all(self) -> None:
        """Drop every request's page keys (the radix cache's salt changed)."""
        self._keys.clear()

    def load(self, req, token_ids: Sequence[int], prefix) -> int:
        """Before admitting `req`: if the tiers hold more of `token_ids` (the tokens a match
        may cover) than the radix cache's `prefix` (`BlockManager.peek_prefix`), load those
        blocks into new cache pages, or not, as `load_policy` says. Returns the pages loaded
        (then the caller peeks again); 0 if nothing was loaded."""
        bp, device_pages = self.block_pages, prefix.num_pages
        first = device_pages // bp  # the block holding the first page the device lacks
        if len(token_ids) // self.page_size // bp <= first:
            return 0
        keys = self._page_keys(req, token_ids)
        block_keys = keys[bp - 1 :: bp]
        tiers = self.store.available(block_keys)[first:]
        if not tiers:
            return 0
        policy = self.config.load_policy
        tokens = (first + len(tiers)) * bp * self.page_size - device_pages * self.page_size
        if policy == "never" or (
            policy == "cost" and self.load_seconds(tiers) >= tokens / self.prefill_tokens_per_s
        ):
            self.stats.num_recomputes += 1
            return 0
        t = time.perf_counter()
        blocks = []
        for j, tier in enumerate(tiers, start=first):
            data = self.store.read(block_keys[j], tier)
            if data is None:
                self.stats.num_load_failures += 1
                break
            blocks.append((tier, data))
        self.stats.load_seconds += time.perf_counter() - t
        num_pages = (first + len(blocks)) * bp - device_pages
        if num_pages <= 0:
            return 0
        if num_pages > self.bm.num_available_pages - prefix.num_unlocked_pages:
            return 0  # (the admission check the caller made says they fit)
        data = np.concatenate([d for _, d in blocks], axis=2)[:, :, device_pages - first * bp :]
        self._loading = []
        try:
            pages = self.bm.extend_cache(token_ids, num_pages, req.cache_namespace)
        finally:
            leaves, self._loading = self._loading, None
        self._ops.append(_Import(pages, data))
        for leaf in leaves:
            if leaf.parent is not None:
                self._queue_blocks(leaf)
        self.stats.num_loads += 1
        first_pass = not req.output_token_ids
        for j, (tier, _) in enumerate(blocks):
            name = self.store.names[tier]
            n = bp * self.page_size - (device_pages - first * bp) * self.page_size * (j == 0)
            self.stats.blocks_loaded[name] = self.stats.blocks_loaded.get(name, 0) + 1
            self.stats.tokens_loaded[name] = self.stats.tokens_loaded.get(name, 0) + n
            if first_pass:
                req.loaded_tokens[name] = req.loaded_tokens.get(name, 0) + n
        return num_pages

    # ---- prefetch -------------------------------------------------------------------------

    def prefetch(self, waiting) -> None:
        """Store the disk blocks read ahead so far in T1, then start reading those the first
        waiting prompts will want (the module doc). A no-op without T1 above a disk tier."""
        if self._disk is None:
            return
        self._collect_prefetch()
        t1, disk, bp = self.store.tiers[0], self.store.tiers[self._disk], self.block_pages
        for req in list(waiting)[:PREFETCH_REQUESTS]:
            tokens = req.token_ids_slice(0, req.num_tokens - 1)
            if len(tokens) // self.page_size < bp:
                continue
            block_keys = self._page_keys(req, tokens)[bp - 1 :: bp]
            have = t1.exists(block_keys)
            on_disk = disk.exists(block_keys)
            for j in range(have, on_disk):
                key = block_keys[j]
                if key in self._prefetching:
                    continue
                if self._prefetch_pool is None:
                    import concurrent.futures

                    self._prefetch_pool = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="llmjax-kv-prefetch"
                    )
                parent = block_keys[j - 1] if j else ROOT_KEY
                self._prefetching[key] = (parent, self._prefetch_pool.submit(disk.read_file, key))

    def _collect_prefetch(self) -> None:
        t1 = self.store.tiers[0]
        for key, (parent, future) in list(self._prefetching.items()):  # in submission order
            if not future.done():
                break  # (a later block's parent may be this one)
            del self._prefetching[key]
            data = future.result()
            if data is None or key in t1:
                continue
            if self.store.write(0, [(key, parent, data)]):  # refused if its parent is not in T1
                self.stats.blocks_prefetched += 1

    def close(self) -> None:
        """Store what the device still has in flight, stop the prefetch thread and leave the
        store (which other engines may share; its tiers stay open)."""
        self.flush()
        if self._prefetch_pool is not None:
            self._prefetch_pool.shutdown(wait=True)
            self._prefetch_pool = None
            self._collect_prefetch()
        if self._tier_changed in self.store.listeners:
            self.store.listeners.remove(self._tier_changed)

    # ---- invariants -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every block-ending page of the radix tree records exactly the tiers (those that
        report their evictions) holding its block; the tiers keep their own rules."""
        self.store.check_invariants()
        bp = self.block_pages
        exact = [i for i, t in enumerate(self.store.tiers) if hasattr(t, "on_drop")]
        for node in self.cache.nodes():
            keys = self.cache.path_keys(node)
            start = len(keys) - len(node.page_keys)
            for i, key in enumerate(node.page_keys):
                at_end = (start + i + 1) % bp == 0
                for t in exact:
                    want = at_end and key in self.store.tiers[t]
                    got = bool(node.page_tiers[i] >> t & 1)
                    assert got == want, f"page {start + i}: tier {t} record {got}, holds {want}"


class KVTierSteps(StepFeature):
    """The KV tiers' part of the engine step (a `StepFeature`).

    - `scheduled` (every step, empty or not): dispatch the queued gathers and scatters, before
      the step reuses evicted pages or reads loaded ones.
    - `collect`: store the gathers that ran before the step; a step that prefilled updates the
      cost model's prefill rate.
    - `update`: the blocks the step completed start their copy down; with nothing left to run
      they are finished at once (nothing to overlap with); disk reads for the waiting
      requests' next admissions start."""

    def __init__(self, tiers: KVTiers, scheduler):
        self.tiers = tiers
        self.scheduler = scheduler

    def scheduled(self, step) -> None:
        self.tiers.dispatch()

    def collect(self, step) -> None:
        self.tiers.finish()
        if any(not s.is_decode for s in step.batch.seqs):
            self.tiers.record_prefill(step.batch.num_tokens, step.device_s)

    def update(self, step) -> None:
        self.tiers.dispatch()
        if not self.scheduler.has_unfinished():
            self.tiers.finish()
        self.tiers.prefetch(self.scheduler.waiting)


def attach_kv_tiers(engine, store: TieredStore | None) -> KVTiers:
    """`engine`'s KV tiers over `store` (one shared with other engines), or over a new store as
    its `config.kv_store` describes. The engine's config takes a shared store's policies; its
    scheduler loads prefixes through the tiers."""
    from llmjax.kvstore.tiered import make_store

    if store is not None and store.config is not None:  # a shared store's policies
        engine.config = engine.config.replace(kv_store=store.config)
    cfg = engine.config
    if not hasattr(engine.runner, "import_host_pages") or engine.runner.pipelined:
        raise ValueError("the KV tiers need a real device with pp == 1 and dense KV")
    block_pages = cfg.kv_store.block_size // cfg.cache.page_size
    if store is not None and store.block_pages != block_pages:
        raise ValueError(
            f"kv_store holds blocks of {store.block_pages} pages; this engine's are "
            f"{block_pages} (kv_store.block_size {cfg.kv_store.block_size})"
        )
    shape = list(engine.runner.transfer_shape(block_pages))
    shape[2] = block_pages
    if store is None:
        salt = engine.block_manager.prefix_cache.salt
        store = make_store(
            cfg.kv_store, tuple(shape), engine.runner.kv_dtype, block_pages, salt.hex()[:16]
        )
    elif store.tiers and tuple(store.tiers[0].block_shape) != tuple(shape):
        raise ValueError(
            f"kv_store holds blocks of shape {store.tiers[0].block_shape}; this engine's "
            f"are {tuple(shape)} (another model, layout or block size)"
        )
    tiers = KVTiers(store, engine.block_manager, engine.runner, cfg.kv_store)
    engine.scheduler.prefix_loader = tiers.load
    return tiers

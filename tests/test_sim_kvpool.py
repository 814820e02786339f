"""Mooncake Store's DRAM pool in the simulator (llmjax/sim/kvpool.py) and the Conductor's use of
it (llmjax/cluster/conductor.py, llmjax/sim/cluster.py): the pool's invariants against a
reference under random inserts, touches and evictions; the Conductor's pool-fetch choice; a
SimCluster with the pool (a fetch from the pool replicates and delays; outputs independent of
the routing; every request finishes or is rejected exactly once)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs import PRESETS
from llmjax.bench.replay import replay
from llmjax.bench.workloads import RequestSpec
from llmjax.cluster import Conductor, MeasuredCostModel, RouteRequest, SimCostModel
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.kvstore.keys import ROOT_KEY, chain_keys
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimCluster, SimConfig
from llmjax.sim.kvpool import SimKVPool
from llmjax.sim.roofline import kv_page_bytes_per_device

SALT = b"test-salt"

# ---- the pool against a reference ---------------------------------------------------------------


class RefPool:
    """The rules of the module doc, the slow way: every key with its parent and the stamp of
    the last operation through it; eviction takes the leaf of the oldest stamp."""

    def __init__(self, capacity_pages):
        self.cap = capacity_pages
        self.parent: dict[bytes, bytes] = {}
        self.stamp: dict[bytes, int] = {}
        self.clock = 0
        self.evicted: list[bytes] = []

    def present(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.parent:
            n += 1
        return n

    def touch(self, keys):
        self.clock += 1
        n = self.present(keys)
        for k in keys[:n]:
            self.stamp[k] = self.clock
        return n

    def leaves(self):
        parents = set(self.parent.values())
        return [k for k in self.parent if k not in parents]

    def evict(self, n, protect=()):
        out = []
        while len(out) < n and self.parent:
            k = min(self.leaves(), key=self.stamp.__getitem__)
            assert k not in protect, "the reference would evict the chain being inserted"
            del self.parent[k], self.stamp[k]
            out.append(k)
        self.evicted += out
        return out

    def insert(self, keys):
        keys = keys[: self.cap]
        have = self.touch(keys)
        missing = len(keys) - have
        if missing <= 0:
            return 0
        over = len(self.parent) + missing - self.cap
        if over > 0:
            self.evict(over, protect=set(keys[:have]))
        parent = keys[have - 1] if have else ROOT_KEY
        for k in keys[have:]:
            self.parent[k], self.stamp[k] = parent, self.clock
            parent = k
        return missing


PAGE = 2
_tokens = st.lists(st.integers(0, 2), min_size=0, max_size=6 * PAGE)  # a small trie: sharing
_op = st.one_of(
    st.tuples(st.just("insert"), _tokens),
    st.tuples(st.just("touch"), _tokens),
    st.tuples(st.just("evict"), st.integers(0, 4)),
    st.tuples(st.just("match"), _tokens),
)


@settings(max_examples=300, deadline=None)
@given(capacity_pages=st.integers(0, 12), ops=st.lists(_op, max_size=60))
def test_pool_matches_the_reference_under_random_operations(capacity_pages, ops):
    pool = SimKVPool(capacity_pages * PAGE + 1, PAGE, SALT)  # a partial page of room: ignored
    ref = RefPool(capacity_pages)
    assert pool.capacity_pages == capacity_pages
    inserted_chains = []
    for kind, arg in ops:
        if kind == "evict":
            assert pool.evict(arg) == ref.evict(arg)
        elif kind == "match":
            keys = chain_keys(arg[:-1], PAGE, SALT)
            assert pool.match_tokens(arg) == ref.present(keys) * PAGE
        else:
            keys = chain_keys(arg, PAGE, SALT)
            if kind == "insert":
                assert pool.insert_path(keys) == ref.insert(keys)
                inserted_chains.append(keys)
            else:
                assert pool.touch(keys) == ref.touch(keys)
        pool.check_invariants()
        assert set(pool.lru_order()) == set(ref.parent)  # the same keys, so the same evictions
        assert pool.num_pages <= capacity_pages
        # prefix-closed: every stored key's chain from the first page is stored
        for chain in inserted_chains:
            n = pool.match_keys(chain)
            assert not any(k in pool for k in chain[n:])
    assert pool.num_evicted == len(ref.evicted)


def test_pool_evicts_the_least_recently_used_leaf_first():
    pool = SimKVPool(4 * PAGE, PAGE, SALT)
    a = chain_keys([1, 1, 2, 2, 3, 3], PAGE, SALT)  # 3 pages
    b = chain_keys([1, 1, 5, 5], PAGE, SALT)  # shares a's first page
    pool.insert_path(a)
    pool.insert_path(b)  # 4 pages: a0 a1 a2 b1
    assert pool.num_pages == 4
    pool.touch(a)  # a used again: b1 is the least recently used leaf (a0 is no leaf)
    c = chain_keys([7, 7], PAGE, SALT)
    pool.insert_path(c)
    assert b[1] not in pool and a[2] in pool and c[0] in pool
    pool.insert_path(chain_keys([8, 8], PAGE, SALT))  # then a2 (a1 is a leaf only after it)
    assert a[2] not in pool and a[1] in pool and c[0] in pool
    assert pool.match_tokens([1, 1, 2, 2, 3, 3, 9]) == 2 * PAGE
    pool.check_invariants()
    # a chain longer than the pool: its first pages
    small = SimKVPool(2 * PAGE, PAGE, SALT)
    assert small.insert_path(a) == 2 and small.match_keys(a) == 2


# ---- the Conductor's choice ---------------------------------------------------------------------

# prefill: 1 ms a token; transfer: 0.1 ms a token
COST = MeasuredCostModel(prefill_s_per_token=1e-3, decode_step_s=0.01, transfer_s_per_token=1e-4)


@dataclasses.dataclass
class Fake:
    index: int
    cached: int = 0
    queued: list = dataclasses.field(default_factory=list)
    kv_capacity_tokens: int = 10**9

    @property
    def instance_id(self) -> int:
        return self.index

    def cached_prefix_tokens(self, prompt) -> int:
        return min(self.cached, len(prompt) - 1)

    def queued_prefills(self):
        return self.queued

    def decode_requests(self):
        return []


@dataclasses.dataclass
class FakePool:
    stored: int

    def match_tokens(self, prompt) -> int:
        return min(self.stored, len(prompt) - 1)


def _schedule(conductor, prefill, pool, rid="r", n=1000):
    request = RouteRequest(rid, tuple(range(n)), 0.0, SamplingParams(max_tokens=8))
    return conductor.schedule(request, prefill, [Fake(0)], 0.0, pool=pool)


def test_the_conductor_fetches_from_the_pool_when_it_pays():
    # nothing on the instances, 900 tokens in the pool: 0.09 s transfer + 0.1 s prefill < 1 s
    d = _schedule(Conductor(COST), [Fake(0), Fake(1)], FakePool(900))
    assert (d.from_pool, d.fetch_from, d.fetch_tokens, d.local_tokens) == (True, None, 900, 0)
    assert d.fetches and d.ttft == pytest.approx(0.09 + 0.1)
    assert d.transfer_s == pytest.approx(0.09)
    # the pool longer than the best instance (500): from the pool, to the idle one
    views = [Fake(0), Fake(1, cached=500, queued=[("q", 3000, 0)])]
    d = _schedule(Conductor(COST), views, FakePool(900), rid="s")
    assert (d.prefill, d.from_pool, d.fetch_tokens) == (0, True, 900)
    # a transfer dearer than recomputing (2 ms a token > 1 ms): no pool fetch
    dear = dataclasses.replace(COST, transfer_s_per_token=2e-3)
    d = _schedule(Conductor(dear), [Fake(0), Fake(1)], FakePool(900), rid="t")
    assert not d.from_pool and d.fetch_from is None and not d.fetches
    assert d.ttft == pytest.approx(1.0)
    # the pool no longer than an instance's cache: Algorithm 1 as without a pool
    views = [Fake(0), Fake(1, cached=900, queued=[("q", 3000, 0)])]
    for pool in (FakePool(900), FakePool(400), None):
        d = _schedule(Conductor(COST), views, pool, rid="u")
        assert (d.prefill, d.fetch_from, d.from_pool, d.fetch_tokens) == (0, 1, False, 900)
    # and the threshold gates the pool as it gates an instance: best / local = 900 / 600
    views = [Fake(0, cached=600)]
    d = _schedule(Conductor(COST, kvcache_balancing_threshold=2.0), views, FakePool(900), "v")
    assert not d.from_pool and d.local_tokens == 600
    d = _schedule(Conductor(COST, kvcache_balancing_threshold=1.2), views, FakePool(900), "w")
    assert d.from_pool and d.ttft == pytest.approx(0.03 + 0.1)


# ---- on the simulator ----------------------------------------------------------------------------

TINY = PRESETS["tiny"]
STEP = LinearCostModel((0.01, 0.001, 0.0, 0.002, 0.0))  # 10 ms + 1 ms a token + 2 ms a decode
PAGE_SIZE = 4


def _engine(role, num_pages=64, max_num_seqs=4):
    config = EngineConfig(
        model=TINY,
        device="sim",
        sim=SimConfig(cost_model=STEP),
        cache=CacheConfig(page_size=PAGE_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
        max_model_len=128,
    )
    return LLMEngine(config, params=None, num_pages=num_pages, role=role)


def _cluster(conductor, num_prefill=2, num_decode=1, num_pages=64, **kw):
    engines = [_engine("prefill", num_pages) for _ in range(num_prefill)]
    engines += [_engine("decode", 128) for _ in range(num_decode)]
    return SimCluster(engines, conductor, **kw)


def test_sim_cost_model_pool_transfer():
    config = _engine("prefill").config
    m = SimCostModel(config)
    assert m.pool_transfer_seconds(64) == pytest.approx(m.transfer_seconds(64))
    slow = SimCostModel(config, pool_bandwidth=1e6, pool_latency_s=0.5)
    per_token = kv_page_bytes_per_device(TINY, PAGE_SIZE, config.dtype, 1, 1) / PAGE_SIZE
    assert slow.pool_transfer_seconds(64) == pytest.approx(0.5 + 64 * per_token / 1e6)
    assert slow.pool_transfer_seconds(0) == 0.0


def test_pool_capacity_and_hooks():
    engines = [_engine("prefill"), _engine("prefill"), _engine("decode")]
    per_token = kv_page_bytes_per_device(TINY, 1, engines[0].config.dtype, 1, 1)
    cluster = SimCluster(engines, Conductor(), kv_pool_bytes_per_node=1e6)
    nodes = len({cluster.nodes[0], cluster.nodes[1]})
    pool = cluster.kv_pool
    assert pool.capacity_pages == int(1e6 * nodes // per_token) // PAGE_SIZE
    assert pool.salt == engines[0].block_manager.prefix_cache.salt
    assert SimCluster([_engine("prefill"), _engine("decode")], Conductor()).kv_pool is None
    with pytest.raises(ValueError, match="page_size"):
        SimCluster(
            [_engine("prefill"), _engine("decode")], Conductor(), kv_pool=SimKVPool(64, 8, SALT)
        )


def test_a_prefix_fetched_from_the_pool_delays_the_prefill_and_replicates():
    """A prefix computed on instance 0 and then dropped from its HBM cache stays in the pool; a
    request sharing it fetches it from the pool (no instance holds it), joins its instance
    after the modeled transfer and prefills only the rest; the prefix is cached there after."""
    prefix = list(range(3, 3 + 48))
    conductor = Conductor(MeasuredCostModel(prefill_s_per_token=1e-3, transfer_s_per_token=0))
    pool = SimKVPool(10_000, PAGE_SIZE, _engine("prefill").block_manager.prefix_cache.salt)
    cluster = _cluster(conductor, num_pages=128, kv_pool=pool)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    cluster.add_request([*prefix, 7], one, request_id="warm", arrival_time=0.0)
    while cluster.has_unfinished_requests():
        cluster.step()
    assert pool.match_tokens([*prefix, 9]) == 48  # written by instance 0's prefill
    for e in cluster.instances:
        assert e.reset_prefix_cache()  # only the pool holds it now
    assert pool.match_tokens([*prefix, 9]) == 48
    cluster.add_request([*prefix, 9, 9], one, request_id="hit", arrival_time=1.0)
    seen = set()
    while cluster.has_unfinished_requests():
        seen.add(cluster.state_of("hit"))
        cluster.step()
    st_ = cluster.conductor_stats
    assert "fetching" in seen
    assert (st_.num_fetches, st_.num_pool_fetches, st_.pool_fetched_tokens) == (1, 1, 48)
    p = cluster.path_of("hit")[0]
    seconds, nbytes = cluster.kv_pool_seconds(p, 48)
    assert st_.fetch_seconds == pytest.approx(seconds) and st_.fetch_bytes == nbytes > 0
    assert cluster.instances[p].stats.num_cached_prefill_tokens == 48
    assert cluster.instances[p].block_manager.peek_prefix(prefix).num_tokens == 48
    pool.check_invariants()


def _workload(seed, n=50, qps=40.0, num_prefixes=6):
    rng = np.random.default_rng(seed)
    shared = [rng.integers(3, 250, 28).tolist() for _ in range(num_prefixes)]
    t = np.cumsum(rng.exponential(1 / qps, n))
    return [
        RequestSpec(
            arrival_time=float(t[i]),
            output_len=int(rng.integers(1, 12)),
            prompt_token_ids=shared[int(rng.integers(num_prefixes))]
            + rng.integers(3, 250, int(rng.integers(2, 16))).tolist(),
        )
        for i in range(n)
    ]


def _run(cluster, specs):
    """Replay `specs` step by step: each request's one finishing output (asserting that it
    comes exactly once)."""
    ended, i = {}, 0
    while i < len(specs) or cluster.has_unfinished_requests():
        now = cluster.clock.now()
        while i < len(specs) and specs[i].arrival_time <= now:
            s = specs[i]
            cluster.add_request(
                s.prompt_token_ids,
                SamplingParams(max_tokens=s.output_len, ignore_eos=True),
                request_id=str(i),
                arrival_time=s.arrival_time,
            )
            i += 1
        if i < len(specs) and not cluster.has_unfinished_requests():
            cluster.clock.advance_to(specs[i].arrival_time)
        for out in cluster.step():
            if out.finished:
                assert out.request_id not in ended
                ended[out.request_id] = out
    return ended


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    mode=st.sampled_from(["none", "predicted"]),
    num_pages=st.integers(16, 40),
    pool_pages=st.sampled_from([8, 40, 10_000]),
)
def test_sim_cluster_with_the_pool_serves_the_same_tokens(seed, mode, num_pages, pool_pages):
    """Small HBM caches (evicting), a pool of a few pages to plenty: every request finishes or
    is rejected exactly once, each served request's tokens are those of the same run without
    the pool and of a single engine, no page is held at the end, the pool keeps its rules."""
    specs = _workload(seed)
    salt = _engine("prefill").block_manager.prefix_cache.salt

    def conductor():
        return Conductor(ttft_slo=0.5, tbt_slo=0.05, rejection=mode)

    pool = SimKVPool(pool_pages * PAGE_SIZE, PAGE_SIZE, salt)
    with_pool = _cluster(conductor(), num_pages=num_pages, kv_pool=pool)
    ended = _run(with_pool, specs)
    without = _run(_cluster(conductor(), num_pages=num_pages), specs)
    reference = replay(SimCluster([_engine("colocated", 512)], "round_robin"), specs)
    assert set(ended) == set(without) == {str(i) for i in range(len(specs))}
    st_ = with_pool.conductor_stats
    rejected = [o for o in ended.values() if o.finish_reason == "rejected"]
    assert len(rejected) == st_.num_rejected and (mode == "predicted" or not rejected)
    for i, ref in enumerate(reference):
        o = ended[str(i)]
        if o.finish_reason == "rejected":
            assert o.token_ids == [] and with_pool.path_of(o.request_id) == ()
            continue
        assert o.error is None and o.token_ids == ref.token_ids
        assert len(o.token_ids) == specs[i].output_len
        other = without[str(i)]
        if other.finish_reason != "rejected":
            assert other.token_ids == o.token_ids
    for e in with_pool.instances:
        e.block_manager.check_invariants()
        assert e.block_manager.num_used_pages == 0 and not e.has_unfinished_requests()
    pool.check_invariants()
    assert pool.num_pages <= pool_pages and pool.num_inserted > 0
    assert st_.num_pool_fetches <= st_.num_fetches
    event(f"pool fetches: {st_.num_pool_fetches > 0}")


def test_the_pool_gets_fetches_the_hbm_caches_lost():
    """With small HBM caches and a big pool the Conductor fetches from the pool, and the run
    reuses more prompt tokens than without it."""
    specs = _workload(1, n=80, qps=20.0, num_prefixes=10)
    salt = _engine("prefill").block_manager.prefix_cache.salt
    cached = {}
    for name, kw in (("pool", {"kv_pool": SimKVPool(10**6, PAGE_SIZE, salt)}), ("off", {})):
        cluster = _cluster(Conductor(), num_pages=16, **kw)
        outs = replay(cluster, specs)
        assert all(o.error is None for o in outs)
        cached[name] = sum(e.stats.num_cached_prefill_tokens for e in cluster.instances[:2])
        if name == "pool":
            assert cluster.conductor_stats.num_pool_fetches > 0
    assert cached["pool"] > cached["off"]

"""Routers over engine instances (llmjax/cluster/router.py): power_of_two and cache_aware on
hand-made loads, the prefix trie against a brute-force model, and every router on a SimCluster."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import PRESETS
from llmjax.bench.metrics import summarize
from llmjax.bench.replay import replay
from llmjax.bench.workloads import RequestSpec
from llmjax.cluster.router import (
    ROUTERS,
    CacheAware,
    InstanceLoad,
    PowerOfTwo,
    PrefixTrie,
    RouteRequest,
    make_router,
)
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimConfig
from llmjax.sim.cluster import InstanceView, SimCluster


@dataclasses.dataclass
class Load:
    """A hand-made InstanceLoad."""

    index: int
    num_outstanding: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_free_pages: int = 100
    num_available_pages: int = 100

    def cached_prefix_tokens(self, prompt_token_ids) -> int:
        return 0


def loads(*outstanding) -> list[InstanceLoad]:
    return [Load(i, n) for i, n in enumerate(outstanding)]


def req(tokens, t=0.0, rid="r") -> RouteRequest:
    return RouteRequest(rid, tuple(tokens), t, SamplingParams())


def test_the_interface_moved_and_sim_cluster_re_exports_it():
    import llmjax.sim
    import llmjax.sim.cluster as sim_cluster
    from llmjax import cluster

    for name in ("ROUTERS", "make_router", "RoundRobin", "LeastOutstanding", "RouteRequest"):
        assert getattr(sim_cluster, name) is getattr(cluster, name)
    assert llmjax.sim.ROUTERS is ROUTERS and llmjax.sim.make_router is make_router
    assert list(ROUTERS) == [
        "round_robin",
        "least_outstanding",
        "power_of_two",
        "cache_aware",
        "random",
        "mooncake",
    ]
    assert isinstance(InstanceView, type)  # stays in sim/cluster.py


def test_unknown_router_is_a_value_error_listing_the_choices():
    with pytest.raises(ValueError, match=r"unknown router 'fastest'.*cache_aware.*power_of_two"):
        make_router("fastest")
    assert make_router("power_of_two", seed=3).name == "power_of_two"
    r = make_router("cache_aware", cache_threshold=0.9)
    assert isinstance(r, CacheAware) and r.cache_threshold == 0.9


# ---- power_of_two --------------------------------------------------------------------------------


def test_power_of_two_is_seeded_and_prefers_the_less_loaded():
    views = loads(5, 0, 3, 9, 1, 7)
    picks = [PowerOfTwo(seed=1).route(req([1]), views, 0.0) for _ in range(3)]
    assert len(set(picks)) == 1  # fresh routers with one seed: one choice
    r1, r2 = PowerOfTwo(seed=7), PowerOfTwo(seed=7)
    seq1 = [r1.route(req([1]), views, 0.0) for _ in range(200)]
    assert seq1 == [r2.route(req([1]), views, 0.0) for _ in range(200)]
    other = PowerOfTwo(seed=8)
    assert seq1 != [other.route(req([1]), views, 0.0) for _ in range(200)]
    # the most loaded one never wins (it is always paired with a lighter one)
    assert 3 not in seq1
    # the lightest wins whenever drawn: 1 - P(not drawn) = 1 - C(5,2)/C(6,2) = 1/3
    assert 0.2 < seq1.count(1) / 200 < 0.5
    # check the pair rule directly against the generator's draws
    rng = np.random.default_rng(7)
    for pick in seq1[:50]:
        a, b = rng.choice(6, size=2, replace=False)
        assert pick == min((views[a].num_outstanding, a), (views[b].num_outstanding, b))[1]


def test_power_of_two_ties_and_one_instance():
    assert {PowerOfTwo(seed=s).route(req([1]), loads(2, 2), 0.0) for s in range(20)} == {0}
    assert PowerOfTwo().route(req([1]), [Load(0, 50)], 0.0) == 0


# ---- cache_aware ---------------------------------------------------------------------------------

P = 4  # the trie's page size in these tests
SYSTEM = list(range(100, 116))  # 16 tokens: 4 pages


def test_cache_aware_imbalance_goes_to_the_least_loaded():
    r = CacheAware(page_size=P)
    prompt = [*SYSTEM, 1, 2, 3, 4]
    assert r.route(req(prompt), loads(0, 0, 0), 0.0) == 0
    # 100 - 60 > 32 and 100 > 60 * 1.0001: imbalanced -> least loaded, cache ignored
    assert r.route(req(prompt), loads(100, 60, 61), 1.0) == 1
    assert r.route(req(prompt), loads(33, 0, 5), 2.0) == 1  # 33 - 0 > 32 and 33 > 0
    # balanced (diff <= 32): the cache decides -> instance 0 or 1 (both hold the prompt)
    assert r.route(req(prompt), loads(32, 0, 0), 3.0) == 0
    # relative threshold: diff > abs but hi <= lo * rel
    r2 = CacheAware(page_size=P, balance_abs_threshold=2, balance_rel_threshold=2.0)
    r2.route(req(prompt), loads(0, 0), 0.0)
    assert r2.route(req(prompt), loads(10, 6), 1.0) == 0  # 10 <= 12: balanced, cache wins
    assert r2.route(req(prompt), loads(13, 6), 2.0) == 1  # 13 > 12 and 7 > 2: imbalanced


def test_cache_aware_match_above_threshold_wins_below_goes_to_the_smallest_tree():
    r = CacheAware(page_size=P)
    a = [*SYSTEM, 1, 2, 3, 4]  # 20 tokens
    assert r.route(req(a), loads(0, 0, 0), 0.0) == 0  # all empty: smallest tree, lowest index
    b = list(range(200, 232))  # 32 tokens, no match anywhere
    assert r.route(req(b), loads(0, 0, 0), 0.0) == 1  # tree sizes 20 -> 0 is larger
    assert (r.tree(0).size, r.tree(1).size, r.tree(2).size) == (20, 32, 0)
    # 16 of 24 tokens match on instance 0: 0.67 > 0.5, even though it is the busier one
    assert r.route(req(SYSTEM + [9] * 8), loads(3, 0, 0), 1.0) == 0
    # 16 of 36 = 0.44 <= 0.5: the smallest tree (instance 2, empty)
    assert r.route(req(SYSTEM + [7] * 20), loads(0, 0, 0), 2.0) == 2
    # the higher rate wins: instance 1 holds all of b
    assert r.route(req([*b, 5, 5]), loads(0, 0, 0), 3.0) == 1
    # a rate of exactly the threshold does not count (sglang: match_rate > cache_threshold)
    for threshold, expected in [(0.5, 2), (0.49, 0)]:
        r = CacheAware(page_size=P, cache_threshold=threshold)
        assert r.route(req(SYSTEM[:8]), loads(0, 0, 0), 0.0) == 0
        assert r.route(req(list(range(300, 340))), loads(0, 0, 0), 0.0) == 1
        # 8 of 16 tokens match on instance 0; else the smallest tree is instance 2's (empty)
        assert r.route(req(SYSTEM[:8] + [1] * 8), loads(0, 0, 0), 1.0) == expected
    assert r.route(req([]), loads(0, 0, 0), 2.0) == 2  # an empty prompt: the smallest tree


def test_cache_aware_prunes_by_size_lru_leaves_first():
    r = CacheAware(page_size=P, max_tree_size=24)
    r.route(req(SYSTEM + [1] * 4), [Load(0)], 0.0)  # 5 pages = 20 tokens
    r.route(req(SYSTEM + [2] * 4), [Load(0)], 1.0)  # + 1 page = 24 tokens: at the cap
    assert r.tree(0).size == 24
    r.route(req(SYSTEM + [3] * 8), [Load(0)], 2.0)  # + 2 pages -> 32: evict [1]*4, ...
    t = r.tree(0)
    assert t.size == 24 and t.match(SYSTEM + [1] * 4) == 16 and t.match(SYSTEM + [2] * 4) == 16
    assert t.match(SYSTEM + [3] * 8) == 24  # ... and then [2]*4: the LRU leaves


def test_cache_aware_prunes_entries_older_than_the_eviction_interval():
    r = CacheAware(page_size=P, eviction_interval_secs=60.0)
    old, new = SYSTEM + [1] * 4, list(range(500, 508))
    r.route(req(old), [Load(0), Load(1)], 0.0)
    r.route(req(new), [Load(0), Load(1)], 30.0)
    assert (r.tree(0).size, r.tree(1).size) == (20, 8)
    r.route(req([9] * 4), [Load(0), Load(1)], 60.0)  # cutoff 0: nothing older than it
    assert r.tree(0).match(old) == 20
    r.route(req([8] * 4), [Load(0), Load(1)], 60.5)  # cutoff 0.5: `old` goes
    assert r.tree(0).match(old) == 0 and r.tree(1).match(new) == 8
    # the system prompt, touched again later, outlives the request-specific tail
    r = CacheAware(page_size=P, eviction_interval_secs=10.0)
    r.route(req(SYSTEM + [1] * 4), [Load(0)], 0.0)
    r.route(req(SYSTEM + [2] * 4), [Load(0)], 8.0)
    r.route(req([7] * 4), [Load(0)], 15.0)  # cutoff 5
    t = r.tree(0)
    assert t.match(SYSTEM + [1] * 4) == 16 and t.match(SYSTEM + [2] * 4) == 20


def test_the_trie_stores_whole_pages_only():
    t = PrefixTrie(page_size=4)
    t.insert([1, 2, 3], 0.0)
    assert t.size == 0 and t.match([1, 2, 3]) == 0
    t.insert(range(10), 0.0)
    assert t.size == 8 and t.match(range(12)) == 8 and t.match([0, 1, 2, 3, 9]) == 4
    with pytest.raises(ValueError, match="page_size"):
        PrefixTrie(0)


def test_the_trie_is_fast_on_long_prompts():
    import time

    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 10_000).tolist()
    r = CacheAware()
    views = loads(0, 0, 0, 0)
    t0 = time.perf_counter()
    for k in range(100):
        prompt = system + rng.integers(0, 32000, 2_000).tolist()
        r.route(req(prompt, t=k * 0.1), views, k * 0.1)
    assert time.perf_counter() - t0 < 5.0
    assert r.tree(0).size == (10_000 + 100 * 2_000) // 16 * 16  # all on one, all pages kept


# ---- the trie against a brute-force model ------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 5), st.lists(st.integers(0, 2), max_size=14)),
    st.tuples(st.just("match"), st.integers(0, 5), st.lists(st.integers(0, 2), max_size=14)),
    st.tuples(st.just("size"), st.integers(0, 40)),
    st.tuples(st.just("age"), st.integers(0, 6)),
    st.tuples(st.just("tick"), st.integers(0, 3)),
)
_PREFIXES = [[], [0, 1, 2], [0, 1, 2, 0, 1], [2, 2, 2, 2, 2, 2], [1], [0, 1, 2, 1, 1, 1, 1]]


@settings(max_examples=300, deadline=None)
@given(page_size=st.integers(1, 3), ops=st.lists(_op, max_size=40))
def test_the_trie_matches_a_brute_force_model(page_size, ops):
    """The model: the set of page-aligned prefixes (tuples of pages) of the inserted prompts
    still present, each with (time, insert number) of its last insert; a match is the longest
    present prefix; a size prune drops the least recent, longest first (always a leaf); an age
    prune drops those last inserted before the cutoff. Times are non-decreasing."""
    trie = PrefixTrie(page_size)
    present: dict[tuple, tuple[float, int]] = {}  # prefix -> (time, insert number)
    now, seq = 0.0, 0

    def pages(tokens):
        starts = range(0, len(tokens) - page_size + 1, page_size)
        return [tuple(tokens[k : k + page_size]) for k in starts]

    for op in ops:
        if op[0] in ("insert", "match"):
            tokens = _PREFIXES[op[1]] + op[2]
            ps = pages(tokens)
            if op[0] == "insert":
                trie.insert(tokens, now)
                seq += 1
                for k in range(1, len(ps) + 1):
                    present[tuple(ps[:k])] = (now, seq)
            else:
                k = max(k for k in range(len(ps) + 1) if k == 0 or tuple(ps[:k]) in present)
                assert trie.match(tokens) == k * page_size
        elif op[0] == "size":
            evicted = trie.prune_to_size(op[1])
            n = len(present)
            while len(present) * page_size > op[1]:
                del present[min(present, key=lambda p: (present[p][1], -len(p)))]
            assert evicted == (n - len(present)) * page_size
        elif op[0] == "age":
            cutoff = now - op[1]
            trie.prune_older_than(cutoff)
            present = {p: v for p, v in present.items() if v[0] >= cutoff}
        else:
            now += op[1]
        assert trie.size == len(present) * page_size
        # the trie holds exactly the model's prefixes
        stack, got = [(trie.root, ())], set()
        while stack:
            node, path = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and len(key) == page_size
                got.add((*path, key))
                stack.append((child, (*path, key)))
        assert got == set(present)
        assert all(p[:-1] in present for p in present if len(p) > 1)  # prefix-closed


# ---- every router on a SimCluster -------------------------------------------------------------

PAGE = 16
TINY = PRESETS["tiny"]
COST = LinearCostModel((0.005, 0.0002, 0.0, 0.001, 0.0))


def _engine():
    config = EngineConfig(
        model=TINY,
        device="sim",
        sim=SimConfig(cost_model=COST),
        cache=CacheConfig(page_size=PAGE),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        max_model_len=512,
    )
    return LLMEngine(config, params=None, num_pages=128)


def _tenants(num_tenants=4, per_tenant=6, qps=8.0, seed=0):
    """Each tenant's requests: its 256-token system prompt + 32 own tokens; Poisson arrivals
    with the tenants interleaved at random."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 250, 256).tolist() for _ in range(num_tenants)]
    owners = rng.permutation(np.repeat(np.arange(num_tenants), per_tenant))
    times = np.cumsum(rng.exponential(1 / qps, len(owners)))
    return [
        RequestSpec(
            arrival_time=float(t),
            output_len=8,
            prompt_token_ids=systems[k] + rng.integers(3, 250, 32).tolist(),
        )
        for t, k in zip(times, owners, strict=True)
    ], owners


def test_cache_aware_keeps_tenants_together_and_outputs_do_not_depend_on_the_router():
    specs, owners = _tenants()
    tokens, hit_rate, placement = {}, {}, {}
    for name in ROUTERS:
        cluster = SimCluster([_engine() for _ in range(4)], name)
        outs = replay(cluster, specs)
        tokens[name] = [tuple(o.token_ids) for o in outs]
        stats = cluster.stats
        prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
        hit_rate[name] = sum(s.num_cached_prefill_tokens for s in stats) / prompt_tokens
        assert summarize(outs).prefix_cache_hit_rate == pytest.approx(hit_rate[name])
        placement[name] = [cluster.instance_of(o.request_id) for o in outs]
    assert all(len(t) == 8 for t in tokens["round_robin"])
    assert len({tuple(t) for t in tokens.values()}) == 1, "tokens must not depend on placement"
    # cache_aware: each tenant on one instance of its own (4 tenants, 4 instances)
    pairs = list(zip(placement["cache_aware"], owners, strict=True))
    where = {k: {i for i, o in pairs if o == k} for k in range(4)}
    assert all(len(w) == 1 for w in where.values()) and len(set().union(*where.values())) == 4
    # all but each tenant's first request reuse its 256-token prefix: the most there is to hit
    assert hit_rate["cache_aware"] == pytest.approx(4 * 5 * 256 / prompt_tokens), hit_rate
    assert hit_rate["cache_aware"] > hit_rate["round_robin"] + 0.3, hit_rate  # 74% vs 30%

"""The hybrid KV layout (`CacheConfig.hybrid_kv_cache`, `KVGroups`; Gemma 2 and 3): one page table
per group of layers, sliding-window groups holding their window's pages only.

- The layout: which group and slot each layer gets, for Gemma 2's and Gemma 3's patterns.
- The block manager, as a hypothesis state machine: requests arrive with prompts that share
  prefixes, compute in chunks, finish, are preempted, meet memory pressure and cache resets. Each
  page carries the tokens whose KV it would hold (written when a request computes them); after
  every step the invariants hold (`check_invariants`: every page owned once, every windowed
  page's count right), every running request's window is resident in every windowed group, and
  every page a request reads (its own or shared from the cache) holds that request's tokens.
- The engine: greedy outputs with the hybrid layout equal those with one page table, on tiny
  Gemma 2 and 3, under chunked prefill across the window, prefix hits after the window passed
  the shared prefix, preemption, a quantized cache and speculative decoding (n-gram and the
  early-exit draft); a long sequence's windowed groups hold their window's pages (and a chunk's
  while its prompt runs) only; validation refuses what can never fit, by that count.
- The simulator: Gemma 3 27B's pages hold its layout's layers, so more requests run at once.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from configs.gemma3 import GEMMA3_27B
from configs.tiny import TINY_GEMMA2, TINY_GEMMA3
from llmjax.config import KVGroups, kv_groups
from llmjax.engine.block_manager import BlockManager, pages_needed
from llmjax.engine.radix_cache import RadixCache
from llmjax.model.step_input import RESERVED_PAGE
from tests.conftest import TESTDATA


def test_layouts():
    g2 = kv_groups(TINY_GEMMA2, True)  # local, global alternating
    assert g2 == KVGroups((None, 8), (1, 0, 1, 0), (0, 0, 1, 1), 2)
    g3 = kv_groups(TINY_GEMMA3, True)
    assert g3.num_slots == 1 and g3.windows[0] is None and g3.num_groups == 5
    big = kv_groups(GEMMA3_27B, True)  # 10 global layers, 52 local: six local groups
    assert big.num_slots == 10 and big.windows == (None,) + (1024,) * 6
    for layers in (big.layer_group, big.layer_slot):
        assert len(layers) == GEMMA3_27B.num_layers
    pairs = set(zip(big.layer_group, big.layer_slot, strict=True))
    assert len(pairs) == GEMMA3_27B.num_layers  # no two layers share a group's slot
    assert all(GEMMA3_27B.layer_window(i) == big.windows[g] for i, g in enumerate(big.layer_group))
    assert kv_groups(GEMMA3_27B, False) == KVGroups.single(62)
    # a 32k sequence: 2048 pages of 10 layers and 6 x 65 windowed ones, against 2048 of 62
    assert big.pages_for(32768, 16) == 2048 + 6 * 65
    assert KVGroups.single(62).pages_for(32768, 16) == 2048
    assert big.slots_per_device(62, 1) == 10 and KVGroups.single(62).slots_per_device(62, 4) == 16


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_pipeline_stage_layouts(pp):
    """pp > 1: the groups are cut per stage (Gemma 3 27B's stages of 16/16/15/15 layers hold at
    most 3 global layers each, so pages hold 3 slots on every device, not 10), each group has at
    most `num_slots` layers on a stage, in distinct slots, and a stage's padding layers (a
    shorter stage) read and write the null group."""
    from llmjax.config.cache import stage_layers

    g = kv_groups(GEMMA3_27B, True, pp)
    stages = stage_layers(62, pp)
    groups, slots, num_kv_slots = g.stage_slots(stages)
    assert num_kv_slots == g.num_slots == g.slots_per_device(62, pp)
    assert g.num_slots == max(sum(GEMMA3_27B.layer_window(i) is None for i in s) for s in stages)
    for s, g_row, k_row in zip(stages, groups, slots, strict=True):
        real = list(zip(g_row[: len(s)], k_row[: len(s)], strict=True))
        assert real == [(g.layer_group[i], g.layer_slot[i]) for i in s]
        assert len(set(real)) == len(s) and max(k_row) < num_kv_slots  # distinct, in range
        padding = zip(g_row[len(s) :], k_row[len(s) :], strict=True)
        assert all(x == (g.num_groups, 0) for x in padding)
    assert all(GEMMA3_27B.layer_window(i) == g.windows[k] for i, k in enumerate(g.layer_group))
    if pp == 4:
        assert (g.num_slots, g.num_groups) == (3, 6)
        # the simulator sizes the cache by it: pages of 3 layers on each device, not 16
        from llmjax.config import CacheConfig, EngineConfig, ParallelConfig
        from llmjax.sim import SimConfig, sim_num_pages

        def pages(mode):
            return sim_num_pages(
                EngineConfig(
                    model=GEMMA3_27B,
                    dtype="bfloat16",
                    cache=CacheConfig(hybrid_kv_cache=mode),
                    parallel=ParallelConfig(pp=4),
                    device="sim",
                    sim=SimConfig(hardware="h100-sxm"),
                )
            )

        assert pages("on") == pytest.approx(pages("off") * 16 / 3, rel=0.01)


# ---- the block manager -------------------------------------------------------------------------


class HybridBlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([2, 4]),
        windows=st.sampled_from([(5,), (8, 8), (3, 9)]),
        num_pages=st.integers(24, 60),
    )
    def setup(self, page_size, windows, num_pages):
        self.ps = page_size
        groups = KVGroups((None, *windows), (), (), 1)
        self.bm = BlockManager(num_pages, page_size, RadixCache(page_size), groups)
        self.requests: dict[str, list[int]] = {}  # running: its tokens
        self.computed: dict[str, int] = {}
        self.content: dict[int, tuple[int, ...]] = {}  # page -> the token prefix its KV is of
        self.ids = itertools.count()

    def key(self, tokens, i):
        return tuple(tokens[: (i + 1) * self.ps])

    @rule(data=st.data())
    def arrive(self, data):
        base = data.draw(st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9] * 20, [1, 2, 3] * 7]))
        cut = data.draw(st.integers(1, len(base)))
        tail = data.draw(st.lists(st.integers(1, 4), max_size=12))
        tokens = base[:cut] + tail
        if len(tokens) < 2:
            return
        rid = f"r{next(self.ids)}"
        bm = self.bm
        prefix = bm.peek_prefix(tokens[:-1])
        if not bm.can_allocate(rid, len(tokens), 0, prefix):
            return
        cached = bm.match_prefix(rid, tokens[:-1])
        assert cached == prefix.num_tokens
        self.requests[rid] = tokens
        self.computed[rid] = cached
        self.check_reads(rid)

    @rule(tokens=st.lists(st.integers(1, 4), min_size=2, max_size=30))
    def arrive_with_kv(self, tokens):
        """A request whose KV of all but its last token a transfer writes (P/D, a prefix fetch):
        group 0 every page, each windowed group its window (holes before it)."""
        rid, bm, c = f"r{next(self.ids)}", self.bm, len(tokens) - 1
        if not bm.can_allocate(rid, len(tokens)):
            return
        pages = bm.allocate_import(rid, len(tokens), c)
        assert pages == bm.kv_pages(rid, c) and len(pages) == bm.groups.kv_pages(c, self.ps)
        for g, t in enumerate(bm.tables_of(rid)):  # the transfer writes them
            for i in range(bm.groups.window_start(g, c, self.ps), pages_needed(c, self.ps)):
                self.content[t[i]] = self.key(tokens, i)
        self.requests[rid] = tokens
        self.computed[rid] = c
        self.check_reads(rid)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), whole=st.booleans())
    def compute(self, data, whole):
        """The next n tokens; `whole`: group 0 takes pages for all the tokens known so far, the
        windowed groups for these n (sarathi's admission and chunks)."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, bm = self.requests[rid], self.bm
        c = self.computed[rid]
        n = data.draw(st.integers(1, 9))
        if c + n > len(tokens):
            tokens.extend(data.draw(st.lists(st.integers(1, 4), min_size=c + n - len(tokens))))
        end = len(tokens) if whole else c + n
        if not bm.can_allocate(rid, end, window_tokens=c + n):
            self.preempt(rid)
            return
        assert bm.num_missing_pages(rid, end, c + n) <= bm.num_available_pages
        bm.allocate(rid, end, c + n)
        assert bm.num_missing_pages(rid, end, c + n) == 0
        self.check_reads(rid, upto=c)
        for i in range(c // self.ps, pages_needed(c + n, self.ps)):  # the step writes its tokens
            for t in bm.tables_of(rid):
                assert t[i] != RESERVED_PAGE, "a position being written has no page"
                self.content[t[i]] = self.key(tokens, i)
        self.computed[rid] = c + n
        bm.cache_computed(rid, tokens[: c + n])
        bm.release_window(rid, c + n)

    def preempt(self, rid):
        self.bm.free(rid, self.requests[rid][: self.computed[rid]])
        del self.requests[rid], self.computed[rid]

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), offer=st.booleans())
    def finish(self, data, offer):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        tokens = self.requests.pop(rid)[: self.computed.pop(rid)] if offer else ()
        self.bm.free(rid, tokens)
        if not offer:
            self.requests.pop(rid), self.computed.pop(rid)

    @rule(n=st.integers(1, 40))
    def pressure(self, n):
        """Someone takes pages (drops and evictions) and gives them back."""
        bm = self.bm
        n = min(n, bm.num_available_pages // bm.num_groups)
        if n:
            bm.allocate("hog", n * self.ps)
            bm.free("hog")

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self):
        assert self.bm.reset_prefix_cache()

    def check_reads(self, rid, upto=None):
        """Every page `rid` reads (in every group, within its window) holds its tokens."""
        bm, tokens = self.bm, self.requests[rid]
        c = self.computed[rid] if upto is None else upto
        for g, t in enumerate(bm.tables_of(rid)):
            window = bm.groups.windows[g]
            first = 0 if window is None else max(0, (c - window + 1) // self.ps)
            for i in range(first, c // self.ps):  # full pages computed
                assert t[i] != RESERVED_PAGE, f"group {g} lost page {i} inside the window"
                assert self.content.get(t[i]) == self.key(tokens, i), "a page of other tokens"

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for rid in self.requests:
            self.check_reads(rid)
            c = self.computed[rid]  # what an export would move: no hole inside a window
            assert len(self.bm.kv_pages(rid, c)) == self.bm.groups.kv_pages(c, self.ps)
            tables = self.bm.tables_of(rid)
            for g, t in enumerate(tables[1:], 1):  # windowed groups hold their window at most
                held = sum(p != RESERVED_PAGE for p in t)
                window = self.bm.groups.windows[g]
                assert held <= pages_needed(window, self.ps) + 1 + 9 // self.ps + 1


HybridBlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestHybridBlockManager = HybridBlockManagerMachine.TestCase


def _computed(num_pages, ps=4):
    """A block manager of `num_pages` pages of `ps` (one windowed group, window 8) where request
    'a' computed 40 tokens and offered them to the cache."""
    bm = BlockManager(num_pages, ps, RadixCache(ps), KVGroups((None, 8), (), (), 1))
    tokens = list(range(1, 41))
    bm.allocate("a", 40)
    bm.cache_computed("a", tokens)
    return bm, tokens


def test_window_pages_are_released_and_cached_ones_dropped_before_eviction():
    ps = 4
    bm, tokens = _computed(40, ps)
    assert [sum(p != RESERVED_PAGE for p in t) for t in bm.tables_of("a")] == [10, 10]
    # the next token at 40 sees keys 33..: pages 8 and 9 stay, 0..7 go
    assert bm.release_window("a", 40) == 8
    assert bm.group_tables["a"][0][:8] == [RESERVED_PAGE] * 8
    bm.check_invariants()
    bm.free("a", tokens)
    # the windowed pages stay cached (droppable), so a hit at the end reads them
    assert len(bm._droppable) == 10 and bm.num_available_pages == 39
    assert bm.peek_prefix([*tokens, 0]).num_tokens == 40
    bm.allocate("hog", 14 * ps)  # 28 pages: the 19 free ones, then 9 drops (oldest first)
    assert bm.prefix_cache.num_cached_pages == 10  # no prefix evicted while drops were left
    assert len(bm._droppable) == 1
    bm.free("hog")
    bm.check_invariants()
    # the window before the end lost page 8, and every shorter prefix its pages: no hit
    assert bm.peek_prefix([*tokens, 0]).num_tokens == 0
    assert bm.match_prefix("b", [*tokens, 0]) == 0
    bm.check_invariants()


def test_a_match_is_cut_to_where_its_window_is_resident():
    ps = 4
    bm, tokens = _computed(60, ps)
    assert bm.release_window("a", 24) == 4  # pages 0..3 go (the window at 24 starts at page 4)
    assert bm.release_window("a", 40) == 4  # then 4..7: the scan stops at the first hole
    assert bm.release_window("a", 40) == 0
    bm.free("a", tokens)
    # drop the windowed pages of positions 7 and 8 only: the hit ends before page 7's window
    anchors = bm.prefix_cache.match_pages(tokens)
    for i in (7, 8):
        bm._drop(bm._bundles[anchors[i]][0])
    bm.check_invariants()
    got = bm.peek_prefix([*tokens, 0]).num_tokens
    assert got == 7 * ps  # a prefix of 7 pages reads windowed pages 5, 6: both there
    assert bm.match_prefix("b", [*tokens, 0]) == got
    assert bm.group_tables["b"][0] == [RESERVED_PAGE] * 5 + [
        bm._bundles[anchors[i]][0] for i in (5, 6)
    ]
    bm.check_invariants()


# ---- the engine --------------------------------------------------------------------------------

OPTS = dict(
    page_size=4,
    max_num_batched_tokens=16,  # chunks of 16 cross the 8-token window
    max_num_seqs=4,
    max_model_len=128,
    prefix_cache="radix",
    compilation_cache_dir="",
)


def _path(name):
    return os.path.join(TESTDATA, "hf_tiny", name)


def _run(name, prompts, max_tokens=24, **kw):
    from llmjax import LLM, SamplingParams

    llm = LLM(_path(name), **{**OPTS, **kw})
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _vocab(name):
    with open(os.path.join(_path(name), "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)["vocab_size"]


def _prompts(vocab, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, 40).tolist()  # longer than the window: passed at the hit
    return [
        shared + rng.integers(1, vocab, 5).tolist(),
        rng.integers(1, vocab, 30).tolist(),
        shared + rng.integers(1, vocab, 12).tolist(),
        rng.integers(1, vocab, 3).tolist(),
    ]


@pytest.mark.parametrize(
    "name, opts",
    [
        ("gemma3", dict(scheduler_policy="sarathi")),
        ("gemma2", dict(scheduler_policy="splitfuse")),
        ("gemma2", dict(scheduler_policy="sarathi", kv_cache_dtype="int8", layer_loop="unroll")),
    ],
    ids=["gemma3-sarathi", "gemma2-splitfuse", "gemma2-int8-unroll"],
)
def test_outputs_equal_one_page_table(name, opts):
    prompts = _prompts(_vocab(name), 0)
    _, want, _ = _run(name, prompts, hybrid_kv_cache="off", **opts)
    llm, got, cached = _run(name, prompts, hybrid_kv_cache="on", **opts)
    bm = llm.engine.block_manager
    assert bm.num_groups > 1
    assert got == want
    bm.check_invariants()
    assert cached[2] >= 40 - 4  # the shared prefix hit though its window had passed
    assert llm.engine.num_compiles <= len(llm.engine.buckets.shapes())


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_equals_one_page_table(method):
    """Speculative decoding over the hybrid layout: proposals take pages in every group, the
    rejected ones' pages are given back (`truncate`), and the early-exit draft reads and writes
    its layers' windowed pages through their groups' tables; greedy output unchanged. The
    prompts repeat themselves, so n-gram proposals are made and some accepted; the draft runs
    all 4 layers (three local ones), so it is the target and every proposal is accepted only if
    it read every group's pages right."""
    prompts = [(p[:7] * 6)[:40] for p in _prompts(_vocab("gemma3"), 1)]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["num_draft_layers"] = 4
    opts = dict(prefix_cache="none", speculative_config=spec, max_tokens=32)
    _, want, _ = _run("gemma3", prompts, hybrid_kv_cache="off", **opts)
    llm, got, _ = _run("gemma3", prompts, hybrid_kv_cache="on", **opts)
    assert got == want
    stats = llm.engine.stats
    assert stats.num_spec_accepted_tokens > 0
    if method == "draft":
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("policy, num_pages", [("splitfuse", 44), ("sarathi", 44)])
def test_preemption_equals_one_page_table(policy, num_pages):
    """Four requests growing past a small pool: preempted and recomputed, outputs unchanged."""
    prompts = [p[:10] for p in _prompts(_vocab("gemma3"), 0)]
    opts = dict(scheduler_policy=policy, prefix_cache="none", max_tokens=48)
    _, want, _ = _run("gemma3", prompts, hybrid_kv_cache="off", **opts)
    llm, got, _ = _run("gemma3", prompts, hybrid_kv_cache="on", num_pages=num_pages, **opts)
    assert got == want
    assert llm.engine.stats.num_preemptions > 0
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("policy", ["sarathi", "splitfuse"])
def test_a_long_sequence_holds_its_window_only(policy):
    """Decoding, a windowed group holds its window's pages (8 tokens: 3 pages of 4); while its
    prompt is computed, a chunk's more under both policies (sarathi takes a whole prompt's pages
    at admission in group 0 only; its windowed groups grow per chunk)."""
    from llmjax import LLM, SamplingParams

    llm = LLM(_path("gemma3"), **OPTS, hybrid_kv_cache="on", scheduler_policy=policy)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request(
        list(range(1, 60)), SamplingParams(max_tokens=40, ignore_eos=True), request_id="x"
    )
    prefill, decode = 0, []
    while engine.has_unfinished_requests():
        engine.step()
        if "x" in bm.page_tables:
            held = max(sum(p != RESERVED_PAGE for p in t) for t in bm.tables_of("x")[1:])
            if engine.scheduler.running and engine.scheduler.running[0].num_output_tokens:
                decode.append(held)
            else:
                prefill = max(prefill, held)
            bm.check_invariants()
    assert len(decode) > 30 and max(decode) <= 3 and decode[-1] == 3
    assert prefill <= 3 + 4 + 1  # (sarathi takes the whole prompt's pages in group 0 only)


def test_a_request_that_can_never_fit_is_refused(caplog):
    """Validation counts every group's pages at most held at once: group 0 a whole sequence's
    (14 pages of 4 for 56 tokens), each of the 3 windowed groups its window (3 pages) and one
    chunk's (16 tokens: 5 pages). One page fewer is refused, naming the count; just enough runs,
    without livelock, to the one table's output."""
    from llmjax import LLM, SamplingParams

    prompt, params = list(range(1, 53)), SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(_path("gemma3"), **OPTS, hybrid_kv_cache="on", num_pages=38)
    assert not llm.generate([prompt], params)[0].token_ids
    assert "needs 38 KV pages" in caplog.text
    llm = LLM(_path("gemma3"), **OPTS, hybrid_kv_cache="on", num_pages=39)
    got = llm.generate([prompt], params)[0].token_ids
    _, want, _ = _run("gemma3", [prompt], max_tokens=4, hybrid_kv_cache="off")
    assert got == want[0] and len(got) == 4


def test_what_needs_one_page_table_is_named():
    from configs.tiny import TINY
    from llmjax.config import (
        CacheConfig,
        EngineConfig,
        ParallelConfig,
        SparseKVConfig,
        SpeculativeConfig,
    )

    on = CacheConfig(hybrid_kv_cache="on")
    with pytest.raises(ValueError, match="hybrid_kv_cache='yes'"):
        CacheConfig(hybrid_kv_cache="yes")
    with pytest.raises(ValueError, match="both sliding-window and full-attention"):
        EngineConfig(model=TINY, cache=on)  # Llama-shaped: nothing to group
    with pytest.raises(ValueError, match="sparse_kv='none'"):
        EngineConfig(model=TINY_GEMMA3, cache=on, sparse_kv=SparseKVConfig(mode="quest"))
    with pytest.raises(ValueError, match="layer_loop='scan'"):
        EngineConfig(
            model=TINY_GEMMA3, cache=on, parallel=ParallelConfig(pp=2), layer_loop="unroll"
        )
    assert EngineConfig(
        model=TINY_GEMMA3, cache=on, parallel=ParallelConfig(pp=2), layer_loop="scan"
    ).kv_groups.hybrid
    assert EngineConfig(
        model=TINY_GEMMA3, cache=on, speculative=SpeculativeConfig(method="ngram")
    ).kv_groups.hybrid
    # 'auto' falls back to one table where something needs it, and groups where nothing does
    auto = EngineConfig(model=TINY_GEMMA3, sparse_kv=SparseKVConfig(mode="quest"))
    assert not auto.kv_groups.hybrid
    assert EngineConfig(model=TINY_GEMMA3).kv_groups.hybrid
    assert not EngineConfig(
        model=TINY_GEMMA3, cache=CacheConfig(hybrid_kv_cache="off")
    ).kv_groups.hybrid


def test_disaggregated_serving_moves_every_group():
    """A prefill and a decode instance with the hybrid layout: the transfer moves group 0's
    pages and each windowed group's window (`BlockManager.kv_pages`; the decode side's windowed
    tables start with holes), and greedy outputs equal one colocated engine's with one table.
    Prompts of 3 to 52 tokens against an 8-token window: the window ends inside and past a
    page, and one prompt is shorter than it."""
    from llmjax import SamplingParams
    from llmjax.cluster import InstanceSpec, launch

    prompts = _prompts(_vocab("gemma3"), 2)
    _, want, _ = _run("gemma3", prompts, hybrid_kv_cache="off")
    cluster = launch(
        _path("gemma3"), InstanceSpec.parse("prefill,decode"), **OPTS, hybrid_kv_cache="on"
    )
    outs = cluster.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    st = cluster.transfer_stats
    assert st.num_transfers == len(prompts) and st.num_failures == st.num_recomputed == 0
    for inst in cluster.instances:
        bm = inst.engine.block_manager
        assert bm.num_groups == 4
        bm.check_invariants()
        assert bm.num_used_pages == 0
    groups = cluster.instances[0].engine.config.kv_groups
    assert groups.kv_pages(52, 4) == 13 + 3 * 2  # 13 pages in group 0, 2 in each window


def test_a_fetched_prefix_brings_its_windows():
    """The Conductor's prefix fetch between two hybrid instances: the offer is the cached
    prefix's group-0 pages and its bundles' window at its end; the destination caches them, a
    request there reuses the prefix (its window past the shared tokens) and its greedy output
    equals one table's."""
    from llmjax import SamplingParams
    from llmjax.cluster import InstanceSpec, launch

    a, b = _prompts(_vocab("gemma3"), 0)[0], _prompts(_vocab("gemma3"), 0)[2]  # 40 shared
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    _, want, _ = _run("gemma3", [b], max_tokens=12, hybrid_kv_cache="off")
    cluster = launch(
        _path("gemma3"), InstanceSpec.parse("2xcolocated"), **OPTS, hybrid_kv_cache="on"
    )
    src, dst = (inst.engine for inst in cluster.instances)
    src.add_request(a, params, request_id="a")
    while src.has_unfinished_requests():
        src.step()
    got = cluster.fetch_prefix(0, 1, b)
    assert got == 40  # the shared prefix's 10 full pages (b's own tokens are not cached at 0)
    assert cluster.conductor_stats.fetched_tokens == 40
    dst.add_request(b, params, request_id="b")
    outs = {}
    while dst.has_unfinished_requests():
        outs |= {o.request_id: o for o in dst.step() if o.finished}
    assert outs["b"].outputs[0].token_ids == want[0]
    assert outs["b"].num_cached_tokens == 40
    for engine in (src, dst):
        engine.block_manager.check_invariants()


def test_the_simulator_runs_the_layout():
    """Gemma 3 27B on a simulated H100 (bfloat16, tp=1): the pages hold 10 layers, not 62, so
    6.2x the pages fit in the same memory, and 16 prompts of 6k tokens run more at once, without
    preemption, in less simulated time, to the same tokens."""
    import numpy as np

    from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmjax.engine.engine import LLMEngine
    from llmjax.engine.request import SamplingParams
    from llmjax.sim import SimConfig, sim_num_pages

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, 6000).tolist() for _ in range(16)]
    runs = {}
    for mode in ("off", "on"):
        config = EngineConfig(
            model=GEMMA3_27B,
            dtype="bfloat16",
            max_model_len=8192,
            cache=CacheConfig(hybrid_kv_cache=mode, prefix_cache="none"),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
            device="sim",
            sim=SimConfig(hardware="h100-sxm"),
        )
        engine = LLMEngine(config, None, None)
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        peak, outs = 0, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
            peak = max(peak, len(engine.scheduler.running))
        engine.block_manager.check_invariants()
        runs[mode] = (sim_num_pages(config), peak, engine.clock.now(), outs, engine.stats)
    (pages0, peak0, t0, outs0, _), (pages1, peak1, t1, outs1, s1) = runs["off"], runs["on"]
    assert pages1 == pytest.approx(pages0 * 62 / 10, rel=0.01)
    assert outs1 == outs0 and len(outs1) == 16
    assert peak1 >= 2 * peak0 and s1.num_preemptions == 0
    assert t1 < t0

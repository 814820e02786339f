"""The engine over its KV tiers (issue 22, item 2; llmjax/engine/kv_tiers.py): property tests
with the fake paged model (whose KV slots hold the token ids written there, and whose next token
hashes the sequence read back through the page table, so a wrong or stale load changes the
output), and the tiny real model's greedy outputs from every tier.

The property run draws page and block sizes, a small device cache (so pages are evicted), a
host tier of a few blocks and/or a disk tier, a write policy and a load policy, then serves
waves of requests sharing prefixes over one or two engines that share the store; between waves
it restarts the process (new engines and host tier over the same disk directory), restarts one
instance (a new engine over the store the others keep), drops the device caches, or flips a
byte of a block file.
After every step: the block manager's and the tiers' invariants (the radix tree's tier records
exact, chains closed, no slot or file leaked), every readable block holds exactly the tokens of
its pages, freed pages are poisoned; at the end every output equals the one recomputed from its
prompt alone.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import types

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs.tiny import TINY
from llmjax.config import CacheConfig, EngineConfig, KVStoreConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.kvstore.keys import ROOT_KEY, chain_keys
from llmjax.sampling_params import SamplingParams
from tests.fake_model import FakeRunner, reference_generation

VOCAB = 64
MODEL = TINY.replace(vocab_size=VOCAB, eos_token_ids=(1,))
MAX_MODEL_LEN = 48


@pytest.fixture
def fake_runner(monkeypatch):
    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = FakeRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)


@dataclasses.dataclass
class Scenario:
    page_size: int
    block_pages: int
    num_pages: int
    host_blocks: int
    disk: bool
    write_policy: str
    load_policy: str
    budget: int
    num_engines: int  # instances sharing one store
    waves: list[list[tuple[tuple[int, ...], int, int]]]  # (prompt, max_tokens, arrival step)
    events: list[str]  # after each wave: none | restart | instance | reset | corrupt

    def config(self, disk_dir: str) -> EngineConfig:
        return EngineConfig(
            model=MODEL,
            cache=CacheConfig(page_size=self.page_size, num_pages=self.num_pages),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.budget, max_num_seqs=4),
            kv_store=KVStoreConfig(
                host_blocks=self.host_blocks,
                disk_dir=disk_dir if self.disk else "",
                disk_blocks=64,
                block_size=self.block_pages * self.page_size,
                write_policy=self.write_policy,
                write_through_threshold=2,
                load_policy=self.load_policy,
                # 'cost' with a slow modeled prefill: loads win (the cost path runs)
                prefill_tokens_per_s=1.0,
            ),
            max_model_len=MAX_MODEL_LEN,
            compilation_cache_dir="",
        )


@st.composite
def scenarios(draw):
    page_size = draw(st.sampled_from([2, 4]))
    block_pages = draw(st.sampled_from([1, 2]))
    full = MAX_MODEL_LEN // page_size + 1  # one request alone always fits
    disk = draw(st.booleans())
    host_blocks = draw(st.integers(0 if disk else 1, 12))
    prefixes = [
        draw(st.lists(st.integers(2, VOCAB - 1), min_size=6, max_size=24)) for _ in range(2)
    ]
    waves = []
    for _ in range(draw(st.integers(2, 4))):
        wave = []
        for _ in range(draw(st.integers(1, 5))):
            head = prefixes[draw(st.integers(0, 1))] if draw(st.integers(0, 3)) else []
            tail = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=8))
            prompt = tuple(head + tail)[: MAX_MODEL_LEN - 10]
            wave.append((prompt, draw(st.integers(1, 8)), draw(st.integers(0, 4))))
        waves.append(wave)
    return Scenario(
        page_size=page_size,
        block_pages=block_pages,
        num_pages=draw(st.integers(full, 2 * full)),
        host_blocks=host_blocks,
        disk=disk,
        write_policy=draw(
            st.sampled_from(["write_through", "write_through_selective", "write_back"])
        ),
        load_policy=draw(st.sampled_from(["cost", "always", "never"])),
        budget=draw(st.sampled_from([8, 16, 64])),
        num_engines=draw(st.integers(1, 2)),
        waves=waves,
        events=[
            draw(st.sampled_from(["none", "restart", "restart", "instance", "reset", "corrupt"]))
            for _ in waves
        ],
    )


class PageBook:
    """Every page key the run could store -> (the previous page's key, the page's tokens)."""

    def __init__(self, salt: bytes, page_size: int):
        self.salt, self.page_size, self.pages = salt, page_size, {}

    def add(self, tokens) -> None:
        ps = self.page_size
        prev = ROOT_KEY
        for i, k in enumerate(chain_keys(tokens, ps, self.salt)):
            self.pages[k] = (prev, tuple(tokens[i * ps : (i + 1) * ps]))
            prev = k

    def block_tokens(self, key: bytes, block_pages: int) -> list[int]:
        chunks = []
        for _ in range(block_pages):
            prev, toks = self.pages[key]
            chunks.append(toks)
            key = prev
        return [t for c in reversed(chunks) for t in c]


def check(engine: LLMEngine, book: PageBook, sc: Scenario) -> None:
    engine.block_manager.check_invariants()
    tiers = engine.kv_tiers
    tiers.check_invariants()
    for tier in tiers.store.tiers:
        for key in tier.readable_keys():
            data = tier.peek(key)
            if data is None:  # a corrupted file: gone now, with its chain
                continue
            want = book.block_tokens(key, sc.block_pages)
            assert data.reshape(-1).tolist() == want, (
                f"{tier.name} block {key.hex()} holds wrong KV"
            )
    bm = engine.block_manager
    engine.runner.model.poison(list(bm._free))  # a read of a freed page is caught


def _engine(config, sc, store=None) -> LLMEngine:
    engine = LLMEngine(config, params=None, num_pages=sc.num_pages, kv_store=store)
    # the fake model's steps take microseconds: keep the modeled prefill rate, so that 'cost'
    # loads (a load costs ~1e-5 s per block, recomputing a token 1 s)
    engine.kv_tiers.record_prefill = lambda num_tokens, seconds: None
    return engine


PROPERTY = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@PROPERTY
@given(sc=scenarios())
def test_tiers_property(sc, fake_runner, tmp_path_factory):
    disk_dir = str(tmp_path_factory.mktemp("kv"))
    config = sc.config(disk_dir)

    def start() -> list[LLMEngine]:  # a process: its engines share one new store
        first = _engine(config, sc)
        return [first] + [
            _engine(config, sc, first.kv_tiers.store) for _ in range(sc.num_engines - 1)
        ]

    engines = start()
    book = PageBook(engines[0].block_manager.prefix_cache.salt, sc.page_size)
    results = {}
    n = 0
    for wave, event_name in zip(sc.waves, sc.events, strict=True):
        pending = sorted(
            ((arrival, f"r{n + i}", prompt, mt) for i, (prompt, mt, arrival) in enumerate(wave)),
        )
        n += len(wave)
        step = 0
        while pending or any(e.has_unfinished_requests() for e in engines):
            while pending and pending[0][0] <= step:
                _, rid, prompt, mt = pending.pop(0)
                params = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=True)
                engines[int(rid[1:]) % len(engines)].add_request(
                    list(prompt), params, request_id=rid
                )
                want, _ = reference_generation(
                    prompt, max_tokens=mt, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB
                )
                book.add(list(prompt) + want)
                results[rid] = (prompt, mt, want, None)
            for engine in engines:
                for out in engine.step():
                    if out.finished:
                        prompt, mt, want, _ = results[out.request_id]
                        results[out.request_id] = (prompt, mt, want, out)
            for engine in engines:
                check(engine, book, sc)
            step += 1
            assert step < 500, "livelock"
        event(f"event {event_name}")
        st_ = engines[0].kv_tiers.stats
        event(f"loads {min(st_.num_loads, 3)}, recomputes {min(st_.num_recomputes, 3)}")
        if event_name == "restart":  # a new process: fresh devices and host, the same disk
            for engine in engines:
                engine.kv_tiers.close()
            engines = start()
        elif event_name == "instance":  # one instance restarts; the store it shared stays
            engines[0].kv_tiers.close()
            engines[0] = _engine(config, sc, engines[-1].kv_tiers.store)
        elif event_name == "reset":
            for engine in engines:
                engine.reset_prefix_cache()
        elif event_name == "corrupt":
            files = sorted(glob.glob(os.path.join(disk_dir, "*", "*.kv")))
            if files:
                path = files[len(files) // 2]
                data = bytearray(open(path, "rb").read())
                data[-1] ^= 0x01  # the payload's last byte
                open(path, "wb").write(bytes(data))
        for engine in engines:
            check(engine, book, sc)
    loaded = 0
    for rid, (_, _, want, out) in results.items():
        assert out is not None, f"{rid} never finished"
        assert out.token_ids == want, f"{rid}: output differs from its prompt alone"
        tiers = out.num_cached_tokens_per_tier
        assert sum(tiers.values()) == out.num_cached_tokens
        loaded += sum(v for k, v in tiers.items() if k != "device")
    event(f"loaded tokens > 0: {loaded > 0}")
    if sc.load_policy == "never":
        assert loaded == 0

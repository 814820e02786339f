"""The KV tiers with the tiny real model (issue 22): greedy outputs are identical whether a
prefix's KV came from the device cache, host memory (T1), disk (T2) or was recomputed, after a
cold restart of the process that finds the prefixes on disk only, and when a block file is
corrupt or the disk is full (recomputed, never a wrong KV). T3 (Mooncake Store) has its own
tests (test_kvstore_mooncake.py)."""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs.tiny import TINY
from llmjax import LLM, SamplingParams
from llmjax.config import KVStoreConfig

PAGE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@functools.cache
def _base():
    return LLM(
        "tiny",
        load_format="dummy",
        page_size=PAGE,
        max_num_seqs=4,
        max_model_len=96,
        num_pages=40,
        max_num_batched_tokens=32,
        compilation_cache_dir="",
    )


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    system = rng.integers(2, TINY.vocab_size, 40).tolist()
    return [system + rng.integers(2, TINY.vocab_size, 6).tolist() for _ in range(n)]


@functools.cache
def _reference():
    llm = _base().with_options(prefix_cache="none")
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _serve_one_by_one(llm, prompts, drop_device=True):
    """Each prompt alone, the device cache dropped between them (so a hit is a load)."""
    outs = []
    for p in prompts:
        outs += llm.generate([p], GREEDY, use_tqdm=False)
        if drop_device:
            llm.engine.reset_prefix_cache()
    return outs


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"], ids=lambda t: t.replace("+", "_"))
def test_greedy_outputs_identical_from_every_tier(tiers, tmp_path):
    kv = KVStoreConfig(
        host_blocks=64 if "host" in tiers else 0,
        disk_dir=str(tmp_path) if "disk" in tiers else "",
        block_size=8,
        write_policy="write_through",
        load_policy="always",
    )
    llm = _base().with_options(kv_store=kv)
    outs = _serve_one_by_one(llm, _prompts())
    assert [o.token_ids for o in outs] == _reference()
    first = "host" if "host" in tiers else "disk"
    # the first request computes the shared 40-token prefix; the others load its 5 blocks
    assert outs[0].num_cached_tokens_per_tier == {"device": 0}
    for o in outs[1:]:
        assert o.num_cached_tokens_per_tier == {"device": 0, first: 40}
    llm.engine.kv_tiers.check_invariants()
    assert llm.engine.kv_tiers.stats.num_loads == len(outs) - 1


def test_recompute_policy_and_device_hits_match(tmp_path):
    kv = KVStoreConfig(host_blocks=64, block_size=8, write_policy="write_through")
    never = _base().with_options(kv_store=dataclass_replace(kv, load_policy="never"))
    outs = _serve_one_by_one(never, _prompts())
    assert [o.token_ids for o in outs] == _reference()
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert never.engine.kv_tiers.stats.num_recomputes == len(outs) - 1
    # the device cache kept: hits from T0 only
    device = _base().with_options(kv_store=kv)
    outs = _serve_one_by_one(device, _prompts(), drop_device=False)
    assert [o.token_ids for o in outs] == _reference()
    assert [o.num_cached_tokens_per_tier for o in outs[1:]] == [{"device": 40}] * 5


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_cost_model_chooses_load_or_recompute(tmp_path):
    """The same stored prefix: loaded when recomputing is modeled slow, recomputed when the
    tier is modeled slow."""
    base = KVStoreConfig(host_blocks=64, block_size=8, write_policy="write_through")
    slow_prefill = dataclass_replace(base, prefill_tokens_per_s=1.0)
    slow_host = dataclass_replace(base, host_latency=10.0, prefill_tokens_per_s=1e9)
    for kv, loads in ((slow_prefill, True), (slow_host, False)):
        llm = _base().with_options(kv_store=kv)
        llm.engine.kv_tiers.record_prefill = lambda n, s: None  # keep the modeled rate
        outs = _serve_one_by_one(llm, _prompts(3))
        assert [o.token_ids for o in outs] == _reference()[:3]
        stats = llm.engine.kv_tiers.stats
        assert (stats.num_loads, stats.num_recomputes) == ((2, 0) if loads else (0, 2))


def test_corrupt_block_file_is_recomputed(tmp_path):
    kv = KVStoreConfig(
        disk_dir=str(tmp_path), block_size=8, write_policy="write_through", load_policy="always"
    )
    llm = _base().with_options(kv_store=kv)
    prompts = _prompts()
    outs = _serve_one_by_one(llm, prompts[:1])
    files = sorted(glob.glob(os.path.join(str(tmp_path), "*", "*.kv")))
    assert len(files) >= 5
    # flip one payload byte of every block file: each load finds its first block corrupt
    for path in files:
        data = bytearray(open(path, "rb").read())
        data[-3] ^= 0x10
        open(path, "wb").write(bytes(data))
    outs += _serve_one_by_one(llm, prompts[1:2])
    assert [o.token_ids for o in outs] == _reference()[:2]
    assert outs[1].num_cached_tokens == 0
    assert llm.engine.kv_tiers.stats.num_load_failures >= 1
    llm.engine.kv_tiers.check_invariants()


def test_full_disk_degrades_to_recompute(tmp_path, monkeypatch, caplog):
    from llmjax.kvstore import disk_tier

    def no_space(self, b, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier.DiskTier, "_write_slot", no_space)
    kv = KVStoreConfig(
        disk_dir=str(tmp_path), block_size=8, write_policy="write_through", load_policy="always"
    )
    llm = _base().with_options(kv_store=kv)
    with caplog.at_level("WARNING"):
        outs = _serve_one_by_one(llm, _prompts(3))
    assert [o.token_ids for o in outs] == _reference()[:3]
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert "No space left on device" in caplog.text
    store = llm.engine.kv_tiers.store
    assert store.num_errors >= 1 and store.tiers[0].num_used == 0
    assert not glob.glob(os.path.join(str(tmp_path), "*", "*"))  # nothing half-written left


_RESTART = """
import json, sys
sys.path.insert(0, {root!r})
from tests.test_kv_tiers_model import _base, _prompts, GREEDY
from llmjax.config import KVStoreConfig
kv = KVStoreConfig(disk_dir={disk!r}, block_size=8, write_policy="write_through",
                   load_policy="always")
llm = _base().with_options(kv_store=kv)
outs = llm.generate(_prompts()[{lo}:{hi}], GREEDY, use_tqdm=False)
print(json.dumps([[o.token_ids, o.num_cached_tokens_per_tier] for o in outs]))
"""


@pytest.mark.slow
def test_cold_restart_reloads_prefixes_from_disk(tmp_path):
    """Process 1 computes the shared prefix and writes it to disk; process 2 (a cold start:
    empty device and host) serves the other prompts from the disk blocks."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for lo, hi in ((0, 1), (1, 6)):
        code = _RESTART.format(root=root, disk=str(tmp_path), lo=lo, hi=hi)
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs += json.loads(proc.stdout.strip().splitlines()[-1])
    assert [t for t, _ in runs] == _reference()
    assert runs[0][1] == {"device": 0}
    # the first of process 2 loads the prefix from disk; the rest find it on the device
    assert runs[1][1] == {"device": 0, "disk": 40}
    assert all(c == {"device": 40} for _, c in runs[2:])


def test_host_gather_lands_in_pinned_host_memory_with_the_same_bytes():
    llm = _base().with_options(kv_store=KVStoreConfig(host_blocks=8, block_size=8))
    llm.generate(_prompts(1), GREEDY, use_tqdm=False)  # some real KV in the pages
    runner = llm.engine.runner
    pages = [3, 1, 2]
    host = runner.export_host_pages(pages)
    assert runner.host_memory_kind == "pinned_host"
    assert host.sharding.memory_kind == "pinned_host"
    plain = np.asarray(runner.export_pages(pages))
    assert np.array_equal(np.asarray(host), plain) and np.abs(plain[:, :, :3]).sum() > 0
    numpy_llm = _base().with_options(
        kv_store=KVStoreConfig(host_blocks=8, block_size=8, host_memory="numpy")
    )
    assert numpy_llm.engine.runner.host_memory_kind is None


def test_precompile_covers_the_tier_copies(tmp_path):
    kv = KVStoreConfig(
        host_blocks=64, block_size=8, write_policy="write_through", load_policy="always"
    )
    llm = _base().with_options(kv_store=kv, precompile=True)
    runner = llm.engine.runner
    before = (runner.num_compiles, runner.num_transfer_compiles)
    outs = _serve_one_by_one(llm, _prompts(3))
    assert [o.token_ids for o in outs] == _reference()[:3]
    assert llm.engine.kv_tiers.stats.num_loads == 2
    assert (runner.num_compiles, runner.num_transfer_compiles) == before, "serving compiled"


def test_local_instances_share_one_store():
    """Two colocated instances of one layout: one TieredStore; a prefix computed on instance 0
    is loaded from the shared host tier by instance 1 (round robin), same greedy outputs."""
    from llmjax.cluster import InstanceSpec, launch

    kv = KVStoreConfig(
        host_blocks=64, block_size=8, write_policy="write_through", load_policy="always"
    )
    cluster = launch(
        "tiny",
        InstanceSpec.parse("2xcolocated"),
        router="round_robin",
        load_format="dummy",
        page_size=PAGE,
        max_num_seqs=4,
        max_model_len=96,
        num_pages=40,
        max_num_batched_tokens=32,
        compilation_cache_dir="",
        kv_store=kv,
    )
    engines = [inst.engine for inst in cluster.instances]
    assert engines[0].kv_tiers.store is engines[1].kv_tiers.store
    outs = []
    for p in _prompts(4):  # one at a time: 0, 1, 0, 1
        outs += cluster.generate([p], GREEDY)
    assert [o.token_ids for o in outs] == _reference()[:4]
    assert outs[1].num_cached_tokens_per_tier == {"device": 0, "host": 40}
    assert outs[3].num_cached_tokens_per_tier == {"device": 40}
    for e in engines:
        e.kv_tiers.check_invariants()


def test_disk_blocks_of_waiting_prompts_are_prefetched_into_host_memory(tmp_path):
    """A cold engine over a disk that holds three prompts' prefixes, one request at a time:
    the first loads from disk; while it runs, the others' blocks are read ahead into T1, and
    they load from host memory. Same greedy outputs."""
    prompts = [_prompts(1, seed=s)[0] for s in (1, 2, 3)]
    reference = [
        o.token_ids
        for o in _base().with_options(prefix_cache="none").generate(prompts, GREEDY, use_tqdm=False)
    ]
    disk = KVStoreConfig(disk_dir=str(tmp_path), block_size=8, write_policy="write_through")
    _base().with_options(kv_store=disk).generate(prompts, GREEDY, use_tqdm=False)
    cold = _base().with_options(
        kv_store=dataclass_replace(disk, host_blocks=64, load_policy="always"), max_num_seqs=1
    )
    outs = cold.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    tiers = [o.num_cached_tokens_per_tier for o in outs]
    assert tiers[0] == {"device": 0, "disk": 40}
    assert tiers[1:] == [{"device": 0, "host": 40}] * 2, tiers
    assert cold.engine.kv_tiers.stats.blocks_prefetched == 10
    cold.engine.kv_tiers.close()

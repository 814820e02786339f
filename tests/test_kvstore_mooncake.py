"""T3, the Mooncake tier (llmjax/kvstore/mooncake_tier.py) against a real `mooncake_master` on
127.0.0.1 (started and stopped here): exact bytes back (float32 and bfloat16 pages), chains and
`exists` (a hole left by the master stops the walk), two-phase puts, another process seeing
the same blocks, tampered values read as missing, an unreachable or vanished master answered
with misses and a logged reason, pins reaching the master, and the host tier's hypothesis run.
Skipped without the `mooncake` extra (or Debian's libibverbs1, which its native module needs).
"""

import logging
import os
import subprocess
import sys
import time
import urllib.request

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax.kvstore import ROOT_KEY, MooncakeTier, chain_keys
from llmjax.kvstore.mooncake_master import free_port, start_master
from tests.test_kvstore_host_tier import SALT, SHAPE, _block, ops, run_operations

pytest.importorskip(
    "mooncake.store", reason="needs the mooncake extra and libibverbs1", exc_type=ImportError
)  # the wheel is there, its native module needs libibverbs.so.1

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = (30, 2, 16, 3, 64)  # one 16-token SmolLM2-135M page: layers, k/v, tokens, kv heads, dim


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("mooncake") / "master.log")
    with start_master(log_path=log, timeout_s=30) as m:
        yield m


def _tier(master, **kwargs) -> MooncakeTier:
    kwargs.setdefault("global_segment_bytes", 64 << 20)
    kwargs.setdefault("local_buffer_bytes", 8 << 20)
    return MooncakeTier(
        kwargs.pop("block_shape", SHAPE),
        master_address=master.master_address,
        metadata_url=master.metadata_url,
        **kwargs,
    )


@pytest.fixture(scope="module")
def shared(master):
    with _tier(master, namespace="tests") as t:  # its segment holds every test's blocks
        yield t


@pytest.fixture
def tier(shared):
    shared.reset()
    shared.num_blocks, shared.high_watermark, shared.low_watermark = None, 0.95, 0.85
    shared.num_errors, shared.last_error, shared.num_evictions = 0, None, 0
    yield shared
    shared.check_invariants()


def _chain(tier, keys):
    for parent, k in zip([ROOT_KEY, *keys], keys, strict=False):
        assert tier.put(k, parent, _block(k))


def _metric(master, name: str) -> float:
    url = f"http://{master.host}:{master.metrics_port}/metrics"
    text = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_blocks_round_trip_exactly_float32_and_bfloat16(master, tier):
    keys = chain_keys(list(range(12)), 2, SALT)
    _chain(tier, keys)
    for k in keys:
        np.testing.assert_array_equal(tier.get(k), _block(k))
    assert tier.object_name(keys[0]) == f"tests/{keys[0].hex()}"  # namespaced objects
    assert tier._client.is_exist(f"tests/{keys[0].hex()}") == 1
    assert tier._client.is_exist(keys[0].hex()) == 0
    with _tier(master, namespace="bf16", block_shape=PAGE, dtype=ml_dtypes.bfloat16) as bf:
        rng = np.random.default_rng(0)
        page = (rng.standard_normal(PAGE) + 3.0).astype(ml_dtypes.bfloat16)  # never zeros
        assert page.nbytes == 360 << 10 and np.all(page != 0)
        assert bf.put(keys[0], ROOT_KEY, page)
        got = bf.get(keys[0])
        assert got.dtype == page.dtype and got.tobytes() == page.tobytes()
        assert tier.get(keys[0]) is not None  # namespaces do not collide
    assert tier.num_errors == 0


def test_a_put_is_visible_only_once_committed_and_needs_its_parent(tier):
    a, b, c = chain_keys([1, 2, 3, 4, 5, 6], 2, SALT)
    assert not tier.put_begin(b, a), "an orphan (parent not stored) is refused"
    assert tier.put_begin(a)
    tier.write(a, _block(a))
    assert tier.get(a) is None and tier.exists([a]) == 0  # staged here, nothing in the store
    assert tier._client.is_exist(tier.object_name(a)) == 0
    assert tier.put_commit(a) and tier.exists([a, b]) == 1
    assert tier.put_begin(b, a)
    tier.put_abort(b)
    assert b not in tier and tier.num_used == 1
    assert tier.put(b, a, _block(b)) and tier.put(c, b, _block(c)) and tier.exists([a, b, c]) == 3
    with pytest.raises(ValueError, match="shape"):
        tier.put(b"x" * 16, ROOT_KEY, np.zeros((9,)))
    assert b"x" * 16 not in tier and tier.num_used == 3  # the failed write left nothing
    assert tier.remove(a) == 3 and tier.exists([a, b, c]) == 0 and tier.num_used == 0


def test_a_hole_left_by_the_master_stops_the_chain(tier):
    keys = chain_keys(list(range(12)), 2, SALT)
    _chain(tier, keys)
    assert tier.exists([*keys, b"z" * 16]) == 6
    assert tier._client.remove(tier.object_name(keys[2]), True) == 0  # as the master evicts
    assert tier.exists(keys) == 2  # the orphans below the hole are never reachable
    np.testing.assert_array_equal(tier.get(keys[4]), _block(keys[4]))  # (their bytes are right)
    assert tier.num_used == 2  # the lost block's local subtree is forgotten
    assert not tier.put(keys[3], keys[2], _block(keys[3]))  # its parent is gone: refused
    assert tier.put(keys[2], keys[1], _block(keys[2])) and tier.exists(keys) == 6  # recomputed


def test_another_process_sees_the_same_blocks(master, tier):
    keys = chain_keys(list(range(14)), 2, SALT)
    _chain(tier, keys[:6])
    code = (
        "import sys\n"
        "import llmjax.kvstore as kv\n"
        "assert 'mooncake' not in sys.modules  # the package never imports it\n"
        "import numpy as np\n"
        "from tests.test_kvstore_host_tier import SALT, _block\n"
        f"t = kv.MooncakeTier({SHAPE!r}, master_address={master.master_address!r},\n"
        f"    metadata_url={master.metadata_url!r}, namespace='tests', global_segment_bytes=0)\n"
        "keys = kv.chain_keys(list(range(14)), 2, SALT)\n"
        "assert t.exists(keys) == 6, t.exists(keys)\n"
        "for k in keys[:6]:\n"
        "    np.testing.assert_array_equal(t.get(k), _block(k))\n"
        "assert t.put(keys[6], keys[5], _block(keys[6]))  # extends the other's prefix\n"
        "t.check_invariants()\n"
        "t.close()\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    assert tier.exists(keys) == 7  # its block lives in this process's segment
    np.testing.assert_array_equal(tier.get(keys[6]), _block(keys[6]))
    assert tier.remove(keys[5]) == 1  # only what this client chained below is removed here
    assert tier.exists(keys) == 5


def test_tampered_values_read_as_missing(tier, caplog):
    keys = chain_keys(list(range(8)), 2, SALT)
    _chain(tier, keys)
    raw = tier._client
    value = bytearray(raw.get(tier.object_name(keys[1])))
    value[-3] ^= 0x10  # one bit of the payload
    assert raw.upsert(tier.object_name(keys[1]), bytes(value)) == 0
    with caplog.at_level(logging.WARNING):
        assert tier.get(keys[1]) is None  # never the wrong bytes
    assert "checksum" in caplog.text and tier.num_errors == 1
    assert tier.exists(keys) == 1 and tier.num_used == 1  # removed, with its chain
    # a sound value copied under another key, and a value of another size
    assert raw.upsert(tier.object_name(keys[1]), raw.get(tier.object_name(keys[0]))) == 0
    assert tier.get(keys[1]) is None and raw.is_exist(tier.object_name(keys[1])) == 0
    assert raw.put(tier.object_name(keys[2]), b"\x01" * 100) == 0
    assert tier.get(keys[2]) is None and raw.is_exist(tier.object_name(keys[2])) == 1
    np.testing.assert_array_equal(tier.get(keys[0]), _block(keys[0]))


def test_leases_and_pins(master, tier):
    keys = chain_keys(list(range(6)), 2, SALT)
    other = chain_keys([7, 7], 2, SALT)[0]
    _chain(tier, keys)
    assert tier.put(other, ROOT_KEY, _block(other))
    with tier.lease(keys[2]) as data:
        np.testing.assert_array_equal(data, _block(keys[2]))
        with pytest.raises(RuntimeError, match="leased"):
            tier.remove(keys[0])
        assert tier.evict(3) == 1 and tier.exists(keys) == 3  # leaves only, never a leased one
        assert other not in tier
    assert tier.evict(1) == 1 and tier.exists(keys) == 2 and tier.num_evictions == 2
    pinned_before = _metric(master, "master_soft_pin_key_count")
    tier.pin(keys[0])
    assert _metric(master, "master_soft_pin_key_count") == pinned_before + 1  # in the master
    np.testing.assert_array_equal(tier.get(keys[0]), _block(keys[0]))
    tier.pin(keys[0], False)
    assert _metric(master, "master_soft_pin_key_count") == pinned_before
    with pytest.raises(KeyError):
        tier.pin(b"q" * 16)


def test_an_unreachable_master_degrades_to_misses(caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        t = MooncakeTier(
            SHAPE,
            master_address=f"127.0.0.1:{port}",
            metadata_url=f"http://127.0.0.1:{free_port()}/metadata",
            retry_interval_s=60,
        )
        key = chain_keys([1, 2], 2, SALT)[0]
        assert not t.healthy
        assert not t.put(key, ROOT_KEY, _block(key)) and t.get(key) is None
        assert t.exists([key]) == 0 and key not in t and t.readable_keys() == []
    assert time.monotonic() - t0 < 10  # probed, never the client's 90 s of retries
    assert t.num_errors == 1 and f"127.0.0.1:{port}" in t.last_error
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # logged once
    t.close()


def test_a_master_that_stops_and_returns(tmp_path, caplog):
    m = start_master(log_path=str(tmp_path / "master.log"))
    t = MooncakeTier(
        SHAPE, master_address=m.master_address, metadata_url=m.metadata_url,
        global_segment_bytes=16 << 20, local_buffer_bytes=4 << 20, retry_interval_s=0.5,
    )  # fmt: skip
    keys = chain_keys(list(range(4)), 2, SALT)
    try:
        assert t.put(keys[0], ROOT_KEY, _block(keys[0]))
        m.stop()
        with caplog.at_level(logging.WARNING):
            assert t.get(keys[0]) is None
            assert not t.put(keys[1], keys[0], _block(keys[1])) and t.exists(keys) == 0
        assert not t.healthy and t.num_errors >= 1 and "unreachable" in caplog.text
        m = start_master(m.host, m.rpc_port, m.http_port, m.metrics_port, log_path=m.log_path)
        deadline = time.monotonic() + 20
        while not t.put(keys[0], ROOT_KEY, _block(keys[0])) and time.monotonic() < deadline:
            time.sleep(0.2)  # the new master knows nothing; the client rejoins it
        assert t.healthy and t.exists(keys) == 1
        np.testing.assert_array_equal(t.get(keys[0]), _block(keys[0]))
    finally:
        t.close()
        m.stop()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_random_operations_keep_the_invariants_in_mooncake(shared, num_blocks, ops):
    shared.reset()
    shared.num_blocks, shared.high_watermark, shared.low_watermark = num_blocks, 0.9, 0.6
    shared.num_errors, shared.num_evictions = 0, 0
    run_operations(shared, num_blocks, ops, read=shared.peek)
    assert shared.num_errors == 0, shared.last_error

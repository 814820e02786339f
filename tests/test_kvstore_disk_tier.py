"""T2, the disk tier (llmjax/kvstore/disk_tier.py): the host tier's rules over block files
(the same hypothesis run), a cold restart that finds the blocks, a writer killed mid-put that
leaves nothing readable, a flipped byte caught by the checksum, a chain whose parent file is gone
dropped on open."""

import os
import subprocess
import sys
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax.kvstore import ROOT_KEY, chain_keys
from llmjax.kvstore.disk_tier import DiskTier
from tests.test_kvstore_host_tier import SALT, SHAPE, _block, ops, run_operations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chain(tier, keys):
    for parent, k in zip([ROOT_KEY, *keys], keys, strict=False):
        assert tier.put(k, parent, _block(k))


def test_blocks_survive_a_cold_restart(tmp_path):
    keys = chain_keys(list(range(12)), 2, SALT)
    _chain(DiskTier(str(tmp_path), 16, SHAPE), keys)
    again = DiskTier(str(tmp_path), 16, SHAPE)  # as a new process would open it
    assert again.exists(keys) == 6
    for k in keys:
        np.testing.assert_array_equal(again.get(k), _block(k))
    again.check_invariants()
    assert DiskTier(str(tmp_path), 16, (3, 2)).exists(keys) == 0  # another shape: dropped


def test_a_writer_killed_mid_put_leaves_nothing_readable(tmp_path):
    key = chain_keys([1, 2], 2, SALT)[0]
    code = (
        "import os, sys, numpy as np\n"
        "from llmjax.kvstore.disk_tier import DiskTier\n"
        f"t = DiskTier({str(tmp_path)!r}, 4, {SHAPE!r})\n"
        f"key = bytes.fromhex({key.hex()!r})\n"
        "assert t.put_begin(key)\n"
        f"t.write(key, np.ones({SHAPE!r}, np.float32))\n"
        "os._exit(9)  # killed before put_commit\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert proc.returncode == 9
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the half-written file
    t = DiskTier(str(tmp_path), 4, SHAPE)
    assert key not in t and t.get(key) is None
    assert not os.listdir(tmp_path)  # swept on open
    t.check_invariants()


def test_a_flipped_byte_is_caught_and_its_chain_dropped(tmp_path, caplog):
    keys = chain_keys(list(range(8)), 2, SALT)
    t = DiskTier(str(tmp_path), 8, SHAPE)
    _chain(t, keys)
    path = t.path(keys[1])
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0x10  # one bit of the payload
    with open(path, "wb") as f:
        f.write(raw)
    assert t.get(keys[1]) is None  # never the wrong bytes
    assert "checksum" in caplog.text
    assert t.exists(keys) == 1 and not os.path.exists(path)  # the chain below went too
    t.check_invariants()


def test_a_chain_whose_parent_file_is_gone_is_dropped_on_open(tmp_path):
    keys = chain_keys(list(range(8)), 2, SALT)
    t = DiskTier(str(tmp_path), 8, SHAPE)
    _chain(t, keys)
    os.unlink(t.path(keys[1]))
    again = DiskTier(str(tmp_path), 8, SHAPE)
    assert again.exists(keys) == 1 and again.num_used == 1
    again.check_invariants()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_random_operations_keep_the_invariants_on_disk(num_blocks, ops):
    with tempfile.TemporaryDirectory() as d:
        tier = DiskTier(d, num_blocks, SHAPE, high_watermark=0.9, low_watermark=0.6)
        run_operations(tier, num_blocks, ops)

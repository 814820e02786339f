"""T1, the host tier (llmjax/kvstore/host_tier.py): two-phase puts, chains, leases, soft pins and
leaf-first watermark eviction, under hypothesis: random puts (some abandoned mid-write), gets,
removals, leases and pins, with the invariants after every operation: a readable key returns
exactly the bytes put, no chained key outlives its parent, no slot leaks, leased blocks are never
evicted and pinned ones only when no unpinned leaf is left."""

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmjax.kvstore import ROOT_KEY, chain_keys
from llmjax.kvstore.host_tier import HostTier

SALT = b"s" * 32
SHAPE = (2, 3)


def _block(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal(SHAPE).astype(np.float32)


def test_a_put_is_readable_only_once_committed_and_chains_need_their_parent():
    t = HostTier(8, SHAPE)
    a, b = chain_keys([1, 2, 3, 4], 2, SALT)
    assert not t.put_begin(b, a), "an orphan (parent not stored) is refused"
    assert t.put_begin(a)
    t.write(a, _block(a))
    assert t.get(a) is None and t.exists([a, b]) == 0  # half-written: not readable
    t.put_commit(a)
    np.testing.assert_array_equal(t.get(a), _block(a))
    assert t.put(b, a, _block(b)) and t.exists([a, b]) == 2
    assert t.remove(a) == 2 and t.exists([a, b]) == 0  # the chain goes with its parent
    t.check_invariants()
    with pytest.raises(ValueError, match="shape"):
        t.put(a, ROOT_KEY, np.zeros((9,)))
    assert a not in t and t.num_used == 0  # the failed write left nothing


def test_eviction_takes_leaves_lru_first_and_spares_leases_and_pins():
    t = HostTier(4, SHAPE, high_watermark=1.0, low_watermark=1.0)
    keys = chain_keys(list(range(8)), 2, SALT)  # a chain of 4
    for parent, k in zip([ROOT_KEY, *keys], keys, strict=False):
        assert t.put(k, parent, _block(k))
    other = chain_keys([50, 51], 2, SALT)[0]
    # full: the new block evicts the chain's leaf (the only leaf), never a prefix
    assert t.put(other, ROOT_KEY, _block(other))
    assert t.exists(keys) == 3 and other in t
    t.pin(other)
    with t.lease(keys[2]):  # the chain's leaf is leased: the pinned one goes
        assert t.put(b"x" * 16, ROOT_KEY, _block(b"x" * 16))
        assert other not in t and t.exists(keys) == 3
        with pytest.raises(RuntimeError, match="leased"):
            t.remove(keys[0])
    t.check_invariants()


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "begin", "get", "remove", "lease_put", "pin", "evict"]),
        st.integers(0, 7),  # which chain
        st.integers(0, 5),  # position in it
    ),
    max_size=60,
)


def run_operations(t, num_blocks: int, ops, read=None) -> None:
    """Random operations on tier `t` (of `num_blocks` blocks), the invariants after each (the
    disk and Mooncake tiers' tests run it too; `read(k)` reads a block as the invariant check
    does, by default straight from the tier's storage)."""
    read = read or (lambda k: t._read_slot(k, t._blocks[k]))
    chains = [chain_keys(list(range(100 * c, 100 * c + 12)), 2, SALT) for c in range(8)]
    for op, c, i in ops:
        keys = chains[c]
        key, parent = keys[i], keys[i - 1] if i else ROOT_KEY
        before = set(t.readable_keys())
        if op == "put":  # the chain's first i + 1 pages, in order (as a prefix is saved)
            for j in range(i + 1):
                p = keys[j - 1] if j else ROOT_KEY
                ok = t.put(keys[j], p, _block(keys[j]))
                assert ok or (p != ROOT_KEY and p not in t) or t.num_used == num_blocks
                if not ok:
                    break
        elif op == "begin":  # a writer that stops mid-put
            if t.put_begin(key, parent) and key not in before:
                t.write(key, np.full(SHAPE, np.nan, np.float32))
                assert key not in t
        elif op == "get":
            got = t.get(key)
            assert (got is None) == (key not in before)
            if got is not None:
                np.testing.assert_array_equal(got, _block(key))
        elif op == "remove":
            t.remove(key)
            assert not any(k in t for k in keys[i:])
        elif op == "lease_put":  # a lease survives the pressure of another chain's puts
            if key in t:
                with t.lease(key):
                    for j, k in enumerate(chains[(c + 1) % 8]):
                        t.put(k, chains[(c + 1) % 8][j - 1] if j else ROOT_KEY, _block(k))
                    assert key in t
                    np.testing.assert_array_equal(t.get(key), _block(key))
        elif op == "pin":
            if key in t:
                t.pin(key)
        elif op == "evict":
            pinned = {k for k in t.readable_keys() if t._blocks[k].pinned}
            unpinned_leaves = [
                k
                for k in t.readable_keys()
                if not t._blocks[k].children and not t._blocks[k].pinned
            ]
            n = t.evict(i)
            gone = pinned - set(t.readable_keys())
            assert not gone or n > len(unpinned_leaves), "a pin went before an unpinned leaf"
        t.check_invariants()
        for k in t.readable_keys():  # every readable key holds exactly its bytes
            np.testing.assert_array_equal(read(k), _block(k))
    event(f"evictions: {min(t.num_evictions, 3)}+")
    chained = sum(b.parent != ROOT_KEY for b in t._blocks.values())
    event(f"chained blocks held at the end: {chained > 0}")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(num_blocks=st.integers(1, 10), ops=ops)
def test_random_operations_keep_the_invariants(num_blocks, ops):
    run_operations(
        HostTier(num_blocks, SHAPE, high_watermark=0.9, low_watermark=0.6), num_blocks, ops
    )

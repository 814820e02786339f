"""Page keys (llmjax/kvstore/keys.py): chained, salted, the same in every process; and the radix
tree's per-node keys (RadixCache(salt=...)), which must always chain from the root along its
path through inserts, splits, evictions and resets (hypothesis)."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import configs
from llmjax.config import CacheConfig, EngineConfig, ParallelConfig
from llmjax.engine.radix_cache import RadixCache
from llmjax.kvstore import ROOT_KEY, KeySalt, chain_keys, page_key, shard_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SALT = KeySalt("m", "float32", 4, "tp=1").digest


def test_keys_chain_from_the_parent_and_skip_the_partial_page():
    tokens = list(range(3, 14))  # 11 tokens, page size 4: 2 full pages
    keys = chain_keys(tokens, 4, SALT)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert keys[0] == page_key(ROOT_KEY, tokens[:4], SALT)
    assert keys[1] == page_key(keys[0], tokens[4:8], SALT)
    # a key names its whole prefix: the same page after another first page differs
    other = chain_keys([99, 98, 97, 96, *tokens[4:8]], 4, SALT)
    assert other[1] != keys[1]
    # prefixes share their keys; a continuation from a parent equals the whole chain
    assert chain_keys(tokens[:8], 4, SALT) == keys
    assert chain_keys(tokens[4:8], 4, SALT, parent=keys[0]) == keys[1:]
    assert chain_keys(tokens[:3], 4, SALT) == []


def test_the_salt_covers_model_dtype_page_size_and_layout():
    tiny = configs.get_preset("tiny")
    base = EngineConfig(model=tiny)
    variants = [
        base,
        EngineConfig(model=tiny, dtype="bfloat16"),
        EngineConfig(model=tiny, cache=CacheConfig(page_size=32)),
        EngineConfig(model=tiny, parallel=ParallelConfig(tp=2)),
        EngineConfig(model=tiny, parallel=ParallelConfig(tp=4)),  # kv heads repeated
        EngineConfig(model=configs.get_preset("tiny-gqa1")),
    ]
    digests = [KeySalt.for_engine(c).digest for c in variants]
    assert len(set(digests)) == len(digests)
    assert KeySalt.for_engine(base).digest == KeySalt.for_engine(EngineConfig(model=tiny)).digest
    tokens = list(range(32))
    assert chain_keys(tokens, 16, digests[0]) != chain_keys(tokens, 16, digests[1])
    assert len({shard_key(b"k" * 16, r) for r in range(4)}) == 4
    with pytest.raises(ValueError):
        shard_key(b"k" * 16, -1)


def test_keys_are_the_same_in_another_process():
    code = (
        "from llmjax.kvstore import KeySalt, chain_keys\n"
        "salt = KeySalt('m', 'float32', 4, 'tp=1').digest\n"
        "print(' '.join(k.hex() for k in chain_keys(list(range(3, 20)), 4, salt)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [k.hex() for k in chain_keys(list(range(3, 20)), 4, SALT)]


def _check_keys(cache: RadixCache) -> None:
    cache.check_invariants()  # includes: every node's keys chain from its parent's last key
    for node in cache.nodes():
        path, n = [], node
        while n is not cache.root:
            path.append(n)
            n = n.parent
        tokens = [t for x in reversed(path) for t in x.token_ids]
        assert cache.path_keys(node) == chain_keys(tokens, cache.page_size, cache.salt)


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "evict", "lock", "reset"]),
        st.lists(st.integers(1, 4), min_size=0, max_size=14),
        st.integers(0, 6),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(page_size=st.sampled_from([1, 2, 4]), ops=ops)
def test_radix_page_keys_chain_through_inserts_splits_evictions(page_size, ops):
    cache = RadixCache(page_size, salt=SALT)
    next_page, locked = 1, []
    for op, tokens, n in ops:
        if op == "insert":
            pages = list(range(next_page, next_page + len(tokens) // page_size))
            next_page += len(pages)
            cache.insert(tokens, pages)
        elif op == "match":
            m = cache.match(tokens)
            assert cache.path_keys(m.node) == chain_keys(tokens[: m.num_tokens], page_size, SALT)
        elif op == "lock":
            m = cache.match(tokens)
            if m.num_tokens:
                cache.lock(m.node)
                locked.append(m.node)
        elif op == "evict":
            cache.evict(n)
        elif op == "reset":
            for node in locked:
                cache.unlock(node)
            locked.clear()
            cache.reset()
        _check_keys(cache)


def test_an_engine_keys_its_cached_pages():
    from llmjax.sim import SimConfig

    tiny = configs.get_preset("tiny")
    config = EngineConfig(
        model=tiny,
        cache=CacheConfig(page_size=4, num_pages=64, prefix_cache="radix"),
        max_model_len=64,
        device="sim",
        sim=SimConfig(hardware="a100-80gb"),
    )
    from llmjax.engine.engine import LLMEngine
    from llmjax.sampling_params import SamplingParams

    engine = LLMEngine(config, None, 64)
    engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    cache = engine.block_manager.prefix_cache
    m = cache.match(list(range(3, 20)))
    assert m.num_tokens == 16
    salt = KeySalt.for_engine(config).digest
    assert cache.path_keys(m.node) == chain_keys(list(range(3, 19)), 4, salt)

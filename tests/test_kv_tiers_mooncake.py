"""The engine over T3, Mooncake Store (issue 22): a prefix one engine computed is loaded by
another engine (another client of the same master) with identical greedy outputs and counted
as 'mooncake' hits; an unreachable master degrades to recomputation with a logged reason.
Skipped without the `mooncake` extra (and Debian's libibverbs1)."""

from __future__ import annotations

import pytest

from llmjax.config import KVStoreConfig
from llmjax.kvstore.mooncake_master import free_port, start_master
from tests.test_kv_tiers_model import GREEDY, _base, _prompts, _reference, _serve_one_by_one

pytest.importorskip(
    "mooncake.store", reason="needs the mooncake extra and libibverbs1", exc_type=ImportError
)  # the wheel is there, its native module needs libibverbs.so.1


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("mooncake") / "master.log")
    with start_master(log_path=log, timeout_s=30) as m:
        yield m


def _close(llm) -> None:
    for tier in llm.engine.kv_tiers.store.tiers:
        if hasattr(tier, "close"):
            tier.close()


def test_a_prefix_computed_by_one_engine_is_loaded_by_another(master):
    kv = KVStoreConfig(
        mooncake_master=master.master_address,
        mooncake_metadata=master.metadata_url,
        mooncake_namespace="engines",
        block_size=8,
        write_policy="write_through",
        load_policy="always",
    )
    prompts = _prompts()
    first = _base().with_options(kv_store=kv)
    second = _base().with_options(kv_store=kv)  # its own device pages and its own client
    try:
        outs = first.generate(prompts[:1], GREEDY, use_tqdm=False)
        # 46 prompt + 5 computed output tokens: 6 full blocks of 8
        assert first.engine.kv_tiers.store.tiers[0].num_used == 6
        outs += _serve_one_by_one(second, prompts[1:])
        assert [o.token_ids for o in outs] == _reference()
        assert [o.num_cached_tokens_per_tier for o in outs[1:]] == [
            {"device": 0, "mooncake": 40}
        ] * 5
        second.engine.kv_tiers.check_invariants()
    finally:
        _close(second)
        _close(first)


def test_an_unreachable_master_degrades_to_recompute(caplog):
    kv = KVStoreConfig(
        mooncake_master=f"127.0.0.1:{free_port()}",
        mooncake_metadata=f"http://127.0.0.1:{free_port()}/metadata",
        block_size=8,
        write_policy="write_through",
        load_policy="always",
    )
    with caplog.at_level("WARNING"):
        llm = _base().with_options(kv_store=kv)
        outs = _serve_one_by_one(llm, _prompts(3))
    assert [o.token_ids for o in outs] == _reference()[:3]
    assert all(o.num_cached_tokens == 0 for o in outs)
    tier = llm.engine.kv_tiers.store.tiers[0]
    assert not tier.healthy and tier.num_errors >= 1
    assert "mooncake" in caplog.text.lower()
    _close(llm)

"""LoRA adapters across instances (issue 42 with llmjax/cluster/): a request under an adapter
moves from a prefill to a decode instance with its adapter (`MigratedRequest.lora_request`),
is recomputed under it when its transfer fails, and a decode instance takes no more distinct
adapters than its slots (`can_accept`); the Conductor's prefix fetch copies an adapter's
prefix into the adapter's tree only; instances that do not all serve adapters are refused; the
simulated cluster runs the same engines' rules. The invariant: each request's greedy tokens are
the ones it gets alone on one engine."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from llmjax import LLM, LoRARequest, SamplingParams
from llmjax.cluster import Cluster, InstanceSpec, LocalInstance
from llmjax.cluster.transfer import LocalTransport, TransferError
from tests.conftest import TESTDATA

BASE = os.path.join(TESTDATA, "hf_tiny", "llama")
LORA = os.path.join(TESTDATA, "lora", "llama")
ADAPTERS = [LoRARequest(n, i + 1, os.path.join(LORA, n))
            for i, n in enumerate(["qv_r4", "all_r8", "od_rslora"])]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTS = dict(enable_lora=True, max_lora_rank=8, max_num_seqs=8, num_pages=64, page_size=8,
            max_model_len=64, compilation_cache_dir="")  # fmt: skip


def _workload(n: int = 8):
    """Prompts sharing a prefix, over three adapters and the base model."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 250, 16).tolist()
    prompts = [shared[: 8 + i] + rng.integers(3, 250, 5).tolist() for i in range(n)]
    loras = [None if i % 4 == 3 else ADAPTERS[i % 3] for i in range(n)]
    return prompts, loras


@pytest.fixture(scope="module")
def alone():
    """Each request's greedy tokens alone on one engine."""
    prompts, loras = _workload()
    llm = LLM(BASE, prefix_cache="none", max_loras=1, **{**OPTS, "enable_lora": True})
    return [llm.generate([p], GREEDY, lora_request=lr)[0].token_ids
            for p, lr in zip(prompts, loras, strict=True)]  # fmt: skip


def _instances(roles, transport, per_role=None):
    from llmjax.cluster.launch import split_devices

    specs = [InstanceSpec(r) for r in roles]
    out = []
    for spec, devs in zip(specs, split_devices(jax.devices(), specs), strict=True):
        options = {**OPTS, **(per_role or {}).get(spec.role, {})}
        llm = LLM(BASE, role=spec.role, devices=devs, **options)
        out.append(LocalInstance(llm.engine, transport, spec.role))
    return out


def test_requests_move_to_decode_with_their_adapters(alone):
    """Prefill -> decode with three adapters and the base model: every request's tokens are
    its tokens alone; the decode instance (one adapter slot) never runs two adapters at once,
    so the pull condition holds requests back; nothing is left held."""
    transport = LocalTransport()
    instances = _instances(["prefill", "decode"], transport, {"decode": {"max_loras": 1}})
    cluster = Cluster(instances, "round_robin")
    decode = instances[1].engine
    peak = []
    step = decode.step

    def watched_step():
        ids = {r.lora_int_id for r in decode.scheduler.running if r.lora_int_id}
        peak.append(len(ids))
        return step()

    decode.step = watched_step
    prompts, loras = _workload()
    outs = cluster.generate(prompts, GREEDY, lora_request=loras)
    assert [o.token_ids for o in outs] == alone
    assert cluster.transfer_stats.num_transfers == len(prompts)
    assert max(peak) == 1, "the decode instance ran more adapters than its slots"
    assert set(decode.list_loras()) == {1, 2, 3}  # registered as the requests arrived
    assert decode.stats.num_decode_tokens > 0 and instances[0].engine.stats.num_decode_tokens == 0
    for inst in instances:
        inst.engine.block_manager.check_invariants()
        assert inst.engine.block_manager.num_used_pages == 0 and not inst.engine.parked
    assert transport.num_offers == 0
    with pytest.raises(ValueError, match="in use"):  # refused while a request runs under it
        cluster.add_request(prompts[0], GREEDY, lora_request=ADAPTERS[0])
        cluster.remove_lora(ADAPTERS[0].lora_int_id)
    cluster.abort_all()
    assert cluster.remove_lora(ADAPTERS[0].lora_int_id)
    assert 1 not in decode.list_loras() and 1 not in instances[0].engine.list_loras()


class FailingTransport(LocalTransport):
    def pull(self, offer, runner, deadline):
        return TransferError("injected: the link is down")


def test_a_failed_transfer_recomputes_under_the_adapter(alone):
    transport = FailingTransport()
    instances = _instances(["prefill", "decode"], transport)
    cluster = Cluster(instances, on_transfer_failure="recompute")
    prompts, loras = _workload()
    outs = cluster.generate(prompts[:4], GREEDY, lora_request=loras[:4])
    assert cluster.transfer_stats.num_failures == 4
    assert [o.token_ids for o in outs] == alone[:4]
    assert instances[1].engine.stats.num_prefill_tokens > 0  # the decode side recomputed


def test_a_prefix_fetch_lands_in_the_adapters_tree_only():
    """The Conductor's fetch of a prefix cached under adapter A copies it into A's tree on
    the destination: a hit there for A, a miss for the base model and for adapter B; a fetch
    under B finds nothing to offer."""
    transport = LocalTransport()
    src, dst = _instances(["colocated", "colocated"], transport)
    cluster = Cluster([src, dst])
    a, b = ADAPTERS[0], ADAPTERS[1]
    prompt = np.random.default_rng(2).integers(3, 250, 33).tolist()
    src.engine.add_request(prompt, GREEDY, lora_request=a)
    while src.engine.has_unfinished_requests():
        src.engine.step()
    ns = lambda x: None if x is None else x.cache_namespace
    assert src.cached_prefix_tokens(prompt, ns(a)) == 32
    assert src.cached_prefix_tokens(prompt) == src.cached_prefix_tokens(prompt, ns(b)) == 0
    assert cluster.fetch_prefix(0, 1, prompt, ns(b)) == 0  # nothing cached under b
    assert cluster.fetch_prefix(0, 1, prompt) == 0  # nor under the base model
    assert cluster.fetch_prefix(0, 1, prompt, ns(a)) == 32
    assert [dst.cached_prefix_tokens(prompt, ns(x)) for x in (a, b, None)] == [32, 0, 0]
    dst.engine.add_request(prompt, GREEDY, lora_request=a, request_id="again")
    while dst.engine.has_unfinished_requests():
        [out] = dst.engine.step() or [None]
    assert out.num_cached_tokens == 32
    want = LLM(BASE, prefix_cache="none", **OPTS).generate([prompt], GREEDY, lora_request=a)
    assert out.token_ids == want[0].token_ids  # the fetched KV is adapter a's


def test_instances_must_all_serve_adapters_or_none():
    transport = LocalTransport()
    prefill, decode = _instances(["prefill", "decode"], transport)
    plain = LLM(BASE, role="decode", **{**OPTS, "enable_lora": False})
    with pytest.raises(ValueError, match=r"every instance needs EngineConfig\.lora"):
        Cluster([prefill, LocalInstance(plain.engine, transport, "decode")])
    # an engine without adapters never takes a moved request under one (the pull condition)
    from llmjax.engine.roles import _migrated

    req = prefill.engine.scheduler  # (any request will do: build one under an adapter)
    prefill.engine.add_request([5, 6, 7], GREEDY, "r", lora_request=ADAPTERS[0])
    m = _migrated(req.waiting[0], 0)
    assert m.lora_request == ADAPTERS[0]
    assert not plain.engine.can_accept(m) and decode.engine.can_accept(m)
    with pytest.raises(ValueError, match="adapter slots"):
        plain.engine.reserve_import(m)


def test_the_simulated_cluster_moves_adapters_as_the_real_one():
    """A simulated prefill + decode cluster (Llama-2-7B shapes on an A100, adapters priced by
    the simulator) under adapters: every request finishes with its max_tokens, the decode side
    never runs more adapters than its slots, and no page is left held."""
    from llmjax.sim.cluster import SimCluster

    def engine(role):
        return LLM("llama2-7b", device="sim", role=role, enable_lora=True, max_loras=1,
                   max_lora_rank=16, max_num_seqs=8, max_model_len=512).engine  # fmt: skip

    pre, dec = engine("prefill"), engine("decode")
    cluster = SimCluster([pre, dec])
    peak = []
    step = dec.step

    def watched_step():
        peak.append(len({r.lora_int_id for r in dec.scheduler.running if r.lora_int_id}))
        return step()

    dec.step = watched_step
    loras = [LoRARequest(f"a{i}", i, f"/sim/a{i}") for i in (1, 2, 3)]
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ids = [cluster.add_request(rng.integers(3, 30000, 200).tolist(), params, arrival_time=0.01 * i,
                               lora_request=loras[i % 3] if i % 4 else None)
           for i in range(12)]  # fmt: skip
    done = {}
    while cluster.has_unfinished_requests():
        done.update({o.request_id: o for o in cluster.step() if o.finished})
    assert sorted(done) == sorted(ids)
    assert all(len(o.token_ids) == 16 and o.error is None for o in done.values())
    assert max(peak) == 1
    for e in (pre, dec):
        assert e.block_manager.num_used_pages == 0

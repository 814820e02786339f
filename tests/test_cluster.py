"""Many instances in one process (llmjax/cluster/): the local launcher's sub-meshes, routers over
colocated instances, and DistServe's disaggregation with the local KV transport, on the tiny
model and 8 fake CPU devices.

The invariant: a request's greedy output does not depend on where it ran. Disaggregated outputs
equal a colocated engine's (same tp on both sides) with mixed prompt lengths, partial last pages,
non-contiguous pages, prefix-cache hits on the prefill side and preemption on the decode side;
with another tp on the decode side the moved pages are bitwise equal head by head. Different
random weights on the two sides prove which side ran which phase (against a jnp reference that
prefills with one model and decodes with the other).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from llmjax import LLM
from llmjax.cluster import Cluster, InstanceSpec, LocalInstance, launch
from llmjax.cluster.transfer import LocalTransport, TransferError, kv_head_map
from llmjax.engine.runner import transfer_bucket
from llmjax.sampling_params import SamplingParams
from tests.parallel_cases import ENGINE_OPTS, prompts

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def colocated():
    """Greedy outputs of one colocated engine per tp (the references)."""
    out = {}
    for tp in (1, 2, 4):
        out[tp] = _tokens(LLM("tiny", tp=tp, **ENGINE_OPTS).generate(prompts(8), GREEDY))
    return out


class RecordingTransport(LocalTransport):
    """The local transport, remembering each offer's pages."""

    def __init__(self):
        super().__init__()
        self.pages: list[list[int]] = []

    def offer(self, runner, request_id, pages):
        self.pages.append(list(pages))
        return super().offer(runner, request_id, pages)


def _instances(specs, transport, **options):
    """LocalInstances on consecutive devices, with one shared transport (as launch() does)."""
    from llmjax.cluster.launch import split_devices

    out = []
    for spec, devs in zip(specs, split_devices(jax.devices(), specs), strict=True):
        llm = LLM(
            "tiny",
            tp=spec.tp,
            role=spec.role,
            devices=devs,
            **{**ENGINE_OPTS, **options, **spec.options},
        )
        out.append(LocalInstance(llm.engine, transport, spec.role))
    return out


@pytest.mark.parametrize(
    "layout",
    [
        "prefill:tp=4,decode:tp=4",  # 4 + 4 devices
        "prefill:tp=2,prefill:tp=2,decode:tp=2",  # two prefill instances feed one decode
    ],
)
def test_disaggregated_greedy_outputs_equal_colocated(colocated, layout):
    specs = InstanceSpec.parse(layout)
    tp = specs[-1].tp
    # A small decode cache: decodes preempt there (and the pull condition holds requests back).
    # With two prefill instances the decode instance schedules asynchronously (its imports
    # join the running batch while a step is in flight).
    overlap = len(specs) > 2
    options = {"num_pages": 24, "async_scheduling": overlap}
    specs[-1] = InstanceSpec("decode", tp=tp, options=options)
    transport = RecordingTransport()
    instances = _instances(specs, transport)
    cluster = Cluster(instances, "round_robin")
    got = _tokens(cluster.generate(prompts(8), GREEDY))
    assert got == colocated[tp]
    decode, prefills = instances[-1].engine, [i.engine for i in instances[:-1]]
    assert decode.async_scheduling == overlap
    assert cluster.transfer_stats.num_transfers == 8
    assert cluster.transfer_stats.num_failures == 0
    assert decode.stats.num_preemptions > 0, "the small decode cache should preempt"
    assert sum(e.stats.num_cached_prefill_tokens for e in prefills) > 0, "no prefix-cache hit"
    assert all(e.stats.num_decode_tokens == 0 for e in prefills)
    # partial last pages and non-contiguous page lists were moved
    lengths = [len(p) for p in prompts(8)]
    assert any(n % ENGINE_OPTS["page_size"] for n in lengths)
    assert any(any(b != a + 1 for a, b in itertools.pairwise(p)) for p in transport.pages)
    for inst in instances:  # nothing held once everything finished
        bm = inst.engine.block_manager
        bm.check_invariants()
        assert bm.num_used_pages == 0 and not inst.engine.parked
    assert transport.num_offers == 0


def test_kv_pages_move_bitwise_to_another_tp(colocated):
    """prefill tp=2 (kv heads as they are) -> decode tp=4 (each kv head repeated twice): shard by
    shard, and every head arrives bitwise equal; decoding there gives the colocated tokens."""
    transport = LocalTransport()
    pre, dec = _instances([InstanceSpec("prefill", tp=2), InstanceSpec("decode", tp=4)], transport)
    prompt = prompts(8)[3]
    pre.engine.add_request(prompt, GREEDY, request_id="r")
    while not pre.engine.parked:
        pre.step()
    m, src_pages = pre.engine.export_request("r")
    src = np.asarray(pre.engine.runner.export_pages(src_pages))
    m, offer = pre.offer("r")
    dec.begin_import(m, offer, timeout_s=30.0, on_failure="recompute")
    dst_pages = dec._imports["r"].pages
    [res] = dec.poll_imports()
    assert res.status == "done"
    pre.release("r")
    dst = np.asarray(dec.engine.runner.export_pages(dst_pages))
    src_heads, dst_heads = kv_head_map(pre.engine.runner), kv_head_map(dec.engine.runner)
    assert src_heads == (0, 1) and dst_heads == (0, 0, 1, 1)
    n = len(src_pages)
    for j, h in enumerate(dst_heads):
        np.testing.assert_array_equal(dst[:, :, :n, :, j], src[:, :, :n, :, h])
    assert np.abs(src[:, :, :n]).sum() > 0  # real KV, not zeros
    tokens = []
    while dec.engine.has_unfinished_requests():
        outs, _ = dec.step()
        tokens = outs[-1].token_ids if outs else tokens
    assert tokens == colocated[2][3] == colocated[4][3]


def _hybrid_greedy(params_a, params_b, config, prompt, n, page_size=4, max_pages=24):
    """jnp reference: prefill `prompt` with params_a, then greedy-decode n - 1 tokens with
    params_b over the same KV pages (a fixed page table, so the decode compiles once)."""
    import jax.numpy as jnp

    from llmjax.model.kv_cache import allocate_kv_pages
    from tests.helpers import make_step

    run = _jitted_forward(config)
    table = list(range(1, max_pages + 1))
    kv = allocate_kv_pages(config, max_pages + 1, page_size, jnp.float32)
    logits, kv = run(params_a, kv, make_step([(list(prompt), 0, table)], page_size))
    out = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        step = make_step([([out[-1]], len(prompt) + i, table)], page_size)
        logits, kv = run(params_b, kv, step)
        out.append(int(np.argmax(logits[-1])))
    return out


_FORWARDS = {}


def _jitted_forward(config):
    from llmjax.model.llama import forward

    if config not in _FORWARDS:
        _FORWARDS[config] = jax.jit(lambda p, kv, step: forward(p, kv, step, config))
    return _FORWARDS[config]


def test_routing_with_different_weights_shows_which_side_ran_which_phase():
    import configs
    from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmjax.engine.engine import LLMEngine
    from llmjax.model.params import init_params

    model = configs.get_preset("tiny")
    config = EngineConfig(
        model=model,
        cache=CacheConfig(page_size=4, num_pages=64, prefix_cache="radix"),
        scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=32, max_num_seqs=8),
        max_model_len=128,
        attention_backend="reference",
        compilation_cache_dir="",
    )
    params_a = init_params(model, jax.random.key(1))
    params_b = init_params(model, jax.random.key(2))
    transport = LocalTransport()
    devs = jax.devices()
    pre = LLMEngine(config, params_a, 64, role="prefill", devices=[devs[0]])
    dec = LLMEngine(config, params_b, 64, role="decode", devices=[devs[1]])
    cluster = Cluster([LocalInstance(pre, transport), LocalInstance(dec, transport)])
    ps = prompts(4)
    got = _tokens(cluster.generate(ps, GREEDY))
    for prompt, tokens in zip(ps, got, strict=True):
        assert tokens == _hybrid_greedy(params_a, params_b, model, prompt, 8)
        assert tokens != _hybrid_greedy(params_a, params_a, model, prompt, 8)  # not all A
        assert tokens[0] != _hybrid_greedy(params_b, params_b, model, prompt, 1)[0] or (
            tokens[1:] != _hybrid_greedy(params_b, params_b, model, prompt, 8)[1:]
        )  # not all B
    assert pre.stats.num_decode_tokens == 0 and dec.stats.num_prefill_tokens == 0


class FailingTransport(LocalTransport):
    def pull(self, offer, runner, deadline):
        return TransferError("injected: the link is down")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_transfers_recompute_or_fail_with_the_reason(colocated, policy):
    transport = FailingTransport()
    instances = _instances([InstanceSpec("prefill"), InstanceSpec("decode")], transport)
    cluster = Cluster(instances, on_transfer_failure=policy)
    outs = cluster.generate(prompts(8)[:3], GREEDY)
    assert cluster.transfer_stats.num_failures == 3
    if policy == "recompute":
        assert _tokens(outs) == colocated[1][:3]
        assert instances[1].engine.stats.num_prefill_tokens > 0  # the decode side recomputed
    else:
        for o in outs:
            assert o.finish_reason == "error" and "the link is down" in o.error
            assert len(o.token_ids) == 1  # the first token came from the prefill side
    for inst in instances:
        assert inst.engine.block_manager.num_used_pages == 0
    assert transport.num_offers == 0


def test_transfer_buckets_are_precompiled(colocated):
    transport = LocalTransport()
    instances = _instances([InstanceSpec("prefill"), InstanceSpec("decode")], transport)
    max_pages = 128 // ENGINE_OPTS["page_size"]
    for inst in instances:
        inst.engine.runner.precompile_transfer(max_pages)
    compiled = [inst.engine.runner.num_transfer_compiles for inst in instances]
    assert compiled == [2 * 6] * 2  # gather + scatter for buckets 1, 2, 4, ..., 32
    out = Cluster(instances).generate(prompts(8), GREEDY)
    assert _tokens(out) == colocated[1]
    assert [inst.engine.runner.num_transfer_compiles for inst in instances] == compiled
    assert [transfer_bucket(n) for n in (0, 1, 2, 3, 5, 17)] == [1, 1, 2, 4, 8, 32]


@pytest.mark.parametrize(
    "router", ["round_robin", "least_outstanding", "power_of_two", "cache_aware"]
)
def test_colocated_instances_behind_each_router_give_the_same_outputs(colocated, router):
    cluster = launch("tiny", InstanceSpec.parse("2xcolocated"), router=router, **ENGINE_OPTS)
    assert _tokens(cluster.generate(prompts(8), GREEDY)) == colocated[1]
    served = [s.num_prefill_tokens > 0 for s in cluster.stats]
    if router != "cache_aware":  # which may send every prompt with the shared prefix to one
        assert all(served)
    assert [d["devices"] for d in cluster.describe()] == [["cpu:0"], ["cpu:1"]]


def test_launch_errors_are_clear():
    with pytest.raises(ValueError, match="need 12 devices"):
        launch("tiny", InstanceSpec.parse("3xprefill:tp=4"), **ENGINE_OPTS)
    with pytest.raises(ValueError, match="decode instance"):
        launch("tiny", InstanceSpec.parse("prefill"), **ENGINE_OPTS)
    with pytest.raises(ValueError, match="tp=N or pp=N"):
        InstanceSpec.parse("prefill:dp=2")
    with pytest.raises(ValueError, match="unknown role"):
        launch("tiny", InstanceSpec.parse("prefil"), **ENGINE_OPTS)
    assert InstanceSpec.parse("2xprefill:tp=2/pp=1,decode") == [
        InstanceSpec("prefill", 2, 1),
        InstanceSpec("prefill", 2, 1),
        InstanceSpec("decode", 1, 1),
    ]


def test_benchmark_script_runs_a_disaggregated_cluster(tmp_path):
    """scripts/benchmark.py --instances: the real cluster (local launcher, fake devices) runs a
    workload end to end and reports the KV transfers; its greedy tokens equal one engine's."""
    import json

    from tests.helpers import run_benchmark_script

    common = [
        "--model=tiny", "--load_format=dummy", "--workload=sharegpt", "--num_requests=6",
        "--qps=20", "--max_model_len=256", "--page_size=4", "--policies=sarathi",
        "--tbt_slo=1.0", "--warmup=0", "--norehearse",
    ]  # fmt: skip
    out = tmp_path / "disagg.json"
    run_benchmark_script([*common, "--instances=prefill:tp=2,decode:tp=2", f"--json_out={out}"])
    single = tmp_path / "single.json"
    run_benchmark_script([*common, f"--json_out={single}"])
    v = json.loads(out.read_text())["variants"]["sarathi"]
    ref = json.loads(single.read_text())["variants"]["sarathi"]
    assert v["summary"]["num_finished"] == 6
    assert v["transfer_stats"]["num_transfers"] == 6 and v["transfer_stats"]["bytes"] > 0
    assert [d["role"] for d in v["engine"]["instances"]] == ["prefill", "decode"]
    assert len(v["instance_utilization"]) == 2
    assert v["output_token_ids"] == ref["output_token_ids"]

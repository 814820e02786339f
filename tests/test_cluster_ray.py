"""The Ray launcher (llmjax/cluster/ray_launcher.py): each instance a Ray actor, a process of its
own with its own (fake CPU) devices, on a local Ray cluster; the tiny model.

Greedy outputs do not depend on where a request ran: two colocated actors behind round_robin,
and a prefill actor feeding a decode actor through the transfer_server KV transport, give one
in-process engine's outputs. An actor killed mid-generation has its requests recomputed on the
other, and every request finishes. Skipped when Ray (the `cluster` extra) is not installed or
cannot start here.
"""

from __future__ import annotations

import importlib.util
import os
import time

import jax
import pytest

from llmjax import LLM
from llmjax.cluster import InstanceSpec, launch
from llmjax.cluster.instance import LocalInstance
from llmjax.sampling_params import SamplingParams
from tests.parallel_cases import ENGINE_OPTS, prompts

ray = pytest.importorskip("ray", reason="the Ray launcher needs the `cluster` extra (ray)")

from llmjax.cluster.ray_launcher import RayInstance, UnixClock  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
NUM_PROMPTS = 6


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ray_session():
    """A fresh local Ray cluster for this module (address='local': never someone else's)."""
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=100 * 1024**2,
        )
    except Exception as e:
        pytest.skip(f"Ray cannot start here: {e!r}")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """One in-process engine's greedy outputs."""
    return _tokens(LLM("tiny", **ENGINE_OPTS).generate(prompts(NUM_PROMPTS), GREEDY))


def _ray_options():
    """The actors share this run's persistent compilation cache and XLA's -O0 (conftest.py)."""
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return dict(platform="cpu", env_vars=env, xla_flags=" ".join(flags), call_timeout_s=120)


def _shutdown(cluster):
    for inst in cluster.instances:
        inst.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_session):
    """Two colocated actors behind round_robin (the death test, last, kills one)."""
    cluster = launch(
        "tiny",
        InstanceSpec.parse("2xcolocated"),
        launcher="ray",
        router="round_robin",
        ray_options=_ray_options(),
        **ENGINE_OPTS,
    )
    yield cluster
    _shutdown(cluster)


def test_the_handle_has_every_call_of_a_local_instance():
    public = {n for n in vars(LocalInstance) if not n.startswith("_")}
    assert public <= set(vars(RayInstance)), public - set(vars(RayInstance))
    assert {"step_begin", "step_end"} <= set(vars(RayInstance))


def test_local_transport_between_actors_is_refused():
    with pytest.raises(ValueError, match="transfer_server"):
        launch(
            "tiny",
            InstanceSpec.parse("prefill,decode"),
            launcher="ray",
            transport="local",
            **ENGINE_OPTS,
        )


def test_colocated_actors_give_one_engines_outputs(colocated, reference):
    cluster = colocated
    assert isinstance(cluster.clock, UnixClock)
    assert all(isinstance(inst, RayInstance) for inst in cluster.instances)
    pids = [inst.pids()[0] for inst in cluster.instances]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # each actor sees its own single fake device (XLA_FLAGS from the runtime_env)
    assert [len(d["devices"]) for d in cluster.describe()] == [1, 1]
    t0 = time.time()
    outs = cluster.generate(prompts(NUM_PROMPTS), GREEDY)
    assert _tokens(outs) == reference
    for o in outs:  # stamped by the actors' UnixClock: comparable with the driver's time.time()
        m = o.metrics
        assert t0 - 1 <= m.arrival_time <= m.first_token_time <= m.finished_time <= time.time()
    assert all(s.num_decode_tokens > 0 for s in cluster.stats)  # round_robin used both


@pytest.mark.skipif(
    importlib.util.find_spec("llmjax.cluster.transfer_server") is None,
    reason="llmjax/cluster/transfer_server.py (the cross-process KV transport) is not there yet",
)
def test_prefill_and_decode_actors_move_kv_through_the_transfer_server(ray_session, reference):
    cluster = launch(
        "tiny",
        InstanceSpec.parse("prefill,decode"),
        launcher="ray",
        transport="transfer_server",
        ray_options=_ray_options(),
        **ENGINE_OPTS,
    )
    try:
        outs = cluster.generate(prompts(NUM_PROMPTS), GREEDY)
        assert _tokens(outs) == reference
        st = cluster.transfer_stats
        assert (st.num_transfers, st.num_failures, st.num_recomputed) == (NUM_PROMPTS, 0, 0)
        assert st.bytes > 0
    finally:
        _shutdown(cluster)


def test_a_killed_actor_has_its_requests_recomputed_on_the_other(colocated, reference):
    cluster = colocated
    ids = [cluster.add_request(p, GREEDY) for p in prompts(NUM_PROMPTS)]
    on_victim = [rid for rid in ids if cluster.instance_of(rid) == 1]
    assert on_victim
    done = {}
    for _ in range(3):  # mid-generation: some tokens out, none finished
        for o in cluster.step():
            if o.finished:
                done[o.request_id] = o
    ray.kill(cluster.instances[1].actors[0])
    t0 = time.perf_counter()
    while cluster.has_unfinished_requests():
        for o in cluster.step():
            if o.finished:
                done[o.request_id] = o
        assert time.perf_counter() - t0 < 60
    assert cluster.alive == [True, False]
    assert cluster.transfer_stats.num_recomputed >= len([r for r in on_victim if r not in done])
    outs = [done[rid] for rid in ids]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert _tokens(outs) == reference

"""The Ray launcher (llmjax/cluster/ray_launcher.py): each instance a Ray actor, a process of its
own with its own (fake CPU) devices, on a local Ray cluster; the tiny model.

Greedy outputs do not depend on where a request ran: two colocated actors behind round_robin,
and a prefill actor feeding a decode actor through the transfer_server KV transport, give one
in-process engine's outputs, and so does a tp=2 instance spanning two actors (one
jax.distributed group, as across hosts). An actor killed mid-generation has its requests
recomputed on the other, and every request finishes; a hung one raises after the call timeout.
Skipped when Ray (the `cluster` extra) is not installed or cannot start here.
"""

from __future__ import annotations

import os
import time

import jax
import pytest

from llmjax import LLM
from llmjax.cluster import InstanceSpec, launch
from llmjax.cluster.instance import LocalInstance
from llmjax.engine.engine import InvalidRequest
from llmjax.sampling_params import SamplingParams
from tests.parallel_cases import ENGINE_OPTS, prompts

ray = pytest.importorskip("ray", reason="the Ray launcher needs the `cluster` extra (ray)")

from llmjax.cluster.ray_launcher import RayInstance, UnixClock  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:os.fork\\(\\) was called:RuntimeWarning"  # Ray's subprocesses (fork + exec)
)

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
NUM_PROMPTS = 6
RAY_NICENESS = "RAY_worker_niceness"  # Ray's config variables keep their case


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def ray_session():
    """A fresh local Ray cluster for this module (address='local': never someone else's). Its
    workers run at nice 0, not Ray's default 15: beside this suite's other xdist workers (nice
    0, busy) the actors got ~1/30 of a core and the lockstep test took 93 s instead of 9."""
    saved = os.environ.get(RAY_NICENESS)
    os.environ[RAY_NICENESS] = "0"  # read by the raylet that ray.init starts
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
    finally:
        if saved is None:
            os.environ.pop(RAY_NICENESS, None)
        else:
            os.environ[RAY_NICENESS] = saved
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
    # a quarter CPU per actor (Ray's logical CPUs): the module's instances fit in num_cpus=2
    return dict(
        platform="cpu",
        num_cpus=0.25,
        env_vars=env,
        xla_flags=" ".join(flags),
        call_timeout_s=120,
    )


def _shutdown(cluster):
    for inst in cluster.instances:
        inst.shutdown()


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


def _colocated_outputs(cluster, reference):
    assert isinstance(cluster.clock, UnixClock)
    assert all(isinstance(inst, RayInstance) for inst in cluster.instances)
    info = [inst.process_info()[0] for inst in cluster.instances]
    pids = [i["pid"] for i in info]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # each actor has one fake device (XLA_FLAGS from its runtime_env; this process has 8)
    assert [i["num_devices"] for i in info] == [1, 1]
    # what an actor raises comes back as it was (InvalidRequest does not pickle as such)
    with pytest.raises(InvalidRequest, match="vocab") as e:
        cluster.instances[0].validate_request([10**6], GREEDY)
    assert e.value.param == "prompt"
    t0 = time.time()
    outs = cluster.generate(prompts(NUM_PROMPTS), GREEDY)
    assert _tokens(outs) == reference
    for o in outs:  # stamped by the actors' UnixClock: comparable with the driver's time.time()
        m = o.metrics
        assert t0 - 1 <= m.arrival_time <= m.first_token_time <= m.finished_time <= time.time()
    assert all(s.num_decode_tokens > 0 for s in cluster.stats)  # round_robin used both


def _death(cluster, reference):
    ids = [cluster.add_request(p, GREEDY) for p in prompts(NUM_PROMPTS)]
    on_victim = [rid for rid in ids if cluster.instance_of(rid) == 1]
    assert on_victim
    done = {}
    for _ in range(3):  # mid-generation: some tokens out, none finished
        for o in cluster.step():
            if o.finished:
                done[o.request_id] = o
    assert not done
    ray.kill(cluster.instances[1].actors[0])
    t0 = time.perf_counter()
    while cluster.has_unfinished_requests():
        for o in cluster.step():
            if o.finished:
                done[o.request_id] = o
        assert time.perf_counter() - t0 < 60
    assert cluster.alive == [True, False]
    # a dead instance still describes itself and reports its last stats
    assert [d["alive"] for d in cluster.describe()] == [True, False]
    assert cluster.stats[1].num_decode_tokens > 0
    assert cluster.transfer_stats.num_recomputed == len(on_victim)
    outs = [done[rid] for rid in ids]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    assert _tokens(outs) == reference


def _hanging_actor_raises_after_the_call_timeout():
    from llmjax.cluster.ray_launcher import _Group

    class _Stuck:  # local: Ray pickles it by value (the workers cannot import this module)
        """An actor whose every call hangs (an instance stuck in a step)."""

        def call(self, method, args=(), kwargs=None):
            time.sleep(60)

    actor = ray.remote(_Stuck).options(num_cpus=0).remote()
    info = dict(role="colocated", config=None, tokenizer=None, describe={}, stats=None)
    inst = RayInstance([actor], info, "stuck", _Group([]), call_timeout_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(ray.exceptions.GetTimeoutError):
        inst.step_end(inst.step_begin())
    assert time.perf_counter() - t0 < 10
    inst.shutdown()  # kills it (its calls time out too)
    with pytest.raises(RuntimeError, match="shut down"):
        inst.load()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.call.remote("load"), timeout=30)


def test_colocated_actors_give_one_engines_outputs_and_survive_failures(ray_session, reference):
    """Two colocated actors behind round_robin give one engine's outputs; then one is killed
    mid-generation (ray.kill): the cluster recomputes its requests on the other and every request
    finishes. An actor that hangs makes its handle raise after `call_timeout_s`."""
    cluster = launch(
        "tiny",
        InstanceSpec.parse("2xcolocated"),
        launcher="ray",
        router="round_robin",
        ray_options=_ray_options(),
        **ENGINE_OPTS,
    )
    try:
        _colocated_outputs(cluster, reference)
        _death(cluster, reference)
    finally:
        _shutdown(cluster)
    _hanging_actor_raises_after_the_call_timeout()
    # an actor that fails to start: its error as it was, and nothing left behind
    with pytest.raises(TypeError, match="no_such_option"):
        launch(
            "tiny",
            [InstanceSpec()],
            launcher="ray",
            ray_options=_ray_options(),
            no_such_option=1,
            **ENGINE_OPTS,
        )
    groups = ray.util.placement_group_table().values()
    assert {g["state"] for g in groups} == {"REMOVED"}


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


def test_an_instance_spanning_two_processes_runs_in_lockstep(ray_session, reference):
    """hosts=2: a tp=2 instance over two actors (one device each) in one jax.distributed group
    (gloo), every engine call sent to both; on one node here (PACK instead of STRICT_SPREAD).
    Its outputs are one device's (tp=2 equals one device: tests/test_parallel.py)."""
    cluster = launch(
        "tiny",
        [InstanceSpec("colocated", tp=2, options=dict(check_lockstep=True))],
        launcher="ray",
        ray_options=dict(_ray_options(), hosts=2, host_strategy="PACK"),
        **ENGINE_OPTS,
    )
    try:
        (inst,) = cluster.instances
        info = inst.process_info()
        assert [(i["process_index"], i["process_count"]) for i in info] == [(0, 2), (1, 2)]
        assert [(len(i["local_devices"]), i["num_devices"]) for i in info] == [(1, 2), (1, 2)]
        outs = cluster.generate(prompts(NUM_PROMPTS), GREEDY)
        assert _tokens(outs) == reference
    finally:
        _shutdown(cluster)

"""One cluster core, two drivers (issue 40): the same cluster built both ways makes the same
decisions, as the engine's same-code-path test (tests/test_sim.py) does for one engine.

The real cluster (`Cluster` over `LocalInstance`s of the tiny model on fake CPU devices, the KV
moved by the local transport) runs on a virtual clock that each `step()` advances by the wall
time that step took (every busy instance steps once per `step()`, so that is the recorded step
time of each instance that ran in it). The simulated cluster (`SimCluster` over simulated engines
of the same configs) is then driven by those recorded times (`RecordedCostModel`, one list per
instance) with the same arrivals and instant transfers. Every routing and every migration
decision must be the same: which instance, from the same view of the candidates (outstanding,
waiting and running requests, free pages), in the same order, and each request's path.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest

import configs
from llmjax.cluster import Cluster, LocalInstance
from llmjax.cluster.router import make_router
from llmjax.cluster.transfer import LocalTransport
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.clock import VirtualClock
from llmjax.engine.engine import LLMEngine
from llmjax.model.params import init_params
from llmjax.sampling_params import SamplingParams
from llmjax.sim import RecordedCostModel, SimCluster, SimConfig


class Recording:
    """A router that logs each decision with what it saw of the candidates."""

    def __init__(self, name: str, log: list, tag: str):
        self.inner, self.log, self.tag = make_router(name), log, tag

    def route(self, request, instances, now):
        k = self.inner.route(request, instances, now)
        seen = tuple(
            (v.num_outstanding, v.num_waiting, v.num_running, v.num_free_pages) for v in instances
        )
        self.log.append((self.tag, request.request_id, int(k), seen))
        return k


def _config(num_pages: int) -> EngineConfig:
    return EngineConfig(
        model=configs.get_preset("tiny"),
        cache=CacheConfig(page_size=4, num_pages=num_pages, prefix_cache="radix"),
        scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=32, max_num_seqs=4),
        max_model_len=128,
        attention_backend="reference",
        compilation_cache_dir="",
    )


def _workload(rng, vocab: int, n: int):
    """(round, request id, prompt ids, params): a few arrivals per round, some sharing a
    prefix, mixed prompt and output lengths."""
    shared = [int(t) for t in rng.integers(1, vocab, 12)]
    out, r = [], 0
    for i in range(n):
        r += int(rng.choice([0, 0, 1, 2]))
        own = [int(t) for t in rng.integers(1, vocab, int(rng.integers(3, 30)))]
        prompt = (shared + own) if rng.random() < 0.4 else own
        params = SamplingParams(max_tokens=int(rng.integers(2, 12)), ignore_eos=True)
        out.append((r, f"r{i}", prompt, params))
    return out


def _real(roles, pages, workload, router, log):
    """The real cluster on a virtual clock: per instance, the recorded time of each step it ran,
    and the arrival time of each request."""
    model = configs.get_preset("tiny")
    params = init_params(model, jax.random.key(0))
    clock, transport, devs = VirtualClock(), LocalTransport(), jax.devices()
    engines = [
        LLMEngine(_config(n), params, n, role=role, devices=[devs[i]], clock=clock)
        for i, (role, n) in enumerate(zip(roles, pages, strict=True))
    ]
    ran: list[int] = []
    for i, e in enumerate(engines):  # note which instances launch a step in each round

        def launch(*args, _i=i, _launch=e.runner.launch):
            ran.append(_i)
            return _launch(*args)

        e.runner.launch = launch
    instances = [LocalInstance(e, transport) for e in engines]
    paths: dict[str, list[int]] = {}
    for i, inst in enumerate(instances):  # each request's path: its entry, then where it moves

        def begin_import(m, *args, _i=i, _begin=inst.begin_import):
            paths[m.request_id].append(_i)
            return _begin(m, *args)

        inst.begin_import = begin_import
    cluster = Cluster(
        instances,
        Recording(router, log, "route"),
        decode_router=Recording("least_outstanding", log, "pull"),
        clock=clock,
    )
    times: list[list[float]] = [[] for _ in roles]
    arrivals, rnd, pending = {}, 0, list(workload)
    while pending or cluster.has_unfinished_requests():
        while pending and pending[0][0] <= rnd:
            _, rid, prompt, p = pending.pop(0)
            cluster.add_request(prompt, p, request_id=rid, arrival_time=clock.now())
            arrivals[rid] = clock.now()
            paths[rid] = [cluster.instance_of(rid)]
        ran.clear()
        t0 = time.perf_counter()
        for out in cluster.step():
            assert out.error is None, out.error
        dt = time.perf_counter() - t0
        for i in ran:
            times[i].append(dt)
        clock.advance(dt)
        rnd += 1
        assert rnd < 500, "the real cluster does not finish"
    return times, arrivals, paths, cluster.transfer_stats.num_transfers


def _sim(roles, pages, workload, router, log, times, arrivals):
    engines = []
    for role, n, recorded in zip(roles, pages, times, strict=True):
        config = dataclasses.replace(
            _config(n), device="sim", sim=SimConfig(RecordedCostModel(recorded))
        )
        engines.append(LLMEngine(config, None, n, role=role))
    cluster = SimCluster(
        engines,
        Recording(router, log, "route"),
        decode_router=Recording("least_outstanding", log, "pull"),
        transfer_bandwidth=1e30,
        transfer_latency_s=0.0,
    )
    for _, rid, prompt, p in workload:
        cluster.add_request(prompt, p, request_id=rid, arrival_time=arrivals[rid])
    while cluster.has_unfinished_requests():
        for out in cluster.step():
            assert out.error is None, out.error
    return {rid: list(cluster.path_of(rid)) for _, rid, _, _ in workload}, cluster.transfer_stats


@pytest.mark.parametrize(
    "roles,pages,router",
    [
        (("prefill", "prefill", "decode", "decode"), (48, 48, 20, 24), "least_outstanding"),
        (("colocated", "colocated", "colocated"), (20, 24, 32), "cache_aware"),
    ],
    ids=["disaggregated", "colocated"],
)
def test_real_and_simulated_clusters_decide_alike(roles, pages, router):
    rng = np.random.default_rng(7)
    workload = _workload(rng, configs.get_preset("tiny").vocab_size, 14)
    real_log, sim_log = [], []
    times, arrivals, real_paths, moved = _real(roles, pages, workload, router, real_log)
    sim_paths, sim_transfers = _sim(roles, pages, workload, router, sim_log, times, arrivals)
    routes = [e for e in real_log if e[0] == "route"]
    assert len(routes) == len(workload)
    if "decode" in roles:
        assert moved == len(workload) and sim_transfers.num_transfers == moved
        pulls = [e for e in real_log if e[0] == "pull"]
        assert len({e[2] for e in pulls}) == 2, "both decode instances should be picked"
    assert len({e[2] for e in routes}) > 1, "the router should spread the arrivals"
    for k, (real, sim) in enumerate(zip(real_log, sim_log, strict=False)):
        assert real == sim, f"decision {k} differs: real {real}, simulated {sim}"
    assert len(real_log) == len(sim_log)
    assert real_paths == sim_paths

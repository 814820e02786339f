"""Property tests of DistServe's migration protocol (llmjax/cluster/cluster.py), with a fake model.

Hypothesis draws a cluster of prefill and decode instances (small KV caches, so that decode
instances refuse pulls and preempt), requests arriving at random steps, aborts in every state
(queued or prefilling on a prefill instance, parked there, in transfer, decoding), KV transfers
that are slow, fail or time out, and instance deaths. Each instance is a real `LLMEngine` whose
runner is `FakePagedModel` (tests/fake_model.py: the next token is a hash of the request's tokens
*as read back through its page table*), extended with page export and import, so a KV page that
moves wrong, is read before it arrives, or is freed too early changes the request's output.
Freed pages are poisoned after every step.

After every step: on every live instance `BlockManager.check_invariants()` and the pages are
owned by exactly the running, parked and receiving requests; every request the cluster tracks is
live on the instance it names (and, while moving, parked on its source). At the end every
request ended exactly once: finished with the output recomputed from its prompt alone, aborted
(iff the test aborted it), or failed with a reason (a transfer failure under the 'fail' policy,
or no instance of the kind left); no page is held on any live instance and no offer is alive.
No jax.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from configs.tiny import TINY
from llmjax.cluster.cluster import Cluster
from llmjax.cluster.instance import LocalInstance
from llmjax.cluster.transfer import LocalTransport, TransferError
from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from tests.fake_model import FakeRunner, reference_generation

VOCAB = 64
MODEL = TINY.replace(vocab_size=VOCAB, eos_token_ids=(1,))


class FlakyTransport(LocalTransport):
    """The local transport with a pull that takes `delay` polls, and fails or never arrives
    (its deadline then fails it) as the draw says."""

    def __init__(self, draws):
        super().__init__()
        self._draws = draws  # iterator of (delay, outcome) per pull

    def pull(self, offer, runner, deadline):
        delay, outcome = next(self._draws, (0, "ok"))
        return {"offer": offer, "runner": runner, "left": delay, "outcome": outcome}

    def poll(self, handle):
        if handle["outcome"] == "never":
            return None
        if handle["left"] > 0:
            handle["left"] -= 1
            return None
        if handle["outcome"] == "fail":
            raise TransferError("injected transfer failure")
        return super().poll(super().pull(handle["offer"], handle["runner"], 0.0))


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int
    ignore_eos: bool


@dataclasses.dataclass
class Scenario:
    roles: list[str]
    num_pages: list[int]
    page_size: int
    max_model_len: int
    budget: int
    prefix_cache: str
    policy: str
    requests: list[Spec]
    aborts: list[tuple[int, int]]  # (step, request index)
    kills: list[tuple[int, int]]  # (step, instance index)
    transfers: list[tuple[int, str]]  # per pull: (delay in polls, ok | fail | never)
    on_failure: str

    def config(self, num_pages: int) -> EngineConfig:
        return EngineConfig(
            model=MODEL,
            cache=CacheConfig(
                page_size=self.page_size, num_pages=num_pages, prefix_cache=self.prefix_cache
            ),
            scheduler=SchedulerConfig(
                policy=self.policy,
                # whole-prompt policies need room for any prompt
                max_num_batched_tokens=self.budget
                if self.policy == "sarathi"
                else max(self.budget, self.max_model_len),
                max_num_seqs=4,
            ),
            max_model_len=self.max_model_len,
            compilation_cache_dir="",
        )


@st.composite
def scenarios(draw):
    n_prefill = draw(st.integers(1, 2))
    n_decode = draw(st.integers(1, 2))
    roles = ["prefill"] * n_prefill + ["decode"] * n_decode
    page_size = draw(st.sampled_from([2, 4]))
    max_model_len = 40
    full = max_model_len // page_size + 1  # one request alone always fits
    num_pages = [draw(st.integers(full, 2 * full)) for _ in roles]
    shared = draw(st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=12))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        tail = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=20))
        prompt = tuple((shared if draw(st.booleans()) else []) + tail)[: max_model_len - 12]
        requests.append(
            Spec(prompt, draw(st.integers(1, 16)), draw(st.integers(0, 12)), draw(st.booleans()))
        )
    aborts = draw(
        st.lists(st.tuples(st.integers(0, 30), st.integers(0, len(requests) - 1)), max_size=3)
    )
    kills = []
    if draw(st.integers(0, 3)) == 0:  # a quarter of the runs lose an instance
        kills.append((draw(st.integers(0, 25)), draw(st.integers(0, len(roles) - 1))))
    transfers = draw(
        st.lists(
            st.tuples(
                st.integers(0, 3), st.sampled_from(["ok", "ok", "ok", "ok", "fail", "never"])
            ),
            max_size=12,
        )
    )
    return Scenario(
        roles=roles,
        num_pages=num_pages,
        page_size=page_size,
        max_model_len=max_model_len,
        budget=draw(st.sampled_from([8, 16, 64])),
        prefix_cache=draw(st.sampled_from(["none", "radix"])),
        policy=draw(st.sampled_from(["sarathi", "prefill_first"])),
        requests=requests,
        aborts=aborts,
        kills=kills,
        transfers=transfers,
        on_failure=draw(st.sampled_from(["recompute", "fail"])),
    )


@pytest.fixture
def fake_runner(monkeypatch):
    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = FakeRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)


class StepClock:
    """Transfer deadlines in steps: the test advances it once per cluster step."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def build(sc: Scenario):
    transport = FlakyTransport(iter(sc.transfers))
    clock = StepClock()
    instances = [
        LocalInstance(
            LLMEngine(sc.config(n), params=None, num_pages=n, role=role),
            transport,
            f"{role}{i}",
            time_fn=clock,
        )
        for i, (role, n) in enumerate(zip(sc.roles, sc.num_pages, strict=True))
    ]
    # a pull that has not arrived 5 steps after it started fails by its deadline
    cluster = Cluster(
        instances, "round_robin", on_transfer_failure=sc.on_failure, transfer_timeout_s=5.0
    )
    cluster.step_clock = clock
    return cluster, instances, transport


def check_state(cluster: Cluster, instances) -> None:
    for i, inst in enumerate(instances):
        if not cluster.alive[i]:
            continue
        e = inst.engine
        bm = e.block_manager
        bm.check_invariants()
        holders = {r.request_id for r in e.scheduler.running} | set(e.parked) | set(e._receiving)
        assert set(bm.page_tables) == holders, (set(bm.page_tables), holders)
        inst.engine.runner.model.poison(list(bm._free))  # a read of a freed page is caught
    for rid, rec in cluster._records.items():
        e = instances[rec.instance].engine
        queued = {r.request_id for r in e.scheduler.waiting} | {
            r.request_id for r in e.scheduler.running
        }
        live = queued | set(e.parked) | set(e._receiving) | {r.request_id for r in e._rejected}
        assert rid in live, f"request {rid} is not on instance {rec.instance}"
        if rec.source is not None and cluster.alive[rec.source]:
            assert rid in instances[rec.source].engine.parked, f"{rid} left its source early"


def run(sc: Scenario):
    cluster, instances, transport = build(sc)
    order = sorted(range(len(sc.requests)), key=lambda i: sc.requests[i].arrival)
    outputs, aborted = {}, set()
    for step in range(400):
        for i in order:
            spec = sc.requests[i]
            if spec.arrival == step:
                params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
                cluster.add_request(list(spec.prompt), params, request_id=str(i))
        for t, i in sc.aborts:
            if t == step and cluster.abort_request(str(i)):
                aborted.add(str(i))
        for t, k in sc.kills:
            if t == step and sum(cluster.alive[j] for j in cluster._alive_with(("prefill",))) > (
                sc.roles[k] == "prefill"
            ):
                cluster.kill(k)
        cluster.step_clock.t += 1
        for out in cluster.step():
            assert out.request_id not in outputs, f"output after {out.request_id} ended"
            if out.finished:
                outputs[out.request_id] = out
        check_state(cluster, instances)
        if step > max(s.arrival for s in sc.requests) and not cluster.has_unfinished_requests():
            break
    else:
        raise AssertionError("the cluster did not drain in 400 steps (a livelock)")
    return cluster, instances, transport, outputs, aborted


SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@SETTINGS
@given(sc=scenarios())
def test_migration_protocol_keeps_invariants_and_outputs(fake_runner, sc):
    cluster, instances, transport, outputs, aborted = run(sc)
    st_ = cluster.transfer_stats
    event(f"transfers: {min(st_.num_transfers, 5)}+")
    event(f"transfer failures: {min(st_.num_failures, 2)}+")
    event(f"recomputed: {min(st_.num_recomputed, 2)}+")
    event(f"aborted: {min(len(aborted), 2)}+")
    event(f"killed: {not all(cluster.alive)}")
    event(f"preemptions: {sum(s.num_preemptions for s in cluster.stats) > 0}")
    event(f"failed: {sum(o.finish_reason == 'error' for o in outputs.values()) > 0}")
    for i, spec in enumerate(sc.requests):
        rid = str(i)
        if rid in aborted:
            assert rid not in outputs or not outputs[rid].finish_reason
            continue
        out = outputs[rid]
        if out.finish_reason == "error":
            assert out.error, f"request {rid} failed without a reason"
            assert "KV transfer failed" in out.error or "no live" in out.error, out.error
            continue
        tokens, reason = reference_generation(
            spec.prompt,
            max_tokens=spec.max_tokens,
            max_model_len=sc.max_model_len,
            vocab_size=VOCAB,
            eos_token_ids=MODEL.eos_token_ids,
            ignore_eos=spec.ignore_eos,
        )
        assert (out.token_ids, out.finish_reason) == (tokens, reason), f"request {rid}"
    assert set(outputs) | aborted == {str(i) for i in range(len(sc.requests))}
    for i, inst in enumerate(instances):
        if cluster.alive[i]:
            e = inst.engine
            assert not e.parked and not e._receiving and not e.block_manager.page_tables
            assert e.block_manager.num_used_pages == 0
    assert transport.num_offers == 0, "an offer outlived its request"


def test_a_small_decode_cache_keeps_requests_parked_on_the_prefill_side(fake_runner):
    """DistServe's pull condition: the decode instance takes a request only when it fits, so the
    others wait on the prefill side with their KV held (and no request is lost)."""
    sc = Scenario(
        roles=["prefill", "decode"],
        num_pages=[64, 12],  # 11 usable pages of 4 tokens on the decode side
        page_size=4,
        max_model_len=40,
        budget=64,
        prefix_cache="none",
        policy="sarathi",
        requests=[Spec(tuple(range(2, 30)), 8, 0, True) for _ in range(4)],
        aborts=[],
        kills=[],
        transfers=[],
        on_failure="recompute",
    )
    cluster, instances, _ = build(sc)
    for spec in sc.requests:
        cluster.add_request(list(spec.prompt), SamplingParams(max_tokens=8, ignore_eos=True))
    max_parked = 0
    done = {}
    for _ in range(200):
        for out in cluster.step():
            if out.finished:
                done[out.request_id] = out
        check_state(cluster, instances)
        max_parked = max(max_parked, len(instances[0].engine.parked))
        if not cluster.has_unfinished_requests():
            break
    assert len(done) == 4 and max_parked >= 2
    expected = reference_generation(
        sc.requests[0].prompt, max_tokens=8, max_model_len=40, vocab_size=VOCAB, ignore_eos=True
    )[0]
    assert all(o.token_ids == expected for o in done.values())
    assert instances[1].engine.stats.num_prefill_tokens == 0  # only decodes ran there
    assert instances[0].engine.stats.num_decode_tokens == 0


def test_a_prefill_instance_dying_mid_transfer_makes_the_decode_side_recompute(fake_runner):
    sc = Scenario(
        roles=["prefill", "prefill", "decode"],
        num_pages=[64, 64, 64],
        page_size=4,
        max_model_len=40,
        budget=64,
        prefix_cache="radix",
        policy="sarathi",
        requests=[Spec(tuple(range(2 + i, 20 + i)), 6, 0, True) for i in range(4)],
        aborts=[],
        kills=[],
        transfers=[(5, "ok")] * 4,  # each pull takes 5 polls
        on_failure="recompute",
    )
    cluster, instances, transport = build(sc)
    for spec in sc.requests:
        cluster.add_request(list(spec.prompt), SamplingParams(max_tokens=6, ignore_eos=True))
    done = {}
    killed = False
    for _ in range(200):
        for out in cluster.step():
            if out.finished:
                done[out.request_id] = out
        if not killed and instances[2].engine._receiving:
            moving = [r for r in cluster._records.values() if r.source == 0]
            if moving:
                cluster.kill(0)  # prefill 0 dies with its KV still to be pulled
                killed = True
        check_state(cluster, instances)
        if not cluster.has_unfinished_requests():
            break
    assert killed and len(done) == 4
    assert cluster.transfer_stats.num_failures >= 1
    assert cluster.transfer_stats.num_recomputed >= 1
    for rid, out in done.items():
        spec = sc.requests[int(rid)]
        expected = reference_generation(
            spec.prompt, max_tokens=6, max_model_len=40, vocab_size=VOCAB, ignore_eos=True
        )[0]
        assert out.token_ids == expected, rid
    assert transport.num_offers == 0

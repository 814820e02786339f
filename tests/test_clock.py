"""The engine's clock (llmjax/engine/clock.py): request metrics, the device's step seconds and
the trace replayer read it, so an engine on a `VirtualClock` reports simulated time."""

from __future__ import annotations

import sys
import time
import types

import pytest

from llmjax.engine.clock import WALL_CLOCK, VirtualClock
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from tests.fake_model import FakeRunner
from tests.test_scheduler_properties import _workload

STEP_S = 0.25  # every modeled step


def test_virtual_clock_moves_only_forward():
    c = VirtualClock(5.0)
    assert c.now() == 5.0 and c.advance(0.5) == 5.5
    assert c.advance_to(3.0) == 5.5  # never back
    assert c.advance_to(7.0) == 7.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            c.advance(bad)
    with pytest.raises(ValueError):
        c.advance_to(float("nan"))
    a = WALL_CLOCK.now()
    assert WALL_CLOCK.now() >= a


def _engine(monkeypatch, clock):
    class TimedRunner(FakeRunner):
        """The fake model, each step taking STEP_S on the virtual clock."""

        def run(self, step, sampling):
            clock.advance(STEP_S)
            return super().run(step, sampling)

    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = TimedRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)
    sc = _workload("sarathi", num_pages=64, max_model_len=64)
    return LLMEngine(sc.config(), params=None, num_pages=sc.num_pages, clock=clock)


def test_metrics_and_step_seconds_are_on_the_engine_clock(monkeypatch):
    clock = VirtualClock(100.0)
    engine = _engine(monkeypatch, clock)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([3, 4, 5], params, request_id="a")  # arrives at 100
    clock.advance(1.0)
    engine.add_request([6, 7], params, request_id="b")  # at 101, while nothing runs
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    a, b = outs["a"].metrics, outs["b"].metrics
    assert a.arrival_time == 100.0 and b.arrival_time == 101.0
    # both prefill in the first step (scheduled at 101, done at 101.25), then one token a step
    assert a.first_scheduled_time == b.first_scheduled_time == 101.0
    assert a.first_token_time == b.first_token_time == 101.0 + STEP_S
    assert a.token_times == pytest.approx([101.0 + STEP_S * k for k in range(1, 5)])
    assert a.finished_time == pytest.approx(101.0 + 4 * STEP_S)
    assert a.ttft == pytest.approx(1.0 + STEP_S) and b.ttft == pytest.approx(STEP_S)
    assert engine.stats.device_time_s == pytest.approx(4 * STEP_S)  # modeled, not wall time


def test_replay_on_a_virtual_clock_advances_instead_of_sleeping(monkeypatch):
    from llmjax.bench.replay import replay
    from llmjax.bench.workloads import RequestSpec

    clock = VirtualClock()
    engine = _engine(monkeypatch, clock)
    specs = [
        RequestSpec(0.0, 2, prompt_token_ids=(3, 4, 5)),
        RequestSpec(3600.0, 2, prompt_token_ids=(6, 7)),
    ]
    t = time.perf_counter()
    first, late = replay(engine, specs, realtime=True)
    assert time.perf_counter() - t < 30  # an hour of simulated idle time, not slept
    assert first.metrics.arrival_time == 0.0 and late.metrics.arrival_time == 3600.0
    assert late.metrics.first_token_time == pytest.approx(3600.0 + STEP_S)
    assert first.metrics.finished_time == pytest.approx(2 * STEP_S)

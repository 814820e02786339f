"""DistServe's goodput search (llmjax/bench/goodput.py)."""

from __future__ import annotations

import types

import pytest

from configs.tiny import TINY
from llmjax.bench import goodput_search, replay, summarize, workloads
from llmjax.config import EngineConfig, SchedulerConfig
from llmjax.engine.engine import LLMEngine
from llmjax.sim import LinearCostModel, SimConfig


def _summary(attainment):
    return types.SimpleNamespace(slo_attainment=attainment)


def test_bisection_finds_the_rate_where_attainment_crosses_the_target():
    # attainment falls linearly with the total rate: 90 % at 2.0 qps
    runs = []

    def run(qps):
        runs.append(qps)
        return _summary(max(0.0, 1.0 - 0.05 * qps))

    r = goodput_search(run, 0.25, 0.1, num_devices=2, esp=0.01)
    assert r.goodput == pytest.approx(2.0, abs=2 * 0.01) and r.goodput <= 2.0
    assert r.goodput_per_device == pytest.approx(r.goodput / 2)
    assert [q for q, _, _ in r.trials] == runs  # per-device rate x devices
    assert runs[0] == pytest.approx(5.0)  # midpoint of [0, 5] per device, x 2
    assert all(ok == (1.0 - 0.05 * q >= 0.9) for q, _, ok in r.trials)
    assert r.as_dict()["goodput"] == r.goodput
    # nothing passes -> 0; everything passes -> just under the bound
    assert goodput_search(lambda q: _summary(0.5), 1, 1).goodput_per_device == 0.0
    top = goodput_search(lambda q: _summary(1.0), 1, 1, esp=0.25)
    assert 5.0 - 0.25 <= top.goodput_per_device < 5.0


def test_goodput_search_errors():
    with pytest.raises(ValueError, match="SLOs"):
        goodput_search(lambda q: _summary(1.0), 0, 1)
    with pytest.raises(ValueError, match="target"):
        goodput_search(lambda q: _summary(1.0), 1, 1, target=1.5)
    with pytest.raises(ValueError, match="slo_ttft and slo_tpot"):
        goodput_search(lambda q: _summary(None), 1, 1)


def test_goodput_of_a_simulated_engine_falls_as_the_slo_tightens():
    # 10 ms a step + 0.5 ms a token: a fixed machine whose attainment falls with load
    config = EngineConfig(
        model=TINY,
        max_model_len=256,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device="sim",
        sim=SimConfig(cost_model=LinearCostModel((0.01, 5e-4))),
    )

    def goodput(slo_ttft):
        def run(qps):
            engine = LLMEngine(config, None, 256)
            specs = workloads.fixed(32, prompt_len=48, output_len=16, qps=qps, seed=0)
            return summarize(replay(engine, specs), slo_ttft=slo_ttft, slo_tpot=0.05)

        return goodput_search(run, slo_ttft, 0.05, max_per_device_rate=40, esp=0.5)

    loose, tight = goodput(0.5), goodput(0.05)
    assert loose.goodput > tight.goodput > 0
    for _, s, ok in loose.trials:
        assert ok == (s.slo_attainment >= 0.9)

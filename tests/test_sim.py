"""The simulated device (llmjax/sim/): the engine's own scheduler on a virtual clock."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from llmjax.config import EngineConfig
from llmjax.engine.clock import VirtualClock
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, RecordedCostModel, SimConfig, SimRunner, StepFeatures
from llmjax.sim.cost import FEATURES
from llmjax.sim.roofline import kv_page_bytes_per_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workload(seed=0, n=10):
    """Prompts sharing prefixes (cache hits) and long enough to preempt in a small cache."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, 12).tolist()
    prompts = [
        (system if i % 2 else []) + rng.integers(3, 250, int(rng.integers(3, 30))).tolist()
        for i in range(n)
    ]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 24)), ignore_eos=True) for _ in prompts]
    return prompts, params


def _run(engine, prompts, params):
    """Add everything at once, step to the end; -> (per step: the scheduled (request, start,
    new tokens), per request: cached prompt tokens and preemptions)."""
    decisions = []
    schedule = engine.scheduler.schedule

    def logged():
        batch = schedule()
        decisions.append([(s.request.request_id, s.start, s.num_new_tokens) for s in batch.seqs])
        return batch

    engine.scheduler.schedule = logged
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(p, sp, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    per_request = {rid: (o.num_cached_tokens, len(o.token_ids)) for rid, o in finished.items()}
    return decisions, per_request, engine.stats.num_preemptions


def test_simulated_engine_makes_the_real_engines_decisions_step_by_step():
    """The tiny model on the CPU, then the same config on the simulated device driven by the
    real run's step times: the same batches, preemptions and prefix-cache hits at every step."""
    from llmjax import LLM

    llm = LLM("tiny", load_format="dummy", page_size=4, max_num_batched_tokens=32,
              max_num_seqs=4, max_model_len=64, num_pages=24, compilation_cache_dir="")  # fmt: skip
    prompts, params = _workload()
    times, clock0 = [], []
    runner = llm.engine.runner
    launch, collect = runner.launch, runner.collect

    def timed_launch(*args):
        clock0.append(llm.engine.clock.now())
        return launch(*args)

    def timed_collect(launched):
        out = collect(launched)
        times.append(llm.engine.clock.now() - clock0.pop())
        return out

    runner.launch, runner.collect = timed_launch, timed_collect
    real = _run(llm.engine, prompts, params)
    assert real[2] > 0, "the workload should preempt"
    assert any(cached for cached, _ in real[1].values()), "and hit the prefix cache"

    config = dataclasses.replace(
        llm.engine.config, device="sim", sim=SimConfig(RecordedCostModel(times))
    )
    engine = LLMEngine(config, params=None, num_pages=24)
    assert isinstance(engine.runner, SimRunner) and isinstance(engine.clock, VirtualClock)
    sim = _run(engine, prompts, params)
    assert sim == real
    assert engine.clock.now() == pytest.approx(sum(times))  # the real run's device time


def _random_steps(rng, n):
    """Steps packed as `pack` pads them: T tokens up to a power of two, S >= the sequences."""
    from llmjax.model.step_input import StepInput

    steps = []
    for _ in range(n):
        num = int(rng.integers(1, 9))
        q = rng.integers(1, 3, num) * rng.choice([1, 1, 17], num)  # decodes and prefill chunks
        kv = q + rng.integers(0, 300, num)
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        T = 1 << int(cu[-1] - 1).bit_length()
        S = num + int(rng.integers(0, 4))
        cu = np.concatenate([cu, np.full(S - num, cu[-1])]).astype(np.int32)
        kv = np.concatenate([kv, np.zeros(S - num)]).astype(np.int32)
        steps.append(
            StepInput(
                np.zeros(T, np.int32),
                np.zeros(T, np.int32),
                np.zeros(T, np.int32),
                cu,
                kv,
                np.zeros((S, 1), np.int32),
                np.array([num], np.int32),
                np.maximum(cu[1:] - 1, 0),
            )
        )
    return steps


def test_features_and_a_least_squares_fit_recover_a_linear_cost():
    rng = np.random.default_rng(0)
    steps = _random_steps(rng, 600)
    f = StepFeatures.from_step(steps[0])
    num = int(steps[0].num_seqs[0])
    q = np.diff(steps[0].cu_q_lens)[:num]
    kv = steps[0].kv_lens[:num]
    assert f.tokens == q.sum() and f.decodes == (q == 1).sum()
    assert f.prefill_attention == (q * kv)[q > 1].sum() and f.decode_context == kv[q == 1].sum()
    assert (f.padded_tokens, f.padded_seqs) == (len(steps[0].token_ids), len(steps[0].kv_lens))
    true = LinearCostModel((2e-3, 1e-5, 2e-8, 4e-5, 1e-7, 3e-6, 5e-5))
    feats = [StepFeatures.from_step(s) for s in steps]
    noisy = [true.step_seconds(x) * (1 + 0.01 * rng.standard_normal()) for x in feats]
    fitted = LinearCostModel.fit(feats[:500], noisy[:500])
    held_out = [true.step_seconds(x) for x in feats[500:]]
    assert fitted.relative_error(feats[500:], held_out) < 0.02
    np.testing.assert_allclose(fitted.coefficients, true.coefficients, rtol=0.1)
    with pytest.raises(ValueError, match="features"):
        LinearCostModel((1.0,) * (len(FEATURES) + 1))
    # fewer coefficients are the first features' (the padded-shape terms 0)
    assert LinearCostModel((1.0, 2.0)).coefficients == (1.0, 2.0) + (0.0,) * (len(FEATURES) - 2)
    with pytest.raises(ValueError, match="feature rows"):
        LinearCostModel.fit(feats[:3], [1.0])
    assert len(FEATURES) == len(true.coefficients)


def test_sim_runner_tokens_clock_and_config_checks():
    from configs.tiny import TINY

    model = dataclasses.replace(TINY, eos_token_ids=(5, 7))
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(model=model, device="sim")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model=model, device="gpu")
    with pytest.raises(ValueError, match="step_seconds"):
        SimConfig(cost_model=3)
    cost = LinearCostModel((0.5, 0.01, 0.0, 0.0, 0.0))
    config = EngineConfig(model=model, device="sim", sim=SimConfig(cost))
    engine = LLMEngine(config, params=None, num_pages=64)
    a = engine.add_request([9, 10, 11], SamplingParams(max_tokens=6), request_id="a")
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = [o for o in outs if o.request_id == a]
    assert len(out.token_ids) == 6 and not set(out.token_ids) & {5, 7}  # never an EOS id
    assert all(0 <= t < model.vocab_size for t in out.token_ids)
    # 1 prefill step of 3 tokens, then 5 decode steps of 1: 0.5 + 0.01 tokens each
    assert engine.clock.now() == pytest.approx(6 * 0.5 + 0.01 * (3 + 5))
    assert out.metrics.ttft == pytest.approx(0.53)
    again = LLMEngine(config, params=None, num_pages=64)
    again.add_request([9, 10, 11], SamplingParams(max_tokens=6), request_id="b")
    while again.has_unfinished_requests():
        outs2 = again.step()
    assert outs2[0].token_ids == out.token_ids  # deterministic per prompt
    from llmjax.config import SparseKVConfig

    with pytest.raises(ValueError, match="sparse_kv"):
        SimRunner(
            dataclasses.replace(config, sparse_kv=SparseKVConfig(mode="offload")),
            64,
            VirtualClock(),
        )
    with pytest.raises(ValueError, match="VirtualClock"):
        from llmjax.engine.clock import WALL_CLOCK

        SimRunner(config, 64, WALL_CLOCK)


def test_kv_page_bytes_is_the_real_layout():
    from configs.tiny import TINY
    from llmjax.model.kv_cache import kv_cache_bytes

    for dtype in ("float32", "bfloat16"):
        assert kv_page_bytes_per_device(TINY, 16, dtype, 1, 1) == kv_cache_bytes(TINY, 1, 16, dtype)


def test_a_simulated_engine_imports_no_jax():
    code = (
        "import sys\n"
        "from configs.tiny import TINY\n"
        "from llmjax.config import EngineConfig\n"
        "from llmjax.engine.engine import LLMEngine\n"
        "from llmjax.sim import LinearCostModel, SimConfig\n"
        "cost = LinearCostModel((1e-3, 1e-5, 0, 0, 0))\n"
        "e = LLMEngine(EngineConfig(model=TINY, device='sim', sim=SimConfig(cost)), None, 32)\n"
        "e.add_request([3, 4], request_id='x')\n"
        "while e.has_unfinished_requests(): e.step()\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_fit_never_predicts_less_than_the_fastest_measured_step():
    rng = np.random.default_rng(1)
    feats = [StepFeatures.from_step(s) for s in _random_steps(rng, 40)]
    seconds = [0.01 + 1e-4 * f.tokens for f in feats]
    fitted = LinearCostModel.fit(feats, seconds)
    assert fitted.min_seconds == min(seconds)
    empty = StepFeatures(tokens=0, prefill_attention=0, decodes=0, decode_context=0)
    assert fitted.step_seconds(empty) >= min(seconds)

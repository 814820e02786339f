"""The analytic cost model, the hardware and model presets, tp / pp on the simulated device."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import numpy as np
import pytest

import configs
from llmjax.config import EngineConfig, ParallelConfig, SchedulerConfig
from llmjax.engine.clock import VirtualClock
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import HARDWARE, RooflineCostModel, SimConfig, SimRunner, StepFeatures
from llmjax.sim.hardware import cpu_from_profile, get_hardware
from llmjax.sim.roofline import model_weight_elements, weight_bytes_per_device
from llmjax.sim.runner import sim_num_pages

ROOT = __file__.rsplit("/tests/", 1)[0]

# Parameter counts as published (HF model cards / config sums, with norms and biases, which the
# model leaves out: < 0.5 %).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "mistral-7b-instruct-v0.2": 7_241_732_096,
    "yi-34b": 34_388_917_248,
    "opt-13b": 12_853_473_280,
    "opt-66b": 65_706_000_000,
    "opt-175b": 175_000_000_000,
    "falcon-180b": 179_500_000_000,
    "qwen3-8b": 8_200_000_000,  # model card: 8.2B
    "qwen3-32b": 32_800_000_000,  # model card: 32.8B
    # The text decoder (the 27.4B checkpoint adds the ~0.4B SigLIP vision encoder).
    "gemma3-27b": 27_000_000_000,
}


def _decode(batch, context):
    return StepFeatures(
        tokens=batch, prefill_attention=0, decodes=batch, decode_context=batch * context, seqs=batch
    )


def _prefill(q, kv):
    return StepFeatures(
        tokens=q,
        prefill_attention=q * kv,
        decodes=0,
        decode_context=0,
        prefill_pairs=q * kv - q * (q - 1) // 2,
        prefill_context=kv,
        seqs=1,
    )


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_model_presets_have_the_published_sizes(name):
    got = model_weight_elements(configs.PRESETS[name])
    assert got == pytest.approx(PUBLISHED_PARAMS[name], rel=0.006)


def test_sim_only_architectures_refuse_the_real_device():
    with pytest.raises(ValueError, match="simulated device only"):
        EngineConfig(model=configs.PRESETS["opt-13b"])
    with pytest.raises(ValueError, match="simulated device only"):
        EngineConfig(model=configs.PRESETS["falcon-180b"], device="jax")
    EngineConfig(model=configs.PRESETS["opt-13b"], device="sim", sim=SimConfig())


def test_decode_is_a_read_of_weights_and_kv_and_prefill_a_matmul_at_peak():
    model = configs.PRESETS["llama2-7b"]
    hw = HARDWARE["a100-80gb"]
    m = RooflineCostModel(model, hw, "bfloat16")
    # batch-1 decode: every projection weight read once (2 bytes each), memory-bound
    layer_weights = model_weight_elements(model) - 2 * model.vocab_size * model.hidden_size
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    read = 2 * layer_weights / bandwidth
    lm_head = 2 * model.vocab_size * model.hidden_size / bandwidth
    t1 = m.step_seconds(_decode(1, 1))
    assert t1 == pytest.approx(read + lm_head + hw.step_overhead_s, rel=0.02)
    # the KV of 32 x 2048 tokens: 2 (K, V) x 32 layers x 4096 x 2 bytes per token
    kv = 32 * 2048 * 2 * 32 * 4096 * 2 / (hw.memory_bandwidth * hw.decode_attention_efficiency)
    t32 = m.step_seconds(_decode(32, 2048))
    assert t32 - m.step_seconds(_decode(32, 1)) == pytest.approx(kv, rel=0.02)
    # a 4096-token prefill: 2 FLOPs per weight per token at the matmul efficiency
    proj = 2 * 4096 * layer_weights / (hw.peak_flops * hw.matmul_efficiency)
    b = m.breakdown(_prefill(4096, 4096))
    assert sum(b[k] for k in ("qkv", "attn_out", "mlp_up", "mlp_down")) == pytest.approx(
        proj, rel=0.01
    )
    # causal attention: 4 x pairs x head_dim x heads FLOPs per layer
    pairs = 4096 * 4096 - 4096 * 4095 // 2
    attn = 32 * 4 * pairs * 128 * 32 / (hw.peak_flops * hw.prefill_attention_efficiency)
    assert b["prefill_attention"] == pytest.approx(attn, rel=0.01)
    # a chunk over a long cached prefix costs more attention, the same projections
    late = m.breakdown(_prefill(512, 8192))
    early = m.breakdown(_prefill(512, 512))
    assert late["prefill_attention"] > 10 * early["prefill_attention"]
    assert late["mlp_up"] == early["mlp_up"]


def test_tensor_parallel_splits_the_work_and_adds_all_reduces():
    model = configs.PRESETS["llama2-70b"]
    one = RooflineCostModel(model, "a100-80gb", tp=1)
    two = RooflineCostModel(model, "a100-80gb", tp=2)
    four = RooflineCostModel(model, "a100-80gb", tp=4)
    f = _prefill(2048, 2048)
    assert one.layer_seconds(f)["tp_all_reduce"] == 0
    b2, b4 = two.layer_seconds(f), four.layer_seconds(f)
    assert b2["mlp_up"] == pytest.approx(one.layer_seconds(f)["mlp_up"] / 2, rel=0.01)
    # a ring all-reduce moves 2 (tp - 1) / tp of the bytes: 1x at tp=2, 1.5x at tp=4
    hw = get_hardware("a100-80gb")
    ring = 2 * 2048 * 8192 / (hw.link_bandwidth * hw.link_efficiency)
    assert b2["tp_all_reduce"] == pytest.approx(2 * (hw.link_latency_s + ring), rel=1e-6)
    assert b4["tp_all_reduce"] == pytest.approx(2 * (hw.link_latency_s + 1.5 * ring), rel=1e-6)
    assert one.step_seconds(f) > two.step_seconds(f) > four.step_seconds(f)
    # Falcon sums attention and MLP before one reduce per layer
    falcon = RooflineCostModel(configs.PRESETS["falcon-180b"], "a100-80gb", tp=4)
    ring = 2 * 2048 * 14848 / (hw.link_bandwidth * hw.link_efficiency)
    assert falcon.layer_seconds(f)["tp_all_reduce"] == pytest.approx(
        hw.link_latency_s + 1.5 * ring, rel=1e-6
    )


def test_pipeline_stages_split_the_layers_and_send_over_the_network_across_nodes():
    model = configs.PRESETS["falcon-180b"]
    hw = get_hardware("a100-80gb-pcie")  # 4 per node: TP4 x PP2 spans two nodes
    flat = RooflineCostModel(model, hw, tp=4, pp=1)
    piped = RooflineCostModel(model, hw, tp=4, pp=2)
    f = _decode(64, 1024)
    s0, s1 = piped.stage_seconds(f)
    send = hw.network_latency_s + 2 * 64 * 14848 / (hw.network_bandwidth * hw.link_efficiency)
    layers = flat.stage_seconds(f)[0] - (s1 - s0 + send)  # flat = all layers + LM head
    assert s0 == pytest.approx(layers / 2 + send, rel=1e-6)
    assert sum(piped.stage_seconds(f)) == pytest.approx(flat.stage_seconds(f)[0] + send, rel=1e-6)
    with pytest.raises(ValueError, match="pp"):
        RooflineCostModel(configs.PRESETS["tiny"], hw, pp=99)


def test_kv_pages_fill_the_memory_left_by_the_weights():
    model = configs.PRESETS["mistral-7b-instruct-v0.2"]
    config = EngineConfig(model=model, dtype="bfloat16", device="sim", sim=SimConfig())
    pages = sim_num_pages(config)
    hw = get_hardware("a100-80gb")
    page = 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, 8 kv heads of 128, bf16
    free = 0.9 * hw.memory_bytes - weight_bytes_per_device(model, "bfloat16", 1, 1)
    assert pages * page <= free < (pages + 1) * page
    assert 25_000 < pages < 30_000  # ~ 55 GiB of 2 MiB pages
    # tp=2 halves each device's share of a page and of the weights: more than twice the pages
    tp2 = dataclasses.replace(config, parallel=ParallelConfig(tp=2))
    assert sim_num_pages(tp2) > 2 * pages
    big = EngineConfig(
        model=configs.PRESETS["falcon-180b"], dtype="bfloat16", device="sim", sim=SimConfig()
    )
    with pytest.raises(ValueError, match="leaves"):
        sim_num_pages(big)


def test_hardware_and_sim_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("b300")
    with pytest.raises(ValueError, match="matmul_efficiency"):
        HARDWARE["h100-sxm"].replace(matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="cost_model"):
        SimConfig(cost_model="vidur")
    with pytest.raises(ValueError, match="profile"):
        SimConfig(cost_model="fitted")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"steps": []}))
    with pytest.raises(ValueError, match="roofline"):
        cpu_from_profile(str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match="JSON"):
        cpu_from_profile(str(bad))
    good = tmp_path / "cpu.json"
    good.write_text(json.dumps({"roofline": {"read_bytes_per_s": 1e10, "matmul_flops": 1e11}}))
    cpu = get_hardware(str(good))
    assert cpu.memory_bandwidth == 1e10 and cpu.matmul_efficiency == 1.0


class _StageCost:
    """Each stage: 1 ms per token of the micro-batch."""

    def stage_seconds(self, f):
        return [1e-3 * f.tokens] * 2

    def step_seconds(self, f):
        return 2e-3 * f.tokens


def _step(num_tokens):
    return types.SimpleNamespace(
        num_seqs=np.array([1]),
        cu_q_lens=np.array([0, num_tokens]),
        kv_lens=np.array([num_tokens]),
        logits_indices=np.array([num_tokens - 1]),
        token_ids=np.arange(num_tokens) + 3,
        positions=np.arange(num_tokens),
    )


def test_pipeline_ticks_last_as_the_slowest_stage_and_count_the_bubble():
    config = EngineConfig(
        model=configs.PRESETS["tiny"],
        parallel=ParallelConfig(pp=2),
        device="sim",
        sim=SimConfig(cost_model=_StageCost()),
    )
    from llmjax.engine.stats import EngineStats

    clock = VirtualClock()
    runner = SimRunner(config, 64, clock)
    stats = EngineStats(num_pages=64)
    assert runner.pipelined
    exited, tokens = runner.tick(_step(10), None, "a")  # [a, -]: 10 ms
    assert exited is None and tokens == [10, 0] and clock.now() == pytest.approx(0.010)
    stats.record_tick(tokens, runner.last_stage_seconds)
    exited, tokens = runner.tick(_step(2), None, "b")  # [b, a]: 10 ms, a leaves
    assert exited[0] == "a" and tokens == [2, 10] and clock.now() == pytest.approx(0.020)
    stats.record_tick(tokens, runner.last_stage_seconds)
    exited, tokens = runner.tick(None, None)  # [-, b]: 2 ms, b leaves
    assert exited[0] == "b" and clock.now() == pytest.approx(0.022)
    assert runner.last_stage_seconds == pytest.approx([0.0, 0.002])
    stats.record_tick(tokens, runner.last_stage_seconds)
    # busy 10 + 2 + 10 + 2 = 24 ms of 2 stages x 22 ms
    assert stats.pipeline_time_bubble_fraction == pytest.approx(1 - 24 / 44)
    assert runner.num_in_flight == 0


def _sim_engine(model, tp=1, pp=1, policy="sarathi", num_pages=None, hardware="a100-80gb"):
    sched = SchedulerConfig(policy=policy, max_num_seqs=16, max_num_batched_tokens=256)
    if policy == "prefill_first":
        sched = dataclasses.replace(sched, max_num_batched_tokens=512)
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        max_model_len=512,
        scheduler=sched,
        parallel=ParallelConfig(tp=tp, pp=pp),
        device="sim",
        sim=SimConfig(hardware=hardware),
    )
    return LLMEngine(config, None, num_pages)


def _generate(engine, seed=0, n=12):
    rng = np.random.default_rng(seed)
    ids = {}
    for i in range(n):
        prompt = rng.integers(3, 200, int(rng.integers(5, 300))).tolist()
        p = SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True)
        ids[engine.add_request(prompt, p, request_id=str(i))] = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ids[out.request_id] = out.token_ids
    return ids


def test_greedy_tokens_do_not_depend_on_parallelism_or_policy():
    model = configs.PRESETS["llama2-13b"]
    ref = _generate(_sim_engine(model))
    assert all(v is not None for v in ref.values())
    for kw in (dict(tp=2), dict(pp=2), dict(tp=2, pp=2), dict(policy="prefill_first")):
        assert _generate(_sim_engine(model, **kw)) == ref, kw
    # preemption in a small cache: the same tokens
    assert _generate(_sim_engine(model, num_pages=40)) == ref


def test_tp_and_pp_change_the_simulated_time_as_the_model_says():
    model = configs.PRESETS["llama2-70b"]
    times = {}
    for tp, pp in ((2, 1), (4, 1), (2, 2)):
        engine = _sim_engine(model, tp=tp, pp=pp)
        _generate(engine)
        times[tp, pp] = engine.clock.now()
        if pp > 1:  # the engine counts the modeled ticks' bubble
            assert 0 < engine.stats.pipeline_time_bubble_fraction < 1
    assert times[4, 1] < times[2, 1]


def test_llm_with_a_simulated_device_starts_without_jax():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from llmjax.llm import LLM\n"
        "from llmjax.sampling_params import SamplingParams\n"
        "llm = LLM('yi-34b', device='sim', tp=2, max_num_seqs=64)\n"
        "assert llm.config.dtype == 'bfloat16' and llm.config.sim.hardware.name == 'a100-80gb'\n"
        "outs = llm.generate([[5] * 500] * 8, SamplingParams(max_tokens=20, ignore_eos=True))\n"
        "assert all(len(o.token_ids) == 20 for o in outs)\n"
        "assert llm.engine.clock.now() > 0\n"
        "assert 'jax' not in sys.modules\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True
    )
    assert float(out.stdout) < 5


def test_padded_roofline_charges_the_bucket_not_the_tokens():
    model = configs.PRESETS["llama2-7b"]
    f = dataclasses.replace(_prefill(65, 65), padded_tokens=128, padded_seqs=64)
    exact = RooflineCostModel(model, "h100-sxm").layer_seconds(f)
    padded = RooflineCostModel(model, "h100-sxm", padded=True).layer_seconds(f)
    full = RooflineCostModel(model, "h100-sxm").layer_seconds(_prefill(128, 128))
    assert padded["mlp_up"] == pytest.approx(full["mlp_up"]) and padded["mlp_up"] > exact["mlp_up"]
    assert padded["prefill_attention"] == exact["prefill_attention"]  # kernels skip padding
    engine_cfg = EngineConfig(
        model=model, dtype="bfloat16", device="sim", sim=SimConfig(hardware="h100-sxm", padded=True)
    )
    from llmjax.sim.runner import make_cost_model

    assert make_cost_model(engine_cfg).padded


def test_stats_of_instances_merge_by_summing():
    from llmjax.engine.stats import EngineStats

    a, b = EngineStats(num_pages=10, num_steps=3), EngineStats(num_pages=5, num_steps=4)
    a.host_time_s, b.host_time_s = 0.5, 0.25
    total = EngineStats.merge([a, b])
    assert (total.num_pages, total.num_steps, total.host_time_s) == (15, 7, 0.75)
    with pytest.raises(ValueError):
        EngineStats.merge([])


def _brute_window(spans, window):
    """(prefill pairs, prefill keys read, decode keys) by counting each token's visible keys."""
    pairs = context = decode = 0
    for q, kv in spans:
        seen = [set(range(max(0, p - window + 1), p + 1)) for p in range(kv - q, kv)]
        if q == 1:
            decode += len(seen[0])
        elif q > 1:
            pairs += sum(map(len, seen))
            context += len(set().union(*seen))
    return pairs, context, decode


def test_sliding_window_layers_cost_their_window():
    """`StepFeatures.in_window` counts a local layer's keys as brute force does (random chunks
    and decodes, windows inside and beyond the context), and the roofline charges Gemma 3's
    local layers for their window: a long-context decode costs less than with every layer
    global, the same once the window covers the context; the KV a shared page table holds
    beyond need is what those windows leave unread."""
    from llmjax.sim.roofline import window_kv_needed

    rng = np.random.default_rng(0)
    for _ in range(20):
        spans = []
        for _ in range(rng.integers(1, 6)):
            q = int(rng.choice([1, rng.integers(2, 40)]))
            spans.append((q, q + int(rng.integers(0, 60))))
        window = int(rng.integers(1, 80))
        f = StepFeatures(
            tokens=sum(q for q, _ in spans), prefill_attention=0, decodes=0, decode_context=0,
            spans=tuple(spans),
        ).in_window(window)  # fmt: skip
        assert (f.prefill_pairs, f.prefill_context, f.decode_context) == _brute_window(
            spans, window
        )
        assert f.prefill_attention == sum(q * min(kv, q + window - 1) for q, kv in spans if q > 1)

    gemma = configs.PRESETS["gemma3-27b"]
    full = gemma.replace(layer_types=("full_attention",) * gemma.num_layers)
    step = StepFeatures(
        tokens=8, prefill_attention=0, decodes=8, decode_context=8 * 32768, seqs=8,
        spans=((1, 32768),) * 8,
    )  # fmt: skip
    local, dense = (RooflineCostModel(m, "h100-sxm", tp=4) for m in (gemma, full))
    assert local.step_seconds(step) < 0.8 * dense.step_seconds(step)
    short = dataclasses.replace(step, decode_context=8 * 512, spans=((1, 512),) * 8)
    assert local.step_seconds(short) == pytest.approx(dense.step_seconds(short))
    b = local.breakdown(step)
    assert b["decode_attention"] < dense.breakdown(step)["decode_attention"]

    assert window_kv_needed(full, 32768) == 1.0
    w = gemma.sliding_window
    sliding = gemma.sliding_layers
    pages = 32768 // 16
    want = ((gemma.num_layers - sliding) * pages + sliding * (w // 16 + 1)) / (
        gemma.num_layers * pages
    )
    assert window_kv_needed(gemma, 32768) == pytest.approx(want)
    assert window_kv_needed(gemma, 256) == 1.0  # the window covers the context

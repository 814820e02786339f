"""The engine with `attention_backend="pallas"` (the TPU kernel, interpreted on the CPU) gives the
reference backend's greedy outputs, on mixed chunked-prefill batches of the tiny model and on
SmolLM2 (slow)."""

import functools

import numpy as np
import pytest

from llmjax import LLM, SamplingParams
from llmjax.model.params import unstack_layers


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny"])  # GQA ratios 1/4/8: the kernel tests (interpreted)
def test_tiny_model_greedy_outputs_equal_the_reference_backend(model):
    opts = dict(
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,  # prompts are chunked beside running decodes
        max_num_seqs=8,
        max_model_len=64,
        compilation_cache_dir="",
    )
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(4, hi=34)
    ref = LLM(model, attention_backend="reference", **opts)
    pallas = ref.with_options(attention_backend="pallas")  # the same weights
    assert pallas.engine.runner.attention_backend == "pallas"
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in pallas.generate(prompts, params)]
    assert got == want
    assert pallas.engine.stats.num_steps > len(prompts)  # several mixed steps ran


def test_mosaic_gpu_kernel_greedy_outputs_equal_the_reference_backend(monkeypatch):
    """pallas_kernel='mgpu' (Mosaic GPU's interpreter on the CPU) in the engine: a bfloat16 model
    with head dim 64 (the kernel's smallest) on mixed chunked-prefill batches gives the
    reference backend's greedy outputs, with the kernel's options (EngineConfig.kernel_options)
    reaching it: here its warp-specialized variant (the single-warpgroup one runs in the engine
    in the two tests below)."""
    kernel_options = "warp_specialized=true,num_consumers=2"
    import kernels_pallas.ragged_paged_attention.kernel_mgpu as mgpu_module

    traced = []
    real = mgpu_module.ragged_paged_attention_mgpu

    @functools.wraps(real)  # its signature: the engine checks kernel options against it
    def tracing_mgpu(q, *args, **kw):
        traced.append(kw)
        return real(q, *args, **kw)

    monkeypatch.setattr(mgpu_module, "ragged_paged_attention_mgpu", tracing_mgpu)
    opts = dict(
        load_format="dummy",
        dtype="bfloat16",
        page_size=16,
        max_num_batched_tokens=32,  # prompts are chunked beside running decodes
        max_num_seqs=8,
        max_model_len=96,
        compilation_cache_dir="",
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = _prompts(2, seed=2, lo=10, hi=30)
    ref = LLM("tiny-h64", attention_backend="reference", **opts)
    mgpu = ref.with_options(
        attention_backend="pallas", pallas_kernel="mgpu", kernel_options=kernel_options
    )
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in mgpu.generate(prompts, params)]
    assert got == want
    assert mgpu.engine.stats.num_steps > len(prompts)  # several mixed steps ran
    assert traced  # the Mosaic GPU kernel, not another, was traced into the steps
    assert all(kw["warp_specialized"] is True and kw["num_consumers"] == 2 for kw in traced)


def test_mosaic_gpu_flash_prefill_runs_for_lone_fresh_prompts(monkeypatch):
    """pallas_kernel='mgpu' with flash_prefill='on': each prompt's prefill step (one prompt,
    nothing cached) attends with the Mosaic GPU flash prefill kernel (interpreted; counted at run
    time inside its lax.cond branch), decodes with the Mosaic GPU ragged kernel, and the greedy
    outputs equal the reference backend's."""
    import jax

    import kernels_pallas.flash_prefill.kernel_mgpu as flash_mgpu_module

    ran = []
    real = flash_mgpu_module.flash_prefill_mgpu

    def counting_flash(q, k, v, seq_len, **kw):
        jax.debug.callback(lambda n: ran.append(int(n[0])), seq_len)
        return real(q, k, v, seq_len, **kw)

    monkeypatch.setattr(flash_mgpu_module, "flash_prefill_mgpu", counting_flash)
    opts = dict(
        load_format="dummy",
        dtype="bfloat16",
        page_size=16,
        scheduler_policy="prefill_first",
        max_num_batched_tokens=64,  # whole prompts: one per prefill step
        max_num_seqs=4,
        max_model_len=64,
        compilation_cache_dir="",
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = _prompts(2, seed=4, lo=33, hi=60)
    ref = LLM("tiny-h64", attention_backend="reference", **opts)
    llm = ref.with_options(attention_backend="pallas", pallas_kernel="mgpu", flash_prefill="on")
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    n_layers = llm.engine.config.model.num_layers
    assert sorted(ran) == sorted(len(p) for p in prompts for _ in range(n_layers))


def test_mosaic_gpu_kernel_model_logits_match_the_reference_backend():
    """The model's logits with the Mosaic GPU kernel (interpreted) on two mixed steps (a prefill
    chunk beside a whole prompt, then the next chunk beside a decode, pages shuffled) match the
    reference backend's to 2e-2 x max|logit| (bf16; observed ~0.5 %). Greedy tokens of a random
    model can hide an attention bug (a kernel that skips each query's own key left the engine
    test's tokens unchanged but moved these logits by ~75 %)."""
    from llmjax.model.attention import make_attention_fn
    from tests.kernels.kernel_testing import mixed_steps_logits

    a, b = _prompts(2, seed=3, lo=12, hi=40)
    run = functools.partial(mixed_steps_logits, a=a, b=b)
    ref = run(make_attention_fn("reference"))
    got = run(make_attention_fn("pallas", pallas_kernel="mgpu"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def _first_layers(llm, num_layers: int):
    """`llm` serving only the first `num_layers` decoder layers of its model (real weights)."""
    import dataclasses

    from llmjax.engine.engine import LLMEngine

    config = dataclasses.replace(
        llm.config, model=dataclasses.replace(llm.config.model, num_layers=num_layers)
    )
    params = unstack_layers(llm.params)  # the runner stacks them again for its scan
    params = {**params, "layers": params["layers"][:num_layers]}
    llm.engine = LLMEngine(config, params, llm.engine.block_manager.num_pages, llm.tokenizer)
    return llm


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_the_reference_backend(smollm2_path):
    """SmolLM2's real weights and shapes (9 query heads over 3 kv heads, head dim 64) through its
    first 2 of 30 layers, on a mixed chunked-prefill batch: the interpreted kernel is compiled
    once per layer and bucket, and all 30 layers took 2-2.5 minutes of the suite's time."""
    opts = dict(max_model_len=128, max_num_batched_tokens=16, compilation_cache_dir="")
    params = SamplingParams(max_tokens=4, ignore_eos=True)  # interpreted kernels: keep it short
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    base = LLM(attention_backend="reference", **opts)
    pallas = _first_layers(base.with_options(attention_backend="pallas"), 2)  # same weights
    ref = _first_layers(base, 2)
    assert pallas.engine.runner.attention_backend == "pallas"
    want = [o.token_ids for o in ref.generate(prompts, params)]
    got = [o.token_ids for o in pallas.generate(prompts, params)]
    assert got == want
    assert pallas.engine.stats.num_steps >= 3  # a 16-token prefill, a mixed step, decodes


@pytest.mark.parametrize("flash_prefill", ["on", "off"])
def test_flash_prefill_runs_exactly_for_lone_fresh_prompts(monkeypatch, flash_prefill):
    """With flash_prefill='on', a step that is one prompt with nothing cached attends with the
    flash prefill kernel (counted at run time inside its lax.cond branch) and the greedy outputs
    still equal the reference backend's; with 'off' it never runs."""
    import jax

    import kernels_pallas.flash_prefill as flash_module

    ran = []
    real = flash_module.flash_prefill_attention

    def counting_flash(q, k, v, seq_len, **kw):
        jax.debug.callback(lambda n: ran.append(int(n[0])), seq_len)
        return real(q, k, v, seq_len, **kw)

    monkeypatch.setattr(flash_module, "flash_prefill_attention", counting_flash)
    opts = dict(
        load_format="dummy",
        page_size=4,
        scheduler_policy="prefill_first",
        max_num_batched_tokens=64,  # whole prompts of 33-49 tokens: one per prefill step
        max_num_seqs=8,
        max_model_len=64,
        compilation_cache_dir="",
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = _prompts(3, seed=1, lo=33, hi=50)
    ref = LLM("tiny", attention_backend="reference", **opts)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    llm = ref.with_options(attention_backend="pallas", flash_prefill=flash_prefill)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    n_layers = llm.engine.config.model.num_layers
    if flash_prefill == "on":
        # Each prompt's prefill step, in every layer, with the prompt's length.
        assert sorted(ran) == sorted(len(p) for p in prompts for _ in range(n_layers))
    else:
        assert ran == []

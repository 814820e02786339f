"""The engine end to end on the tiny model: batch invariance, chunked prefill, preemption,
bad input, stop conditions, aborts and bounded compilation."""

import ast
import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from llmjax import LLM, SamplingParams

ENGINE_DIR = os.path.join(os.path.dirname(__file__), "..", "llmjax", "engine")


def test_only_the_runner_imports_jax():
    for name in os.listdir(ENGINE_DIR):
        if not name.endswith(".py"):  # runner/, the package that may import jax
            continue
        tree = ast.parse(open(os.path.join(ENGINE_DIR, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                )
                assert not any(m and m.split(".")[0] in ("jax", "jaxlib") for m in mods), name
    code = (
        "import sys, llmjax, llmjax.engine.scheduler, llmjax.engine.batch, llmjax.engine.engine;"
        "assert 'jax' not in sys.modules, 'host side imported jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@functools.cache
def _base_llm():
    """The tiny model's random weights, loaded once per process: each test's engine is built over
    them with `LLM.with_options` (loading costs ~3 s, an engine milliseconds)."""
    return LLM(
        "tiny",
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=96,
        compilation_cache_dir="",
    )


def _llm(**kw):
    return _base_llm().with_options(**kw)


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, rng.integers(lo, hi)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llm():
    return _llm()


@pytest.fixture(scope="module")
def alone_outputs(llm):
    """Each prompt run alone: the reference for batch invariance."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return {i: llm.generate([p], params)[0].token_ids for i, p in enumerate(_prompts(7))}


POLICIES = ["sarathi", "prefill_first", "decode_first", "splitfuse"]


def _policy_llm(policy, **kw):
    chunked = policy in ("sarathi", "splitfuse")
    return _llm(scheduler_policy=policy, max_num_batched_tokens=32 if chunked else 96, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_outputs_do_not_depend_on_the_batch_or_policy(policy, alone_outputs):
    llm = _policy_llm(policy)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(_prompts(7), params)  # chunked prefills (budget 32) mixed with decodes
    assert [o.token_ids for o in outs] == [alone_outputs[i] for i in range(7)]
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_recomputes_and_loses_nothing(policy, alone_outputs):
    # 19 usable pages of 4 tokens: not enough for 7 requests at once, so decodes preempt.
    small = _policy_llm(policy, num_pages=20)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = small.generate(_prompts(7), params)
    assert small.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [alone_outputs[i] for i in range(7)]
    bm = small.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_with_options_shares_the_weights_and_changes_only_the_engine(llm):
    other = llm.with_options(scheduler_policy="decode_first", max_num_batched_tokens=96, seed=7)
    assert other.engine is not llm.engine and other.params is llm.params
    assert other.engine.runner.params["embed"] is llm.engine.runner.params["embed"]  # no copy
    assert other.config.scheduler.policy == "decode_first" and other.config.seed == 7
    assert other.config.max_model_len == 96  # the rest as llm's
    assert llm.config.scheduler.policy == "sarathi" and llm.config.seed == 0
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts(3, seed=4)
    assert [o.token_ids for o in other.generate(prompts, params)] == [
        o.token_ids for o in llm.generate(prompts, params)
    ]
    with pytest.raises(ValueError, match=r"\['dtype', 'tp'\] fix how the weights were loaded"):
        llm.with_options(dtype="bfloat16", tp=2)
    with pytest.raises(TypeError, match=r"unknown engine options \['page'\]"):
        llm.with_options(page=8)


def test_overrides_reach_the_engine(llm):
    other = llm.with_options(
        overrides={"scheduler.lpm_max_queue_len": "7", "cache.watermark": 0.05}
    )
    assert other.config.scheduler.lpm_max_queue_len == 7
    assert other.engine.scheduler.config.lpm_max_queue_len == 7
    assert other.engine.scheduler.watermark_pages == int(
        0.05 * other.engine.block_manager.num_usable_pages
    )
    with pytest.raises(ValueError, match="'dtype' is fixed by the loaded weights"):
        llm.with_options(overrides={"dtype": "bfloat16"})


def test_whole_prompt_policies_need_a_budget_for_any_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 must be >= max_model_len=96"):
        _llm(scheduler_policy="prefill_first", max_num_batched_tokens=32)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    prompts = _prompts(4, seed=1)
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1


def test_bad_prompts_are_rejected_and_others_served(llm, alone_outputs):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    good = _prompts(7)[0]
    outs = llm.generate([[], good, [5] * 96, [3, 999999]], params)
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error"]
    assert "empty prompt" in outs[0].error
    assert "max_model_len=96" in outs[2].error
    assert "outside the vocabulary" in outs[3].error
    assert outs[1].token_ids == alone_outputs[0]


def test_stop_strings_without_a_tokenizer_are_rejected_and_others_served(llm, alone_outputs):
    good = _prompts(7)[0]
    outs = llm.generate(
        [good, good], [SamplingParams(max_tokens=12, stop="x"), SamplingParams(max_tokens=12)]
    )
    assert outs[0].finish_reason == "error" and "need a tokenizer" in outs[0].error
    assert outs[1].token_ids == alone_outputs[0]


def test_prompt_larger_than_the_cache_is_rejected():
    tiny_cache = _llm(num_pages=5, max_model_len=64)
    out = tiny_cache.generate([list(range(3, 40))], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error" and "KV pages" in out.error


def test_max_model_len_and_stop_tokens_end_requests(llm, alone_outputs):
    prompt = _prompts(7)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=1000, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 96
    stop = alone_outputs[0][4]
    first = alone_outputs[0].index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == alone_outputs[0][: first + 1]


def test_abort_frees_pages(llm):
    engine = llm.engine
    rid = engine.add_request(_prompts(1, seed=3, lo=20)[0], SamplingParams(max_tokens=50))
    engine.step()
    bm = engine.block_manager
    assert bm.num_available_pages < bm.num_usable_pages
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert bm.num_available_pages == bm.num_usable_pages
    assert bm.prefix_cache.num_cached_pages > 0  # the computed prefix stays reusable
    assert engine.reset_prefix_cache()
    assert bm.num_free_pages == bm.num_usable_pages


def test_metrics_are_recorded(llm):
    out = llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 5 and len(m.tbt) == 4 and m.ttft > 0


def test_no_compile_after_precompile():
    """Every bucket compiled at start (sarathi's buckets; the policies share the step and differ
    only in which buckets they reach; compiled ahead of time in threads, the samplers too); then
    serving a mixed workload compiles nothing, and gives the lazily compiled engine's tokens,
    greedy and seeded."""
    import jax

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: events.append(event)
    )
    llm = _policy_llm("sarathi", precompile=True, max_num_seqs=4, max_model_len=48)
    engine = llm.engine
    assert engine.num_compiles == len(engine.buckets.shapes())
    assert engine.runner.num_steps == 0  # compiled ahead of time: no padded step was run
    # the sampler, its own program, once per sequence-row bucket
    assert engine.runner.num_sample_compiles == len({S for _, S, _ in engine.buckets.shapes()})
    before, num_events = engine.num_compiles, len(events)
    mixed = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=1)
        for n, t in zip((1, 5, 30, 12, 60, 3, 9), (0, 1.0, 0, 0.5, 0, 0, 1.0), strict=True)
    ]
    outs = llm.generate(_prompts(7, seed=5, hi=30), mixed)  # some run into max_model_len
    assert engine.num_compiles == before
    assert engine.runner.num_compiled_ahead == 0  # (compile_ahead's counter, not precompile's)
    # Nothing traced, compiled or fetched from the persistent compilation cache while serving.
    serving = events[num_events:]
    assert not [e for e in serving if e.startswith(("/jax/core/compile/", "/jax/comp"))]
    lazy = _policy_llm("sarathi", max_num_seqs=4, max_model_len=48)
    expected = lazy.generate(_prompts(7, seed=5, hi=30), mixed)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert lazy.engine.num_compiles < before  # (it compiled only the buckets it met)


STAGE_RANGES = (
    "llmjax_step",
    "llmjax.schedule",
    "llmjax.prepare",
    "llmjax.launch",
    "llmjax.collect",
    "llmjax.update",
)


def test_profile_holds_the_engine_steps(llm, tmp_path):
    import glob

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)  # compiled outside the profile
    with llm.profile(str(tmp_path)):
        llm.generate([[5, 6, 7, 8], [9, 10]], params)
    [xplane] = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    data = open(xplane, "rb").read()
    for name in STAGE_RANGES:
        assert name.encode() in data, name


def test_the_sampler_compiles_only_for_sampling_steps_once_per_row_bucket():
    """Greedy steps never build the sampler (sort, top-p, threefry); sampling steps build it
    once per S bucket, whatever their T and P, and draw what the in-step form drew."""
    import jax.numpy as jnp

    from llmjax.model.sampler import sample

    llm = _llm()
    runner = llm.engine.runner
    llm.generate(_prompts(5, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    assert runner.num_sample_compiles == 0 and runner.num_compiles > 0
    sampled = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s)
               for s in range(5)]  # fmt: skip
    first = [o.token_ids for o in llm.generate(_prompts(5, seed=2), sampled)]
    rows = {S for _, S, _ in llm.engine.buckets.shapes()}
    assert 0 < runner.num_sample_compiles <= len(rows)
    before = runner.num_sample_compiles
    assert [o.token_ids for o in llm.generate(_prompts(5, seed=2), sampled)] == first
    assert runner.num_sample_compiles == before
    # the split program draws what `sample` (greedy shortcut included) draws on the same logits
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 300)), jnp.float32)
    args = (jnp.asarray([0.0, 0.7, 1.3, 0.7]), jnp.asarray([0, 5, 0, 0], jnp.int32),
            jnp.asarray([1.0, 1.0, 0.8, 0.5]), jnp.arange(4, dtype=jnp.uint32),
            jnp.asarray([0, 3, 9, 1], jnp.int32))  # fmt: skip
    want = sample(logits, *args, jnp.bool_(False))
    assert np.array_equal(runner._sample(logits, *args), want)


def test_serving_again_does_not_recompile(llm):
    """The same requests again take the same steps (the prefix cache emptied: a hit would chunk
    the prompts otherwise, into buckets this module's other tests may not have compiled yet) and
    compile nothing."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.reset_prefix_cache()
    llm.generate(_prompts(7), params)
    before = llm.engine.num_compiles
    llm.reset_prefix_cache()
    llm.generate(_prompts(7), params)
    assert llm.engine.num_compiles == before


def test_startup_reuses_the_persistent_compilation_cache(tmp_path):
    """A second process with the same cache directory loads the compiled step from disk."""
    code = (
        "import sys, jax; from llmjax import LLM, SamplingParams;"
        "hits = [];"
        "jax.monitoring.register_event_listener("
        "    lambda e, **kw: hits.append(e) if e == '/jax/compilation_cache/cache_hits' else None);"
        "llm = LLM('tiny', load_format='dummy', max_model_len=64,"
        "          compilation_cache_dir=sys.argv[1]);"
        "llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3));"
        "print('HITS', len(hits))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # not the test run's shared cache (conftest.py)
    run = lambda: (
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert "HITS 0" in run()
    assert any("step_impl" in e for e in os.listdir(tmp_path))
    second = run()
    assert "HITS 0" not in second and "HITS" in second


def test_token_ids_slice_matches_all_token_ids():
    from llmjax.engine.request import Request

    req = Request("r", [1, 2, 3, 4], SamplingParams(), frozenset(), seed=0)
    req.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert req.token_ids_slice(start, end) == req.all_token_ids[start:end]


def test_duplicate_request_id_is_refused_while_in_flight(llm):
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id='dup' is already waiting or running"):
        engine.add_request([8, 9], SamplingParams(max_tokens=2), request_id="dup")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request([8, 9], SamplingParams(max_tokens=2), request_id="dup")  # free again
    assert engine.abort_request("dup")


def test_compile_ahead_serves_steps_from_shapes_compiled_in_the_background():
    """`EngineConfig.compile_ahead`: the steps' likely next shapes compile in a background
    thread; steps that meet one run its executable (no compile on the spot), and the tokens are
    the ones the synchronous path gives."""
    prompts = _prompts(6, seed=3, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = _llm(overrides={"compile_ahead": False})
    on = _llm(overrides={"compile_ahead": True})
    want = [o.token_ids for o in off.generate(prompts, params)]
    got = [o.token_ids for o in on.generate(prompts, params)]
    assert got == want
    r_on, r_off = on.engine.runner, off.engine.runner
    assert r_off.num_compiled_ahead == 0
    assert r_on.num_compiled_ahead > 0
    assert r_on.num_compiles < r_off.num_compiles  # some shapes were ready when first met
    before = (r_on.num_compiles, r_on.num_compiled_ahead)
    on.generate(prompts, params)  # the same shapes again: nothing new either way
    assert (r_on.num_compiles, r_on.num_compiled_ahead) == before
    from llmjax.engine.batch import Buckets

    paged = Buckets.create(64, 8, 24)  # a page bucket per context length (the jnp reference)
    assert paged.likely_next((8, 8, 4), 3) == [(8, 8, 8), (4, 4, 4), (4, 4, 8)]
    ragged = Buckets.create(64, 8, 24, ragged_pages=True)  # the CPU kernel: one P
    assert ragged.page_buckets == (24,)
    assert ragged.likely_next((8, 8, 24), 3) == [(4, 4, 24)]
    assert on.engine.buckets.page_buckets == (24,)  # the CPU kernel here

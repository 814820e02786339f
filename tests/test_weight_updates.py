"""Weights updated while serving (issue 43; llmjax/engine/weights.py): pause modes, updates,
sleep and wake.

With a fake runner (hypothesis): its "weights" are a version number written into every KV slot
with the token (as the fake model records a LoRA adapter), and its next token hashes the slots
read back, so a token computed from KV of the old weights (a stale prefix-cache hit, a page not
recomputed) differs from the reference. Random requests, arrivals and aborts, and at a random
step a pause ('abort', 'wait', 'keep' or none), optionally sleep, an update, wake and resume:
every request's output is the reference's, made under the version each of its tokens came from;
the engine's invariants hold after every step.

With the tiny model: `LLM.update_weights` gives the outputs of a fresh LLM loaded from the same
weights, greedy and seeded, in float32, bfloat16 and int8, from llmjax's and HF's names, a
pytree or an iterator, with tp=2 and pp=2 from weights sharded another way; nothing recompiles;
a prefix cached before the update is not hit after it; sleep frees the KV pages (and the
weights) and wake serves the same outputs again.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmjax.config import SCHEDULER_POLICIES
from llmjax.engine.engine import LLMEngine
from llmjax.engine.weights import PAUSE_MODES
from llmjax.sampling_params import SamplingParams
from tests.fake_model import UNWRITTEN, FakeRunner, reference_generation
from tests.test_async_scheduling import _check_engine
from tests.test_scheduler_properties import PROPERTY_SETTINGS, max_steps, scenarios


class VersionedRunner(FakeRunner):
    """The fake runner whose weights are a version: every slot it writes records it."""

    weights_released = False
    mesh = device = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def run(self, step, sampling):
        versions = np.full(len(step.token_ids), self.version, np.int64)
        next_ids = self.model.run(step, sampling.spec, versions)
        self.last_spec = self.model.last_spec
        return next_ids

    def update_params(self, params) -> None:
        self.version, self.weights_released = int(params), False

    def release_kv(self) -> int:
        self.model.kv[:] = UNWRITTEN  # what the pages held is gone
        return self.model.kv.nbytes

    def restore_kv(self) -> None:
        pass

    def release_params(self) -> int:
        self.weights_released = True
        return 8


@pytest.fixture
def versioned_runner(monkeypatch):
    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = VersionedRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)


def _reference(sc, spec, version: int, done: list[int] = ()) -> list[int]:
    """`spec`'s tokens: `done` (made before an update), then the rest under `version`."""
    rest, _ = reference_generation(
        list(spec.prompt) + list(done),
        max_tokens=spec.max_tokens - len(done),
        max_model_len=sc.max_model_len,
        vocab_size=sc.vocab_size,
        stop_token_ids=spec.stop_token_ids,
        eos_token_ids=sc.config().model.eos_token_ids,
        ignore_eos=spec.ignore_eos,
        lora_id=version,
    )
    return list(done) + rest


@settings(
    PROPERTY_SETTINGS,
    max_examples=40,
    suppress_health_check=[
        *PROPERTY_SETTINGS.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(data=st.data())
@pytest.mark.parametrize("prefix_cache", ["none", "radix"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_updates_in_every_pause_mode_serve_each_token_from_its_version(
    versioned_runner, prefix_cache, async_scheduling, data
):
    policy = data.draw(st.sampled_from(SCHEDULER_POLICIES), label="policy")
    sc = data.draw(scenarios(policy, prefix_cache), label="scenario")
    sc = dataclasses.replace(
        sc, pipeline_depth=1, balance_micro_batches=False, num_speculative_tokens=0,
        max_loras=None, requests=tuple(dataclasses.replace(r, lora=0) for r in sc.requests),
    )  # fmt: skip
    mode = data.draw(st.sampled_from([None, *PAUSE_MODES]), label="pause mode")
    at = data.draw(st.integers(0, 14), label="update step")
    sleep = data.draw(st.sampled_from([0, 0, 1, 2]), label="sleep level")
    config = sc.config().replace(async_scheduling=async_scheduling)
    engine = LLMEngine(config, params=None, num_pages=sc.num_pages)
    outputs: dict = {}
    made_before: dict[str, list[int]] = {}  # request id -> its tokens at the update
    aborted_by_pause: set[str] = set()
    done_before: set[str] = set()

    def record(outs):
        for out in outs:
            prev = outputs.get(out.request_id)
            assert prev is None or not prev.finished, "an output after the request finished"
            outputs[out.request_id] = out

    last_arrival = max(r.arrival for r in sc.requests)
    for step in range(2 * max_steps(sc) + 40):
        for i, spec in enumerate(sc.requests):
            if spec.arrival == step:
                params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos,
                                        stop_token_ids=list(spec.stop_token_ids))  # fmt: skip
                engine.add_request(list(spec.prompt), params, request_id=str(i))
            if spec.abort_at == step:
                engine.abort_request(str(i))
        if step == at:
            live_at = engine._live_requests()  # (their state after the update says where they are)
            live = {r.request_id for r in live_at}
            if mode is not None:
                outs = engine.pause_generation(mode)
                record(outs)
                if mode == "abort":
                    aborted_by_pause = {o.request_id for o in outs if o.finish_reason == "abort"}
                    assert aborted_by_pause <= live and not engine._live_requests()
                if mode == "wait":
                    while engine.can_step:  # what ran at the pause finishes
                        record(engine.step())
                        _check_engine(engine, sc)
                    started = engine._started & {r.request_id for r in engine._live_requests()}
                    assert not started, f"'wait' left {started} unfinished"
                else:  # frozen: a step makes nothing
                    before = {r.request_id: r.num_tokens for r in engine._live_requests()}
                    record(engine.step())
                    assert {r.request_id: r.num_tokens for r in engine._live_requests()} == before
            if sleep:
                freed = engine.sleep(sleep)
                assert freed["kv_bytes"] > 0 and (freed["weight_bytes"] > 0) == (sleep == 2)
                assert engine.block_manager.prefix_cache.num_cached_pages == 0
                engine.wake_up()
            version = engine.update_weights(1)
            assert version == engine.weight_version == 1
            assert engine.block_manager.prefix_cache.num_cached_pages == 0
            assert not engine.scheduler.running  # every request recomputes
            made_before = {r.request_id: list(r.output_token_ids)
                           for r in live_at if not r.status.is_done}  # fmt: skip
            done_before = {rid for rid, o in outputs.items() if o.finished}
            done_before |= {r.request_id for r in live_at if r.status.is_done}
            if mode is not None:
                engine.resume_generation()
            _check_engine(engine, sc)
        if step > max(last_arrival, at) and not engine.has_unfinished_requests():
            break
        record(engine.step())
        _check_engine(engine, sc)
    else:
        pytest.fail(f"livelock: {sc}")

    for i, spec in enumerate(sc.requests):
        rid, out = str(i), outputs.get(str(i))
        if not sc.is_valid(spec):
            assert out is not None and out.finish_reason == "error" and not out.token_ids
            continue
        if rid in done_before:
            want = _reference(sc, spec, 0)
        elif rid in made_before:  # live at the update: its tokens so far, then version 1's
            want = _reference(sc, spec, 1, made_before[rid])
            assert made_before[rid] == _reference(sc, spec, 0)[: len(made_before[rid])]
        else:  # it arrived after the update
            want = _reference(sc, spec, 1 if spec.arrival >= at else 0)
        aborted = spec.abort_at is not None and (
            out is None or not out.finished or out.finish_reason == "abort"
        )
        if rid in aborted_by_pause or aborted:
            got = [] if out is None else out.token_ids
            assert got == want[: len(got)], f"request {i}: aborted output is not a prefix"
            continue
        assert out is not None and out.finished, f"request {i} never finished"
        assert out.token_ids == want, f"request {i}: not its versions' tokens"
        if rid not in done_before and out.token_ids:  # its last token came after the update
            assert out.weight_version == 1, f"request {i}: weight_version"
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages, "pages still held at the end"
    event(f"mode {mode}")
    event("live requests at the update" if made_before else "none live at the update")


# ---- the tiny model --------------------------------------------------------------------------

OPTS = dict(page_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64,
            num_pages=64, compilation_cache_dir="", smoothquant=None)  # fmt: skip
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _sampling():
    return [GREEDY, SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3,
                                   ignore_eos=True)] * 2  # fmt: skip


def _prompts():
    rng = np.random.default_rng(4)
    shared = rng.integers(3, 250, 12).tolist()
    return [shared + rng.integers(3, 250, int(n)).tolist() for n in (3, 9, 1, 17)]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """Random weights other than the dummy ones, and an HF directory holding them."""
    import jax

    import configs
    from llmjax.checkpoint.hf import save_hf
    from llmjax.model.params import init_params

    config = configs.get_preset("tiny")
    params = init_params(config, jax.random.key(11))
    path = save_hf(tmp_path_factory.mktemp("updated"), config, params)
    return config, params, str(path)


def _compiles(llm):
    r = llm.engine.runner
    return r.num_compiles, getattr(r, "num_sample_compiles", 0)


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "dtype, quantization", [("float32", "none"), ("bfloat16", "none"), ("float32", "int8")]
)
def test_updated_weights_serve_as_a_fresh_llm_loaded_from_them(new_weights, dtype, quantization):
    from llmjax import LLM

    _, params, path = new_weights
    llm = LLM("tiny", load_format="dummy", dtype=dtype, quantization=quantization, **OPTS)
    prompts = _prompts()
    old = _tokens(llm.generate(prompts, _sampling()))
    cached = llm.generate(prompts[:1], GREEDY)[0].num_cached_tokens
    assert cached > 0  # the prompt is in the prefix cache before the update
    compiles = _compiles(llm)
    assert llm.update_weights(params) == 1
    outs = llm.generate(prompts, _sampling())
    assert outs[0].num_cached_tokens == 0, "a prefix cached before the update was served"
    assert all(o.weight_version == 1 for o in outs)
    assert _compiles(llm) == compiles, "the update recompiled"
    fresh = LLM(path, dtype=dtype, quantization=quantization, **OPTS)
    want = _tokens(fresh.generate(prompts, _sampling()))
    assert _tokens(outs) == want and want != old


def test_hf_names_an_iterator_and_bad_weights(new_weights):
    """HF's names and an iterator of (name, array) pairs give the same engine as the pytree; a
    wrong shape, a missing or an unknown weight is refused by name and changes nothing."""
    import jax.numpy as jnp

    from llmjax import LLM
    from llmjax.checkpoint.hf import hf_tensors_from_params

    config, params, _ = new_weights
    llm = LLM("tiny", load_format="dummy", **OPTS)
    prompts = _prompts()
    llm.update_weights(params)
    want = _tokens(llm.generate(prompts, GREEDY))
    hf = hf_tensors_from_params(config, params, np.float32)
    assert llm.update_weights(hf, source_format="hf") == 2
    assert _tokens(llm.generate(prompts, GREEDY)) == want

    def named():  # layer by layer, as a trainer might send them
        yield "embed", params["embed"]
        for i, layer in enumerate(params["layers"]):
            for k, v in layer.items():
                yield f"layers.{i}.{k}", v
        yield from ((k, params[k]) for k in ("final_norm", "lm_head") if k in params)

    assert llm.update_weights(named()) == 3
    assert _tokens(llm.generate(prompts, GREEDY)) == want

    bad = {**params, "layers": [dict(layer) for layer in params["layers"]]}
    bad["layers"][1]["wq"] = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match=r"layers\.1\.wq"):
        llm.update_weights(bad)
    with pytest.raises(ValueError, match=r"missing HF weight 'model\.norm\.weight'"):
        llm.update_weights(
            {k: v for k, v in hf.items() if k != "model.norm.weight"}, source_format="hf"
        )
    with pytest.raises(ValueError, match="unexpected HF weights"):
        llm.update_weights(
            {**hf, "model.extra.weight": hf["model.norm.weight"]}, source_format="hf"
        )
    with pytest.raises(ValueError, match="given twice"):
        llm.update_weights([("embed", params["embed"]), ("embed", params["embed"])])
    assert llm.weight_version == 3
    assert _tokens(llm.generate(prompts, GREEDY)) == want  # still the last good weights


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}])
def test_tp_and_pp_engines_take_weights_sharded_another_way(new_weights, parallel):
    """The trainer's arrays sharded over 4 other devices (rows split where they divide) go into
    a tp=2 or pp=2 engine: its outputs are a fresh engine's on those weights, no recompile."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from llmjax import LLM

    _, params, path = new_weights
    mesh = Mesh(np.array(jax.devices()[4:8]), ("data",))

    def trainer_layout(x):
        spec = PartitionSpec("data") if x.shape[0] % 4 == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    sharded = jax.tree.map(trainer_layout, params)
    llm = LLM("tiny", load_format="dummy", **OPTS, **parallel)
    prompts = _prompts()
    llm.generate(prompts, _sampling())
    compiles = _compiles(llm)
    llm.update_weights(sharded)
    got = _tokens(llm.generate(prompts, _sampling()))
    assert _compiles(llm) == compiles
    assert got == _tokens(LLM(path, **OPTS, **parallel).generate(prompts, _sampling()))


def test_sleep_frees_the_pages_and_the_weights_and_wake_serves_the_same(new_weights):
    import jax

    from llmjax import LLM

    _, params, _ = new_weights
    llm = LLM("tiny", load_format="dummy", **OPTS)
    prompts = _prompts()
    want = _tokens(llm.generate(prompts, GREEDY))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())
    before = live()
    freed = llm.sleep(level=1)
    assert freed["kv_bytes"] > 0 and freed["weight_bytes"] == 0
    assert before - live() >= freed["kv_bytes"]
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.generate(prompts, GREEDY)
    llm.wake_up()
    assert _tokens(llm.generate(prompts, GREEDY)) == want
    before = live()
    freed = llm.sleep(level=2)
    assert (
        freed["weight_bytes"] > 0 and before - live() >= freed["kv_bytes"] + freed["weight_bytes"]
    )
    llm.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.generate(prompts, GREEDY)
    llm.update_weights(params)
    got = _tokens(llm.generate(prompts, GREEDY))
    llm.update_weights(llm_params := jax.tree.map(np.asarray, params))
    assert _tokens(llm.generate(prompts, GREEDY)) == got and llm_params is not None


def test_pause_modes_on_the_llm():
    """'keep' freezes a request mid-decode and an update recomputes it under the new weights;
    'wait' lets it finish first; 'abort' ends it with finish_reason 'abort'."""
    import dataclasses

    import jax

    import configs
    from llmjax import LLM
    from llmjax.model.params import init_params

    config = configs.get_preset("tiny")
    first, second = (init_params(config, jax.random.key(k)) for k in (0, 5))
    llm = LLM("tiny", load_format="dummy", **OPTS)
    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for mode in ("keep", "wait", "abort"):
        llm.update_weights(first)
        old = llm.generate([prompt], params)[0].token_ids
        e = llm.engine
        rid = e.add_request(prompt, params)
        outs = [o for _ in range(4) for o in e.step()]
        outs += llm.pause_generation(mode)
        [req] = [r for r in e._live_requests() if r.request_id == rid] or [None]
        k = len(req.output_token_ids) if req is not None else None
        with pytest.raises(RuntimeError, match="paused"):
            llm.generate([prompt], params)
        llm.update_weights(second)
        llm.resume_generation()
        while e.has_unfinished_requests():
            outs += e.step()
        [out] = [o for o in outs if o.request_id == rid and o.finished]
        if mode == "abort":
            assert req is None and out.finish_reason == "abort"
            assert 0 < len(out.token_ids) < 12 and out.token_ids == old[: len(out.token_ids)]
        elif mode == "wait":  # it finished under the old weights before the update
            assert req is None and out.token_ids == old
            assert out.weight_version == llm.weight_version - 1
        else:  # its first k tokens old, the rest made under the new weights from them
            assert 0 < k < 12 and out.token_ids[:k] == old[:k]
            rest = dataclasses.replace(params, max_tokens=12 - k)
            new = llm.generate([prompt + old[:k]], rest)[0].token_ids
            assert out.token_ids[k:] == new and out.weight_version == llm.weight_version


def test_blocks_in_the_kv_tiers_are_not_served_after_an_update(new_weights):
    """A prefix written to the host tier before an update is not loaded after it (its keys
    carry the old weights' salt); computed again under the new weights, it loads again."""
    from llmjax import LLM
    from llmjax.config import KVStoreConfig

    _, params, path = new_weights
    kv = KVStoreConfig(host_blocks=64, block_size=16, write_policy="write_through",
                       load_policy="always")  # fmt: skip
    llm = LLM("tiny", load_format="dummy", **OPTS).with_options(kv_store=kv)
    prompt = _prompts()[3]  # 29 tokens: one full 16-token block
    tiers = []
    for update in (False, True, False):
        if update:
            llm.update_weights(params)
        [out] = llm.generate([prompt], GREEDY)
        tiers.append(out.num_cached_tokens_per_tier)
        llm.engine.reset_prefix_cache()  # a hit from now on is a load from the host tier
        [again] = llm.generate([prompt], GREEDY)
        tiers.append(again.num_cached_tokens_per_tier)
        assert again.token_ids == out.token_ids
        llm.engine.reset_prefix_cache()
    assert tiers[1] == {"device": 0, "host": 16}, tiers  # the tier serves the old weights' block
    assert tiers[2] == {"device": 0}, tiers  # not after the update
    assert tiers[3] == tiers[5] == {"device": 0, "host": 16}, tiers  # the new weights' block
    want = LLM(path, **OPTS).generate([prompt], GREEDY)[0].token_ids
    assert out.token_ids == want


def test_an_expert_parallel_moe_takes_hf_named_experts(tmp_path):
    """A mixture of experts under tp=2, ep=2 takes new weights by HF names (one tensor per
    expert, stacked on the devices' expert shards) and serves as a fresh engine on them."""
    import jax

    from llmjax import LLM
    from llmjax.checkpoint import load_hf
    from llmjax.checkpoint.hf import hf_tensors_from_params, save_hf
    from llmjax.model.params import init_params
    from tests.conftest import TESTDATA

    base = f"{TESTDATA}/hf_tiny/mixtral"
    config, _ = load_hf(base)
    params = init_params(config, jax.random.key(3))
    path = str(save_hf(tmp_path / "moe", config, params))
    opts = dict(tp=2, ep=2, page_size=4, max_model_len=64, num_pages=48, compilation_cache_dir="")
    llm = LLM(base, **opts)
    prompts = _prompts()[:2]
    llm.generate(prompts, GREEDY)
    compiles = _compiles(llm)
    llm.update_weights(hf_tensors_from_params(config, params, np.float32), source_format="hf")
    got = _tokens(llm.generate(prompts, GREEDY))
    assert _compiles(llm) == compiles
    assert got == _tokens(LLM(path, **opts).generate(prompts, GREEDY))

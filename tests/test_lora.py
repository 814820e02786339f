"""Multi-LoRA serving (issue 42): PEFT adapters against HF + PEFT (goldens of
scripts/golden/make_lora_golden.py), many adapters in one batch equal to each request alone,
isolation in the prefix cache, bad adapters refused, and the host cache / device slots'
invariants under random use (hypothesis)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax import LLM, LoRARequest, SamplingParams
from llmjax.checkpoint import load_hf
from llmjax.config import LORA_TARGETS, LoRAConfig
from llmjax.lora import LoRAError, LoRAManager, load_peft_adapter
from llmjax.model import lora as lora_slots
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import stack_layers
from llmjax.model.step_input import contiguous_prefill
from tests.conftest import TESTDATA

LORA = os.path.join(TESTDATA, "lora")
TINY_ADAPTERS = [
    ("llama", "qv_r4"),
    ("llama", "all_r8"),
    ("llama", "od_rslora"),
    ("qwen3", "qkvo_r8"),
    ("gemma2", "mlp_r4"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _golden(base: str, name: str):
    path = os.path.join(LORA, base, name)
    return path, np.load(os.path.join(path, "golden.npz"))


def _slots_with(config, adapters: dict[int, object], max_loras=3, rank=8, grouped=False):
    """`params["lora"]` with adapter weights (LoRAWeights) in the given slots (the masked or
    the grouped layout)."""
    lora = lora_slots.allocate_slots(
        config, tuple(LORA_TARGETS), max_loras, rank, jnp.float32, grouped=grouped
    )
    for slot, adapter in adapters.items():
        arrays = {k: (jnp.asarray(a), jnp.asarray(b)) for k, (a, b) in adapter.weights.items()}
        lora = lora_slots.write_slot(lora, slot, arrays, rank)
    return lora


def _logits(params, config, rows, slots, page_size=8):
    """Every position's logits of each row [B, n] (one prefill step), row b under slot
    slots[b] (-1: the base model)."""
    rows = np.asarray(rows, np.int32)
    B, n = rows.shape
    step, _ = contiguous_prefill(rows, n, page_size)
    step = step._replace(
        logits_indices=np.arange(B * n, dtype=np.int32),
        lora_slots=np.repeat(np.asarray(slots, np.int32), n),
    )
    stacked = isinstance(params["layers"], dict)
    kv = allocate_kv_pages(config, 2 + B * -(-n // page_size), page_size, jnp.float32, stacked)
    logits, _ = jax.jit(forward, static_argnames="config")(params, kv, step, config=config)
    return np.asarray(logits).reshape(B, n, -1)


@functools.cache
def _base(name: str):
    return load_hf(os.path.join(TESTDATA, "hf_tiny", name))


@pytest.mark.parametrize("base, name", TINY_ADAPTERS)
def test_adapters_match_hf_and_peft(base, name):
    """Every position's logits with the adapter in a slot equal HF + PEFT's (which the golden
    script checks against the merged weights), with the layers unrolled and scanned, the slots
    masked or grouped (alternating over the cases); the base model's slot (-1) in the same step
    does not."""
    config, params = _base(base)
    path, golden = _golden(base, name)
    adapter = load_peft_adapter(path, config, 8)
    grouped = TINY_ADAPTERS.index((base, name)) % 2 == 1
    lora = _slots_with(config, {2: adapter}, grouped=grouped)
    n = int(golden["lengths"][0])
    ids = golden["input_ids"][0, :n]
    for p in (params, stack_layers(params)):
        got = _logits({**p, "lora": lora}, config, [ids, ids], [2, -1])
        want = golden["logits"][0, :n]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4 * scale)
        assert np.abs(got[1] - want).max() > 0.1 * scale  # the base row: no adapter


@pytest.mark.parametrize("grouped", [False, True], ids=["masked", "grouped"])
def test_one_step_mixes_adapters_and_the_base_model(grouped):
    """Five rows in one step, three adapters in slots and the base model: each row's logits
    equal the row alone (masked: the other slots' columns zeroed exactly; grouped: the rows
    sorted by slot and back); the two forms agree."""
    config, params = _base("llama")
    adapters = {s: load_peft_adapter(os.path.join(LORA, "llama", n), config, 8)
                for s, n in enumerate(["qv_r4", "all_r8", "od_rslora"])}  # fmt: skip
    p = {**params, "lora": _slots_with(config, adapters, grouped=grouped)}
    rows = np.random.default_rng(0).integers(3, 250, (5, 12))
    slots = [1, -1, 2, 0, 1]
    together = _logits(p, config, rows, slots)
    for b, slot in enumerate(slots):
        alone = _logits(p, config, rows[b : b + 1], [slot])[0]
        np.testing.assert_allclose(together[b], alone, rtol=1e-5, atol=1e-5)
    base = _logits(params, config, rows[1:2], [-1])[0]  # params without slots at all
    np.testing.assert_allclose(together[1], base, rtol=1e-5, atol=1e-5)
    other = {**params, "lora": _slots_with(config, adapters, grouped=not grouped)}
    np.testing.assert_allclose(_logits(other, config, rows, slots), together, rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.fixture(scope="module")
def patterned(tmp_path_factory) -> str:
    return _patterned_adapter(tmp_path_factory.mktemp("lora"))


def _patterned_adapter(tmp_path) -> str:
    """A fourth llama adapter written here: all_r8's q/v weights under another name, with
    PEFT's per-module alpha_pattern (v_proj: alpha 4) and layers_to_transform ([1]: layer 0's
    weights dropped), to check those readings against the arithmetic."""
    src = os.path.join(LORA, "llama", "all_r8")
    dst = tmp_path / "patterned"
    dst.mkdir()
    from safetensors.numpy import load_file, save_file

    tensors = {
        k: v
        for k, v in load_file(os.path.join(src, "adapter_model.safetensors")).items()
        if (".q_proj." in k or ".v_proj." in k) and ".layers.1." in k
    }
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    config = json.loads(open(os.path.join(src, "adapter_config.json")).read())
    config.update(target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 4},
                  layers_to_transform=[1])  # fmt: skip
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def test_peft_config_readings(patterned):
    """Scaling as PEFT defines it: alpha / r, alpha / sqrt(r) with use_rslora, alpha_pattern per
    module; layers the adapter leaves out are zero."""
    config, _ = _base("llama")
    from safetensors.numpy import load_file

    raw = load_file(os.path.join(LORA, "llama", "od_rslora", "adapter_model.safetensors"))
    od = load_peft_adapter(os.path.join(LORA, "llama", "od_rslora"), config, 8)
    B = raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    np.testing.assert_allclose(od.weights["w_down"][1][1], (B * 8 / 2.0).T, rtol=1e-6)
    assert od.rank == 4 and od.targets == ("o_proj", "down_proj")
    p = load_peft_adapter(patterned, config, 8)
    raw = load_file(os.path.join(LORA, "llama", "all_r8", "adapter_model.safetensors"))
    Bq = raw["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    Bv = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    np.testing.assert_allclose(p.weights["wq"][1][1], (Bq * 16 / 8).T, rtol=1e-6)
    np.testing.assert_allclose(p.weights["wv"][1][1], (Bv * 4 / 8).T, rtol=1e-6)
    assert not p.weights["wq"][0][0].any() and not p.weights["wq"][1][0].any()


@functools.cache
def _tiny_llm(kernel: str = "auto", **options) -> LLM:
    base = dict(enable_lora=True, max_lora_rank=8, max_num_seqs=8, num_pages=96, max_model_len=64,
                compilation_cache_dir="", overrides={"lora.kernel": kernel})  # fmt: skip
    return LLM(os.path.join(TESTDATA, "hf_tiny", "llama"), **(base | options))


def _requests(patterned: str):
    adapters = [LoRARequest(n, i + 1, os.path.join(LORA, "llama", n))
                for i, n in enumerate(["qv_r4", "all_r8", "od_rslora"])]  # fmt: skip
    adapters.append(LoRARequest("patterned", 4, patterned))
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 250, 24).tolist()  # a prefix every adapter's prompts share
    prompts, loras = [], []
    for i in range(10):
        tail = rng.integers(3, 250, int(rng.integers(2, 14))).tolist()
        prompts.append(shared[: 8 + 2 * i] + tail)
        loras.append(None if i % 5 == 4 else adapters[i % 4])
    return prompts, loras


@pytest.mark.parametrize("policy, kernel", [("sarathi", "masked"), ("prefill_first", "grouped")])
def test_a_batch_of_four_adapters_and_the_base_gives_each_its_output_alone(
    policy, kernel, patterned
):
    """Ten requests over four adapters and the base model, sharing a prompt prefix, in a
    cache small enough to preempt, two device slots (adapters swap), prompts chunked beside
    decodes: each request's greedy tokens are the ones it gets alone. The adapters of the HF
    goldens give their HF + PEFT greedy tokens through the engine."""
    prompts, loras = _requests(patterned)
    alone_llm = _tiny_llm(prefix_cache="none", max_loras=1)
    alone = [alone_llm.generate([p], GREEDY, lora_request=lr)[0].token_ids
             for p, lr in zip(prompts, loras, strict=True)]  # fmt: skip
    budget = 16 if policy == "sarathi" else 64  # whole prompts: the budget holds the longest
    llm = _tiny_llm(kernel, max_loras=2, num_pages=10, page_size=8,
                    max_num_batched_tokens=budget, scheduler_policy=policy)  # fmt: skip
    assert lora_slots.is_grouped(llm.engine.runner.params["lora"]) == (kernel == "grouped")
    writes, compiles = llm.engine.runner.num_lora_writes, llm.engine.runner.num_compiles
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.runner.num_lora_writes - writes > 2  # more adapters than slots: swaps
    assert llm.engine.runner.num_compiles - compiles <= len(llm.engine.buckets.shapes())
    for name in ["qv_r4", "all_r8", "od_rslora"]:
        _, golden = _golden("llama", name)
        n = int(golden["lengths"][0])
        lr = next(lr for lr in loras if lr is not None and lr.lora_name == name)
        params = dataclasses.replace(GREEDY, max_tokens=len(golden["greedy_ids"]))
        got = llm.generate([golden["input_ids"][0, :n].tolist()], params, lora_request=lr)
        assert got[0].token_ids == golden["greedy_ids"].tolist()


def test_the_prefix_cache_keeps_adapters_apart():
    """A prompt cached under adapter A is a miss for adapter B and for the base model (and
    the reverse), a hit for A again; the radix tree's page keys differ by adapter."""
    llm = _tiny_llm(max_loras=2)
    a = LoRARequest("qv_r4", 1, os.path.join(LORA, "llama", "qv_r4"))
    b = LoRARequest("all_r8", 2, os.path.join(LORA, "llama", "all_r8"))
    prompt = np.random.default_rng(3).integers(3, 250, 40).tolist()
    llm.engine.reset_prefix_cache()
    cached = [llm.generate([prompt], GREEDY, lora_request=lr)[0].num_cached_tokens
              for lr in (a, b, None, a, b, None)]  # fmt: skip
    assert cached[:3] == [0, 0, 0] and min(cached[3:]) > 0, cached
    cache = llm.engine.block_manager.prefix_cache
    keys = {ns: cache.path_keys(cache.match(prompt, ns).node)
            for ns in (None, a.cache_namespace, b.cache_namespace)}  # fmt: skip
    assert all(keys.values()) and len({k[0] for k in keys.values()}) == 3
    cache.check_invariants()


def test_the_kv_tiers_keep_adapters_apart():
    """With a host KV tier a prefix computed under adapter A (its device pages dropped) loads
    back for A, with A's outputs, and is neither served to adapter B nor to the base model
    (their keys are salted by the adapter)."""
    from llmjax.config import KVStoreConfig

    kv = KVStoreConfig(host_blocks=64, block_size=16, write_policy="write_through",
                       load_policy="always")  # fmt: skip
    llm = _tiny_llm(max_loras=2, page_size=8).with_options(kv_store=kv)
    a = LoRARequest("qv_r4", 1, os.path.join(LORA, "llama", "qv_r4"))
    b = LoRARequest("all_r8", 2, os.path.join(LORA, "llama", "all_r8"))
    prompt = np.random.default_rng(5).integers(3, 250, 40).tolist()
    alone = {x: _tiny_llm(prefix_cache="none", max_loras=1).generate(
        [prompt], GREEDY, lora_request=x)[0].token_ids for x in (a, b, None)}  # fmt: skip
    tiers = []
    for x in (a, a, b, None, b):
        [out] = llm.generate([prompt], GREEDY, lora_request=x)
        assert out.token_ids == alone[x]
        tiers.append(out.num_cached_tokens_per_tier)
        llm.engine.reset_prefix_cache()  # a hit from now on is a load from the host tier
    assert tiers[0] == tiers[2] == tiers[3] == {"device": 0}, tiers
    assert tiers[1] == tiers[4] == {"device": 0, "host": 32}, tiers
    llm.engine.kv_tiers.check_invariants()


def test_bad_adapters_are_refused_and_the_others_served(tmp_path):
    llm = _tiny_llm(max_loras=2, max_lora_rank=4)
    good = LoRARequest("qv_r4", 1, os.path.join(LORA, "llama", "qv_r4"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(os.path.join(LORA, "llama", "qv_r4"), corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 9)
    dora = tmp_path / "dora"
    shutil.copytree(os.path.join(LORA, "llama", "qv_r4"), dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    bad = {
        "no such directory": LoRARequest("gone", 2, str(tmp_path / "gone")),
        "exceeds max_lora_rank=4": LoRARequest("r8", 3, os.path.join(LORA, "llama", "all_r8")),
        "another base model": LoRARequest("qwen", 4, os.path.join(LORA, "qwen3", "qkvo_r8")),
        "cannot read it": LoRARequest("corrupt", 5, str(corrupt)),
        "DoRA": LoRARequest("dora", 6, str(dora)),
        "names adapter 'qv_r4'": LoRARequest("other", 1, os.path.join(LORA, "llama", "od_rslora")),
    }
    prompt = list(range(3, 20))
    outs = llm.generate([prompt] * (len(bad) + 1), GREEDY, lora_request=[good, *bad.values()])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == GREEDY.max_tokens
    for out, why in zip(outs[1:], bad, strict=True):
        assert out.finish_reason == "error" and why in out.error, (why, out.error)
    plain = LLM(os.path.join(TESTDATA, "hf_tiny", "llama"), num_pages=16, max_model_len=64,
                compilation_cache_dir="")  # fmt: skip
    [out] = plain.generate([prompt], GREEDY, lora_request=good)
    assert out.finish_reason == "error" and "enable_lora" in out.error
    config, _ = _base("llama")
    with pytest.raises(LoRAError, match="do not hold"):  # the slots' targets
        load_peft_adapter(os.path.join(LORA, "llama", "all_r8"), config, 8, ("q_proj",))


def _random_adapter(config, root, seed: int, rank: int = 4) -> str:
    """A PEFT directory with random A and B (rank `rank`) on every projection of `config`."""
    from safetensors.numpy import save_file

    from llmjax.config import lora_projection_dims

    rng, dims, tensors = np.random.default_rng(seed), lora_projection_dims(config), {}
    for layer in range(config.num_layers):
        for target, name in LORA_TARGETS.items():
            n_in, n_out = dims[name]
            part = "self_attn" if name in ("wq", "wk", "wv", "wo") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (rank, n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (n_out, rank)).astype(np.float32)
    path = os.path.join(root, f"random{seed}")
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": rank, "target_modules": list(LORA_TARGETS)}, f)
    return path


@pytest.mark.parametrize("name, tp, layout", [("llama_tied", 2, "replicate"),
                                              ("llama", 3, "pad")])  # fmt: skip
def test_tensor_parallel_slots_equal_one_device(name, tp, layout, tmp_path):
    """With tp the slots are split as the weights they attach to, the heads of B (q, k, v) and
    of A (o) laid out as the base weights' (kv heads repeated, or zero heads padded): greedy
    tokens of a batch over two adapters and the base model equal one device's."""
    from llmjax.parallel.heads import tp_head_layout

    path = os.path.join(TESTDATA, "hf_tiny", name)
    config, _ = _base(name)
    assert tp_head_layout(config, tp, pad_heads=True).kind == layout
    loras = [LoRARequest(f"r{i}", i + 1, _random_adapter(config, tmp_path, i)) for i in range(2)]
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(5)]
    wanted = [loras[0], None, loras[1], loras[0], loras[1]]
    opts = dict(enable_lora=True, max_loras=2, max_lora_rank=4, max_model_len=64, num_pages=32,
                compilation_cache_dir="")  # fmt: skip
    one = LLM(path, **opts).generate(prompts, GREEDY, lora_request=wanted)
    many = LLM(path, tp=tp, pad_heads=True, **opts).generate(prompts, GREEDY, lora_request=wanted)
    assert [o.token_ids for o in many] == [o.token_ids for o in one]
    assert one[0].token_ids != one[1].token_ids  # the adapters change the output


def test_configs_refuse_what_lora_does_not_run_with():
    from llmjax.config import EngineConfig

    config, _ = _base("llama")
    for bad in (dict(max_loras=0), dict(max_lora_rank=0), dict(max_loras=4, max_cpu_loras=2),
                dict(target_modules=("embed_tokens",))):  # fmt: skip
        with pytest.raises(ValueError):
            LoRAConfig(**bad)
    assert LoRAConfig().targets_for(mixture_of_experts=True) == ("q_proj", "k_proj", "v_proj",
                                                                 "o_proj")  # fmt: skip
    from llmjax.config import ParallelConfig

    with pytest.raises(ValueError, match="pp == 1"):
        EngineConfig(model=config, lora=LoRAConfig(), parallel=ParallelConfig(pp=2))


# ---- the host cache and the device slots, under random use -----------------------------------


@dataclasses.dataclass
class _FakeWeights:
    lora_id: int


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    max_loras=st.integers(1, 3),
    extra_cpu=st.integers(0, 2),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 6)),
            st.tuples(st.just("remove"), st.integers(1, 6)),
            st.tuples(st.just("step"), st.sets(st.integers(1, 6), max_size=3)),
        ),
        max_size=40,
    ),
)
def test_lora_manager_keeps_its_invariants(max_loras, extra_cpu, ops):
    """Random registrations, removals and steps: after each, the manager's invariants hold, a
    step's adapters each sit in their own slot holding exactly their weights (what the fake
    device received), and the host cache reads an adapter again only after evicting it."""
    config = LoRAConfig(max_loras=max_loras, max_cpu_loras=max_loras + extra_cpu)
    device: dict[int, int] = {}  # slot -> the adapter whose weights it was last written
    reads: list[int] = []

    def loader(path, model, rank, targets):
        lora_id = int(path.rsplit("/", 1)[1])
        reads.append(lora_id)
        return _FakeWeights(lora_id)

    write = lambda slot, weights: device.__setitem__(slot, weights.lora_id)
    m = LoRAManager(config, None, tuple(LORA_TARGETS), write, loader)
    for op, arg in ops:
        n = len(reads)
        if op == "add":
            cached = arg in m.host
            m.add(LoRARequest(f"a{arg}", arg, f"/adapters/{arg}"))
            assert arg in m.host and len(reads) == n + (not cached)
        elif op == "remove":
            registered = arg in m.adapters
            assert m.remove(arg) == registered
            assert arg not in m.adapters and arg not in m.host and arg not in m.slots
        else:
            wanted = {a for a in arg if a in m.adapters}
            if len(wanted) > max_loras:
                with pytest.raises(RuntimeError):
                    m.slots_for(wanted)
                continue
            before = list(m.slots)
            # a read only for an adapter that needs a slot and left the host cache
            fresh = {a for a in wanted if a not in m.slots and a not in m.host}
            got = m.slots_for(wanted)
            assert sorted(reads[n:]) == sorted(fresh)
            assert set(got) == wanted and len(set(got.values())) == len(wanted)
            for lora_id, slot in got.items():
                assert m.slots[slot] == lora_id and device[slot] == lora_id
            kept = [s for s, a in enumerate(before) if a is not None and a == m.slots[s]]
            assert all(device[s] == m.slots[s] for s in kept)
        m.check_invariants()


def test_smollm2_adapter_matches_hf_and_peft(smollm2_path):
    """SmolLM2-135M-Instruct with a rank-4 adapter on q, v and down (its Q4_1 GGUF dequantized
    to float32 on both sides): the engine's greedy tokens equal HF + PEFT's, and every prompt
    position's logits (at 256 vocabulary ids) agree to 1e-4 of their scale."""
    path, golden = _golden("smollm2", "qvd_r4")
    llm = LLM(smollm2_path, enable_lora=True, max_lora_rank=4, max_model_len=128, num_pages=24,
              compilation_cache_dir="")  # fmt: skip
    adapter = LoRARequest("qvd_r4", 1, path)
    n = int(golden["lengths"][0])
    ids = golden["input_ids"][0, :n]
    params = dataclasses.replace(GREEDY, max_tokens=len(golden["greedy_ids"]))
    [out] = llm.generate([ids.tolist()], params, lora_request=adapter)
    assert out.token_ids == golden["greedy_ids"].tolist()
    runner = llm.engine.runner
    slot = llm.engine.lora.slot_of(1)
    got = _logits(runner.params, runner.model_config, [ids], [slot], page_size=16)[0]
    want = golden["logits"][0, :n]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[:, golden["vocab_subset"]], want, rtol=1e-4, atol=1e-4 * scale)


def test_the_simulator_prices_the_slots_and_their_loads():
    """On the simulated device (no weights, no files) adapters run through the real scheduler
    and manager; the roofline charges every slot's shrink and expand (more slots, more time)
    and each slot load over the host link."""
    import configs
    from llmjax.config import lora_projection_dims
    from llmjax.sim.cost import StepFeatures
    from llmjax.sim.roofline import RooflineCostModel

    model = configs.get_preset("llama2-7b")
    targets = tuple(LORA_TARGETS)
    f = StepFeatures(tokens=256, prefill_attention=0, decodes=256, decode_context=256 * 1024)
    plain = RooflineCostModel(model, "a100-80gb")
    slots = [RooflineCostModel(model, "a100-80gb", lora_columns=c, lora_targets=targets)
             for c in (16, 64, 1024)]  # fmt: skip
    lora = [m.layer_seconds(f)["lora"] for m in slots]
    assert 0 < lora[0] <= lora[1] < lora[2] and "lora" not in plain.layer_seconds(f)
    assert plain.step_seconds(f) < slots[0].step_seconds(f) < slots[2].step_seconds(f)
    # grouped (each token its own adapter's 16 columns): cheaper than 1024 masked columns where
    # the step computes (a prefill), reading the same slots' weights
    prefill = StepFeatures(tokens=4096, prefill_attention=4096, decodes=0, decode_context=0)
    grouped = RooflineCostModel(model, "a100-80gb", lora_columns=1024, lora_targets=targets,
                                lora_rank=16)  # fmt: skip
    assert grouped.layer_seconds(prefill)["lora"] < slots[2].layer_seconds(prefill)["lora"] / 3
    per_layer = sum(sum(lora_projection_dims(model)[LORA_TARGETS[t]]) for t in targets)
    nbytes = 2 * model.num_layers * per_layer * 16  # bfloat16, rank 16
    assert slots[0].lora_slot_seconds(16) == pytest.approx(nbytes / 25e9)

    llm = LLM("llama2-7b", device="sim", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=8, max_model_len=512)  # fmt: skip
    base = llm.with_options(enable_lora=False)
    adapters = [LoRARequest(f"a{i}", i + 1, f"/simulated/a{i}") for i in range(3)]
    prompts = [list(range(10, 10 + 64 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    times = []
    for engine, loras in ((base, None), (llm, [adapters[i % 3] for i in range(6)])):
        t0 = engine.engine.clock.now()
        outs = engine.generate(prompts, params, lora_request=loras)
        assert all(o.error is None and len(o.token_ids) == 16 for o in outs)
        times.append(engine.engine.clock.now() - t0)
    assert times[1] > times[0]
    assert llm.engine.runner.num_lora_writes >= 3  # three adapters through two slots

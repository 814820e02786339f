"""Mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE): the routed MLP
against a per-token loop over experts on random inputs (uneven groups, an expert holding every
token, experts receiving none, bf16), and the tiny HF checkpoints through the engine (the logits
against HF are tests/test_hf_parity.py): a continuous batch with chunked prefill, prefix-cache
hits, preemption and the layers unrolled or scanned decodes the golden prompt as HF does, and no
request's output depends on how it was batched. Compiles stay one per bucket: routing changes
group sizes, never shapes."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmjax.model.moe import experts_mlp, grouped_matmul, moe_mlp, route, sort_by_expert
from tests.conftest import TESTDATA


def _loop_reference(x, weights, experts, we_gate, we_up, we_down):
    """Each token, each of its k experts, one at a time, in float64 (silu gated MLP)."""
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    g, u, d = (np.asarray(w, np.float64) for w in (we_gate, we_up, we_down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(experts)[t]):
            a = x[t] @ g[e]
            h = a / (1 + np.exp(-a)) * (x[t] @ u[e])
            out[t] += weights[t, j] * (h @ d[e])
    return out


def _weights(key, E, D, F, dtype):
    kg, ku, kd = jax.random.split(key, 3)
    return (
        (jax.random.normal(kg, (E, D, F)) / np.sqrt(D)).astype(dtype),
        (jax.random.normal(ku, (E, D, F)) / np.sqrt(D)).astype(dtype),
        (jax.random.normal(kd, (E, F, D)) / np.sqrt(F)).astype(dtype),
    )


@pytest.mark.parametrize(
    "T, E, k, D, F, routing",
    [
        (13, 8, 2, 32, 24, "random"),  # uneven groups, some experts with none
        (5, 4, 1, 16, 8, "random"),
        (9, 6, 3, 32, 16, "one_expert"),  # every token's first choice is expert 4
        (7, 16, 2, 16, 8, "two_experts"),  # 14 of 16 experts receive nothing
        (1, 8, 8, 16, 8, "random"),  # one token, every expert
    ],
)
def test_experts_mlp_equals_a_per_token_loop(T, E, k, D, F, routing):
    keys = jax.random.split(jax.random.key(T * 100 + E), 3)
    x = jax.random.normal(keys[0], (T, D))
    router = jax.random.normal(keys[1], (D, E)) / np.sqrt(D)
    if routing == "one_expert":
        router = router.at[:, 4].set(0.0)
        x = x.at[:, 0].set(50.0)  # the expert-4 column dominates through a big feature
        router = router.at[0, 4].set(1.0)
    elif routing == "two_experts":
        router = router.at[0, :].set(-10.0).at[0, 3].set(10.0).at[0, 11].set(9.0)
        x = x.at[:, 0].set(jnp.abs(x[:, 0]) + 2.0)
    weights, experts = route(x, router, k, normalize=True)
    if routing == "one_expert":
        assert (np.asarray(experts)[:, 0] == 4).all()
    if routing == "two_experts":
        assert set(np.asarray(experts).ravel()) == {3, 11}
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    ws = _weights(keys[2], E, D, F, jnp.float32)
    want = _loop_reference(x, weights, experts, *ws)
    got = jax.jit(experts_mlp)(x, weights, experts, *ws)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # bfloat16 weights and activations: within bf16 rounding of the exact result.
    got16 = experts_mlp(
        x.astype(jnp.bfloat16), weights, experts, *(w.astype(jnp.bfloat16) for w in ws)
    )
    np.testing.assert_allclose(
        np.asarray(got16, np.float32), want, rtol=0, atol=0.05 * np.abs(want).max()
    )


@pytest.mark.parametrize(
    "ep, group, T, E, k, F, routing",
    [
        (2, 1, 13, 8, 2, 16, "random"),  # T not a multiple of ep: a padding token
        (4, 1, 9, 8, 2, 16, "one_expert"),  # every pair to one expert group
        (8, 1, 5, 8, 3, 16, "two_experts"),  # 6 of 8 devices receive nothing
        (2, 4, 11, 8, 2, 16, "random"),  # EP x TP: each expert's hidden dim split over 4
        (4, 2, 3, 16, 4, 10, "random"),  # fewer tokens than devices; F 10 % 2: split
        (2, 2, 6, 4, 2, 9, "random"),  # F 9 % 2 != 0: hidden dims stay whole (replicated)
    ],
)
def test_expert_parallel_mlp_equals_one_device(ep, group, T, E, k, F, routing):
    """The all-to-all dispatch over 'ep' (and the hidden split over 'tp') on fake devices gives
    the one-device MoE output, whatever the routing sends where."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from llmjax.config import ParallelConfig
    from llmjax.model.moe import expert_parallel_mlp
    from llmjax.parallel.mesh import make_mesh

    D = 16
    keys = jax.random.split(jax.random.key(ep * 100 + T), 3)
    x = jax.random.normal(keys[0], (T, D))
    router = jax.random.normal(keys[1], (D, E))
    if routing == "one_expert":
        router = router.at[0, :].set(-20.0).at[0, 1].set(20.0)
        x = x.at[:, 0].set(jnp.abs(x[:, 0]) + 3.0)
    elif routing == "two_experts":
        router = router.at[0, :].set(-20.0).at[0, 2].set(20.0).at[0, 3].set(19.0)
        router = router.at[0, 5].set(18.0)
        x = x.at[:, 0].set(jnp.abs(x[:, 0]) + 3.0)
    weights, experts = route(x, router, k, normalize=True)
    if routing == "one_expert":
        assert (np.asarray(experts)[:, 0] == 1).all()
    ws = _weights(keys[2], E, D, F, jnp.float32)
    want = np.asarray(experts_mlp(x, weights, experts, *ws))
    mesh = make_mesh(ParallelConfig(tp=ep * group, ep=ep))
    split = F % group == 0
    specs = [P("ep", None, "tp" if split else None)] * 2 + [P("ep", "tp" if split else None)]
    placed = [jax.device_put(w, NamedSharding(mesh, s)) for w, s in zip(ws, specs, strict=True)]
    f = jax.jit(lambda *a: expert_parallel_mlp(*a, mesh=mesh))
    got = f(x, weights, experts, *placed)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    hlo = f.lower(x, weights, experts, *placed).compile().as_text()
    assert "all-to-all" in hlo  # tokens travel to their experts' devices and back


def test_routing_sorting_and_grouped_matmul():
    # route: top-k of the softmax; renormalized or not; ties to the lower index.
    x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    router = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])  # token 1: experts 0 and 1 tie
    w, e = route(x, router, 2, normalize=False)
    probs = jax.nn.softmax(x @ router, axis=-1)
    assert e.tolist() == [[0, 1], [2, 0]]
    np.testing.assert_allclose(w, np.sort(probs, -1)[:, ::-1][:, :2], rtol=1e-6)
    w, e = route(jnp.ones((1, 2)), jnp.zeros((2, 4)), 2, normalize=True)
    assert e.tolist() == [[0, 1]] and np.allclose(w, 0.5)
    # sort_by_expert: the In/Out example of llmjax/model/moe.py.
    order, sizes = sort_by_expert(jnp.array([[2, 0], [0, 1]]), 3)
    assert order.tolist() == [1, 2, 3, 0] and sizes.tolist() == [2, 1, 1]
    # grouped_matmul against per-group matmuls, with an empty group.
    rows = jax.random.normal(jax.random.key(0), (6, 4))
    w = jax.random.normal(jax.random.key(1), (3, 4, 5))
    sizes = jnp.array([4, 0, 2])
    want = np.concatenate([rows[:4] @ w[0], rows[4:] @ w[2]])
    np.testing.assert_allclose(grouped_matmul(rows, w, sizes), want, rtol=1e-5, atol=1e-5)


def test_shared_expert_is_added_with_its_sigmoid_gate():
    from llmjax.config import ModelConfig
    from llmjax.model.layers import gated_mlp

    config = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=1, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, shared_expert_intermediate_size=12,
                         architecture="qwen2_moe", attention_bias=True)  # fmt: skip
    from llmjax.model.params import init_params

    layer = init_params(config, jax.random.key(3))["layers"][0]
    x = jax.random.normal(jax.random.key(4), (5, 16))
    routed = moe_mlp({k: v for k, v in layer.items() if not k.startswith("ws_")}, x, config)
    shared = gated_mlp(x, layer["ws_gate"], layer["ws_up"], layer["ws_down"])
    gate = jax.nn.sigmoid(x @ layer["ws_score"])[:, None]
    np.testing.assert_allclose(
        moe_mlp(layer, x, config), routed + gate * shared, rtol=1e-5, atol=1e-6
    )


def test_moe_configs_are_checked():
    from llmjax.config import ModelConfig

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                num_kv_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**base, num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**base, num_experts=4)
    with pytest.raises(ValueError, match="needs num_experts"):
        ModelConfig(**base, architecture="mixtral")
    with pytest.raises(ValueError, match="shared expert"):
        ModelConfig(**base, shared_expert_intermediate_size=4)
    hf = {**base, "model_type": "qwen3_moe", "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    hf.pop("num_layers"), hf.pop("num_heads"), hf.pop("num_kv_heads")
    assert ModelConfig.from_hf_config(hf).expert_intermediate_size == 768  # HF's default
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf_config({**hf, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_hf_config({**hf, "decoder_sparse_step": 2})
    from llmjax import LLM

    with pytest.raises(ValueError, match="SmoothQuant of a mixture of experts"):
        LLM(os.path.join(TESTDATA, "hf_tiny", "mixtral"), quantization="w8a8", smoothquant=0.5)


# ---------------------------------------------------------------------------------------------
# The tiny HF checkpoints through the engine.

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _engine_run(name, **kw):
    from llmjax import LLM, SamplingParams
    from tests.parallel_cases import prompts

    path = os.path.join(TESTDATA, "hf_tiny", name)
    golden = np.load(os.path.join(path, "golden.npz"))
    work = [golden["input_ids"][0][: golden["lengths"][0]].tolist(), *prompts(4)]
    opts = dict(page_size=4, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=96,
                prefix_cache="radix", compilation_cache_dir="")  # fmt: skip
    llm = LLM(path, **{**opts, **kw})
    outs = llm.generate(work, SamplingParams(max_tokens=16, ignore_eos=True))
    return llm, [o.token_ids for o in outs], golden["greedy_ids"].tolist(), outs


@pytest.fixture(scope="module")
def baseline():
    return {}


@pytest.mark.parametrize("name", MOE)
def test_batched_greedy_equals_hf(baseline, name):
    llm, got, hf, outs = _engine_run(name)
    baseline[name] = got
    assert got[0] == hf  # the golden prompt, chunked, in a mixed batch, decodes as HF does
    assert sum(o.num_cached_tokens for o in outs) > 0  # shared prefixes hit the radix cache
    assert llm.engine.num_compiles <= len(llm.engine.buckets.shapes())


@pytest.mark.parametrize(
    "name, opts",
    [
        ("qwen2_moe", dict(prefix_cache="none", num_pages=20, layer_loop="unroll")),  # preempts
        ("qwen3_moe", dict(tp=2)),  # attention heads and every expert's hidden dim split
        ("mixtral", dict(tp=2, ep=2)),  # 4 whole experts per device
        ("qwen2_moe", dict(tp=4, ep=2)),  # EP x TP, with the shared expert tensor-parallel
        ("qwen3_moe", dict(tp=8, ep=8, pad_heads=True)),  # one expert per device
        ("mixtral", dict(pp=2, tp=2, ep=2)),  # EP inside each pipeline stage
    ],
    ids=["preempt-unroll", "tp2", "ep2", "ep2xtp2", "ep8", "pp2-ep2"],
)
def test_outputs_do_not_depend_on_layout_cache_or_preemption(baseline, name, opts):
    if name not in baseline:
        baseline[name] = _engine_run(name)[1]
    llm, got, _, _ = _engine_run(name, **opts)
    assert got == baseline[name]
    if "num_pages" in opts:
        assert llm.engine.stats.num_preemptions > 0
    if "ep" in opts:
        assert llm.engine.runner.mesh.shape["ep"] == opts["ep"]
        assert llm.engine.num_compiles <= len(llm.engine.buckets.shapes())


def test_expert_parallel_step_moves_tokens_and_gathers_no_expert_weight():
    """The engine's compiled step at tp=2, ep=2: each MoE layer's tokens go to their experts'
    devices and back by all-to-all (token-sized), and no expert weight is ever gathered."""
    import re

    from llmjax import LLM
    from tests.parallel_cases import compiled_step_hlo

    path = os.path.join(TESTDATA, "hf_tiny", "mixtral")
    llm = LLM(path, tp=2, ep=2, layer_loop="unroll", max_num_batched_tokens=16,
              page_size=4, max_model_len=64, compilation_cache_dir="")  # fmt: skip
    m = llm.engine.runner.model_config
    T = 16
    hlo = compiled_step_hlo(llm, T)
    k, D, L = m.num_experts_per_tok, m.hidden_size, m.num_layers
    a2a = [line for line in hlo.splitlines() if " all-to-all(" in line]
    # Per layer: the rows there and back (one [1, C, D] block per device, C = T / ep * k) and
    # the rows' local expert ids there.
    rows = [line for line in a2a if f"f32[1,{T // 2 * k},{D}]" in line.split("all-to-all(")[0]]
    assert len(rows) == 2 * L and len(a2a) == 3 * L, a2a
    gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
    expert = m.expert_intermediate_size * D
    assert all(np.prod([int(d) for d in g.split(",")]) < expert for g in gathered), gathered


def test_expert_parallelism_is_checked():
    from llmjax import LLM
    from llmjax.config import ParallelConfig

    with pytest.raises(ValueError, match="must divide tp"):
        ParallelConfig(tp=4, ep=3)
    with pytest.raises(ValueError, match="no experts"):
        LLM(os.path.join(TESTDATA, "hf_tiny", "llama"), tp=2, ep=2, compilation_cache_dir="")


# ---------------------------------------------------------------------------------------------
# The simulator's MoE terms (llmjax/sim/roofline.py).


@pytest.mark.parametrize(
    "name, total, active",
    [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235, 22)],
)
def test_presets_have_the_published_parameter_counts(name, total, active):
    from configs import PRESETS
    from llmjax.sim.roofline import active_layer_weight_elements, model_weight_elements

    m = PRESETS[name]
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    assert model_weight_elements(m) / 1e9 == pytest.approx(total, rel=0.01)
    got_active = (m.num_layers * active_layer_weight_elements(m) + embed) / 1e9
    assert got_active == pytest.approx(active, rel=0.03)


def _systematic_sample(q, rng):
    """k distinct experts with inclusion probabilities exactly q (sum k, each <= 1): Madow's
    systematic sampling over the cumulative sums."""
    edges = np.concatenate([[0.0], np.cumsum(q)])
    points = rng.uniform() + np.arange(round(q.sum()))
    return np.searchsorted(edges, points, side="right") - 1


@pytest.mark.parametrize(
    "E, k, T, skew",
    [(8, 2, 1, 0.0), (8, 2, 3, 0.0), (8, 2, 16, 0.0), (128, 8, 4, 0.0), (128, 8, 64, 0.0),
     (64, 6, 8, 1.2), (64, 6, 32, 1.2), (16, 4, 5, 3.0)],
)  # fmt: skip
def test_expected_experts_touched_against_counted_routing(E, k, T, skew):
    from llmjax.sim.roofline import expected_experts_touched, expert_inclusion

    rng = np.random.default_rng(E * T + k)
    trials = 1500
    if skew == 0.0:  # the engine's own routing of random logits
        logits = rng.normal(size=(trials, T, E)).astype(np.float32)
        _, experts = jax.lax.top_k(jnp.asarray(logits), k)
        counts = [len(np.unique(e)) for e in np.asarray(experts)]
    else:
        q = expert_inclusion(E, k, skew)
        assert q.sum() == pytest.approx(k) and q.max() <= 1.0 and q[0] > q[-1]
        counts = [
            len(np.unique(np.concatenate([_systematic_sample(q, rng) for _ in range(T)])))
            for _ in range(trials)
        ]
    want = expected_experts_touched(E, k, T, skew)
    assert np.mean(counts) == pytest.approx(want, abs=4 * np.std(counts) / np.sqrt(trials) + 1e-9)
    if skew == 0.0:
        assert want == pytest.approx(E * (1 - (1 - k / E) ** T))


def test_roofline_reads_the_experts_a_batch_touches():
    from configs import PRESETS
    from llmjax.sim.cost import StepFeatures
    from llmjax.sim.roofline import RooflineCostModel, weight_bytes_per_device

    m = PRESETS["mixtral-8x7b"]
    cost = RooflineCostModel(m, "a100-80gb", "bfloat16", tp=2)
    hw = cost.hardware
    expert_bytes = 2 * 3 * m.hidden_size * m.intermediate_size / 2  # one expert, its tp half

    def experts_s(tokens):
        f = StepFeatures(tokens=tokens, prefill_attention=0, decodes=tokens, decode_context=0)
        return cost.layer_seconds(f)["experts"]

    read_s = expert_bytes / (hw.memory_bandwidth * hw.memory_efficiency)
    assert experts_s(1) == pytest.approx(2 * read_s, rel=0.01)  # one decode: its 2 experts
    assert experts_s(4) == pytest.approx(5.47 * read_s, rel=0.01)
    assert experts_s(64) > 8 * read_s  # every expert, and compute-bound by now
    # ep=2: half the experts' weights per device, plus the all-to-alls.
    ep = RooflineCostModel(m, "a100-80gb", "bfloat16", tp=2, ep=2)
    f = StepFeatures(tokens=256, prefill_attention=256 * 256, decodes=0, decode_context=0)
    assert ep.layer_seconds(f)["ep_all_to_all"] > 0 and "ep_all_to_all" not in cost.layer_seconds(f)
    tp_bytes = weight_bytes_per_device(m, "bfloat16", 2, 1)
    ep_bytes = weight_bytes_per_device(m, "bfloat16", 2, 1, ep=2)
    assert ep_bytes == pytest.approx(tp_bytes)  # the same share, split by expert instead
    with pytest.raises(ValueError, match="ep=2"):
        RooflineCostModel(PRESETS["mistral-7b"], "a100-80gb", tp=2, ep=2)

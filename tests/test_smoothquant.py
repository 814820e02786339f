"""SmoothQuant (llmjax/model/smooth.py): the smoothed float model is the same model; its
calibrated statistics are what they claim; W8A8 of it is closer to float32 on a model whose
activations have outlier channels; LLM(smoothquant=...) checks its value."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax import LLM
from llmjax.model import quant, smooth
from llmjax.model.layers import rms_norm
from llmjax.model.params import init_params
from tests.helpers import full_logits

OUTLIERS = {"attn_norm": (3, 40.0), "mlp_norm": (5, 25.0)}  # channel, factor: planted outliers


def _model(name="tiny", bias=False, outliers=True, seed=3):
    """A random model whose norms scale a channel up (as trained LLMs' outlier channels do)."""
    config = configs.get_preset(name)
    if bias:
        config = dataclasses.replace(config, attention_bias=True)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    for layer in params["layers"]:
        for k in ("attn_norm", "mlp_norm"):
            layer[k] = (1.0 + 0.2 * rng.standard_normal(layer[k].shape)).astype(np.float32)
            if outliers:
                channel, factor = OUTLIERS[k]
                layer[k][channel] *= factor
        for k in ("bq", "bk", "bv"):
            if k in layer:
                layer[k] = (0.1 * rng.standard_normal(layer[k].shape)).astype(np.float32)
    return config, params


def _tokens(config, n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, config.vocab_size, n)]


@pytest.mark.parametrize("scope", smooth.SCOPES)
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(("name", "bias"), [("tiny", False), ("tiny-gqa1", False), ("tiny", True)])
def test_smoothing_leaves_the_float_model_unchanged(scope, alpha, name, bias):
    """X @ W = (X / s) @ (s W), each division folded into a norm, w_up or wv: the logits of the
    smoothed float model equal the original's to float32 rounding (GQA groups sharing a kv head's
    factors, attention biases divided with wv)."""
    config, params = _model(name, bias)
    stats = smooth.collect_input_absmax(params, config, _tokens(config, 40, seed=1))
    smoothed = smooth.smooth_params(params, stats, config, alpha, scope)
    changed = [
        k
        for k in params["layers"][0]
        if not np.array_equal(params["layers"][0][k], smoothed["layers"][0][k])
    ]
    want = {"attn_norm", "wq", "wk", "wv", "mlp_norm", "w_gate", "w_up"}
    if scope == "all":
        want |= {"wo", "w_down"} | ({"bv"} if bias else set())
    assert set(changed) == want
    tokens = _tokens(config, 23)
    ref = full_logits(jax.tree.map(jnp.asarray, params), config, tokens)
    got = full_logits(jax.tree.map(jnp.asarray, smoothed), config, tokens)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_calibrated_statistics_are_the_inputs_largest_magnitudes():
    """Layer 0's attention input is rms_norm(embedding rows): its per-channel max over the
    tokens, computed directly, is what calibration recorded; every input has its width."""
    config, params = _model()
    tokens = _tokens(config, 37)
    stats = smooth.collect_input_absmax(params, config, tokens)
    x = rms_norm(
        jnp.asarray(params["embed"])[jnp.asarray(tokens)],
        jnp.asarray(params["layers"][0]["attn_norm"]),
        config.rms_norm_eps,
    )
    np.testing.assert_allclose(stats[0]["attn"], np.abs(np.asarray(x)).max(0), rtol=1e-5)
    D, N, H = config.hidden_size, config.num_heads, config.head_dim
    widths = {"attn": D, "o": N * H, "mlp": D, "down": config.intermediate_size}
    assert len(stats) == config.num_layers
    for s in stats:
        assert {k: v.shape for k, v in s.items()} == {k: (w,) for k, w in widths.items()}
        assert all(np.all(v >= 0) and np.any(v > 0) for v in s.values())
    assert stats[0]["attn"][OUTLIERS["attn_norm"][0]] > 5 * np.median(stats[0]["attn"])
    assert smooth.describe(stats)["attn"] > 5  # the planted outliers, as describe reports them


def test_migration_strength_moves_the_outliers_as_the_paper_defines():
    """alpha = 1: every smoothed input's channels all peak at 1 (all difficulty moved to the
    weights; wo's input per kv-head group); alpha = 0.5: each smoothed input channel peaks where
    the rows of the matrices reading it do."""
    config, params = _model()
    tokens = _tokens(config, 40, seed=2)
    stats = smooth.collect_input_absmax(params, config, tokens)
    flat = smooth.smooth_params(params, stats, config, 1.0)
    after = smooth.collect_input_absmax(flat, config, tokens)
    K, G, H = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
    for s in after:
        for what in ("attn", "mlp", "down"):
            np.testing.assert_allclose(s[what], 1.0, rtol=2e-3)
        np.testing.assert_allclose(s["o"].reshape(K, G, H).max(1), 1.0, rtol=2e-3)
    half = smooth.smooth_params(params, stats, config, 0.5, scope="norms")
    after = smooth.collect_input_absmax(half, config, tokens)
    for layer, s in zip(half["layers"], after, strict=True):
        rows = smooth._rows_absmax(layer["wq"], layer["wk"], layer["wv"])
        np.testing.assert_allclose(s["attn"], rows, rtol=2e-3)
        np.testing.assert_allclose(
            s["mlp"], smooth._rows_absmax(layer["w_gate"], layer["w_up"]), rtol=2e-3
        )


def test_w8a8_of_the_smoothed_model_is_closer_to_float32():
    """With outlier channels in the activations, per-token int8 rounds the other channels to a
    few levels; smoothed first (the scales calibrated on other tokens than those scored), the
    W8A8 logits are several times closer to float32's."""
    config, params = _model("tiny-h64")
    tokens = _tokens(config, 48, seed=5)
    ref = full_logits(jax.tree.map(jnp.asarray, params), config, tokens)

    def w8a8_error(p):
        got = full_logits(
            jax.tree.map(jnp.asarray, quant.quantize_params(p, "w8a8")), config, tokens
        )
        return np.linalg.norm(got - ref) / np.linalg.norm(ref)

    plain = w8a8_error(params)
    smoothed = w8a8_error(smooth.smoothquant(params, config, _tokens(config, 64, seed=6)))
    assert smoothed < plain / 2, (smoothed, plain)


def test_int8_packs_the_lm_head_weight_only():
    _, params = _model("tiny-gqa1")  # tied: the embedding is the LM head
    packed = quant.quantize_params(params, "w8a8")
    assert packed["embed"].fmt == "int8_wo" and packed["layers"][0]["wq"].fmt == "int8"
    _, params = _model("tiny")  # untied
    packed = quant.quantize_params(params, "w8a8")
    assert packed["lm_head"].fmt == "int8_wo" and not quant.is_packed(packed["embed"])


def test_calibration_tokens_are_the_texts_tail():
    from llmjax.data.texts import public_domain_text

    text = public_domain_text()
    ids = smooth.calibration_tokens(None, 300, 100)
    assert ids == [b % 300 for b in text.encode()][-100:]
    with pytest.raises(ValueError, match="fewer than"):
        smooth.calibration_tokens(None, 300, 10**7)


def test_llm_smoothquant_option():
    """'auto' smooths w8a8 (W8A8) only; a strength goes with w8a8 alone and lies in [0, 1];
    weights fixed at load: with_options refuses it."""
    opts = dict(load_format="dummy", max_model_len=64, num_pages=16, compilation_cache_dir="")
    llm = LLM("tiny", quantization="w8a8", **opts)
    assert llm.smoothquant_alpha == smooth.DEFAULT_ALPHA
    assert LLM("tiny", quantization="w8a8", smoothquant="none", **opts).smoothquant_alpha is None
    assert LLM("tiny", quantization="int8_wo", **opts).smoothquant_alpha is None
    assert LLM("tiny", quantization="w8a8", smoothquant="0.8", **opts).smoothquant_alpha == 0.8
    with pytest.raises(ValueError, match="W8A8"):
        LLM("tiny", smoothquant=0.5, **opts)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        LLM("tiny", quantization="w8a8", smoothquant=1.5, **opts)
    with pytest.raises(ValueError, match="migration strength"):
        LLM("tiny", quantization="w8a8", smoothquant="strong", **opts)
    with pytest.raises(ValueError, match="fix how the weights were loaded"):
        llm.with_options(smoothquant=0.8)
    out = llm.generate([_tokens(llm.model_config, 9)], None)
    assert len(out[0].token_ids) > 0


def test_bad_statistics_or_strength_are_refused():
    config, params = _model()
    stats = smooth.collect_input_absmax(params, config, _tokens(config, 8))
    with pytest.raises(ValueError, match="migration strength"):
        smooth.smooth_params(params, stats, config, -0.1)
    with pytest.raises(ValueError, match="scope"):
        smooth.smooth_params(params, stats, config, 0.5, scope="heads")
    with pytest.raises(ValueError, match="layers of statistics"):
        smooth.smooth_params(params, stats[:1], config, 0.5)
    with pytest.raises(ValueError, match="at least one token"):
        smooth.collect_input_absmax(params, config, [])

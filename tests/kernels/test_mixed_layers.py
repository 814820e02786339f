"""Every attention backend against the jnp reference on models whose layers differ: local
(sliding-window) and global layers in one step, Gemma 2's attention soft cap, Gemma 3's per-kind
RoPE, with the layers unrolled (each layer's window static) and scanned (the window picked per
layer by `lax.switch` over the per-layer table). float32, so the kernels must agree to rounding
(the Mosaic GPU kernel, bfloat16 only, to 2e-2 x max|logit| as in test_rpa_engine.py)."""

import functools

import numpy as np
import pytest

import configs
from llmjax.model.attention import make_attention_fn
from tests.kernels.kernel_testing import mixed_steps_logits, no_cpu_compiler

# head_dim 64: the smallest the Mosaic GPU kernel takes.
MODELS = {
    name: configs.get_preset(name).replace(hidden_size=128, head_dim=64)
    for name in ("tiny-gemma2", "tiny-gemma3")
}
BACKENDS = [
    dict(name="cpu"),
    dict(name="pallas", pallas_kernel="tpu"),
    dict(name="pallas", pallas_kernel="mgpu", bf16=True),
]
# The Mosaic GPU kernel interpreted takes ~25 s a case: Gemma 2 (windows and the soft cap),
# scanned (the window picked by lax.switch) stands for the rest.
CASES = [
    pytest.param(
        backend,
        model,
        stacked,
        id=f"{backend.get('pallas_kernel', backend['name'])}-{model}-"
        + ("scanned" if stacked else "unrolled"),
    )
    for backend in BACKENDS
    for model in sorted(MODELS)
    for stacked in (False, True)
    if backend.get("pallas_kernel") != "mgpu" or (model == "tiny-gemma2" and stacked)
]


def _prompts():
    rng = np.random.default_rng(7)
    return rng.integers(3, 256, 37).tolist(), rng.integers(3, 256, 21).tolist()


@pytest.mark.parametrize("backend, model, stacked", CASES)
def test_mixed_local_and_global_layers_match_the_reference(backend, model, stacked):
    import jax.numpy as jnp

    if backend["name"] == "cpu" and no_cpu_compiler():
        pytest.skip("no C++ compiler for the CPU kernels")
    config = MODELS[model]
    assert len(config.attention_kinds) == 2  # windows 8 and None in the same step
    a, b = _prompts()
    bf16 = backend.get("bf16", False)
    dtype, tol = (jnp.bfloat16, 2e-2) if bf16 else (jnp.float32, 2e-5)
    run = functools.partial(
        mixed_steps_logits, a=a, b=b, config=config, dtype=dtype, stacked=stacked
    )
    ref = run(make_attention_fn("reference"))
    kw = {k: v for k, v in backend.items() if k not in ("name", "bf16")}
    got = run(make_attention_fn(backend["name"], **kw))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    # The windows and the cap are in play: the model without them gives other logits.
    if not stacked and not bf16:
        plain = config.replace(layer_types=None, sliding_window=None, attn_logit_softcapping=None)
        other = mixed_steps_logits(
            make_attention_fn("reference"), a, b, config=plain, dtype=jnp.float32
        )
        assert np.abs(other - ref).max() > 1e-2 * np.abs(ref).max()

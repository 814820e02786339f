"""The TPU flash-attention prefill kernel against the jnp reference (interpret mode on the CPU),
the reference against an independent numpy loop, the public wrapper's dispatch and checks, and
the Mosaic lowering for the engine's models (jax.export for platform tpu).

Tolerances: float32 2e-5 absolute (outputs are convex combinations of N(0, 1) values, |out| < 4;
the kernel's online softmax differs from the reference's one-pass softmax only by f32 rounding,
observed <= 1e-6). bfloat16 2e-2 * max|ref|: both sides round the output to bf16 (one bf16 ulp is
2^-8 = 0.4% relative), and the kernel feeds p to the p @ v matmul in bf16 (another 2^-9 relative
per weight, as TPU flash kernels do); q.k products of bf16 inputs are exact in f32 on both sides.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.llama3 import LLAMA3_8B
from configs.smollm2 import SMOLLM2_135M
from kernels_pallas.flash_prefill import flash_prefill_attention
from kernels_pallas.flash_prefill.kernel_tpu import _kv_block_range, flash_prefill_tpu
from kernels_pallas.flash_prefill.reference import flash_prefill_reference
from tests.kernels.kernel_testing import assert_matches_reference

NUM_KV_HEADS = 2
# name: (seq_len, padded T: the power-of-two bucket)
CASES = {"one_token": (1, 8), "short": (7, 8), "full_bucket": (128, 128), "long": (200, 256)}
# name: (num_queries_per_kv, head_dim, dtype, sliding_window, soft_cap, block_q, block_kv)
CONFIGS = {
    "f32_gqa1_h64": (1, 64, np.float32, None, None, None, None),
    "f32_gqa3_h64": (3, 64, np.float32, None, None, None, None),
    "f32_gqa4_h128_blocks32": (4, 128, np.float32, None, None, 32, 32),
    "f32_gqa8_h64_window_cap_bq16_bkv32": (8, 64, np.float32, 40, 30.0, 16, 32),
    "bf16_gqa4_h128": (4, 128, jnp.bfloat16, None, None, None, None),
    "bf16_gqa8_h64_window_cap_blocks32": (8, 64, jnp.bfloat16, 24, 30.0, 32, 32),
}


def make_case(case: str, config: str, seed: int = 0):
    """Random normal q, k, v (never zeros) over the whole bucket, padding rows included."""
    seq_len, T = CASES[case]
    Q, H, dtype, *_ = CONFIGS[config]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, NUM_KV_HEADS * Q, H)).astype(dtype)
    k, v = (rng.standard_normal((T, NUM_KV_HEADS, H)).astype(dtype) for _ in range(2))
    return [q, k, v, np.array([seq_len], np.int32)]


@functools.cache
def kernel_fn(config: str):
    _, H, _, window, cap, bq, bkv = CONFIGS[config]
    fn = functools.partial(
        flash_prefill_tpu,
        sm_scale=H**-0.5,
        sliding_window=window,
        soft_cap=cap,
        interpret=True,
        block_q=bq,
        block_kv=bkv,
    )
    return jax.jit(fn)


def reference(args, config: str):
    _, H, _, window, cap, *_ = CONFIGS[config]
    return flash_prefill_reference(
        *map(jnp.asarray, args), sm_scale=H**-0.5, sliding_window=window, soft_cap=cap
    )


check = assert_matches_reference


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, config):
    args = make_case(case, config)
    out = kernel_fn(config)(*args)
    check(out, reference(args, config))
    seq_len = CASES[case][0]
    assert not np.asarray(out[seq_len:], np.float32).any()  # padded rows exactly 0


@pytest.mark.parametrize("config", ["f32_gqa4_h128_blocks32", "bf16_gqa8_h64_window_cap_blocks32"])
def test_padding_never_reaches_real_rows(config):
    """NaN in every padded row of q, k and v: real rows stay equal to the clean reference,
    padded rows are 0."""
    args = make_case("long", config, seed=3)
    seq_len = CASES["long"][0]
    poisoned = [a.copy() for a in args]
    for a in poisoned[:3]:
        a[seq_len:] = np.nan
    out = kernel_fn(config)(*poisoned)
    check(out, reference(args, config))
    assert not np.asarray(out[seq_len:], np.float32).any()


def test_kv_block_range_skips_blocks():
    """Causal and window skipping: q block 2 of 32 tokens (tokens 64..95) with a window of 24
    sees keys 41..95, i.e. kv blocks 1..2 of 32; blocks past seq_len and padded q blocks none."""
    rng = functools.partial(_kv_block_range, bq=32, bkv=32)
    assert tuple(map(int, rng(2, 200, sliding_window=24))) == (1, 2)
    assert tuple(map(int, rng(2, 200, sliding_window=None))) == (0, 2)
    assert tuple(map(int, rng(2, 70, sliding_window=None))) == (0, 2)  # keys < 70
    assert tuple(map(int, rng(2, 64, sliding_window=None))) == (0, -1)  # all rows padding


def numpy_attention(q, k, v, seq_len, *, sm_scale, sliding_window=None, soft_cap=None):
    """Row by row, head by head, in float64: an independent reading of the contract."""
    T, N, H = q.shape
    K = k.shape[1]
    out = np.zeros((T, N, H))
    for i in range(seq_len):
        lo = 0 if sliding_window is None else max(0, i - sliding_window + 1)
        for n in range(N):
            kv = n // (N // K)
            s = k[lo : i + 1, kv].astype(np.float64) @ q[i, n].astype(np.float64) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[i, n] = p @ v[lo : i + 1, kv] / p.sum()
    return out


@pytest.mark.parametrize(
    "seq_len, T, N, K, window, cap", [(5, 8, 4, 2, None, None), (11, 16, 6, 2, 4, 5.0)]
)
def test_reference_matches_numpy_loop(seq_len, T, N, K, window, cap):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((T, N, 16)).astype(np.float32)
    k, v = (rng.standard_normal((T, K, 16)).astype(np.float32) for _ in range(2))
    kwargs = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    ref = flash_prefill_reference(q, k, v, jnp.array([seq_len], jnp.int32), **kwargs)
    np.testing.assert_allclose(ref, numpy_attention(q, k, v, seq_len, **kwargs), atol=2e-6)


def test_wrapper_dispatch_and_checks():
    args = make_case("short", "f32_gqa3_h64")
    ref = reference(args, "f32_gqa3_h64")
    for impl in ("tpu", "reference", None):
        out = flash_prefill_attention(*args, sm_scale=64**-0.5, implementation=impl)
        check(out, ref)
    if jax.default_backend() == "cpu":
        with pytest.raises(RuntimeError, match="compiles only on"):
            flash_prefill_attention(*args, sm_scale=1.0, implementation="tpu", interpret=False)
    with pytest.raises(ValueError, match="N=6 must be a multiple of kv heads K=4"):
        flash_prefill_attention(
            args[0], *(np.ones((8, 4, 64), np.float32),) * 2, args[3], sm_scale=1.0
        )
    with pytest.raises(ValueError, match="seq_len must be int32"):
        flash_prefill_attention(*args[:3], np.array([7], np.int64), sm_scale=1.0)
    with pytest.raises(ValueError, match="unknown implementation='cuda'"):
        flash_prefill_attention(*args, sm_scale=1.0, implementation="cuda")
    with pytest.raises(ValueError, match="Mosaic GPU flash prefill kernel takes bfloat16"):
        flash_prefill_attention(*args, sm_scale=1.0, implementation="mgpu", interpret=True)


EXPORT_MODELS = {"smollm2": SMOLLM2_135M, "llama3_8b": LLAMA3_8B}


@pytest.mark.parametrize("num_tokens", [128, 512, 2048])
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_exports_for_tpu(model, num_tokens):
    """The Mosaic lowering (block-shape rules included) runs for the engine's prompt buckets."""
    config = EXPORT_MODELS[model]
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    sds = jax.ShapeDtypeStruct
    args = (
        sds((num_tokens, N, H), jnp.bfloat16),
        sds((num_tokens, K, H), jnp.bfloat16),
        sds((num_tokens, K, H), jnp.bfloat16),
        sds((1,), jnp.int32),
    )
    for window, cap in [(None, None), (256, 30.0)]:
        fn = functools.partial(
            flash_prefill_tpu, sm_scale=H**-0.5, sliding_window=window, soft_cap=cap
        )
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exported.mlir_module()
        assert exported.out_avals[0].shape == (num_tokens, N, H)

"""The Pallas ragged paged attention kernels over a quantized KV cache (issue 41): the TPU and the
Triton GPU kernel (interpret mode on the CPU) against the jnp reference, which dequantizes the
gathered pages (kernels_pallas/kv_quant.py); their lowerings for the real targets (jax.export for
tpu and cuda) with the codes and scales; the TPU kernel's scale DMAs in the TPU simulator; the
Mosaic GPU kernel's refusal.

Keys of magnitudes 1e-3 .. 3 and values of 1e-3 .. 1e3, one scale per row, so the scales matter
and the outputs reach ~1e3: float32's bound is relative to the largest output (the kernels and the
reference dequantize the same codes the same way; only the summation order differs), bfloat16's
is the kernel tests' (both sides round the output, the kernels feed p to p @ v in bfloat16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import kv_quant
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from llmjax.model import kv_cache
from tests.kernels import kernel_testing

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def quantized_case(case, kv_cache_dtype: str, seed: int = 12):
    """case's K/V rows rescaled per row (1e-3 .. 3 and 1e-3 .. 1e3) and quantized as the engine
    writes them (llmjax.model.kv_cache.quantize) -> (kq, vq, ks, vs)."""
    rng = np.random.default_rng(seed)
    rows = case.k_pages.shape[:3]
    k = np.asarray(case.k_pages, np.float32) * 10.0 ** rng.uniform(-3, 0.5, rows)[..., None]
    v = np.asarray(case.v_pages, np.float32) * 10.0 ** rng.uniform(-3, 3, rows)[..., None]
    (kq, ks), (vq, vs) = (kv_cache.quantize(jnp.asarray(x), kv_cache_dtype) for x in (k, v))
    return kq, vq, ks, vs


def check(out, ref, dtype):
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.dtype == ref.dtype and np.isfinite(out32).all()
    scale = np.abs(ref32).max()
    assert scale > 100  # the large values arrived
    np.testing.assert_allclose(out32, ref32, rtol=0, atol=TOL[dtype] * scale)


@pytest.mark.parametrize(
    "implementation, kv_cache_dtype, dtype, name",
    [  # each KV dtype with both q dtypes and both kernels, several ragged batches
        ("tpu", "int8", "float32", "mixed"),
        ("tpu", "fp8_e4m3", "bfloat16", "chunk_mid_page_crossing"),
        ("tpu", "fp8_e5m2", "float32", "small_pages"),
        ("gpu", "int8", "bfloat16", "small_pages"),
        ("gpu", "fp8_e4m3", "float32", "mixed"),
        ("gpu", "fp8_e5m2", "bfloat16", "decodes"),
    ],
)
def test_kernel_equals_the_dequantizing_reference(implementation, kv_cache_dtype, dtype, name):
    q_lens, kv_lens, G = RAGGED_CASES[name]
    case = make_case(q_lens, kv_lens, page_size=G, num_queries_per_kv=2, dtype=jnp.dtype(dtype))
    kq, vq, ks, vs = quantized_case(case, kv_cache_dtype)
    args = (jnp.asarray(case.q), kq, vq, *map(jnp.asarray, case.args[3:]))
    kw = dict(sm_scale=0.125, k_scales=ks, v_scales=vs, kv_cache_dtype=kv_cache_dtype)
    ref = ragged_paged_attention(*args, implementation="reference", **kw)
    out = ragged_paged_attention(*args, implementation=implementation, **kw)
    check(out, ref, dtype)
    valid = int(case.cu_q_lens[case.num_seqs[0]])
    assert (np.asarray(out, np.float32)[valid:] == 0).all()


def test_the_reference_is_the_engines_dequantized_pages():
    """kernels_pallas' reference over codes and scales equals it over the pages that
    llmjax.model.kv_cache dequantizes (the engine's reference backend reads those)."""
    case = make_case([3, 1, 9], [11, 40, 9], page_size=8, num_queries_per_kv=2)
    for kv_cache_dtype in kv_quant.KV_CACHE_DTYPES:
        kq, vq, ks, vs = quantized_case(case, kv_cache_dtype)
        rest = tuple(map(jnp.asarray, case.args[3:]))
        got = ragged_paged_attention(
            jnp.asarray(case.q), kq, vq, *rest, sm_scale=0.125, implementation="reference",
            k_scales=ks, v_scales=vs, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        deq = [
            kv_cache.dequantize(x, s, jnp.float32, kv_cache_dtype) for x, s in ((kq, ks), (vq, vs))
        ]
        want = ragged_paged_attention(
            jnp.asarray(case.q), *deq, *rest, sm_scale=0.125, implementation="reference"
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_split_kv_and_window_on_the_gpu_kernel():
    """Triton's split-KV path (float32 partials combined) and a window with a soft cap."""
    case = make_case([1, 20, 1], [300, 70, 45], pages_per_seq=24, num_queries_per_kv=2, seed=6)
    kq, vq, ks, vs = quantized_case(case, "fp8_e4m3")
    args = (jnp.asarray(case.q), kq, vq, *map(jnp.asarray, case.args[3:]))
    kw = dict(sm_scale=0.125, sliding_window=48, soft_cap=30.0)
    kw.update(k_scales=ks, v_scales=vs, kv_cache_dtype="fp8_e4m3")
    ref = ragged_paged_attention(*args, implementation="reference", **kw)
    out = ragged_paged_attention_gpu(*args, interpret=True, num_kv_splits=4, block_q=8, **kw)
    check(out, ref, "float32")


def test_scale_dmas_in_the_tpu_simulator():
    """The TPU kernel's code and scale copies in the simulator: uninitialized VMEM is NaN and
    races are tracked, so a scale copy not waited on shows up."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: races

    case = make_case([3, 1], [19, 9], page_size=8, num_kv_heads=2, num_queries_per_kv=2,
                     head_dim=128, max_num_seqs=3)  # fmt: skip
    kq, vq, ks, vs = quantized_case(case, "int8")
    args = (jnp.asarray(case.q), kq, vq, *map(jnp.asarray, case.args[3:]))
    kw = dict(sm_scale=0.1, k_scales=ks, v_scales=vs, kv_cache_dtype="int8")
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ragged_paged_attention_tpu(
        *args, interpret=params, num_queries_per_block=8, num_kv_pages_per_block=2, **kw
    )
    check(out, ragged_paged_attention(*args, implementation="reference", **kw), "float32")
    assert not ipc.races.races_found


def _shapes(kv_cache_dtype, T=16, S=8, P=8, N=9, K=3, H=64, num_pages=64, G=16):
    sds, codes = jax.ShapeDtypeStruct, kv_quant.KV_CACHE_DTYPES[kv_cache_dtype][1]
    return (
        sds((T, N, H), jnp.bfloat16),
        sds((num_pages, G, K, H), codes),
        sds((num_pages, G, K, H), codes),
        sds((S,), jnp.int32),
        sds((S, P), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((1,), jnp.int32),
        sds((num_pages, G, K, 1), jnp.float32),
        sds((num_pages, G, K, 1), jnp.float32),
    )


def _with_scales(kernel, kv_cache_dtype, **kw):
    def fn(*a):
        return kernel(*a[:7], k_scales=a[7], v_scales=a[8], kv_cache_dtype=kv_cache_dtype, **kw)

    return jax.jit(fn)


@pytest.mark.parametrize("kv_cache_dtype", list(kv_quant.KV_CACHE_DTYPES))
def test_lowers_for_cuda_and_tpu(kv_cache_dtype):
    """Triton's lowering for cuda (the fp8 bit casts included; one and several KV splits) and
    Mosaic's for tpu, at a decode and a prefill bucket."""
    for T in (1, 64):
        for splits in (1, 4):
            fn = _with_scales(ragged_paged_attention_gpu, kv_cache_dtype, sm_scale=0.125,
                              num_kv_splits=splits)  # fmt: skip
            kernel_testing.export_for_cuda(fn, _shapes(kv_cache_dtype, T=T))
        fn = _with_scales(ragged_paged_attention_tpu, kv_cache_dtype, sm_scale=0.125)
        exported = jax.export.export(fn, platforms=["tpu"])(*_shapes(kv_cache_dtype, T=T))
        assert "tpu_custom_call" in exported.mlir_module()


def test_bad_quantized_inputs_are_refused():
    case = make_case([1], [9], page_size=8)
    kq, vq, ks, vs = quantized_case(case, "int8")
    rest = tuple(map(jnp.asarray, case.args[3:]))
    call = functools.partial(ragged_paged_attention, jnp.asarray(case.q), sm_scale=0.1)
    with pytest.raises(ValueError, match=r"mgpu.*does not read"):
        call(kq, vq, *rest, k_scales=ks, v_scales=vs, kv_cache_dtype="int8", implementation="mgpu")
    with pytest.raises(ValueError, match="needs v_scales"):
        call(kq, vq, *rest, k_scales=ks, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="hold uint8 codes"):
        call(kq, vq, *rest, k_scales=ks, v_scales=vs, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="without a quantized"):
        call(kq.astype(jnp.float32), vq.astype(jnp.float32), *rest, k_scales=ks)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", list(kv_quant.KV_CACHE_DTYPES))
def test_compiled_gpu_kernel_equals_the_reference(kv_cache_dtype):
    """The Triton kernel compiled on an NVIDIA GPU (scripts/device_check.sh runs it): bfloat16
    queries, one and four KV splits."""
    case = make_case([1, 20, 1, 7], [300, 70, 45, 7], pages_per_seq=24, num_queries_per_kv=2,
                     dtype=jnp.bfloat16, seed=9)  # fmt: skip
    kq, vq, ks, vs = quantized_case(case, kv_cache_dtype)
    args = (jnp.asarray(case.q), kq, vq, *map(jnp.asarray, case.args[3:]))
    kw = dict(sm_scale=0.125, k_scales=ks, v_scales=vs, kv_cache_dtype=kv_cache_dtype)
    ref = ragged_paged_attention(*args, implementation="reference", **kw)
    for splits in (1, 4):
        out = ragged_paged_attention_gpu(*args, interpret=False, num_kv_splits=splits, **kw)
        check(out, ref, "bfloat16")

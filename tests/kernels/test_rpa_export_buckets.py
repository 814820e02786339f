"""Every kernel configuration the engine's step shapes reach lowers for the real targets: the TPU
kernel for `tpu` and the GPU kernels (Triton, Mosaic GPU) for `cuda`, over the (T, S, P) buckets of
SmolLM2's default engine configuration (`Buckets.shapes()`, as precompilation visits them), one
bucket of each configuration (block sizes, split count: what changes the lowered kernel), in
bfloat16, the accelerators' dtype. The per-kernel test files export a few shapes of several
models; this one sweeps the buckets (slow)."""

import time
from functools import partial

import jax
import jax.numpy as jnp
import pytest

import configs
from kernels_pallas.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
from kernels_pallas.ragged_paged_attention.kernel_mgpu import ragged_paged_attention_mgpu
from kernels_pallas.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from llmjax.engine.batch import Buckets
from llmjax.engine.block_manager import pages_needed
from tests.kernels import kernel_testing

pytestmark = pytest.mark.slow


def _engine_shapes():
    """SmolLM2 as LLM() serves it by default: budget 512, 32 sequences, 4096 tokens, page 16,
    the default token buckets; every token bucket at the smallest and largest page bucket, and
    every page bucket at the largest token bucket (T and P are independent in the kernels)."""
    from llmjax.config import EngineConfig

    config = configs.get_preset("smollm2-135m-instruct")
    per_octave = EngineConfig(model=config).token_buckets_per_octave
    buckets = Buckets.create(512, 32, pages_needed(4096, 16), per_octave=per_octave)
    Ps, Ts = buckets.page_buckets, buckets.token_buckets
    shapes = [s for s in buckets.shapes() if s[2] in (Ps[0], Ps[-1]) or s[0] == Ts[-1]]
    return config, shapes


def _args(config, T, S, P, num_pages=2048, page_size=16):
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    return (
        sds((T, N, H), bf16),
        sds((num_pages, page_size, K, H), bf16),
        sds((num_pages, page_size, K, H), bf16),
        sds((S,), jnp.int32),
        sds((S, P), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


def _one_per_configuration(shapes, configuration) -> list:
    """The first bucket of each kernel configuration (what changes the lowered kernel: block
    sizes, split count), and the smallest and largest bucket; the grid and array sizes of the
    others only scale it."""
    chosen = {}
    for shape in shapes:
        chosen.setdefault(configuration(*shape), shape)
    return sorted({shapes[0], shapes[-1], *chosen.values()})


def test_every_engine_bucket_exports_for_tpu():
    from kernels_pallas.ragged_paged_attention.kernel_tpu import _default_queries_per_block
    from kernels_pallas.ragged_paged_attention.tuning import TPU_KV_PAGES_PER_BLOCK

    config, shapes = _engine_shapes()
    shapes = _one_per_configuration(
        shapes, lambda T, S, P: (_default_queries_per_block(T), min(TPU_KV_PAGES_PER_BLOCK, P))
    )
    fn = jax.jit(partial(ragged_paged_attention_tpu, sm_scale=config.head_dim**-0.5))
    t = time.perf_counter()
    for T, S, P in shapes:
        exported = jax.export.export(fn, platforms=["tpu"])(*_args(config, T, S, P))
        assert "tpu_custom_call" in exported.mlir_module(), (T, S, P)
    print(f"{len(shapes)} tpu exports in {time.perf_counter() - t:.1f} s")


def test_every_engine_bucket_exports_for_cuda():
    from kernels_pallas.ragged_paged_attention import kernel_gpu

    config, shapes = _engine_shapes()
    K, Q, G = config.num_kv_heads, config.num_heads // config.num_kv_heads, 16

    def configuration(T, S, P):
        block_q, ppb = kernel_gpu.default_block_sizes(T, S, Q, G)
        return block_q, ppb, kernel_gpu.choose_num_kv_splits(T, S, K, P, G, block_q, ppb)

    shapes = _one_per_configuration(shapes, configuration)
    fn = jax.jit(partial(ragged_paged_attention_gpu, sm_scale=config.head_dim**-0.5))
    t = time.perf_counter()
    for T, S, P in shapes:
        kernel_testing.export_for_cuda(fn, _args(config, T, S, P))
    print(f"{len(shapes)} cuda exports in {time.perf_counter() - t:.1f} s")


@pytest.mark.parametrize("warp_specialized", [False, True])
def test_every_engine_kernel_configuration_exports_for_cuda_mosaic_gpu(warp_specialized):
    """Mosaic GPU's lowering (layout inference, SMEM sizing) is the slow part (~2 s a shape
    here): buckets until every value the buckets produce of each kernel parameter (q block, KV
    step, split count, consumer warpgroups) has lowered, which is what changes the lowered
    kernel (the q block sizes the tiles, the split count the grid and the combine), and a
    split KV over blocks of several queries; the grid and array sizes only scale it. Both
    variants of the kernel (warp-specialized or not)."""
    from kernels_pallas.ragged_paged_attention import kernel_mgpu

    config, shapes = _engine_shapes()
    K, Q, G = config.num_kv_heads, config.num_heads // config.num_kv_heads, 16
    chosen, seen, configs_ = {}, set(), set()
    for T, S, P in shapes:
        block_q, ppb = kernel_mgpu.default_block_sizes(T, S, Q, G)
        nc = kernel_mgpu.default_num_consumers(T, S, block_q) if warp_specialized else 1
        splits = kernel_mgpu.choose_num_kv_splits(T, S, K, P, G, nc * block_q, ppb)
        config_ = (block_q, ppb, splits, nc)
        configs_.add(config_)
        # (parameter, value), and whether a split KV combines blocks of several queries
        values = set(enumerate(config_)) | {("multi-query split", block_q > 1 and splits > 1)}
        if not values <= seen:
            seen |= values
            chosen[config_] = (T, S, P)
    # decode, chunked, split-KV configurations at least; every value of every parameter
    assert len(chosen) >= 4 and ("multi-query split", True) in seen, chosen
    assert seen >= {p for c in configs_ for p in enumerate(c)}
    fn = jax.jit(
        partial(
            ragged_paged_attention_mgpu,
            sm_scale=config.head_dim**-0.5,
            warp_specialized=warp_specialized,
        )
    )
    t = time.perf_counter()
    for T, S, P in chosen.values():
        args = _args(config, T, S, P)
        kernel_testing.export_for_cuda(fn, args, custom_call=kernel_testing.MOSAIC_GPU_CALL)
    took = time.perf_counter() - t
    print(
        f"{len(chosen)} of {len(shapes)} buckets ({len(configs_)} configurations), Mosaic GPU "
        f"exports in {took:.1f} s"
    )

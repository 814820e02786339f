"""The Mosaic GPU flash prefill kernel (kernels_pallas/flash_prefill/kernel_mgpu.py) against the
specification (reference.py), its warpgroup protocol under the race detector, and its export
for cuda.

On the CPU it runs in Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`: the producer and the
two consumer warpgroups run as threads; TMA, mbarriers and wgmma simulated; uninitialized SMEM
reads as NaN; a barrier left with phases a waiting thread never observed raises); compiled on a
GPU the same checks are marked `gpu`. The interpreter accepts code that Mosaic GPU's lowering
rejects (layouts, SMEM size, tile shapes), and it runs P V with P staged in SMEM where the
compiled kernel takes P from registers: the export tests lower both, at the engine's models'
shapes.

Tolerance (bf16/f16 only): 2e-2 x max|ref| against the float32 reference on the same rounded
inputs, as for the other bf16 kernels (test_flash_prefill_gpu.py explains the bf16 steps);
observed one bf16 step at max|ref| (~0.3 %).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.flash_prefill.kernel_mgpu import (
    check_supported,
    fit_num_stages,
    flash_prefill_mgpu,
)
from kernels_pallas.flash_prefill.reference import flash_prefill_reference
from tests.kernels import kernel_testing
from tests.kernels.kernel_testing import reset_mgpu_interpreter  # noqa: F401
from tests.kernels.test_flash_prefill_gpu import make_case as make_case_gqa

TOL = 2e-2  # x max|ref|


def make_case(T, seq_len, **kw):
    """test_flash_prefill_gpu.make_case with 2 query heads of one kv head unless asked for more
    (each query head is one more program to interpret)."""
    kw.setdefault("num_kv_heads", 1)
    kw.setdefault("num_queries_per_kv", 2)
    return make_case_gqa(T, seq_len, **kw)


pytestmark = pytest.mark.usefixtures("reset_mgpu_interpreter")


class FlashPrefillMgpuTest:
    INTERPRET = False

    def check(self, args, *, sliding_window=None, soft_cap=None, ref_args=None, **kernel_kw):
        """Kernel on `args` vs the reference on `ref_args` (default: the same)."""
        q, seq_len = args[0], int(args[3][0])
        kw = dict(sm_scale=q.shape[-1] ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
        kernel_kw.setdefault("interpret", self.INTERPRET)
        out = jax.jit(partial(flash_prefill_mgpu, **kw, **kernel_kw))(*args)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out.astype(jnp.float32))
        ref = flash_prefill_reference(*(ref_args or args), **kw)
        ref = np.asarray(ref.astype(jnp.float32))
        assert np.isfinite(out).all()
        err, scale = np.abs(out - ref).max(), np.abs(ref).max()
        assert err <= TOL * scale, f"max error {err} > {TOL} * {scale}"
        assert (out[seq_len:] == 0).all(), "padding rows must be 0"

    @pytest.mark.parametrize(
        "seq_len, T, block_kv",
        [(1, 16, 64), (7, 16, 128), (128, 128, 64), (200, 256, 128), (300, 384, 64)],
    )
    def test_seq_lens(self, seq_len, T, block_kv):
        """Short buckets (padded to one 128-token program), whole and partial programs, a second
        consumer with no real row (7 of 16), several programs and KV blocks per program."""
        self.check(make_case(T, seq_len, dtype="bfloat16"), block_kv=block_kv)

    @pytest.mark.parametrize(
        "num_kv_heads, num_queries_per_kv, head_dim",
        [(4, 1, 64), (3, 3, 64), (1, 4, 128), (1, 2, 256)],
        ids=["mha", "gqa3_smollm2_like", "gqa4_h128", "gqa2_h256"],
    )
    def test_gqa_and_head_dims(self, num_kv_heads, num_queries_per_kv, head_dim):
        case = make_case(
            192,
            170,
            num_kv_heads=num_kv_heads,
            num_queries_per_kv=num_queries_per_kv,
            head_dim=head_dim,
            dtype="bfloat16",
            seed=1,
        )
        self.check(case, block_kv=64)

    @pytest.mark.parametrize(
        "sliding_window, soft_cap, block_kv",
        [(100, None, 64), (37, 3.0, 128), (64, None, 64), (None, 2.0, 64)],
        ids=["window", "window_and_cap", "window_one_block", "cap"],
    )
    def test_sliding_window_and_soft_cap(self, sliding_window, soft_cap, block_kv):
        """Windows start the consumers' ranges at different blocks (the first consumer waits on
        and releases blocks only the second one reads, and the other way round)."""
        case = make_case(512, 450, dtype="bfloat16", seed=2)
        self.check(case, sliding_window=sliding_window, soft_cap=soft_cap, block_kv=block_kv)

    @pytest.mark.parametrize(
        "kernel_kw",
        [
            dict(num_stages=1),
            dict(num_stages=2, pingpong=False),
            dict(block_kv=192),
            dict(block_kv=64, num_stages=6),
        ],
        ids=["one_stage", "no_pingpong", "kv_192", "six_stages"],
    )
    def test_pipeline_variants(self, kernel_kw):
        """One SMEM slot (every refill waits for both consumers), no ping-pong, a KV block that
        is not a power of two, more stages than blocks."""
        self.check(make_case(384, 381, dtype="bfloat16", seed=3), **kernel_kw)

    def test_float16(self):
        self.check(make_case(256, 222, dtype="float16", seed=4))

    def test_never_reads_padding(self):
        """q, k, v rows at or past seq_len are NaN: none may reach the output."""
        q, k, v, seq_len = make_case(256, 137, dtype="bfloat16", seed=5)
        pad = (jnp.arange(256) >= 137)[:, None, None]
        nan_args = (*(jnp.where(pad, jnp.nan, x).astype(x.dtype) for x in (q, k, v)), seq_len)
        self.check(nan_args, ref_args=(q, k, v, seq_len), block_kv=64, sliding_window=50)


@pytest.mark.gpu
class TestFlashPrefillMgpu(FlashPrefillMgpuTest):
    INTERPRET = False

    @pytest.mark.parametrize("p_in_smem", [False, True])
    def test_long_prompt(self, p_in_smem):
        """A prompt of 2048 tokens, llama3-8b heads, P from registers (the compiled default)
        and staged in SMEM (what the interpreter runs)."""
        case = make_case(2048, 2000, num_kv_heads=8, num_queries_per_kv=4, head_dim=128,
                         dtype="bfloat16", seed=6)  # fmt: skip
        self.check(case, p_in_smem=p_in_smem)


class TestFlashPrefillMgpuInterpret(FlashPrefillMgpuTest):
    INTERPRET = True


def test_warpgroup_protocol_has_no_races():
    """The interpreter's race detector (vector clocks over SMEM accesses, TMA and mbarriers) on
    a window case, so that the consumers' ranges differ at both ends and slots are refilled. A
    refill that does not wait for the consumers' release is reported (tried on purpose)."""
    from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import get_races

    q, k, v, seq_len = make_case(384, 300, dtype="bfloat16", seed=7)
    params = plgpu.InterpretGPUParams(detect_races=True)
    kw = dict(sm_scale=64**-0.5, sliding_window=100, block_kv=64, num_stages=2)
    out = jax.jit(partial(flash_prefill_mgpu, **kw, interpret=params))(q, k, v, seq_len)
    assert not get_races().races_found
    ref = flash_prefill_reference(q, k, v, seq_len, sm_scale=64**-0.5, sliding_window=100)
    ref = np.asarray(ref.astype(jnp.float32))
    err = np.abs(np.asarray(out.astype(jnp.float32)) - ref).max()
    assert err <= TOL * np.abs(ref).max()


@pytest.mark.parametrize(
    "dtype, head_dim, match",
    [
        (jnp.float32, 64, "bfloat16 or float16"),
        (jnp.bfloat16, 96, "head_dim % 64"),
        (jnp.bfloat16, 320, "<= 256"),
    ],
)
def test_unsupported_shapes_raise(dtype, head_dim, match):
    with pytest.raises(ValueError, match=match):
        check_supported(dtype, head_dim)


def test_bad_block_sizes_raise():
    args = make_case(16, 9, dtype="bfloat16")
    for block_kv in (96, 320):
        with pytest.raises(ValueError, match=f"block_kv={block_kv} must be a multiple of 64"):
            flash_prefill_mgpu(*args, sm_scale=1.0, block_kv=block_kv, interpret=True)


def test_stages_are_reduced_to_fit_shared_memory():
    """bf16: two q tiles of 64 rows, K and V slots of 128 keys, P tiles when staged in SMEM."""
    assert fit_num_stages(4, 64, 128, 2, p_in_smem=False) == 4
    assert fit_num_stages(4, 128, 128, 2, p_in_smem=False) == 3
    assert fit_num_stages(4, 128, 128, 2, p_in_smem=True) == 2
    assert fit_num_stages(4, 256, 128, 2, p_in_smem=False) == 1
    with pytest.raises(ValueError, match="SMEM"):
        fit_num_stages(2, 256, 256, 2, p_in_smem=True)


# (num_heads N, num_kv_heads K, head_dim H): the engine's models that fit the kernel
MODELS = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}


def export_for_cuda(T, model, dtype=jnp.bfloat16, **kw):
    N, K, H = MODELS[model]
    sds = jax.ShapeDtypeStruct
    args = (sds((T, N, H), dtype), sds((T, K, H), dtype), sds((T, K, H), dtype))
    args += (sds((1,), jnp.int32),)
    fn = jax.jit(partial(flash_prefill_mgpu, sm_scale=H**-0.5, **kw))
    return kernel_testing.export_for_cuda(fn, args, custom_call=kernel_testing.MOSAIC_GPU_CALL)


@pytest.mark.parametrize("T", [16, 2048])
@pytest.mark.parametrize("model", list(MODELS))
def test_exports_for_cuda(model, T):
    export_for_cuda(T, model)


@pytest.mark.parametrize(
    "kw",
    [
        dict(sliding_window=4096, soft_cap=30.0),
        dict(p_in_smem=True),
        dict(pingpong=False),
        dict(block_kv=64, num_stages=6),
        dict(dtype=jnp.float16),
    ],
    ids=["window_cap", "p_in_smem", "no_pingpong", "kv64", "f16"],
)
def test_exports_for_cuda_variants(kw):
    export_for_cuda(1024, "llama3_8b", **kw)


def test_exports_for_cuda_head_dim_256():
    sds = jax.ShapeDtypeStruct
    args = (sds((512, 8, 256), jnp.bfloat16),) + (sds((512, 2, 256), jnp.bfloat16),) * 2
    fn = jax.jit(partial(flash_prefill_mgpu, sm_scale=0.0625))
    kernel_testing.export_for_cuda(
        fn, (*args, sds((1,), jnp.int32)), custom_call=kernel_testing.MOSAIC_GPU_CALL
    )

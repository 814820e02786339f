"""The GPU flash-attention prefill kernel (kernels_pallas/flash_prefill/kernel_gpu.py) against the
specification (reference.py) on random prompts, and its export for cuda.

`FlashPrefillGpuTest` holds the checks; `TestFlashPrefillGpu` runs them compiled (marked `gpu`:
skipped without one) and `TestFlashPrefillGpuInterpret` (INTERPRET = True) on the CPU in interpret
mode. The export tests lower the kernel for an H200 on the CPU (the Triton IR is built and
serialized), so a kernel that the Pallas Triton lowering rejects fails here.

Tolerances, against the reference on the same (rounded) inputs; q, k, v are standard normal and
sm_scale = H**-0.5, so outputs are O(1):
  float32   2e-5 absolute: only the summation order differs (blocked online softmax vs. one global
            softmax), observed ~6e-7.
  bfloat16  2e-2 * max|ref|: both round the output to bf16, and a float32 difference in the last
            bits flips the rounding: one bf16 step at the largest output (|ref| ~2.7: step 2^-7,
            2.9e-3 * max|ref|) is the largest error observed; the kernel also rounds the softmax
            probabilities to bf16 before the P.V matmul (as flash kernels do, ~2^-9 relative per
            term), which the reference does not. 2e-2 is a few bf16 steps at max|ref|.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.flash_prefill.kernel_gpu import default_block_sizes, flash_prefill_gpu
from kernels_pallas.flash_prefill.reference import flash_prefill_reference
from tests.kernels import kernel_testing

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def make_case(
    T, seq_len, *, num_kv_heads=2, num_queries_per_kv=4, head_dim=64, dtype="float32", seed=0
):
    """-> (q [T, N, H], k [T, K, H], v [T, K, H], seq_len [1] int32), standard normal in dtype
    (padding rows too: the kernel must ignore them)."""
    K, N, H = num_kv_heads, num_kv_heads * num_queries_per_kv, head_dim
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(dtype)
    q = jax.random.normal(kq, (T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (T, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (T, K, H), jnp.float32).astype(dtype)
    return q, k, v, jnp.array([seq_len], jnp.int32)


class FlashPrefillGpuTest:
    """Kernel vs reference; subclasses choose compiled (GPU) or interpret mode (CPU)."""

    INTERPRET = False

    def check(self, args, *, sliding_window=None, soft_cap=None, **kernel_kw):
        q, seq_len = args[0], int(args[3][0])
        kw = dict(sm_scale=q.shape[-1] ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
        kernel = jax.jit(partial(flash_prefill_gpu, **kw, interpret=self.INTERPRET, **kernel_kw))
        out = kernel(*args)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = np.asarray(out.astype(jnp.float32))
        ref = np.asarray(flash_prefill_reference(*args, **kw).astype(jnp.float32))
        assert np.isfinite(out).all()
        tol = TOL[jnp.dtype(q.dtype).name]
        scale = 1.0 if q.dtype == jnp.float32 else np.abs(ref).max()
        err = np.abs(out - ref).max()
        assert err <= tol * scale, f"max error {err} > {tol} * {scale}"
        assert (out[seq_len:] == 0).all(), "padding rows must be 0"
        return out

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("seq_len, T", [(1, 16), (7, 16), (128, 128), (200, 256)])
    def test_seq_lens(self, seq_len, T, dtype):
        self.check(make_case(T, seq_len, dtype=dtype))

    @pytest.mark.parametrize(
        "num_kv_heads, num_queries_per_kv, head_dim",
        [(4, 1, 64), (3, 3, 64), (2, 4, 128), (1, 8, 128)],
        ids=["mha", "gqa3_smollm2_like", "gqa4_h128", "gqa8_h128"],
    )
    def test_gqa_and_head_dims(self, num_kv_heads, num_queries_per_kv, head_dim):
        case = make_case(
            96,
            77,
            num_kv_heads=num_kv_heads,
            num_queries_per_kv=num_queries_per_kv,
            head_dim=head_dim,
            seed=1,
        )
        self.check(case)

    @pytest.mark.parametrize(
        "sliding_window, soft_cap, blocks",
        [
            (18, None, (8, 16)),
            (None, 2.0, (None, None)),
            (34, 3.0, (8, 16)),
            (5, None, (None, None)),
        ],
        ids=["window_small_blocks", "cap", "both_small_blocks", "window_5"],
    )
    def test_sliding_window_and_soft_cap(self, sliding_window, soft_cap, blocks):
        """Small blocks: the window starts the KV loop past block 0; windows 18 and 34 put some q
        block's first visible key (q0 - window + 1) at the last key of a KV block, so starting one
        block too late is caught."""
        block_q, block_kv = blocks
        case = make_case(128, 110, seed=2)
        self.check(
            case,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            block_q=block_q,
            block_kv=block_kv,
        )

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_small_blocks(self, dtype):
        """Many q and kv blocks; block_q 2 pads Q = 2 query heads to 8 (16 rows for tl.dot)."""
        case = make_case(64, 45, num_kv_heads=2, num_queries_per_kv=2, dtype=dtype, seed=3)
        self.check(case, block_q=2, block_kv=16)

    def test_never_reads_padding(self):
        """q, k, v rows at or past seq_len are NaN: none may reach the output."""
        q, k, v, seq_len = make_case(64, 37, seed=4)
        pad = (jnp.arange(64) >= 37)[:, None, None]
        nan_args = (*(jnp.where(pad, jnp.nan, x) for x in (q, k, v)), seq_len)
        ref = flash_prefill_reference(q, k, v, seq_len, sm_scale=64**-0.5)
        out = jax.jit(partial(flash_prefill_gpu, sm_scale=64**-0.5, interpret=self.INTERPRET))(
            *nan_args
        )
        np.testing.assert_allclose(out, ref, atol=TOL["float32"], rtol=0)
        assert (np.asarray(out)[37:] == 0).all()


@pytest.mark.gpu
class TestFlashPrefillGpu(FlashPrefillGpuTest):
    INTERPRET = False


class TestFlashPrefillGpuInterpret(FlashPrefillGpuTest):
    INTERPRET = True


def test_default_block_sizes():
    assert default_block_sizes(2048, 4) == (32, 64)  # llama3-8b: 32 tokens x 4 heads = 128 rows
    assert default_block_sizes(2048, 3) == (32, 64)  # SmolLM2: Q = 3 padded to 4
    assert default_block_sizes(2048, 1) == (128, 64)
    assert default_block_sizes(5, 8) == (8, 16)  # a short bucket: no 128-row blocks


def test_rejects_bad_shapes():
    q, k, v, seq_len = make_case(16, 9, head_dim=64)
    with pytest.raises(ValueError, match="block_q=3"):
        flash_prefill_gpu(q, k, v, seq_len, sm_scale=1.0, interpret=True, block_q=3)
    with pytest.raises(ValueError, match="head_dim"):
        flash_prefill_gpu(q[..., :48], k[..., :48], v[..., :48], seq_len, sm_scale=1.0)


# (num_heads N, num_kv_heads K, head_dim H)
MODELS = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}


def export_for_cuda(T, model, dtype=jnp.bfloat16, **kw):
    N, K, H = MODELS[model]
    sds = jax.ShapeDtypeStruct
    args = (
        sds((T, N, H), dtype),
        sds((T, K, H), dtype),
        sds((T, K, H), dtype),
        sds((1,), jnp.int32),
    )
    fn = jax.jit(partial(flash_prefill_gpu, sm_scale=H**-0.5, **kw))
    return kernel_testing.export_for_cuda(fn, args)


@pytest.mark.parametrize("T", [128, 512, 2048])
@pytest.mark.parametrize("model", list(MODELS))
def test_exports_for_cuda(model, T):
    export_for_cuda(T, model)


@pytest.mark.parametrize("model", list(MODELS))
def test_exports_for_cuda_window_and_cap(model):
    export_for_cuda(512, model, sliding_window=128, soft_cap=30.0)

"""The Mosaic GPU ragged paged attention kernel (kernels_pallas/ragged_paged_attention/
kernel_mgpu.py) against the specification (reference.py), and its export for cuda.

On the CPU it runs in Mosaic GPU's interpreter (`plgpu.InterpretGPUParams`: TMA copies, barriers
and wgmma simulated, uninitialized SMEM reads as NaN, out-of-bounds reads raise); compiled on a
GPU the same checks are marked `gpu`. The interpreter accepts code that Mosaic GPU's lowering
rejects (layouts, SMEM size, tile shapes), and it runs P V with P staged in SMEM where the
compiled kernel takes P from registers: the export tests lower both, for an H200, at every shape
configuration the engine's models use.

Tolerance (bf16/f16 only: the kernel has no float32 path): 2e-2 x max|ref| against the float32
reference on the same rounded inputs (tests/kernels/kernel_testing.py); observed 0.3-0.6 % on
these cases.
"""

import re
import typing
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.kernel_mgpu import (
    _clamped_page_table,
    check_supported,
    ragged_paged_attention_mgpu,
)
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels import kernel_testing
from tests.kernels.kernel_testing import reset_mgpu_interpreter  # noqa: F401

BF16 = jnp.dtype(jnp.bfloat16)
TOL = 2e-2  # x max|ref|


pytestmark = pytest.mark.usefixtures("reset_mgpu_interpreter")


class RaggedPagedAttentionMgpuTest:
    INTERPRET = False
    KERNEL_KW: typing.ClassVar[dict] = {}  # the variant under test (subclasses)

    def check(self, case, *, sliding_window=None, soft_cap=None, ref_case=None, **kernel_kw):
        """Kernel on `case` vs the reference on `ref_case` (default: the same case)."""
        kernel_kw = {**self.KERNEL_KW, **kernel_kw}
        H = case.q.shape[-1]
        kw = dict(sm_scale=H**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)
        fn = partial(ragged_paged_attention_mgpu, **kw, interpret=self.INTERPRET, **kernel_kw)
        out = jax.jit(fn)(*case.args)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        out = np.asarray(out.astype(jnp.float32))
        ref = ragged_paged_attention_reference(*(ref_case or case).args, **kw)
        ref = np.asarray(ref.astype(jnp.float32))
        assert np.isfinite(out).all()
        err, scale = np.abs(out - ref).max(), np.abs(ref).max()
        assert err <= TOL * scale, f"max error {err} > {TOL} * {scale}"
        valid = int(case.cu_q_lens[case.num_seqs[0]])
        assert (out[valid:] == 0).all(), "padding rows must be 0"

    @pytest.mark.parametrize("name", list(RAGGED_CASES))
    def test_ragged_cases(self, name):
        q_lens, kv_lens, page_size = RAGGED_CASES[name]
        self.check(make_case(q_lens, kv_lens, page_size=page_size, dtype=BF16))

    @pytest.mark.parametrize(
        "num_kv_heads, num_queries_per_kv, head_dim",
        [(4, 1, 64), (2, 8, 64), (1, 4, 128), (3, 3, 64)],
        ids=["mha", "gqa8", "gqa4_h128", "smollm2_like"],
    )
    def test_gqa_and_head_dims(self, num_kv_heads, num_queries_per_kv, head_dim):
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(
            q_lens,
            kv_lens,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            num_queries_per_kv=num_queries_per_kv,
            head_dim=head_dim,
            dtype=BF16,
            seed=1,
        )
        self.check(case)

    @pytest.mark.parametrize(
        "sliding_window, soft_cap", [(8, None), (5, 3.0)], ids=["window", "window_and_cap"]
    )
    def test_sliding_window_and_soft_cap(self, sliding_window, soft_cap):
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, dtype=BF16, seed=2)
        self.check(case, sliding_window=sliding_window, soft_cap=soft_cap)

    def test_float16_padded_tokens_and_seqs(self):
        case = make_case(
            [1, 9, 3], [20, 9, 40], num_tokens=32, max_num_seqs=8, dtype=jnp.float16, seed=3
        )
        self.check(case)

    def test_block_and_pipeline_sizes(self):
        """Several q blocks per sequence, 128-key steps, and a single SMEM slot (each step's copies
        issued only after the previous step's matmuls read the slot)."""
        case = make_case([20, 1, 9], [29, 40, 70], dtype=BF16, seed=4)
        self.check(case, block_q=4, pages_per_block=8, num_stages=1)

    def test_never_reads_past_kv_len(self):
        """Keys and values at or past kv_len (the rest of the last page, every page a sequence
        does not own) are NaN: none may reach the output."""
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, dtype=BF16, seed=5)
        owned = np.zeros(case.k_pages.shape[:2], bool)  # [num_pages, G]
        for s in range(int(case.num_seqs[0])):
            for j in range(int(case.kv_lens[s])):
                owned[case.page_indices[s, j // page_size], j % page_size] = True
        nan = np.float32(np.nan)
        k_pages = np.where(owned[:, :, None, None], case.k_pages.astype(np.float32), nan)
        v_pages = np.where(owned[:, :, None, None], case.v_pages.astype(np.float32), nan)
        poisoned = case.__class__(
            case.q, k_pages.astype(BF16), v_pages.astype(BF16), *case.args[3:]
        )
        self.check(poisoned, ref_case=case)

    def test_split_kv_long_decode(self):
        case = make_case([1, 1], [300, 45], pages_per_seq=24, dtype=BF16, seed=6)
        self.check(case, num_kv_splits=4)

    def test_split_kv_prefill_chunks_with_window(self):
        """Splits where some rows see no key of a split (window), and several q blocks."""
        case = make_case([20, 1], [70, 50], dtype=BF16, seed=7)
        self.check(case, num_kv_splits=2, sliding_window=24, block_q=8)


@pytest.mark.gpu
class TestRaggedPagedAttentionMgpu(RaggedPagedAttentionMgpuTest):
    INTERPRET = False

    def test_p_staged_in_smem(self):
        """P V with P staged in SMEM (what the interpreter runs) beside the compiled default,
        P from registers, which every other test here runs."""
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, dtype=BF16, seed=8)
        self.check(case, p_in_smem=True)


class TestRaggedPagedAttentionMgpuInterpret(RaggedPagedAttentionMgpuTest):
    INTERPRET = True


# The warp-specialized variant with two consumers everywhere: decode and short blocks leave the
# second consumer's tile empty (it only waits and releases), prefill chunks fill both.
WARP_SPECIALIZED = dict(warp_specialized=True, num_consumers=2)


@pytest.mark.gpu
class TestRaggedPagedAttentionMgpuWarpSpecialized(RaggedPagedAttentionMgpuTest):
    INTERPRET = False
    KERNEL_KW = WARP_SPECIALIZED


class TestRaggedPagedAttentionMgpuWarpSpecializedInterpret(RaggedPagedAttentionMgpuTest):
    """Interpreted, the cases that reach what warp specialization changes (tile pairs, ranges
    that differ per consumer, the shared V tail, splits, refills, unused programs); the q tile
    layout (GQA ratios, head dims) is the single-warpgroup kernel's, checked above. Compiled on
    a GPU, every case."""

    INTERPRET = True
    KERNEL_KW = WARP_SPECIALIZED

    @pytest.mark.parametrize(
        "name", ["decodes", "prefill_page_plus_one", "chunk_mid_page_crossing", "mixed"]
    )
    def test_ragged_cases(self, name):
        super().test_ragged_cases(name)

    @pytest.mark.parametrize(
        "num_kv_heads, num_queries_per_kv, head_dim", [(3, 3, 64)], ids=["smollm2_like"]
    )
    def test_gqa_and_head_dims(self, num_kv_heads, num_queries_per_kv, head_dim):
        super().test_gqa_and_head_dims(num_kv_heads, num_queries_per_kv, head_dim)

    @pytest.mark.parametrize("name", ["decodes", "mixed"])
    def test_one_consumer(self, name):
        """A producer warpgroup and one consumer (the default for decode buckets)."""
        q_lens, kv_lens, page_size = RAGGED_CASES[name]
        case = make_case(q_lens, kv_lens, page_size=page_size, dtype=BF16, seed=9)
        self.check(case, num_consumers=1)


def test_warp_specialized_protocol_has_no_races():
    """The interpreter's race detector on the warp-specialized kernel: two consumers whose KV
    ranges start at different blocks (window 60: keys 121.. and 129.. of 64-key blocks),
    split-KV (blocks 1-2 and 3), a V tail zeroed by one consumer for both, a slot refilled (one
    stage). A refill that does not wait for the consumers' release is reported (tried on
    purpose)."""
    from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import get_races

    case = make_case([20, 1], [200, 150], dtype=BF16, seed=7)
    kw = dict(sm_scale=0.125, sliding_window=60)
    params = plgpu.InterpretGPUParams(detect_races=True)
    fn = partial(ragged_paged_attention_mgpu, **kw, interpret=params, block_q=8, num_stages=1)
    out = jax.jit(partial(fn, num_kv_splits=2, **WARP_SPECIALIZED))(*case.args)
    assert not get_races().races_found
    kernel_testing.assert_matches_reference(out, ragged_paged_attention_reference(*case.args, **kw))


def test_interpreting_more_warpgroups_than_xla_threads_raises(monkeypatch):
    """With fewer XLA CPU threads than warpgroups the interpreter can deadlock: say so instead."""
    import kernels_pallas.mgpu_common as common

    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(common.jax, "device_count", lambda backend=None: 1)
    with pytest.raises(RuntimeError, match="xla_force_host_platform_device_count"):
        common.interpret_params(True, num_warpgroups=3)
    assert common.interpret_params(True, num_warpgroups=2)  # a producer and one consumer
    assert common.interpret_params(False, num_warpgroups=3) is False


def test_clamped_page_table():
    pages = jnp.array([[5, 7, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]], jnp.int32)
    got = _clamped_page_table(pages, jnp.array([6, 4, 0], jnp.int32), page_size=4, width=6)
    np.testing.assert_array_equal(got, [[5, 7, 7, 7, 7, 7], [3] * 6, [0] * 6])


@pytest.mark.parametrize(
    "dtype, head_dim, page_size, num_queries_per_kv, match",
    [
        (jnp.float32, 64, 16, 4, "bfloat16 or float16"),
        (BF16, 16, 16, 4, "head_dim % 64"),
        (BF16, 64, 4, 4, "page_size % 8"),
        (BF16, 64, 16, 65, "at most 64 query heads"),
    ],
)
def test_unsupported_shapes_raise(dtype, head_dim, page_size, num_queries_per_kv, match):
    with pytest.raises(ValueError, match=match):
        check_supported(dtype, head_dim, page_size, num_queries_per_kv)


def test_default_kv_steps_are_whole_swizzle_tiles():
    from kernels_pallas.ragged_paged_attention.kernel_mgpu import default_block_sizes

    for page_size, pages in [(8, 8), (16, 4), (24, 8), (64, 1), (128, 1)]:
        assert default_block_sizes(64, 4, 4, page_size)[1] == pages, page_size
    assert default_block_sizes(1, 1, 4, 16)[0] == 1  # a decode: one token per q block
    assert default_block_sizes(512, 4, 3, 16)[0] == 21  # 21 tokens x 3 heads = 63 rows


def test_steps_must_be_whole_swizzle_tiles():
    case = make_case([3], [20], dtype=BF16)
    with pytest.raises(ValueError, match="multiple of 64 keys"):
        ragged_paged_attention_mgpu(*case.args, sm_scale=0.125, pages_per_block=2, interpret=True)


# (num_heads N, num_kv_heads K, head_dim H): the engine's models that fit the kernel
MODELS = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}


def export_for_cuda(T, model, dtype=BF16, *, P=8, page_size=16, num_pages=64, **kw):
    N, K, H = MODELS[model]
    S = min(T, 32)
    sds = jax.ShapeDtypeStruct
    args = (
        sds((T, N, H), dtype),
        sds((num_pages, page_size, K, H), dtype),
        sds((num_pages, page_size, K, H), dtype),
        sds((S,), jnp.int32),
        sds((S, P), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = jax.jit(partial(ragged_paged_attention_mgpu, sm_scale=H**-0.5, **kw))
    return kernel_testing.export_for_cuda(fn, args, custom_call=kernel_testing.MOSAIC_GPU_CALL)


@pytest.mark.parametrize("T", [1, 16, 512])
@pytest.mark.parametrize("model", list(MODELS))
def test_exports_for_cuda(model, T):
    export_for_cuda(T, model)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_kv_splits=8, P=64),
        dict(sliding_window=100, soft_cap=30.0),
        dict(dtype=jnp.dtype(jnp.float16), page_size=8),
        dict(page_size=64, pages_per_block=1, num_stages=2),
        dict(p_in_smem=True),
        dict(warp_specialized=True),
        dict(warp_specialized=True, num_consumers=2, num_kv_splits=8, P=64),
        dict(warp_specialized=True, num_consumers=2, sliding_window=100, p_in_smem=True),
    ],
    ids=[
        *("split_kv", "window_cap", "f16_page8", "page64", "p_in_smem"),
        *("ws", "ws2_split", "ws2_window_p_smem"),
    ],
)
def test_exports_for_cuda_variants(kw):
    export_for_cuda(16, "llama3_8b", **kw)


def test_too_many_stages_for_shared_memory_is_reduced():
    """4 stages of 128-key steps at head dim 128 would need ~300 KiB of SMEM: the wrapper keeps
    as many stages as fit (the lowering rejects a kernel over the H200's 227 KiB)."""
    exported = export_for_cuda(16, "llama3_8b", pages_per_block=8, num_stages=4)
    assert re.search(r"mosaic_gpu_v2", exported.mlir_module())

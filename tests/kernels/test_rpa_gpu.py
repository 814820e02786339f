"""The GPU ragged paged attention kernel (kernels_pallas/ragged_paged_attention/kernel_gpu.py)
against the specification (reference.py) on random ragged batches, and its export for cuda.

`RaggedPagedAttentionGpuTest` holds the checks; `TestRaggedPagedAttentionGpu` runs them compiled
(marked `gpu`: skipped without one) and `TestRaggedPagedAttentionGpuInterpret` (INTERPRET = True)
on the CPU in interpret mode. The export tests lower the
kernel for an H200 on the CPU, so a kernel that Triton would reject fails here.

Tolerances, against the float32 reference on the same (rounded) inputs:
  float32   2e-5 absolute (outputs are O(1)): only summation order differs (online vs. global
            softmax), observed ~5e-7.
  bfloat16  2e-2 * max|ref|: both round the output to bf16, and a float32 difference in the last
            bits flips the rounding: one bf16 step at the largest output (|ref| ~2.5: step 2^-6,
            6e-3 * max|ref|) is the largest error observed; the kernel also rounds the softmax
            probabilities to bf16 before the P.V matmul (as flash kernels do), ~2^-9 relative per
            term. 2e-2 is three bf16 steps at max|ref|.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.kernel_gpu import (
    choose_num_kv_splits,
    ragged_paged_attention_gpu,
)
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels import kernel_testing

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


class RaggedPagedAttentionGpuTest:
    """Kernel vs reference; subclasses choose compiled (GPU) or interpret mode (CPU)."""

    INTERPRET = False

    def check(self, case, *, sm_scale=None, sliding_window=None, soft_cap=None, **kernel_kw):
        H = case.q.shape[-1]
        kw = dict(sm_scale=sm_scale or H**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)
        kernel = jax.jit(
            partial(ragged_paged_attention_gpu, **kw, interpret=self.INTERPRET, **kernel_kw)
        )
        out = kernel(*case.args)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        out = np.asarray(out.astype(jnp.float32))
        ref = np.asarray(ragged_paged_attention_reference(*case.args, **kw).astype(jnp.float32))
        assert np.isfinite(out).all()
        tol = TOL[jnp.dtype(case.q.dtype).name]
        scale = 1.0 if case.q.dtype == np.float32 else np.abs(ref).max()
        err = np.abs(out - ref).max()
        assert err <= tol * scale, f"max error {err} > {tol} * {scale}"
        valid = int(case.cu_q_lens[case.num_seqs[0]])
        assert (out[valid:] == 0).all(), "padding rows must be 0"
        return out

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("name", list(RAGGED_CASES))
    def test_ragged_cases(self, name, dtype):
        q_lens, kv_lens, page_size = RAGGED_CASES[name]
        self.check(make_case(q_lens, kv_lens, page_size=page_size, dtype=jnp.dtype(dtype)))

    @pytest.mark.parametrize(
        "num_kv_heads, num_queries_per_kv, head_dim",
        [(4, 1, 64), (2, 8, 64), (1, 4, 128), (3, 3, 64), (2, 2, 16)],
        ids=["mha", "gqa8", "gqa4_h128", "smollm2_like", "tiny"],
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
            seed=1,
        )
        self.check(case)

    @pytest.mark.parametrize(
        "sliding_window, soft_cap",
        [(8, None), (None, 2.0), (5, 3.0)],
        ids=["window", "cap", "both"],
    )
    def test_sliding_window_and_soft_cap(self, sliding_window, soft_cap):
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, seed=2)
        self.check(case, sliding_window=sliding_window, soft_cap=soft_cap)

    def test_padded_tokens_and_seqs(self):
        case = make_case([1, 9, 3], [20, 9, 40], num_tokens=32, max_num_seqs=8, seed=3)
        self.check(case)

    def test_small_blocks(self):
        """Several q blocks per sequence and one page per KV step."""
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, seed=4)
        self.check(case, block_q=2, pages_per_block=1)

    def test_never_reads_past_kv_len(self):
        """Keys at or past kv_len (rest of the last page, unused and padding pages) are NaN: none
        may reach the output."""
        q_lens, kv_lens, page_size = RAGGED_CASES["mixed"]
        case = make_case(q_lens, kv_lens, page_size=page_size, seed=5)
        H = case.q.shape[-1]
        ref = ragged_paged_attention_reference(*case.args, sm_scale=H**-0.5)
        read = np.zeros(case.k_pages.shape[:2], bool)  # [num_pages, G]
        for s in range(int(case.num_seqs[0])):
            for j in range(int(case.kv_lens[s])):
                read[case.page_indices[s, j // page_size], j % page_size] = True
        k_pages = np.where(read[:, :, None, None], case.k_pages, np.nan).astype(np.float32)
        v_pages = np.where(read[:, :, None, None], case.v_pages, np.nan).astype(np.float32)
        args = (case.q, k_pages, v_pages, *case.args[3:])
        out = jax.jit(
            partial(ragged_paged_attention_gpu, sm_scale=H**-0.5, interpret=self.INTERPRET)
        )(*args)
        np.testing.assert_allclose(out, ref, atol=TOL["float32"], rtol=0)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_split_kv_long_decode(self, dtype):
        case = make_case([1, 1], [300, 45], pages_per_seq=24, dtype=jnp.dtype(dtype), seed=6)
        self.check(case, num_kv_splits=4)

    def test_split_kv_prefill_chunks_with_window(self):
        """Splits where some rows see no key of a split (window), and several q blocks."""
        case = make_case([20, 1], [70, 50], seed=7)
        self.check(case, num_kv_splits=2, sliding_window=24, block_q=8, pages_per_block=1)


@pytest.mark.gpu
class TestRaggedPagedAttentionGpu(RaggedPagedAttentionGpuTest):
    INTERPRET = False


class TestRaggedPagedAttentionGpuInterpret(RaggedPagedAttentionGpuTest):
    INTERPRET = True


def test_split_rule():
    # few long decodes on a big model: split, as far as the length allows
    assert (
        choose_num_kv_splits(T=4, S=4, K=8, P=256, page_size=16, block_q=16, pages_per_block=4) == 8
    )
    assert (
        choose_num_kv_splits(T=1, S=1, K=8, P=256, page_size=16, block_q=16, pages_per_block=4)
        == 16
    )
    # short contexts: every split would get fewer than 4 KV blocks
    assert (
        choose_num_kv_splits(T=4, S=4, K=8, P=8, page_size=16, block_q=16, pages_per_block=4) == 1
    )
    # a full decode batch already fills the chip
    assert (
        choose_num_kv_splits(T=64, S=64, K=8, P=256, page_size=16, block_q=16, pages_per_block=4)
        == 1
    )


# (num_heads N, num_kv_heads K, head_dim H): the engine's models
MODELS = {"smollm2": (9, 3, 64), "tiny": (4, 2, 16), "llama3_8b": (32, 8, 128)}


def export_for_cuda(T, model, dtype, *, P=8, page_size=16, num_pages=64, **kw):
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
    fn = jax.jit(partial(ragged_paged_attention_gpu, sm_scale=H**-0.5, **kw))
    return kernel_testing.export_for_cuda(fn, args)


@pytest.mark.parametrize("T", [1, 16, 512])
@pytest.mark.parametrize(
    "model, dtype",
    [
        ("smollm2", "float32"),
        ("smollm2", "bfloat16"),
        ("tiny", "float32"),
        ("llama3_8b", "bfloat16"),
    ],
)
def test_exports_for_cuda(model, dtype, T):
    export_for_cuda(T, model, jnp.dtype(dtype))


@pytest.mark.parametrize("model", ["smollm2", "llama3_8b"])
def test_exports_for_cuda_split_kv(model):
    export_for_cuda(4, model, jnp.bfloat16, P=64, num_kv_splits=4)
    # and chosen by the rule: few sequences with long contexts
    assert choose_num_kv_splits(4, 4, MODELS[model][1], 256, 16, 16, 4) > 1
    export_for_cuda(4, model, jnp.bfloat16, P=256, num_pages=1024)


def test_exports_for_cuda_window_and_cap():
    export_for_cuda(16, "smollm2", jnp.bfloat16, sliding_window=32, soft_cap=30.0)

"""The TPU ragged paged attention kernel against the jnp reference (interpret mode on the CPU),
its Mosaic lowering for the engine's shapes (jax.export for platform tpu), and one DMA/race check
in the TPU simulator.

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
from jax.experimental.pallas import tpu as pltpu

from configs.llama3 import LLAMA3_8B
from configs.smollm2 import SMOLLM2_135M
from configs.tiny import TINY
from kernels_pallas.ragged_paged_attention.cases import RAGGED_CASES, make_case
from kernels_pallas.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.kernel_testing import assert_matches_reference

# A long sequence (several kv steps, the sliding window skips its early pages) next to a decode.
CASES = {**RAGGED_CASES, "long": ([24, 1, 3], [200, 130, 3], 16)}
# Every case is padded to these shapes, so one compile per config serves all cases.
NUM_TOKENS, MAX_NUM_SEQS, PAGES_PER_SEQ, NUM_PAGES = 32, 8, 14, 48

# name: (num_queries_per_kv, head_dim, dtype, sliding_window, soft_cap, q block, kv pages/block)
CONFIGS = {
    "f32_gqa1_h64": (1, 64, np.float32, None, None, None, None),
    "f32_gqa4_h128_bq8_ppb2": (4, 128, np.float32, None, None, 8, 2),
    "f32_gqa8_h64_ppb1": (8, 64, np.float32, None, None, None, 1),
    "f32_gqa4_window_cap": (4, 64, np.float32, 8, 30.0, None, 2),
    "bf16_gqa4_h128": (4, 128, jnp.bfloat16, None, None, None, None),
    "bf16_gqa8_h64_window_cap_bq8": (8, 64, jnp.bfloat16, 8, 30.0, 8, 2),
}


def padded_case(name: str, config: str, seed: int = 0):
    """CASES[name] under CONFIGS[config], padded to the shared shapes (T, S, P, num_pages)."""
    q_lens, kv_lens, page_size = CASES[name]
    Q, H, dtype, *_ = CONFIGS[config]
    case = make_case(
        q_lens,
        kv_lens,
        page_size=page_size,
        num_queries_per_kv=Q,
        head_dim=H,
        dtype=dtype,
        num_tokens=NUM_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        pages_per_seq=PAGES_PER_SEQ,
        seed=seed,
    )
    rng = np.random.default_rng(seed + 1)
    extra = NUM_PAGES - case.k_pages.shape[0]
    k_pages, v_pages = (
        np.concatenate([p, rng.standard_normal((extra, *p.shape[1:])).astype(dtype)])
        for p in (case.k_pages, case.v_pages)
    )
    args = list(case.args)
    args[1:3] = k_pages, v_pages
    return args


@functools.cache
def kernel_fn(config: str, interpret):
    _, H, _, window, cap, bq, ppb = CONFIGS[config]
    return jax.jit(
        functools.partial(
            ragged_paged_attention_tpu,
            sm_scale=H**-0.5,
            sliding_window=window,
            soft_cap=cap,
            interpret=interpret,
            num_queries_per_block=bq,
            num_kv_pages_per_block=ppb,
        )
    )


def reference(args, config: str):
    _, H, _, window, cap, *_ = CONFIGS[config]
    return ragged_paged_attention_reference(
        *map(jnp.asarray, args), sm_scale=H**-0.5, sliding_window=window, soft_cap=cap
    )


check = assert_matches_reference


def poison(args):
    """NaN in every page slot no sequence owns (stale pool data, page tails past kv_len), and
    in the padded query rows: none of it may reach the output."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = (np.array(a) for a in args)
    G = k_pages.shape[1]
    owned = np.zeros(k_pages.shape[:2], bool)  # [num_pages, G]
    for s in range(int(num_seqs[0])):
        for j in range(int(kv_lens[s])):
            owned[page_indices[s, j // G], j % G] = True
    k_pages[~owned] = np.nan
    v_pages[~owned] = np.nan
    q[cu_q_lens[num_seqs[0]] :] = np.nan
    return [q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs]


class TestRaggedPagedAttentionTpu:
    """Compiled on a TPU; the subclass runs the same checks in interpret mode on the CPU."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_backend(self):
        if not self.INTERPRET and jax.default_backend() != "tpu":
            pytest.skip("compiled TPU kernel needs a TPU (the interpret subclass runs on CPU)")

    @pytest.mark.parametrize("config", CONFIGS)
    @pytest.mark.parametrize("case", CASES)
    def test_matches_reference(self, case, config):
        args = padded_case(case, config)
        check(kernel_fn(config, self.INTERPRET)(*args), reference(args, config))

    @pytest.mark.parametrize("config", ["f32_gqa4_window_cap", "bf16_gqa4_h128"])
    @pytest.mark.parametrize("case", ["mixed", "long"])
    def test_never_reads_unowned_kv_or_padded_rows(self, case, config):
        args = padded_case(case, config, seed=3)
        out = kernel_fn(config, self.INTERPRET)(*poison(args))
        ref = reference(args, config)
        check(out, ref)
        padded = int(args[5][args[6][0]])
        assert not np.asarray(out[padded:], np.float32).any()


class TestRaggedPagedAttentionTpuInterpret(TestRaggedPagedAttentionTpu):
    INTERPRET = True


def test_dma_and_races_in_tpu_simulator():
    """One tiny case in the TPU simulator: DMAs land only when waited on, uninitialized VMEM is
    NaN, and concurrent accesses are tracked (a missing wait shows up as NaN or a race). Page
    table slots past each sequence's pages name a page that does not exist: the simulator raises
    on an out-of-bounds read, so no page past kv_len is ever copied."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: races

    case = make_case(
        [3, 1],
        [19, 9],
        page_size=8,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=128,
        max_num_seqs=3,
    )
    args = list(case.args)
    num_pages, G = case.k_pages.shape[:2]
    args[4] = np.where(np.arange(args[4].shape[1]) * G < args[3][:, None], args[4], num_pages + 7)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    out = ragged_paged_attention_tpu(
        *args,
        sm_scale=0.1,
        interpret=params,
        num_queries_per_block=8,
        num_kv_pages_per_block=2,
    )
    ref = ragged_paged_attention_reference(*map(jnp.asarray, case.args), sm_scale=0.1)
    check(out, ref)
    assert not ipc.races.races_found


EXPORT_MODELS = {
    "smollm2_f32": (SMOLLM2_135M, jnp.float32),
    "smollm2_bf16": (SMOLLM2_135M, jnp.bfloat16),
    "tiny_f32": (TINY, jnp.float32),
    "llama3_8b_bf16": (LLAMA3_8B, jnp.bfloat16),
}


@pytest.mark.parametrize("num_tokens", [1, 16, 512])
@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_exports_for_tpu(model, num_tokens):
    """The Mosaic lowering (block-shape rules included) runs for the engine's shapes."""
    config, dtype = EXPORT_MODELS[model]
    N, K, H, G, P = config.num_heads, config.num_kv_heads, config.head_dim, 16, 8
    S = min(num_tokens, 32)
    sds = jax.ShapeDtypeStruct
    pages = sds((64, G, K, H), dtype)
    args = (
        sds((num_tokens, N, H), dtype),
        pages,
        pages,
        sds((S,), jnp.int32),
        sds((S, P), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = functools.partial(
        ragged_paged_attention_tpu, sm_scale=H**-0.5, sliding_window=64, soft_cap=30.0
    )
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (num_tokens, N, H)

"""Ragged paged attention for NVIDIA GPUs: Pallas on the Triton lowering (spec: reference.py).

Lowering choice. This is a plain `pl.pallas_call` with BlockSpecs and jnp ops, lowered by Pallas'
Triton backend (the default for `pallas_call` on CUDA in jax 0.11.2). Why not Mosaic GPU, the
lowering that stays: in 0.11.2 Mosaic GPU is reachable only through `plgpu.kernel`, with Hopper
wgmma tiles (64 rows per warpgroup), operands staged in SMEM by hand and explicit register layouts,
and its interpret mode (`InterpretGPUParams`) accepts code that export then rejects
(docs/pallas_notes_jax_0.11.md, section 2), so such a kernel could not be built and verified on a
CPU-only machine. The Triton kernel runs on the CPU with `interpret=True` and exports for cuda under
an abstract H200 mesh (custom call `__gpu$xla.gpu.triton`, allowed with
`DisabledSafetyCheck.custom_call`). The Triton backend is deprecated ("The Pallas Triton backend is
deprecated..."); the warning is silenced only around our own `pallas_call`. The Mosaic GPU port is
kernel_mgpu.py (implementation 'mgpu'; bf16/f16 on Hopper): it was later built on the CPU after
all, against the interpreter and the cuda export (which does run Mosaic GPU's layout inference),
and stays opt-in until it has been timed on hardware.

Algorithm (flash attention over pages, online softmax in float32):
  - The wrapper splits each sequence's query rows into q blocks of `block_q` tokens (a block never
    spans two sequences) and lists them in a schedule: block b -> (sequence, first query index), -1
    for unused slots. There are at most NB = min(T, cdiv(T, block_q) + S) blocks.
  - Grid (NB, K, num_kv_splits). Program (b, h, c) takes the block's rows for the Q query heads of
    kv head h together ([block_q * Qp, H] rows, so each KV page is read once per kv head), walks
    the KV blocks its rows can see ([first visible key, last row's position]; with a sliding
    window it starts at the first row's window) in steps of `pages_per_block` pages, gathering
    the pages through the page table (masked loads: no key at or past kv_len is read), and keeps
    (acc, m, denom) in float32: scores = q.k * sm_scale -> soft cap -> mask (causal, kv_len,
    window) -> online softmax.
  - One split: the program writes acc / denom in q's dtype, masked to its sequence's rows.
    Split-KV (flash decoding): program c takes the c-th of num_kv_splits equal parts of the
    block's KV range and writes float32 partials (acc / denom, m, denom); the wrapper combines
    them with weights denom * exp(m - max over splits of m).
  - Rows past cu_q_lens[num_seqs[0]] belong to no block; the wrapper returns 0 there.

Triton needs power-of-two tensor sizes: the wrapper pads the Q query heads of a kv head to Qp (a
power of two, and block_q * Qp >= 16 rows for tl.dot), T by block_q rows (so a block's loads stay
in bounds), the page table to a multiple of pages_per_block; page_size and head_dim must be powers
of two.

Block sizes (`default_block_sizes`): block_q * Qp ~ 64 rows and ~64 keys per step
(pages_per_block = 64 // page_size) keep the float32 accumulator [64, H] and the [64, 64] score
tile in registers with 4 warps, like JAX's Triton flash attention; block_q is capped by the
bucket's average q_len T // S (a decode bucket gets block_q = 1: 16-row tiles, not 64 rows of
which Q are used).

A quantized cache (kv_quant.py): the gathered code block is loaded like the pages, its rows'
scales ([pages_per_block, G] float32, same mask) beside it, and the block is dequantized into q's
dtype before the dots: HBM reads the codes and 4 bytes per row.

Split rule (`choose_num_kv_splits`): a bucket surely has max(min(S, T), cdiv(T, block_q)) * K
programs of work; below ~256 (two per SM on an H200's 132) split the KV range into the power of
two that reaches it, at most 16, and keeping >= 4 KV blocks per split (else 1).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import online_softmax
from kernels_pallas.kv_quant import dequantize
from kernels_pallas.ragged_paged_attention.tuning import (
    GPU_DECODE_NUM_STAGES,
    GPU_KEYS_PER_BLOCK,
    GPU_MAX_KV_SPLITS,
    GPU_MIN_KV_BLOCKS_PER_SPLIT,
    GPU_NUM_STAGES,
    GPU_NUM_WARPS,
    GPU_ROWS_PER_BLOCK,
    GPU_TARGET_PROGRAMS,
)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def default_block_sizes(T: int, S: int, num_queries_per_kv: int, page_size: int) -> tuple:
    """-> (block_q tokens, pages_per_block): ~64 query rows and ~64 keys per program step, but no
    more query tokens than a sequence of the bucket has on average (T // S, rounded down to a power
    of two), so a decode bucket (T <= S) gets block_q = 1 and 16-row tiles instead of 64."""
    avg_q_len = max(1, T // S)
    rows = GPU_ROWS_PER_BLOCK // _next_pow2(num_queries_per_kv)
    block_q = max(1, min(rows, 1 << (avg_q_len.bit_length() - 1)))
    return block_q, max(1, GPU_KEYS_PER_BLOCK // page_size)


def choose_num_kv_splits(
    T: int, S: int, K: int, P: int, page_size: int, block_q: int, pages_per_block: int
) -> int:
    """Split the KV range only when the bucket has too few (q block, kv head) programs to fill the
    chip, and only as far as each split keeps GPU_MIN_KV_BLOCKS_PER_SPLIT KV blocks."""
    programs = max(min(S, T), pl.cdiv(T, block_q)) * K
    if programs >= GPU_TARGET_PROGRAMS:
        return 1
    max_by_len = pl.cdiv(P, pages_per_block) // GPU_MIN_KV_BLOCKS_PER_SPLIT
    splits = min(_next_pow2(pl.cdiv(GPU_TARGET_PROGRAMS, programs)), GPU_MAX_KV_SPLITS, max_by_len)
    return max(1, splits)


def _rpa_kernel(
    # metadata (whole int32 arrays: Triton has no scalar prefetch)
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S, P_pad]
    cu_q_lens_ref,  # [S + 1]
    block_seq_ref,  # [NB] sequence of q block b, -1 for an unused slot
    block_q0_ref,  # [NB] its first query index within the sequence
    # inputs
    q_ref,  # [T_pad, K, Qp, H]
    k_pages_ref,  # [num_pages, G, K, H]
    v_pages_ref,  # [num_pages, G, K, H]
    k_scales_ref,  # [num_pages, G, K, 1] float32 (a quantized cache; else [1, 1, 1, 1], unread)
    v_scales_ref,
    # outputs
    o_ref,  # [T_pad, K, Qp, H] q.dtype | split-KV: [C, T_pad, K, Qp, H] float32
    *stat_refs,  # split-KV only: m_ref, l_ref [C, T_pad, K, Qp] float32
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    pages_per_block: int,
    num_kv_splits: int,
    kv_cache_dtype: str | None,
):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, Qp, H = q_ref.shape
    G = k_pages_ref.shape[1]
    BQ, M, BK = block_q, block_q * Qp, pages_per_block * G
    seq = block_seq_ref[b]

    @pl.when(seq >= 0)
    def attend_q_block():
        q0 = block_q0_ref[b]
        q_start = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start
        kv_len = kv_lens_ref[seq]
        row0 = q_start + q0
        q = q_ref[pl.ds(row0, BQ), h, :, :].reshape(M, H)  # [M, H], row r = (token r // Qp)
        i = q0 + jax.lax.broadcasted_iota(jnp.int32, (BQ, Qp), 0)  # query index per row
        pos = (kv_len - q_len + i).reshape(M, 1)  # [M, 1] key position of each row's query
        # Keys this block can see: [lo_key, hi_key), in whole KV blocks.
        hi_key = kv_len - q_len + jnp.minimum(q0 + BQ, q_len)
        lo_key = (
            0
            if sliding_window is None
            else jnp.maximum(0, kv_len - q_len + q0 - sliding_window + 1)
        )
        lo_blk, hi_blk = lo_key // BK, pl.cdiv(hi_key, BK)
        if num_kv_splits > 1:
            per_split = pl.cdiv(hi_blk - lo_blk, num_kv_splits)
            lo_blk = lo_blk + split * per_split
            hi_blk = jnp.minimum(hi_blk, lo_blk + per_split)

        def kv_step(blk, carry):
            acc, m, denom = carry  # [M, H], [M], [M] float32: sum p.v, max, sum p
            pages = page_indices_ref[seq, pl.ds(blk * pages_per_block, pages_per_block)]
            # Gather [pages_per_block, G, H] with one index array per dim (interpret mode can't
            # mix index arrays and slices): element (a, g, d) = k_pages[pages[a], g, h, d].
            shape = (pages_per_block, G, H)
            page_id = jnp.broadcast_to(pages[:, None, None], shape)
            slot, dim = (jax.lax.broadcasted_iota(jnp.int32, shape, d) for d in (1, 2))
            idx = (page_id, slot, h, dim)
            key_pg = blk * BK + jax.lax.broadcasted_iota(jnp.int32, shape, 0) * G + slot
            in_seq = key_pg < kv_len  # never read a key at or past kv_len
            if kv_cache_dtype is not None:  # each row's scale: index arrays of [ppb, G, 1]
                sshape = (pages_per_block, G, 1)
                s_slot = jax.lax.broadcasted_iota(jnp.int32, sshape, 1)
                sidx = (
                    jnp.broadcast_to(pages[:, None, None], sshape),
                    s_slot,
                    h,
                    jnp.zeros(sshape, jnp.int32),
                )
                s_key = blk * BK + jax.lax.broadcasted_iota(jnp.int32, sshape, 0) * G + s_slot
                s_ok = s_key < kv_len

            def load(pages_ref, scales_ref):
                x = pltriton.load(pages_ref.at[idx], mask=in_seq, other=0)
                if kv_cache_dtype is not None:
                    scale = pltriton.load(scales_ref.at[sidx], mask=s_ok, other=0)
                    x = dequantize(x, scale, q.dtype, kv_cache_dtype)
                return x.reshape(BK, H)

            k = load(k_pages_ref, k_scales_ref)
            s = (
                jax.lax.dot_general(
                    q,
                    k,
                    (((1,), (1,)), ((), ())),
                    precision=online_softmax.dot_precision(k.dtype),
                    preferred_element_type=jnp.float32,
                )
                * sm_scale
            )  # [M, BK]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key = blk * BK + jax.lax.broadcasted_iota(jnp.int32, (M, BK), 1)
            visible = (key <= pos) & (key < kv_len)
            if sliding_window is not None:
                visible &= pos - key < sliding_window
            v = load(v_pages_ref, v_scales_ref)
            return online_softmax.update((acc, m, denom), s, visible, v)

        state = online_softmax.init(M, H)
        acc, m, denom = jax.lax.fori_loop(lo_blk, hi_blk, kv_step, state)
        o = online_softmax.finalize(acc, denom).reshape(BQ, Qp, H)
        row_ok = i < q_len  # [BQ, Qp]: rows of this sequence only
        if num_kv_splits == 1:
            pltriton.store(
                o_ref.at[pl.ds(row0, BQ), h, :, :],
                o.astype(o_ref.dtype),
                mask=jnp.broadcast_to(row_ok[:, :, None], (BQ, Qp, H)),
            )
        else:
            m_ref, l_ref = stat_refs
            pltriton.store(
                o_ref.at[split, pl.ds(row0, BQ), h, :, :],
                o,
                mask=jnp.broadcast_to(row_ok[:, :, None], (BQ, Qp, H)),
            )
            pltriton.store(m_ref.at[split, pl.ds(row0, BQ), h, :], m.reshape(BQ, Qp), mask=row_ok)
            pltriton.store(
                l_ref.at[split, pl.ds(row0, BQ), h, :], denom.reshape(BQ, Qp), mask=row_ok
            )


def _q_block_schedule(cu_q_lens, num_seqs, block_q: int, num_blocks: int):
    """-> block_seq, block_q0 [num_blocks] int32: q block b covers queries block_q0[b] ..
    block_q0[b] + block_q - 1 of sequence block_seq[b] (-1: unused slot).

    In (block_q 4): q_lens [6 1 0], num_seqs [2]
    Out:            block_seq [0 0 1 -1 ...], block_q0 [0 4 0 0 ...]"""
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q  # [S]
    ends = jnp.cumsum(blocks)  # [S]
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), S - 1).astype(jnp.int32)
    q0 = (b - (ends[seq] - blocks[seq])) * block_q
    used = b < ends[-1]
    return jnp.where(used, seq, -1).astype(jnp.int32), jnp.where(used, q0, 0).astype(jnp.int32)


def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [num_pages, G, K, H]
    v_pages: jax.Array,  # [num_pages, G, K, H]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, P] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,  # query tokens per program (power of two)
    pages_per_block: int | None = None,  # KV pages per inner step (power of two)
    num_kv_splits: int | None = None,  # None: choose_num_kv_splits
    num_warps: int = GPU_NUM_WARPS,
    num_stages: int | None = None,  # None: GPU_DECODE_NUM_STAGES for block_q 1, else GPU_NUM_STAGES
    k_scales: jax.Array | None = None,  # [num_pages, G, K, 1] float32: a quantized cache
    v_scales: jax.Array | None = None,
    kv_cache_dtype: str | None = None,  # None/'auto': pages in q's dtype (kv_quant.py)
) -> jax.Array:
    """-> [T, N, H] in q's dtype; see reference.py for the contract and the module doc for the
    design."""
    T, N, H = q.shape
    _, G, K, _ = k_pages.shape
    S, P = page_indices.shape
    Q = N // K
    for name, x in [("page_size", G), ("head_dim", H)]:
        if x & (x - 1):
            raise ValueError(f"the Triton kernel needs a power-of-two {name}, got {x}")
    dq, dp = default_block_sizes(T, S, Q, G)
    block_q, pages_per_block = block_q or dq, pages_per_block or dp
    for name, x in [("block_q", block_q), ("pages_per_block", pages_per_block)]:
        if x <= 0 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of two")
    if num_stages is None:
        num_stages = GPU_DECODE_NUM_STAGES if block_q == 1 else GPU_NUM_STAGES
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(T, S, K, P, G, block_q, pages_per_block)
    Qp = max(_next_pow2(Q), pl.cdiv(16, block_q))  # tl.dot needs >= 16 rows
    num_blocks = min(T, pl.cdiv(T, block_q) + S)
    T_pad = T + block_q
    P_pad = pl.cdiv(P, pages_per_block) * pages_per_block

    qg = jnp.pad(q.reshape(T, K, Q, H), ((0, T_pad - T), (0, 0), (0, Qp - Q), (0, 0)))
    page_indices = jnp.pad(page_indices, ((0, 0), (0, P_pad - P)))
    block_seq, block_q0 = _q_block_schedule(cu_q_lens, num_seqs, block_q, num_blocks)

    C = num_kv_splits
    if C == 1:
        out_shape = [jax.ShapeDtypeStruct((T_pad, K, Qp, H), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((C, T_pad, K, Qp, H), jnp.float32),
            jax.ShapeDtypeStruct((C, T_pad, K, Qp), jnp.float32),
            jax.ShapeDtypeStruct((C, T_pad, K, Qp), jnp.float32),
        ]
    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=block_q,
        pages_per_block=pages_per_block,
        num_kv_splits=C,
        kv_cache_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype,
    )
    if kv_cache_dtype in (None, "auto"):
        k_scales = v_scales = jnp.zeros((1, 1, 1, 1), jnp.float32)  # not read
    call = pl.pallas_call(
        kernel,
        grid=(num_blocks, K, C),
        out_shape=out_shape,  # whole arrays: programs store their own rows, masked
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )
    with warnings.catch_warnings():
        # The Triton backend warns on every lowering that it is deprecated; the choice is made
        # and documented above (Mosaic GPU port planned), so do not repeat it at every call.
        warnings.filterwarnings(
            "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
        )
        outs = call(
            kv_lens, page_indices, cu_q_lens, block_seq, block_q0, qg, k_pages, v_pages,
            k_scales, v_scales,
        )  # fmt: skip

    if C == 1:
        o = outs[0][:T]
    else:
        o = online_softmax.combine_splits(*(x[:, :T] for x in outs))  # [T, K, Qp, H]
    o = o[:, :, :Q].reshape(T, N, H)
    valid = jnp.arange(T) < cu_q_lens[num_seqs[0]]  # padding rows are 0
    return jnp.where(valid[:, None, None], o, 0.0).astype(q.dtype)

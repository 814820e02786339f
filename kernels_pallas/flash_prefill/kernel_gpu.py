"""Causal flash-attention prefill for NVIDIA GPUs: Pallas on the Triton lowering (spec:
reference.py).

Lowering choice: the same as the ragged paged attention kernel, for the same reasons (see the
header of kernels_pallas/ragged_paged_attention/kernel_gpu.py): a plain `pl.pallas_call` lowered by
Pallas' Triton backend runs on the CPU with `interpret=True` and exports for cuda under an abstract
H200 mesh (custom call `__gpu$xla.gpu.triton`), while Mosaic GPU in jax 0.11.2 needs hand-written
wgmma/SMEM/layout code whose interpret mode accepts what export rejects. The Triton backend is
deprecated; its warning is silenced only around our own `pallas_call`; a Mosaic GPU port is the
planned follow-up.

Algorithm (one sequence, no cache: K/V are the prompt's own projections):
  - The wrapper views q [T, N, H] as [T, K, Qp, H]: the Q = N // K query heads of kv head h,
    padded to Qp (a power of two, and block_q * Qp >= 16 rows for tl.dot), and pads T to a
    multiple of block_q (q) and of block_kv (k, v).
  - Grid (cdiv(T, block_q), K). Program (i, h) takes the block_q tokens x Qp heads of q block i
    and kv head h as M = block_q * Qp rows (so each K/V block is read once per kv head, not once
    per query head) and walks the KV blocks of block_kv keys its rows can see: from the block
    holding the first row's first key (0, or with a sliding window first row - window + 1) up to
    the one holding its last row's diagonal (causal block skipping; none past seq_len). It keeps
    (acc, m, denom) in float32: scores = q.k * sm_scale -> soft cap -> mask (causal, seq_len,
    window) -> online softmax; P is rounded to v's dtype for the P.V matmul, as flash kernels do.
    Blocks that every row sees whole (below the first row's diagonal and seq_len) run a loop
    without masks; only the diagonal blocks are masked (with a sliding window every block is).
    On the H200 this took a 2048-token prompt from 0.230 to 0.175 ms.
  - seq_len is read from a [1] int32 ref (Triton has no scalar prefetch); K/V loads are masked at
    seq_len (a padded key is never read), and rows at or past seq_len are written 0.

Block sizes (tuning.py, with the H200 measurements that chose them):
  GPU_ROWS_PER_BLOCK = 128 query rows (tokens x padded heads) per program: every K/V block read is
  reused by 128 rows (the FLOP per byte of K/V traffic is the row count), and the float32 [128, H]
  accumulator plus the [128, 64] score tile still fit in registers with 8 warps (4 for H <= 64),
  as in JAX's Triton flash attention (block_q 128, same num_warps rule).
  GPU_KEYS_PER_BLOCK = 64 keys per step (JAX uses 128): the causal diagonal block wastes less (< 64
  masked keys per row); GPU_NUM_STAGES = 3 pipelining stages of K and V tiles (10% faster than 2).
  Short buckets shrink both to the (power-of-two) prompt length (`default_block_sizes`).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import online_softmax
from kernels_pallas.flash_prefill.tuning import (
    GPU_KEYS_PER_BLOCK,
    GPU_NUM_STAGES,
    GPU_ROWS_PER_BLOCK,
)

MIN_DOT_DIM = 16  # tl.dot needs >= 16 rows and columns


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def default_block_sizes(T: int, num_queries_per_kv: int) -> tuple[int, int]:
    """-> (block_q tokens, block_kv keys): ~GPU_ROWS_PER_BLOCK rows and GPU_KEYS_PER_BLOCK keys,
    but no bigger than the (power-of-two rounded) prompt, so short buckets are not padded to 128."""
    t = _next_pow2(T)
    block_q = max(1, min(GPU_ROWS_PER_BLOCK // _next_pow2(num_queries_per_kv), t))
    block_kv = max(MIN_DOT_DIM, min(GPU_KEYS_PER_BLOCK, t))
    return block_q, block_kv


def _flash_prefill_kernel(
    # metadata
    seq_len_ref,  # [1] int32
    # inputs
    q_ref,  # [block_q, Qp, H] block (i, h) of q [T_q, K, Qp, H]
    k_ref,  # [T_kv, K, H] whole array
    v_ref,  # [T_kv, K, H] whole array
    # outputs
    o_ref,  # [block_q, Qp, H] block (i, h) of o [T_q, K, Qp, H]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_kv: int,
):
    i, h = pl.program_id(0), pl.program_id(1)
    BQ, Qp, H = q_ref.shape
    M, BK = BQ * Qp, block_kv
    seq_len = seq_len_ref[0]
    q0 = i * BQ  # first token of this block
    q = q_ref[...].reshape(M, H)  # row r = (token q0 + r // Qp, head r % Qp)
    pos = (q0 + jax.lax.broadcasted_iota(jnp.int32, (BQ, Qp), 0)).reshape(M, 1)  # [M, 1]

    # KV blocks the rows can see: [lo_blk, hi_blk); none for a block wholly past seq_len.
    lo_key = 0 if sliding_window is None else jnp.maximum(0, q0 - sliding_window + 1)
    lo_blk = lo_key // BK
    hi_blk = jnp.where(q0 < seq_len, pl.cdiv(jnp.minimum(q0 + BQ, seq_len), BK), 0)

    # Blocks every row sees whole (all keys <= the first row's position and < seq_len) need no
    # mask: [lo_blk, mid_blk) unmasked, [mid_blk, hi_blk) masked (the diagonal and seq_len edge).
    if sliding_window is None:
        mid_blk = jnp.clip(jnp.minimum(q0 + 1, seq_len) // BK, lo_blk, hi_blk)
    else:
        mid_blk = lo_blk  # the window's lower edge moves per row: mask every block

    def kv_step(blk, carry, *, masked: bool):
        start = blk * BK
        if masked:
            key_col = start + jax.lax.broadcasted_iota(jnp.int32, (BK, H), 0)
            in_seq = key_col < seq_len  # [BK, H]: never read a padded key
            k = pltriton.load(k_ref.at[pl.ds(start, BK), h, :], mask=in_seq, other=0)  # [BK, H]
        else:
            k = k_ref[pl.ds(start, BK), h, :]
        s = jax.lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=online_softmax.dot_precision(k.dtype),
            preferred_element_type=jnp.float32,
        )  # [M, BK]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if not masked:
            return online_softmax.update(carry, s, None, v_ref[pl.ds(start, BK), h, :])
        key = start + jax.lax.broadcasted_iota(jnp.int32, (M, BK), 1)
        visible = (key <= pos) & (key < seq_len)
        if sliding_window is not None:
            visible &= pos - key < sliding_window
        v = pltriton.load(v_ref.at[pl.ds(start, BK), h, :], mask=in_seq, other=0)  # [BK, H]
        return online_softmax.update(carry, s, visible, v)

    state = online_softmax.init(M, H)  # (acc [M, H], m [M], denom [M]) float32
    state = jax.lax.fori_loop(lo_blk, mid_blk, functools.partial(kv_step, masked=False), state)
    acc, _, denom = jax.lax.fori_loop(
        mid_blk, hi_blk, functools.partial(kv_step, masked=True), state
    )
    o = online_softmax.finalize(acc, denom)
    o = jnp.where(pos < seq_len, o, 0.0)  # rows at or past seq_len are 0
    o_ref[...] = o.reshape(BQ, Qp, H).astype(o_ref.dtype)


def flash_prefill_gpu(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    seq_len: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,  # query tokens per program (power of two)
    block_kv: int | None = None,  # keys per inner step (power of two, >= 16)
    num_warps: int | None = None,  # None: 4 for head_dim <= 64, else 8
    num_stages: int = GPU_NUM_STAGES,
) -> jax.Array:
    """-> [T, N, H] in q's dtype; see reference.py for the contract and the module doc for the
    design."""
    T, N, H = q.shape
    K = k.shape[1]
    if N % K:
        raise ValueError(f"num_heads={N} must be divisible by num_kv_heads={K}")
    if H & (H - 1) or H < MIN_DOT_DIM:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {H}")
    Q = N // K
    dq, dkv = default_block_sizes(T, Q)
    block_q, block_kv = block_q or dq, block_kv or dkv
    if block_q <= 0 or block_q & (block_q - 1):
        raise ValueError(f"block_q={block_q} must be a power of two")
    if block_kv < MIN_DOT_DIM or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv={block_kv} must be a power of two >= {MIN_DOT_DIM}")
    Qp = max(_next_pow2(Q), pl.cdiv(MIN_DOT_DIM, block_q))
    num_q_blocks = pl.cdiv(T, block_q)
    T_q, T_kv = num_q_blocks * block_q, pl.cdiv(T, block_kv) * block_kv

    qg = jnp.pad(q.reshape(T, K, Q, H), ((0, T_q - T), (0, 0), (0, Qp - Q), (0, 0)))
    k = jnp.pad(k, ((0, T_kv - T), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, T_kv - T), (0, 0), (0, 0)))
    kernel = functools.partial(
        _flash_prefill_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_kv=block_kv,
    )
    q_block = pl.BlockSpec((block_q, None, Qp, H), lambda i, h: (i, h, 0, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)  # whole array; the kernel loads its own tiles
    call = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, K),
        in_specs=[pl.BlockSpec((1,), lambda i, h: (0,)), q_block, whole, whole],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct((T_q, K, Qp, H), q.dtype),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or (4 if H <= 64 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        name="flash_prefill_gpu",
    )
    with warnings.catch_warnings():
        # The Triton backend warns on every lowering that it is deprecated; the choice is made
        # and documented above (Mosaic GPU port planned), so do not repeat it at every call.
        warnings.filterwarnings(
            "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
        )
        o = call(seq_len, qg, k, v)  # [T_q, K, Qp, H]
    return o[:T, :, :Q].reshape(T, N, H)

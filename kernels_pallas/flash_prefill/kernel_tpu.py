"""Flash-attention prefill as a Pallas Mosaic TPU kernel (specification: `reference.py`).

Algorithm. The jnp wrapper regroups q [T, N, H] by kv head into q_kv [K, Tp * Q, H] (Q = N // K
query heads per kv head; row r of a q block is token t0 + r // Q, query head r % Q of that kv
head, so the Q heads sharing a kv head share one K/V read and one matmul) and k, v [T, K, H] into
[K, Tp, H] (Tp: T padded to the block sizes; so every block is (rows, H) with H the full dim and
rows a multiple of 8, as Mosaic requires). Grid (K, Tp // bq, Tp // bkv): for each kv head and q
block of bq tokens, the last axis walks kv blocks of bkv keys as the "arbitrary" reduction axis,
with a float32 online softmax in VMEM scratch (m, l, acc), initialised at the first kv step
(`init`) and normalised into the output at the last (`finalize`).

Block skipping. seq_len is scalar-prefetched. A kv block is attended (`attend`) only if some row
of the q block can see one of its keys: it starts at or before the block's last real token
(causal, and < seq_len) and ends inside the window of its first token. The K/V index maps clamp
the kv block index into that needed range, so a skipped step re-names the block already in VMEM
and Pallas issues no copy for it: skipped steps cost only the grid-step overhead.

Masks (rows r, keys c of one step; t0 = first token of the q block, j = first key of the step;
conditions on r // Q written as products to keep division off the VPU):
    visible = (j + c <= t0 + r // Q) and (j + c < seq_len) and (t0 + r // Q < seq_len)
              and (t0 + r // Q - (j + c) < window)
    score   = where(visible, soft_cap(q.k * sm_scale), MASK);  p = where(visible, exp(...), 0)
V rows at keys >= seq_len are zeroed before p @ v, so garbage (even NaN) in the padded part of
the caller's buffers cannot reach real rows (0 * NaN). Rows >= seq_len see no key (l = 0) and
are written as 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Block sizes (untuned on hardware: reasoned defaults; arguments override). 128 tokens per q
# block gives 128 * Q matmul rows (a full MXU tile already at Q = 1) with an f32 accumulator of
# 128 * Q * H * 4 bytes (512 KiB at Q = 8, H = 128), well inside scoped VMEM next to the
# double-buffered K/V blocks. 128 keys per kv block make the [rows, bkv] score tile exactly one
# lane-width wide and keep causal skipping fine-grained (a diagonal block wastes at most half).
# Both are capped at the padded prompt length (min 8), so short prompts do not pad up to 128.
from kernels_pallas.flash_prefill.tuning import TPU_BLOCK_KV, TPU_BLOCK_Q
from kernels_pallas.online_softmax import MASK_VALUE  # finite: exp(MASK - m) is 0, never NaN

LANES = 128  # m/l scratch lane width (values replicated across lanes)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _div(a, b: int):
    """a // b for traced a >= 0 (truncating division: no sign fix-up, which Mosaic lowers only
    for a known TPU generation)."""
    return lax.div(a, jnp.asarray(b, jnp.int32))


def _kv_block_range(q_block, seq_len, *, bq: int, bkv: int, sliding_window: int | None):
    """(first, last) kv block holding a key some real row of q block `q_block` can see; last <
    first when the q block has no real row."""
    t0 = q_block * bq
    key_hi = jnp.minimum(t0 + bq, seq_len)  # one past the last visible key
    last = _div(key_hi + bkv - 1, bkv) - 1
    if sliding_window is None:
        first = jnp.int32(0)
    else:
        first = _div(jnp.maximum(t0 - sliding_window + 1, 0), bkv)
    return first, jnp.where(t0 < seq_len, last, first - 1)


def _kv_index_map(h, i, j, seq_len_ref, *, bq, bkv, sliding_window):
    """Clamp kv block j into the needed range: skipped steps re-name a block already in VMEM."""
    first, last = _kv_block_range(i, seq_len_ref[0], bq=bq, bkv=bkv, sliding_window=sliding_window)
    return h, jnp.maximum(jnp.minimum(j, last), first), 0


def _kernel(
    # scalar prefetch (SMEM)
    seq_len_ref,  # [1] int32
    # inputs
    q_ref,  # VMEM [1, R, H], R = bq * Q rows of one kv head
    k_ref,  # VMEM [1, bkv, H]
    v_ref,  # VMEM [1, bkv, H]
    # outputs
    o_ref,  # VMEM [1, R, H]
    # scratch
    m_ref,  # VMEM [R, LANES] f32: running max, replicated across lanes
    l_ref,  # VMEM [R, LANES] f32: running softmax denominator
    acc_ref,  # VMEM [R, H] f32: running unnormalized output
    *,
    bq: int,
    bkv: int,
    num_queries_per_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    q_block, kv_block = pl.program_id(1), pl.program_id(2)
    Q, R, H = num_queries_per_kv, q_ref.shape[1], q_ref.shape[2]
    seq_len = seq_len_ref[0]
    t0, j0 = q_block * bq, kv_block * bkv
    first, last = _kv_block_range(q_block, seq_len, bq=bq, bkv=bkv, sliding_window=sliding_window)

    @pl.when(kv_block == 0)
    def init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((kv_block >= first) & (kv_block <= last))
    def attend():
        row = lax.broadcasted_iota(jnp.int32, (R, bkv), 0)
        key = j0 + lax.broadcasted_iota(jnp.int32, (R, bkv), 1)
        visible = (Q * (key - t0) <= row) & (key < seq_len)  # key <= token, key real
        visible &= row < Q * (seq_len - t0)  # token real
        if sliding_window is not None:
            visible &= row < Q * (key - t0 + sliding_window)  # token - key < window
        q = q_ref[0]  # [R, H]
        precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = lax.dot_general(
            q,
            k_ref[0],
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        s = s * sm_scale  # [R, bkv]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, MASK_VALUE)
        m_prev, l_prev = m_ref[:, :1], l_ref[:, :1]  # [R, 1]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        v_key = j0 + lax.broadcasted_iota(jnp.int32, (bkv, H), 0)
        v = jnp.where(v_key < seq_len, v_ref[0], 0)  # padded keys: garbage -> 0
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        m_ref[...] = jnp.broadcast_to(m_new, (R, LANES))
        l_ref[...] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=1, keepdims=True), (R, LANES))
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def finalize():
        denom = l_ref[:, :1]
        out = jnp.where(denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0)
        o_ref[0] = out.astype(o_ref.dtype)  # rows that saw no key (padding) -> 0


def _default_block(num_tokens: int, target: int) -> int:
    block = 8
    while block < min(num_tokens, target):
        block *= 2
    return block


def flash_prefill_tpu(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    seq_len: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret=False,
    block_q: int | None = None,
    block_kv: int | None = None,
) -> jax.Array:
    """-> [T, N, H]; the contract is reference.py's. `interpret`: False (compile for TPU), True
    (fast generic interpreter) or a `pltpu.InterpretParams` (TPU simulator)."""
    T, N, H = q.shape
    K = k.shape[1]
    Q = N // K
    bq = block_q or _default_block(T, TPU_BLOCK_Q)
    bkv = block_kv or _default_block(T, TPU_BLOCK_KV)
    if bq % 8 or bkv % 8:
        raise ValueError(f"block sizes must be multiples of 8: {bq=} {bkv=}")
    Tp = _cdiv(T, max(bq, bkv)) * max(bq, bkv)
    if Tp % bq or Tp % bkv:
        raise ValueError(f"block sizes must divide each other: {bq=} {bkv=}")

    # [T, N, H] -> [K, Tp * Q, H]: rows of one kv head, token-major; k, v -> [K, Tp, H].
    q_kv = q.reshape(T, K, Q, H).transpose(1, 0, 2, 3)
    q_kv = jnp.pad(q_kv, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(K, Tp * Q, H)
    k_kv, v_kv = (jnp.pad(x.transpose(1, 0, 2), ((0, 0), (0, Tp - T), (0, 0))) for x in (k, v))

    blocks = dict(bq=bq, bkv=bkv, sliding_window=sliding_window)
    kernel = functools.partial(
        _kernel, **blocks, num_queries_per_kv=Q, sm_scale=sm_scale, soft_cap=soft_cap
    )
    R = bq * Q
    q_spec = pl.BlockSpec((1, R, H), lambda h, i, j, *_: (h, i, 0))
    kv_spec = pl.BlockSpec((1, bkv, H), functools.partial(_kv_index_map, **blocks))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(K, Tp // bq, Tp // bkv),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((R, LANES), jnp.float32),
                pltpu.VMEM((R, LANES), jnp.float32),
                pltpu.VMEM((R, H), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_kv.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="flash_prefill",
    )(seq_len, q_kv, k_kv, v_kv)
    out = out.reshape(K, Tp, Q, H).transpose(1, 0, 2, 3)[:T]
    return out.reshape(T, N, H)

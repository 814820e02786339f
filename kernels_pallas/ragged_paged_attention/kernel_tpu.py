"""Ragged paged attention as a Pallas Mosaic TPU kernel (specification: `reference.py`).

Algorithm. The jnp wrapper regroups q [T, N, H] by kv head into q_kv [K, Tp * Q, H] (Q = N // K
query heads per kv head; row r of a block is token r // Q, query head r % Q of that kv head; Tp is
T padded to a multiple of the q block) and computes, per q block, the range of sequences whose
rows overlap it. The kernel runs one grid step per q block of `bq` tokens (all heads): for every
sequence overlapping the block it streams only the pages holding keys some row of the block can
see (causal upper bound, sliding-window lower bound, never past kv_len) from HBM into VMEM and
runs a float32 online softmax over them, kv head by kv head; rows of other sequences are masked,
so one set of m/l/acc accumulators serves all sequences of the block. Padded rows
(>= cu_q_lens[num_seqs[0]]) see no key and are written as 0.

Grid: (Tp // bq,), "parallel": a step starts and waits all of its own DMAs and (re)sets its
scratch, so steps are independent (and may be split across TensorCores).

DMA scheme: one "kv step" = up to `ppb` pages of one sequence, each page copied whole ([G, K, H],
contiguous in the pool's [pages, G, K, H] layout; all kv heads, so the pool is read once per q
block) with its own async copy into one of two VMEM slots, all pages of a slot signalling that
slot's semaphore. The copies of the next kv step (the same sequence's next pages, or the first
pages of the block's next sequence) start before the current step's are waited on, so DMA
overlaps compute, also across the decode sequences of a block. Named `pl.when` blocks:
start_first_step, prefetch_same_seq, prefetch_next_seq, start_page, wait_page.

Masks (rows r, keys c of one kv step; t = t0 + r // Q, j = first key of the step + c):
    visible = cu[s] <= t < cu[s+1]  and  j <= pos(t)  and  pos(t) - j < window
    score   = where(visible, soft_cap(q.k * sm_scale), MASK);  p = where(visible, exp(...), 0)
V rows past the sequence's last needed key (stale VMEM, page tails past kv_len) are zeroed
before p @ v, so garbage there cannot turn into NaN (0 * NaN) in valid rows.

A quantized cache (kv_quant.py): each page's codes are copied as above and its rows' scales
([G, K] float32, the wrapper's view of [pages, G, K, 1]) by two more copies on the same slot's
semaphores; `attend` dequantizes a kv head's [C, H] codes into q's dtype before the dots.

Block sizes (tuning.py; arguments override): bq = 16 tokens (so bq * Q rows fill MXU rows
for prefill while a decode-heavy block wastes at most bq * Q - Q rows per sequence; at most the
next power of two >= T, min 8, so a lone decode does not pad to 16); ppb = 8 pages (128 keys at
page size 16: one MXU-wide tile of scores per step; at most the page table width P).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.kv_quant import dequantize
from kernels_pallas.online_softmax import MASK_VALUE  # finite: exp(MASK - m) is 0, never NaN
from kernels_pallas.ragged_paged_attention.tuning import (
    TPU_KV_PAGES_PER_BLOCK,  # pages per kv step (ppb)
    TPU_QUERIES_PER_BLOCK,  # q tokens per block (bq); rows per block = bq * Q
)

LANES = 128  # m/l scratch lane width (values replicated across lanes)


def _cdiv(a, b):
    return (a + b - 1) // b


def _div(a, b: int):
    """a // b for traced a >= 0 (truncating division: no sign fix-up, which Mosaic lowers only
    for a known TPU generation)."""
    return lax.div(a, jnp.asarray(b, jnp.int32))


def _cdiv_traced(a, b: int):
    return _div(a + b - 1, b)


def _start_page(in_seq, copies):
    @pl.when(in_seq)
    def start_page():
        for copy in copies:
            copy.start()


def _wait_page(in_seq, copies):
    @pl.when(in_seq)
    def wait_page():
        for copy in copies:
            copy.wait()


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S] int32
    page_indices_ref,  # [S * P] int32, flattened page table
    cu_q_lens_ref,  # [S + 1] int32
    num_seqs_ref,  # [1] int32
    seq_lo_ref,  # [num_q_blocks] int32: first sequence with rows in the block
    seq_hi_ref,  # [num_q_blocks] int32: last sequence with rows in the block (< lo: none)
    # inputs
    q_ref,  # VMEM [K, R, H], R = bq * Q rows per kv head
    k_hbm,  # HBM [num_pages, G, K, H]
    v_hbm,  # HBM [num_pages, G, K, H]
    *refs,  # a quantized cache: k_scales_hbm, v_scales_hbm HBM [num_pages, G, K] f32; then
    # outputs: o_ref VMEM [K, R, H]
    # scratch: k_buf, v_buf VMEM [2, ppb, G, K, H] (double-buffered whole pages of one kv
    #   step); quantized: ks_buf, vs_buf VMEM [2, ppb, G, K] f32; sems DMA [2 or 4, 2 (slot)];
    #   m_ref, l_ref VMEM [K, R, LANES] f32 (running max and softmax denominator, replicated
    #   across lanes); acc_ref VMEM [K, R, H] f32 (running unnormalized output)
    bq: int,
    ppb: int,
    pages_per_seq: int,
    num_queries_per_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    kv_cache_dtype: str | None,
):
    if kv_cache_dtype is None:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
        scale_hbm = scale_buf = ()
    else:
        ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref = refs
        scale_hbm, scale_buf = (ks_hbm, vs_hbm), (ks_buf, vs_buf)
    q_block = pl.program_id(0)
    _, G, K, H = k_hbm.shape
    Q, P = num_queries_per_kv, pages_per_seq
    R, C = bq * Q, ppb * G
    t0 = q_block * bq
    seq_lo = seq_lo_ref[q_block]
    seq_hi = jnp.minimum(seq_hi_ref[q_block], num_seqs_ref[0] - 1)

    def seq_span(s):
        """Scalars of sequence s in this block: its q range, kv_len, needed keys and pages."""
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        row_lo, row_hi = jnp.maximum(q_start, t0), jnp.minimum(q_end, t0 + bq)
        first_pos = kv_len - (q_end - q_start) + (row_lo - q_start)
        key_hi = first_pos + (row_hi - row_lo)  # one past the last visible key
        key_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        page_lo, page_hi = _div(key_lo, G), _cdiv_traced(key_hi, G)
        num_steps = jnp.where(row_hi > row_lo, _cdiv_traced(page_hi - page_lo, ppb), 0)
        return dict(
            q_start=q_start,
            q_end=q_end,
            kv_len=kv_len,
            key_hi=key_hi,
            page_lo=page_lo,
            page_hi=page_hi,
            num_steps=num_steps,
        )

    def page_copies(s, span, step, slot):
        """(condition, k copy, v copy) of each page of kv step `step` of sequence s."""
        for j in range(ppb):
            page = span["page_lo"] + step * ppb + j
            in_seq = page < span["page_hi"]
            # Clamped for the table read only; pages past page_hi are never copied.
            page_id = page_indices_ref[s * P + jnp.minimum(page, P - 1)]
            pairs = [(k_hbm, k_buf), (v_hbm, v_buf), *zip(scale_hbm, scale_buf, strict=True)]
            yield (
                in_seq,
                *(
                    pltpu.make_async_copy(src.at[page_id], dst.at[slot, j], sems.at[i, slot])
                    for i, (src, dst) in enumerate(pairs)
                ),
            )

    def start_step(s, span, step, slot):
        for in_seq, *copies in page_copies(s, span, step, slot):
            _start_page(in_seq, copies)

    def wait_step(s, span, step, slot):
        for in_seq, *copies in page_copies(s, span, step, slot):
            _wait_page(in_seq, copies)

    def attend(span, step, slot):
        """Online-softmax update of all K * R rows with the keys of one kv step."""
        # Row r is token t0 + r // Q, at position base + r // Q; conditions on r // Q are
        # written as products (d <= r // Q  <=>  Q * d <= r) to keep division off the VPU.
        first_key = (span["page_lo"] + step * ppb) * G
        base = span["kv_len"] - span["q_end"] + t0
        row = lax.broadcasted_iota(jnp.int32, (R, C), 0)
        key = first_key + lax.broadcasted_iota(jnp.int32, (R, C), 1)
        visible = (row >= Q * (span["q_start"] - t0)) & (row < Q * (span["q_end"] - t0))
        visible &= Q * (key - base) <= row  # key <= pos
        if sliding_window is not None:
            visible &= row < Q * (key - base + sliding_window)  # pos - key < window
        v_key = first_key + lax.broadcasted_iota(jnp.int32, (C, H), 0)
        v_ok = v_key < span["key_hi"]  # stale buffer rows, page tails past kv_len -> 0

        def rows(buf, h, scales):
            """kv head h's [C, H] rows of this step, dequantized into q's dtype if coded."""
            x = buf[slot, :, :, h, :].reshape(C, H)
            if kv_cache_dtype is None:
                return x
            return dequantize(x, scales[slot, :, :, h].reshape(C, 1), q_ref.dtype, kv_cache_dtype)

        ks_buf_, vs_buf_ = scale_buf or (None, None)
        for h in range(K):
            q = q_ref[h]  # [R, H]
            k = rows(k_buf, h, ks_buf_)
            precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
            s = lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            s = s * sm_scale  # [R, C]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, MASK_VALUE)
            m_prev, l_prev = m_ref[h, :, :1], l_ref[h, :, :1]  # [R, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            v = jnp.where(v_ok, rows(v_buf, h, vs_buf_), 0)
            pv = lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            m_ref[h] = jnp.broadcast_to(m_new, (R, LANES))
            l_ref[h] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=1, keepdims=True), (R, LANES))
            acc_ref[h] = alpha * acc_ref[h] + pv

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_body(s, carry):
        slot, started = carry  # started: this sequence's first kv step is already in flight
        span = seq_span(s)
        s_next = jnp.minimum(s + 1, seq_hi)
        span_next = seq_span(s_next)
        next_has_steps = (s + 1 <= seq_hi) & (span_next["num_steps"] > 0)

        @pl.when((span["num_steps"] > 0) & (started == 0))
        def start_first_step():
            start_step(s, span, 0, slot)

        def step_body(step, slot):
            last = step + 1 >= span["num_steps"]

            @pl.when(jnp.logical_not(last))
            def prefetch_same_seq():
                start_step(s, span, step + 1, 1 - slot)

            @pl.when(last & next_has_steps)
            def prefetch_next_seq():
                start_step(s_next, span_next, 0, 1 - slot)

            wait_step(s, span, step, slot)
            attend(span, step, slot)
            return 1 - slot

        slot = lax.fori_loop(0, span["num_steps"], step_body, slot)
        started = ((span["num_steps"] > 0) & next_has_steps).astype(jnp.int32)
        return slot, started

    lax.fori_loop(seq_lo, seq_hi + 1, seq_body, (jnp.int32(0), jnp.int32(0)))

    denom = l_ref[:, :, :1]
    out = jnp.where(
        denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0
    )  # padded rows -> 0
    o_ref[...] = out.astype(o_ref.dtype)


def _default_queries_per_block(num_tokens: int) -> int:
    bq = 8
    while bq < min(num_tokens, TPU_QUERIES_PER_BLOCK):
        bq *= 2
    return bq


def ragged_paged_attention_tpu(
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
    interpret=False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    k_scales: jax.Array | None = None,  # [num_pages, G, K, 1] float32: a quantized cache
    v_scales: jax.Array | None = None,
    kv_cache_dtype: str | None = None,  # None/'auto': pages in q's dtype (kv_quant.py)
) -> jax.Array:
    """-> [T, N, H]; the contract is reference.py's. `interpret`: False (compile for TPU), True
    (fast generic interpreter) or a `pltpu.InterpretParams` (TPU simulator: DMAs, races)."""
    if kv_cache_dtype == "auto":
        kv_cache_dtype = None
    T, N, H = q.shape
    _, G, K, _ = k_pages.shape
    P = page_indices.shape[1]
    Q = N // K
    bq = num_queries_per_block or _default_queries_per_block(T)
    ppb = min(num_kv_pages_per_block or TPU_KV_PAGES_PER_BLOCK, P)
    if bq % 8:
        raise ValueError(f"num_queries_per_block must be a multiple of 8: {bq=}")
    num_blocks = _cdiv(T, bq)
    Tp = num_blocks * bq

    # [T, N, H] -> [K, Tp * Q, H]: rows of one kv head, token-major.
    q_kv = q.reshape(T, K, Q, H).transpose(1, 0, 2, 3)
    q_kv = jnp.pad(q_kv, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(K, Tp * Q, H)

    # Sequences overlapping each q block: those owning its first and last valid rows.
    num_tokens = cu_q_lens[num_seqs[0]]
    t0 = jnp.arange(num_blocks, dtype=jnp.int32) * bq
    last_row = jnp.minimum(t0 + bq, num_tokens) - 1
    seq_lo = jnp.searchsorted(cu_q_lens[1:], t0, side="right").astype(jnp.int32)
    seq_hi = jnp.searchsorted(cu_q_lens[1:], last_row, side="right").astype(jnp.int32)
    empty = t0 >= num_tokens
    seq_lo = jnp.where(empty, 0, seq_lo)
    seq_hi = jnp.where(empty, -1, seq_hi)

    kernel = functools.partial(
        _kernel,
        bq=bq,
        ppb=ppb,
        pages_per_seq=P,
        num_queries_per_kv=Q,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        kv_cache_dtype=kv_cache_dtype,
    )
    R = bq * Q
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scale_inputs, scale_scratch = (), []
    if kv_cache_dtype is not None:  # [num_pages, G, K, 1] -> [num_pages, G, K]: a free view
        scale_inputs = (k_scales[..., 0], v_scales[..., 0])
        scale_scratch = [pltpu.VMEM((2, ppb, G, K), jnp.float32)] * 2
    q_spec = pl.BlockSpec((K, R, H), lambda b, *_: (0, b, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_blocks,),
            in_specs=[q_spec, hbm, hbm, *[hbm for _ in scale_inputs]],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb, G, K, H), k_pages.dtype),
                pltpu.VMEM((2, ppb, G, K, H), v_pages.dtype),
                *scale_scratch,
                pltpu.SemaphoreType.DMA((2 + len(scale_inputs), 2)),
                pltpu.VMEM((K, R, LANES), jnp.float32),
                pltpu.VMEM((K, R, LANES), jnp.float32),
                pltpu.VMEM((K, R, H), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_kv.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        kv_lens,
        page_indices.reshape(-1),
        cu_q_lens,
        num_seqs,
        seq_lo,
        seq_hi,
        q_kv,
        k_pages,
        v_pages,
        *scale_inputs,
    )
    out = out.reshape(K, Tp, Q, H).transpose(1, 0, 2, 3)[:T]
    return out.reshape(T, N, H)

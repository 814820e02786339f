"""Causal flash-attention prefill for Hopper GPUs on Mosaic GPU, warp-specialized (spec:
reference.py).

Why. kernel_gpu.py (Pallas on the deprecated Triton lowering) reached 22 % / 34 % of the H200's
bf16 peak on a 2048- / 8192-token prompt, where cuDNN reached 34 % / 55 % and the issue asks for
60 %. What the Triton lowering cannot express is what the fast Hopper kernels (FlashAttention-3,
JAX's attention_mgpu) are built on: TMA copies issued by a producer warpgroup of their own, two
consumer warpgroups whose wgmma matmuls and softmax overlap, and mbarriers between them. This is
that design, on Mosaic GPU (`plgpu.kernel` with three warpgroups); `implementation="mgpu"`
(EngineConfig.pallas_kernel="mgpu" takes it for flash prefill beside the mgpu ragged kernel).

How it was checked without a GPU: numerics in Mosaic GPU's interpreter (InterpretGPUParams: the
three warpgroups run as threads, TMA, mbarriers and wgmma simulated, uninitialized SMEM reads as
NaN) against reference.py, its race detector over the warpgroups' protocol (it reports a refill
that skips the consumers' release: tried on purpose), and lowering by exporting for cuda at the
engine's model shapes. Interpreting it needs 3 XLA CPU threads (mgpu_common.interpret_params).
scripts/device_check.sh compiles and times it on an H200 when one is lent.

What it needs: bfloat16 or float16 (wgmma has no full-float32 path), head_dim a multiple of 64
and at most 256, sm_90. Anything else raises a ValueError naming the limit.

Algorithm (one prompt, no cache: K/V are the prompt's own projections, [T, K, H]):
  - Grid (cdiv(T, 128), N): one program per 128 query tokens and query head (query head n reads
    kv head n // Q; the Q programs of a kv head read the same K/V blocks, mostly from L2). The
    heaviest q blocks (the last: causal attention sees every key) are launched first, so the
    light ones fill the tail of the last wave.
  - Three warpgroups per program. Warpgroups 0 and 1 (consumers) each own 64 query rows (wgmma's
    M): rows q0 .. q0 + 63 of query head n, read by TMA straight from q [T, N, H] (a strided
    [64, H] box). Warpgroup 2 (producer) copies K and V blocks of `block_kv` keys of kv head h by
    TMA into `num_stages` SMEM slots, one mbarrier per slot for "arrived" (k_ready, v_ready) and
    one for "both consumers done with it" (k_free, v_free, two arrivals); it refills a slot as
    soon as both consumers have released it, so up to num_stages blocks are in flight while the
    consumers compute.
  - Each consumer walks the KV blocks its rows can see (causal block skipping: keys up to its
    last row, and below seq_len; with a sliding window, from its first row's window start), in
    three runs: blocks every row sees whole (no mask), then the diagonal blocks (masked: causal,
    window). The producer loads the union of the two consumers' ranges; a consumer still waits
    on, and releases, the blocks outside its own range (mbarrier phases are tracked per thread:
    a skipped wait would desynchronize them), without computing on them.
  - Per block: S = q K^T (wgmma, f32 accumulator; K released right after), scale (and soft cap)
    in base 2, mask to MASK_VALUE, online softmax with exp2, acc = alpha * acc + P V (wgmma, P in
    the input dtype: from registers when compiled, as FlashAttention-3 does; staged through SMEM
    in the interpreter, whose wgmma takes SMEM operands only), V released.
  - Ping-pong (`pingpong=True`, FlashAttention-3's schedule): the consumers meet at a `turn`
    barrier right after issuing each q K^T and again once their softmax is done; consumer 1
    starts one turn behind, so one consumer's matmuls run while the other computes its softmax.
    Every block, skipped or not, takes the same two turns, so the counts always match.
  - The consumer writes acc / denom (0 for a row that saw no key) in q's dtype over its q tile
    in SMEM and TMA-copies it to out [T, N, H]. The wrapper pads T to whole q and KV blocks (TMA
    boxes stay in bounds), zeroes V at and past seq_len (a masked P is 0 but 0 * NaN is NaN; a
    padded row's K is only ever masked), and zeroes output rows at and past seq_len.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.flash_prefill.tuning import MGPU_KEYS_PER_BLOCK, MGPU_NUM_STAGES
from kernels_pallas.mgpu_common import (
    add_pv,
    base2_scores,
    check_dtype,
    init_softmax_state,
    interpret_params,
    mask_scores,
    normalize,
    online_softmax_step,
    qk,
    stage_p,
    swizzled,
    take_turn,
)
from kernels_pallas.mgpu_common import fit_num_stages as fit_stages

ROWS = 64  # query rows per consumer warpgroup: wgmma's M
NUM_CONSUMERS = 2
BLOCK_T = ROWS * NUM_CONSUMERS  # query tokens per program


def check_supported(q_dtype, head_dim: int) -> None:
    """Raise a ValueError naming the limit if this kernel cannot run the shapes."""
    check_dtype(q_dtype, "flash prefill")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(
            f"the Mosaic GPU flash prefill kernel needs head_dim % 64 == 0 and <= 256, "
            f"got {head_dim}"
        )


def smem_bytes(num_stages: int, H: int, block_kv: int, itemsize: int, p_in_smem: bool) -> int:
    """SMEM the kernel allocates: two q/out tiles, K and V slots (+ two P tiles)."""
    n = NUM_CONSUMERS * ROWS * H + 2 * num_stages * block_kv * H
    if p_in_smem:
        n += NUM_CONSUMERS * ROWS * block_kv
    return n * itemsize


def fit_num_stages(num_stages: int, H: int, block_kv: int, itemsize: int, p_in_smem: bool):
    """The most stages, up to `num_stages`, that fit SMEM; raises if not even one does."""
    return fit_stages(
        num_stages,
        lambda n: smem_bytes(n, H, block_kv, itemsize, p_in_smem),
        f"KV block of {block_kv} keys at head_dim {H}",
    )


def _kv_range(q0, seq_len, block_kv: int, sliding_window: int | None):
    """-> [lo, hi): the KV blocks rows q0 .. q0 + ROWS - 1 can see (empty past seq_len)."""
    last = jnp.minimum(q0 + ROWS, seq_len)  # one past the last key any real row sees
    hi = (last + block_kv - 1) // block_kv
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(0, q0 - sliding_window + 1) // block_kv
    hi = jnp.where(q0 < seq_len, jnp.maximum(hi, lo), lo)
    return lo, hi


def _flash_kernel(
    seq_len_ref,  # [1] int32 (GMEM)
    q_ref,  # [Tp, N, H]
    k_ref,  # [Tp, K, H]
    v_ref,  # [Tp, K, H], zero at and past seq_len
    o_ref,  # [Tp, N, H]
    qo_smem,  # [NUM_CONSUMERS, ROWS, H]: q tiles, then the outputs
    k_smem,  # [num_stages, block_kv, H]
    v_smem,  # [num_stages, block_kv, H]
    p_smem,  # [NUM_CONSUMERS, ROWS, block_kv] or None
    q_ready,  # NUM_CONSUMERS barriers
    k_ready,  # num_stages barriers (TMA)
    v_ready,
    k_free,  # num_stages barriers, NUM_CONSUMERS arrivals each
    v_free,
    turn,  # NUM_CONSUMERS arrivals: the ping-pong between the consumers (None: off)
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_queries_per_kv: int,
    block_kv: int,
    num_stages: int,
):
    BK = block_kv
    H = q_ref.shape[-1]
    dtype = q_ref.dtype
    t = (q_ref.shape[0] // BLOCK_T) - 1 - jax.lax.axis_index("t")  # heaviest block first
    n = jax.lax.axis_index("n")
    wg = jax.lax.axis_index("wg")
    kv_head = n // num_queries_per_kv
    seq_len = seq_len_ref[0]
    t0 = t * BLOCK_T
    ranges = [_kv_range(t0 + c * ROWS, seq_len, BK, sliding_window) for c in range(NUM_CONSUMERS)]
    lo_all = ranges[0][0]  # the lowest: rows further down see no earlier block
    hi_all = functools.reduce(jnp.maximum, [hi for _, hi in ranges])
    num_steps = hi_all - lo_all  # blocks the producer loads, step i = block lo_all + i

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def issue(step, slot):
            keys = pl.ds((lo_all + step) * BK, BK)
            plgpu.copy_gmem_to_smem(k_ref.at[keys, kv_head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys, kv_head], v_smem.at[slot], v_ready.at[slot])

        for i in range(num_stages):
            pl.when(i < num_steps)(functools.partial(issue, i, i))

        @pl.loop(num_stages, jnp.maximum(num_steps, num_stages))
        def _refill(step):
            slot = jax.lax.rem(step, num_stages)
            keys = pl.ds((lo_all + step) * BK, BK)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[keys, kv_head], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys, kv_head], v_smem.at[slot], v_ready.at[slot])

        # Observe the consumers' last releases too: a barrier must not end the kernel with
        # phases a waiting thread never saw (the interpreter checks; a persistent kernel that
        # reused the slots would need it).
        @pl.loop(jnp.maximum(num_steps - num_stages, 0), num_steps)
        def _drain(step):
            slot = jax.lax.rem(step, num_stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q0 = t0 + wg * ROWS
        q_tile = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q0, ROWS), n], q_tile, q_ready.at[wg])
        lo, hi = _kv_range(q0, seq_len, BK, sliding_window)
        lo, hi = lo - lo_all, hi - lo_all  # in steps
        if sliding_window is None:  # blocks whose last key is at or below the first row
            full_end = jnp.clip((q0 + 1) // BK - lo_all, lo, hi)
        else:
            full_end = lo
        shape = (ROWS, BK)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        pos = q0 + row

        def wait_v_and_turn(slot):
            if turn is None:
                plgpu.barrier_wait(v_ready.at[slot])
            else:  # done with the softmax; wait until the other consumer's matmuls are issued
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

        def skip(step, carry):
            # A block outside this consumer's range: wait and release it all the same (mbarrier
            # phases are tracked per thread) and keep the ping-pong's count of turns.
            slot = jax.lax.rem(step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            if turn is not None:
                take_turn(turn)
            plgpu.barrier_arrive(k_free.at[slot])
            wait_v_and_turn(slot)
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        def attend(step, carry, *, masked: bool):
            acc, m, denom = carry
            slot = jax.lax.rem(step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            # Issued: the other consumer may issue its matmul now.
            s = qk(
                q_tile,
                k_smem.at[slot],
                None if turn is None else functools.partial(take_turn, turn),
            )
            plgpu.barrier_arrive(k_free.at[slot])
            s = base2_scores(s, sm_scale, soft_cap)
            if masked:
                key = (lo_all + step) * BK + col
                s = mask_scores(s, key, pos, sliding_window)
            p, m_new, denom, acc = online_softmax_step(s, m, denom, acc)
            p = stage_p(p.astype(dtype), None if p_smem is None else p_smem.at[wg])
            wait_v_and_turn(slot)
            acc = add_pv(acc, p, v_smem.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, denom

        carry = init_softmax_state(ROWS, H)
        plgpu.barrier_wait(q_ready.at[wg])
        if turn is not None:  # consumer 1 starts one turn behind consumer 0 ...
            pl.when(wg == 1)(functools.partial(take_turn, turn))
        carry = jax.lax.fori_loop(0, lo, skip, carry)
        carry = jax.lax.fori_loop(lo, full_end, functools.partial(attend, masked=False), carry)
        carry = jax.lax.fori_loop(full_end, hi, functools.partial(attend, masked=True), carry)
        acc, _, denom = jax.lax.fori_loop(hi, num_steps, skip, carry)
        if turn is not None:  # ... and consumer 0 takes one more turn at the end
            pl.when(wg == 0)(functools.partial(take_turn, turn))

        q_tile[...] = normalize(acc, denom).astype(
            dtype
        )  # every QK wgmma that read q has completed
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[pl.ds(q0, ROWS), n])
        plgpu.wait_smem_to_gmem(0)


def flash_prefill_mgpu(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    seq_len: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_kv: int = MGPU_KEYS_PER_BLOCK,  # keys per KV block (a multiple of 64)
    num_stages: int = MGPU_NUM_STAGES,  # KV blocks in flight (reduced to fit SMEM)
    p_in_smem: bool | None = None,  # None: in the interpreter only
    pingpong: bool = True,  # the consumers take turns on the tensor cores
) -> jax.Array:
    """-> [T, N, H] in q's dtype; see reference.py for the contract and the module doc for the
    design. `interpret` runs the kernel in Mosaic GPU's interpreter (on the CPU, for tests)."""
    T, N, H = q.shape
    K = k.shape[1]
    check_supported(q.dtype, H)
    if not 0 < block_kv <= 256 or block_kv % 64:
        raise ValueError(
            f"{block_kv=} must be a multiple of 64 (wgmma tiles) and at most 256 (a TMA box)"
        )
    if num_stages <= 0:
        raise ValueError(f"{num_stages=} must be positive")
    interpret = interpret_params(interpret, NUM_CONSUMERS + 1)
    if p_in_smem is None:
        p_in_smem = bool(interpret)
    num_stages = fit_num_stages(num_stages, H, block_kv, q.dtype.itemsize, p_in_smem)

    Tp = pl.cdiv(T, math.lcm(BLOCK_T, block_kv)) * math.lcm(BLOCK_T, block_kv)
    pad = ((0, Tp - T), (0, 0), (0, 0))
    real = (jnp.arange(Tp) < seq_len[0])[:, None, None]
    qp, kp = jnp.pad(q, pad), jnp.pad(k, pad)
    vp = jnp.where(real, jnp.pad(v, pad), 0).astype(v.dtype)

    transforms = swizzled(q.dtype)
    scratch = [
        plgpu.SMEM((NUM_CONSUMERS, ROWS, H), q.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, H), q.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_kv, H), q.dtype, transforms=transforms),
        plgpu.SMEM((NUM_CONSUMERS, ROWS, block_kv), q.dtype, transforms=transforms)
        if p_in_smem
        else None,
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=NUM_CONSUMERS) if pingpong else None,
    ]
    kernel = functools.partial(
        _flash_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_queries_per_kv=N // K,
        block_kv=block_kv,
        num_stages=num_stages,
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((Tp, N, H), q.dtype),
        scratch_types=scratch,
        grid=(Tp // BLOCK_T, N),
        grid_names=("t", "n"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(seq_len, qp, kp, vp)
    valid = (jnp.arange(T) < seq_len[0])[:, None, None]
    return jnp.where(valid, out[:T], 0).astype(q.dtype)

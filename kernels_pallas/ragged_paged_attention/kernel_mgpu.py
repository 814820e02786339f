"""Ragged paged attention for Hopper GPUs on Mosaic GPU (`plgpu.kernel`; spec: reference.py).

Why a second GPU kernel. kernel_gpu.py is Pallas on the Triton lowering, which jax 0.11 deprecates
("migrate to the Mosaic GPU backend"); on one H200 it reached 63 % of the HBM data sheet on decode
batches and 22-34 % of the bf16 peak on prefill, short of the issue's goals. This kernel is the
Mosaic GPU port: KV pages arrive by TMA (one async copy per page, page ids read from the page
table in GMEM), several KV blocks in flight at once, and both matmuls run on the tensor cores as
Hopper wgmma. It is the `mgpu` implementation: chosen by name (EngineConfig.pallas_kernel, or
`implementation="mgpu"`), not yet the CUDA default, because it has not been timed on hardware
(scripts/device_check.sh times it next to the Triton kernel when a GPU is lent).

How it was checked without a GPU: numerics in Mosaic GPU's interpreter (InterpretGPUParams: TMA,
barriers and wgmma simulated, uninitialized SMEM read as NaN) against reference.py, and lowering
by exporting for cuda (Mosaic GPU's layout inference, tile and SMEM checks for sm_90) at every
kernel configuration the engine's buckets produce. The interpreter did not flag a slot refilled
before its P V read in the single-warpgroup variant (tried on purpose, also with its race
detector), so that pipeline's ordering rests on the code's structure: a slot is refilled only
after the step's accumulator has been read, which waits for its wgmmas. Across warpgroups (the
warp-specialized variant) the race detector does report a refill that skips the consumers'
release, and the tests run it.

What it needs: bfloat16 or float16 inputs (wgmma has no full-float32 path), head_dim a multiple
of 64, page_size a multiple of 8 (a page is a whole number of 8-row SMEM tiles), at most 64 query
heads per kv head, sm_90 (wgmma). Anything else raises a ValueError naming the limit.

Algorithm (flash attention over pages, online softmax in float32, scores in base 2):
  - The wrapper splits each sequence's query tokens into q blocks of `block_q` tokens (a block
    never spans two sequences; `_q_block_schedule`, shared with kernel_gpu.py) and gathers each
    block's rows into one [64, H] tile per kv head: row r = token r // Q, query head r % Q of that
    kv head (rows past block_q * Q, or past the sequence's last token, are zeros and discarded).
    Decode blocks use Q of the 64 rows: wgmma's minimum is 64 rows per warpgroup. At full HBM
    bandwidth (4.8 TB/s, head dim 128) the padded matmuls then run at ~310 TFLOP/s, a third of
    the bf16 peak, so decode should stay bound by reading KV; if it is not, a decode path that
    puts keys on the 64 rows (S^T = K q^T) is the next step.
  - Grid (num_blocks, K, num_kv_splits), one warpgroup per program. Program (b, h, c) copies its
    q tile to SMEM, then walks the KV blocks its rows can see ([first visible key, last row's
    position], split c of them with split-KV) in steps of `pages_per_block` pages: each step is
    2 x pages_per_block TMA copies (K and V pages of kv head h, strided [G, H] boxes of the
    [pages, G, K, H] cache) into one of `num_stages` SMEM slots; the copies of step i + num_stages
    are issued as soon as step i's matmuls have read the slot. Per step: S = q K^T (wgmma, f32
    accumulator), scale and soft cap, mask (causal, kv_len, window) to MASK_VALUE, online softmax
    (running max in base 2, exp2), acc = alpha * acc + P V (wgmma; P rounded to the input dtype,
    taken from registers when compiled, staged in SMEM in the interpreter, whose wgmma takes
    SMEM operands only; `p_in_smem` chooses).
  - Pages past a sequence's last page are never named: the wrapper clamps each page-table row to
    its last used page, so a block's trailing page copies re-read that page (keys at or past
    kv_len, masked). The last block's V rows at or past kv_len are zeroed in SMEM before P V, so
    whatever a page holds past kv_len (stale or NaN) never reaches the output (0 * NaN = NaN).
  - One split: the program writes acc / denom in q's dtype to its own [64, H] output tile; the
    wrapper scatters tiles back to token rows. Split-KV (flash decoding, same rule as the Triton
    kernel, `choose_num_kv_splits`): float32 partials (acc / denom, m, denom) per split, combined
    by the wrapper with weights denom * 2^(m - max_c m).

Warp-specialized variant (`warp_specialized=True`, `_rpa_kernel_ws`; the design of
flash_prefill/kernel_mgpu.py applied to pages). Above, one warpgroup alternates between issuing
page copies (scalar page-table reads from GMEM, then TMA) and computing, and each KV step serves
one 64-row tile. Here a producer warpgroup issues the copies while `num_consumers` consumer
warpgroups compute: with 2 (the default where a bucket's sequences average more than one q
block), a program takes two consecutive q blocks of one sequence, so each KV step loaded serves
128 rows, and the consumers take turns on the tensor cores (one's softmax overlaps the other's
matmuls). The producer loads the union of the two tiles' KV ranges; a consumer waits on and
releases the steps outside its own range without computing (mbarrier phases are tracked per
thread). The V tail past kv_len is zeroed once, by the consumer holding the sequence's last
query (it always sees that block), between its wait for V and its turn; the other consumer waits
on `tail_done` before its P V. Not the default until timed on hardware beside the variant above.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import online_softmax
from kernels_pallas.mgpu_common import (
    SWIZZLE_BYTES,
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
    zero_rows_from,
)
from kernels_pallas.mgpu_common import fit_num_stages as fit_stages
from kernels_pallas.ragged_paged_attention.kernel_gpu import (
    _q_block_schedule,
    choose_num_kv_splits,
)
from kernels_pallas.ragged_paged_attention.tuning import (
    MGPU_KEYS_PER_BLOCK,
    MGPU_NUM_STAGES,
    MGPU_WARP_SPECIALIZED,
)

ROWS = 64  # query rows per program: one warpgroup's wgmma tile


def check_supported(q_dtype, head_dim: int, page_size: int, num_queries_per_kv: int) -> None:
    """Raise a ValueError naming the limit if this kernel cannot run the shapes."""
    check_dtype(q_dtype, "ragged paged attention")
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernel needs head_dim % 64 == 0, got {head_dim}")
    if page_size % 8:
        raise ValueError(f"the Mosaic GPU kernel needs page_size % 8 == 0, got {page_size}")
    if num_queries_per_kv > ROWS:
        raise ValueError(
            f"the Mosaic GPU kernel takes at most {ROWS} query heads per kv head, "
            f"got {num_queries_per_kv}"
        )


def default_block_sizes(T: int, S: int, num_queries_per_kv: int, page_size: int) -> tuple:
    """-> (block_q tokens, pages_per_block): as many tokens as fill 64 rows, but no more than a
    sequence of the bucket has on average (T // S, so a decode bucket gets 1), and the fewest
    whole pages that make at least MGPU_KEYS_PER_BLOCK keys and a multiple of 64 (the swizzled
    tile of the P V matmul; page_size 24 -> 8 pages)."""
    avg_q_len = max(1, T // S)
    block_q = max(1, min(ROWS // num_queries_per_kv, avg_q_len))
    keys = math.lcm(page_size, 64)
    keys *= -(-MGPU_KEYS_PER_BLOCK // keys)
    return block_q, keys // page_size


def smem_bytes(
    num_stages: int,
    H: int,
    BK: int,
    itemsize: int,
    split: bool,
    p_in_smem: bool = True,
    num_consumers: int = 1,
) -> int:
    """SMEM the kernel allocates: a q/out tile per consumer, K and V slots, a P tile per
    consumer if staged (+ float32 partials per consumer with split-KV)."""
    per_consumer = ROWS * H + (ROWS * BK if p_in_smem else 0)
    n = (num_consumers * per_consumer + 2 * num_stages * BK * H) * itemsize
    return n + (num_consumers * (ROWS * H + 2 * ROWS) * 4 if split else 0)


def fit_num_stages(
    num_stages: int,
    H: int,
    BK: int,
    itemsize: int,
    split: bool,
    p_in_smem: bool = True,
    num_consumers: int = 1,
) -> int:
    """The most stages, up to `num_stages`, that fit SMEM; raises if not even one does."""
    return fit_stages(
        num_stages,
        lambda n: smem_bytes(n, H, BK, itemsize, split, p_in_smem, num_consumers),
        f"KV step of {BK} keys at head_dim {H}",
    )


def default_num_consumers(T: int, S: int, block_q: int) -> int:
    """Consumer warpgroups of the warp-specialized kernel: 2 (two q tiles of a sequence share
    each KV step) where sequences of the bucket average more than one q block, else 1."""
    avg_q_len = T // S
    return 2 if avg_q_len > block_q else 1


def _block_range(q0, q_len, kv_len, block_q: int, BK: int, sliding_window: int | None):
    """The q tile of a sequence's queries q0 .. q0 + block_q - 1 -> (its first query's position,
    [lo, hi) the KV blocks of BK keys its rows can see: from the first row's window start, or 0,
    to the last row's own key). Empty (hi = lo) when q0 is past the sequence's queries."""
    first_pos = kv_len - q_len + q0
    hi = (kv_len - q_len + jnp.minimum(q0 + block_q, q_len) + BK - 1) // BK
    if sliding_window is None:
        lo = jnp.int32(0)
    else:
        lo = jnp.maximum(0, first_pos - sliding_window + 1) // BK
    return first_pos, lo, jnp.where(q0 < q_len, jnp.maximum(hi, lo), lo)


def _split_range(lo, hi, split, num_kv_splits: int):
    """[lo, hi) -> split `split`'s share of it (split-KV; the same rule as kernel_gpu.py)."""
    if num_kv_splits == 1:
        return lo, hi
    per_split = (hi - lo + num_kv_splits - 1) // num_kv_splits
    lo = lo + split * per_split
    return lo, jnp.minimum(hi, lo + per_split)


def _rpa_kernel(
    kv_lens_ref,  # [S] int32
    page_table_ref,  # [S, P_pad] int32, rows clamped to their last used page
    cu_q_lens_ref,  # [S + 1] int32
    block_seq_ref,  # [NB] int32, -1: unused slot
    block_q0_ref,  # [NB] int32
    q_ref,  # [NB, K, ROWS, H]
    k_pages_ref,  # [num_pages, G, K, H]
    v_pages_ref,  # [num_pages, G, K, H]
    o_ref,  # [NB, K, ROWS, H] q.dtype | split-KV: [C, NB, K, ROWS, H] float32
    *refs,  # split-KV: m_ref, l_ref [C, NB, K, ROWS] float32; then the scratch below
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_queries_per_kv: int,
    block_q: int,
    pages_per_block: int,
    num_kv_splits: int,
    num_stages: int,
):
    C = num_kv_splits
    if C > 1:
        m_ref, l_ref, *scratch = refs
        q_smem, k_smem, v_smem, p_smem, q_bar, k_bars, v_bars, o_smem, stat_smem = scratch
    else:
        q_smem, k_smem, v_smem, p_smem, q_bar, k_bars, v_bars = refs
        o_smem = q_smem  # no step reads q any more when the output is written
    Q, BQ, ppb = num_queries_per_kv, block_q, pages_per_block
    G = k_pages_ref.shape[1]
    H = q_ref.shape[-1]
    BK = ppb * G
    dtype = q_ref.dtype
    b, h, split = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("c")
    seq = block_seq_ref[b]

    @pl.when(seq >= 0)
    def _attend():
        q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
        kv_len = kv_lens_ref[seq]
        first_pos, lo_blk, hi_blk = _block_range(
            block_q0_ref[b], q_len, kv_len, BQ, BK, sliding_window
        )
        lo_blk, hi_blk = _split_range(lo_blk, hi_blk, split, C)
        num_steps = jnp.maximum(hi_blk - lo_blk, 0)
        last_blk = (kv_len - 1) // BK  # the block holding key kv_len - 1

        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)

        def issue(step, slot):
            blk = lo_blk + step
            for j in range(ppb):
                page = page_table_ref[seq, blk * ppb + j]
                rows = pl.ds(j * G, G)
                plgpu.copy_gmem_to_smem(
                    k_pages_ref.at[page, :, h, :], k_smem.at[slot, rows], k_bars.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_pages_ref.at[page, :, h, :], v_smem.at[slot, rows], v_bars.at[slot]
                )

        for i in range(num_stages):
            pl.when(i < num_steps)(functools.partial(issue, i, i))

        plgpu.barrier_wait(q_bar)
        shape = (ROWS, BK)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        pos = first_pos + row // Q  # key position of each row's query (unused rows: past it)

        def kv_step(step, carry):
            acc, m, denom = carry
            slot = jax.lax.rem(step, num_stages)
            blk = lo_blk + step
            plgpu.barrier_wait(k_bars.at[slot])
            s = qk(q_smem, k_smem.at[slot])
            s = base2_scores(s, sm_scale, soft_cap)
            s = mask_scores(s, blk * BK + col, pos, sliding_window, kv_len)
            p, m_new, denom, acc = online_softmax_step(s, m, denom, acc)
            plgpu.barrier_wait(v_bars.at[slot])
            pl.when(blk == last_blk)(lambda: zero_rows_from(v_smem.at[slot], blk * BK, kv_len))

            acc = add_pv(acc, stage_p(p.astype(dtype), p_smem), v_smem.at[slot])

            @pl.when(step + num_stages < num_steps)
            def _refill():
                issue(step + num_stages, slot)

            return acc, m_new, denom

        acc, m, denom = jax.lax.fori_loop(0, num_steps, kv_step, init_softmax_state(ROWS, H))
        o = normalize(acc, denom)
        if C == 1:
            o_smem[...] = o.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h])
        else:
            o_smem[...] = o
            stat_smem[0] = m
            stat_smem[1] = denom
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, b, h])
            plgpu.copy_smem_to_gmem(stat_smem.at[0], m_ref.at[split, b, h])
            plgpu.copy_smem_to_gmem(stat_smem.at[1], l_ref.at[split, b, h])
        plgpu.wait_smem_to_gmem(0)


def _rpa_kernel_ws(
    kv_lens_ref,  # [S] int32
    page_table_ref,  # [S, P_pad] int32, rows clamped to their last used page
    cu_q_lens_ref,  # [S + 1] int32
    block_seq_ref,  # [NB] int32, -1: unused slot
    block_q0_ref,  # [NB] int32: the first query of consumer 0's tile
    q_ref,  # [NB * NC, K, ROWS, H]: tile b * NC + c is consumer c's
    k_pages_ref,  # [num_pages, G, K, H]
    v_pages_ref,  # [num_pages, G, K, H]
    o_ref,  # [NB * NC, K, ROWS, H] q.dtype | split-KV: [C, NB * NC, K, ROWS, H] float32
    *refs,  # split-KV: m_ref, l_ref [C, NB * NC, K, ROWS] float32; then the scratch below
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_queries_per_kv: int,
    block_q: int,
    pages_per_block: int,
    num_kv_splits: int,
    num_stages: int,
    num_consumers: int,
):
    """The warp-specialized variant (module doc): warpgroup NC copies KV pages, warpgroups
    0 .. NC - 1 attend one q tile each (consecutive tiles of one sequence)."""
    C, NC = num_kv_splits, num_consumers
    if C > 1:
        m_ref, l_ref, *refs = refs
    (q_smem, k_smem, v_smem, p_smem, o32_smem, stat_smem) = refs[:6]
    (q_ready, k_ready, v_ready, k_free, v_free, turn, tail_done) = refs[6:]
    Q, BQ, ppb = num_queries_per_kv, block_q, pages_per_block
    G = k_pages_ref.shape[1]
    H = q_ref.shape[-1]
    BK = ppb * G
    dtype = q_ref.dtype
    b, h, split = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("c")
    wg = jax.lax.axis_index("wg")
    seq = block_seq_ref[b]

    @pl.when(seq >= 0)
    def _attend():
        q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
        kv_len = kv_lens_ref[seq]
        ranges = [  # consumer c: (first row's position, [lo, hi) KV blocks)
            _block_range(block_q0_ref[b] + c * BQ, q_len, kv_len, BQ, BK, sliding_window)
            for c in range(NC)
        ]
        lo_all = ranges[0][1]
        hi_all = functools.reduce(jnp.maximum, [hi for _, _, hi in ranges])
        lo_all, hi_all = _split_range(lo_all, hi_all, split, C)
        num_steps = jnp.maximum(hi_all - lo_all, 0)  # step i: KV block lo_all + i
        tail_step = (kv_len - 1) // BK - lo_all  # the block holding key kv_len - 1
        # The consumer whose tile holds the sequence's last query sees that block, and zeroes
        # V past kv_len in it for both (the other waits on tail_done before its P V).
        zeroer = jnp.int32(0)
        for c in range(1, NC):
            zeroer = jnp.where(block_q0_ref[b] + c * BQ < q_len, c, zeroer)

        @pl.when(wg == NC)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def copy(step, slot, pages_ref, smem, bars):
                blk = lo_all + step
                for j in range(ppb):
                    page = page_table_ref[seq, blk * ppb + j]
                    plgpu.copy_gmem_to_smem(
                        pages_ref.at[page, :, h, :], smem.at[slot, pl.ds(j * G, G)], bars.at[slot]
                    )

            def first(i):
                copy(i, i, k_pages_ref, k_smem, k_ready)
                copy(i, i, v_pages_ref, v_smem, v_ready)

            for i in range(num_stages):
                pl.when(i < num_steps)(functools.partial(first, i))

            @pl.loop(num_stages, jnp.maximum(num_steps, num_stages))
            def _refill(step):
                slot = jax.lax.rem(step, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                copy(step, slot, k_pages_ref, k_smem, k_ready)
                plgpu.barrier_wait(v_free.at[slot])
                copy(step, slot, v_pages_ref, v_smem, v_ready)

            @pl.loop(jnp.maximum(num_steps - num_stages, 0), num_steps)
            def _drain(step):  # observe the last releases too (see flash_prefill/kernel_mgpu.py)
                slot = jax.lax.rem(step, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

        @pl.when(wg < NC)
        def _consumer():
            plgpu.set_max_registers(232 if NC > 1 else 240, action="increase")
            tile = b * NC + wg
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[tile, h], q_tile, q_ready.at[wg])
            first_pos, lo, hi = ranges[0]
            for c in range(1, NC):
                first_pos, lo, hi = (
                    jnp.where(wg == c, new, old)
                    for new, old in zip(ranges[c], (first_pos, lo, hi), strict=True)
                )
            lo = jnp.clip(lo - lo_all, 0, num_steps)
            hi = jnp.clip(hi - lo_all, lo, num_steps)
            shape = (ROWS, BK)
            row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            pos = first_pos + row // Q  # key position of each row's query (unused rows: past it)

            def wait_v(step, slot):
                """V of `step` is in its slot (and zeroed past kv_len) when this returns. The
                zeroing comes before the turn wait: the other consumer, waiting on tail_done,
                takes its next turn only after its P V, so zeroing after the turn deadlocks."""
                if turn is not None:
                    plgpu.barrier_arrive(turn)  # done with the softmax
                plgpu.barrier_wait(v_ready.at[slot])

                @pl.when((step == tail_step) & (wg == zeroer))
                def _zero_v_tail():
                    zero_rows_from(v_smem.at[slot], (lo_all + step) * BK, kv_len)
                    if tail_done is not None:
                        plgpu.barrier_arrive(tail_done)

                if turn is not None:  # the other consumer's matmuls are issued
                    plgpu.barrier_wait(turn)
                if tail_done is not None:
                    pl.when((step == tail_step) & (wg != zeroer))(
                        lambda: plgpu.barrier_wait(tail_done)
                    )

            def skip(step, carry):  # a block outside this tile's range: wait, release
                slot = jax.lax.rem(step, num_stages)
                plgpu.barrier_wait(k_ready.at[slot])
                if turn is not None:
                    take_turn(turn)
                plgpu.barrier_arrive(k_free.at[slot])
                wait_v(step, slot)
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            def attend(step, carry):
                acc, m, denom = carry
                slot = jax.lax.rem(step, num_stages)
                plgpu.barrier_wait(k_ready.at[slot])
                s = qk(
                    q_tile,
                    k_smem.at[slot],
                    None if turn is None else functools.partial(take_turn, turn),
                )
                plgpu.barrier_arrive(k_free.at[slot])
                s = base2_scores(s, sm_scale, soft_cap)
                s = mask_scores(s, (lo_all + step) * BK + col, pos, sliding_window, kv_len)
                p, m, denom, acc = online_softmax_step(s, m, denom, acc)
                p = stage_p(p.astype(dtype), None if p_smem is None else p_smem.at[wg])
                wait_v(step, slot)
                acc = add_pv(acc, p, v_smem.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m, denom

            carry = init_softmax_state(ROWS, H)
            plgpu.barrier_wait(q_ready.at[wg])
            if turn is not None:  # consumer 1 starts one turn behind consumer 0 ...
                pl.when(wg == 1)(functools.partial(take_turn, turn))
            carry = jax.lax.fori_loop(0, lo, skip, carry)
            carry = jax.lax.fori_loop(lo, hi, attend, carry)
            acc, m, denom = jax.lax.fori_loop(hi, num_steps, skip, carry)
            if turn is not None:  # ... and consumer 0 takes one more turn at the end
                pl.when(wg == 0)(functools.partial(take_turn, turn))
            o = normalize(acc, denom)
            if C == 1:
                q_tile[...] = o.astype(dtype)  # every QK wgmma that read q has completed
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_tile, o_ref.at[tile, h])
            else:
                o32_smem.at[wg][...] = o
                stat_smem.at[wg, 0][...] = m
                stat_smem.at[wg, 1][...] = denom
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o32_smem.at[wg], o_ref.at[split, tile, h])
                plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], m_ref.at[split, tile, h])
                plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], l_ref.at[split, tile, h])
            plgpu.wait_smem_to_gmem(0)


def _clamped_page_table(page_indices, kv_lens, page_size: int, width: int):
    """Each row's entries past its last used page repeat that page, padded to `width` columns:
    a KV block's trailing copies then read a page of the same sequence, never a stranger's.

    In (page_size 4): page_indices [[5 7 0 0]], kv_lens [6], width 6  ->  [[5 7 7 7 7 7]]"""
    P = page_indices.shape[1]
    last = jnp.maximum((kv_lens + page_size - 1) // page_size - 1, 0)  # [S]
    cols = jnp.minimum(jnp.arange(width, dtype=jnp.int32)[None, :], last[:, None])
    cols = jnp.minimum(cols, P - 1)
    return jnp.take_along_axis(page_indices, cols, axis=1)


def _block_rows(cu_q_lens, block_seq, block_q0, num_queries_per_kv: int, block_q: int, T: int):
    """-> (token [NB, ROWS], head [NB, ROWS], used [NB, ROWS]): row r of q block b is query head
    head (of its kv head) of flat token `token`; `used` is False for rows past block_q * Q or past
    the sequence's last token (and for unused blocks)."""
    Q = num_queries_per_kv
    r = jnp.arange(ROWS, dtype=jnp.int32)[None, :]
    i = block_q0[:, None] + r // Q  # query index within the sequence
    seq = jnp.maximum(block_seq, 0)[:, None]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    used = (block_seq[:, None] >= 0) & (r < block_q * Q) & (i < q_len)
    token = jnp.where(used, cu_q_lens[seq] + i, 0)
    return jnp.minimum(token, T - 1), jnp.broadcast_to(r % Q, used.shape), used


def ragged_paged_attention_mgpu(
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
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_q: int | None = None,  # query tokens per program (block_q * Q <= 64)
    pages_per_block: int | None = None,  # KV pages per pipeline step
    num_kv_splits: int | None = None,  # None: choose_num_kv_splits
    num_stages: int = MGPU_NUM_STAGES,  # KV steps in flight
    p_in_smem: bool | None = None,  # P V's P staged in SMEM; None: in the interpreter only
    warp_specialized: bool = MGPU_WARP_SPECIALIZED,  # a producer warpgroup copies KV pages
    num_consumers: int | None = None,  # warp-specialized: q tiles per program (None: default)
) -> jax.Array:
    """-> [T, N, H] in q's dtype; see reference.py for the contract and the module doc for the
    design. `interpret` runs the kernel in Mosaic GPU's interpreter (on the CPU, for tests)."""
    T, N, H = q.shape
    _, G, K, _ = k_pages.shape
    S, P = page_indices.shape
    Q = N // K
    check_supported(q.dtype, H, G, Q)
    dq, dp = default_block_sizes(T, S, Q, G)
    block_q, pages_per_block = block_q or dq, pages_per_block or dp
    if not 0 < block_q * Q <= ROWS:
        raise ValueError(f"{block_q=} x {Q} query heads per kv head must be 1..{ROWS} rows")
    if pages_per_block <= 0 or num_stages <= 0:
        raise ValueError(f"{pages_per_block=} and {num_stages=} must be positive")
    tile = SWIZZLE_BYTES // q.dtype.itemsize  # keys per swizzled SMEM tile row
    if (pages_per_block * G) % tile:
        raise ValueError(
            f"a KV step must be a multiple of {tile} keys (the P.V matmul's swizzled tile): "
            f"{pages_per_block=} x page_size {G} = {pages_per_block * G}"
        )
    if not warp_specialized and num_consumers not in (None, 1):
        raise ValueError(f"{num_consumers=} needs warp_specialized=True")
    NC = (num_consumers or default_num_consumers(T, S, block_q)) if warp_specialized else 1
    if NC not in (1, 2):
        raise ValueError(f"{num_consumers=} must be 1 or 2")
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(T, S, K, P, G, NC * block_q, pages_per_block)
    C = num_kv_splits
    interpret = interpret_params(interpret, NC + 1 if warp_specialized else 1)
    if p_in_smem is None:
        p_in_smem = bool(interpret)
    num_stages = fit_num_stages(
        num_stages, H, pages_per_block * G, q.dtype.itemsize, C > 1, p_in_smem, NC
    )
    # Programs: groups of NC consecutive q blocks of one sequence (one block without warp
    # specialization); tile b * NC + c is block c of group b.
    num_blocks = min(T, pl.cdiv(T, NC * block_q) + S)
    P_pad = pl.cdiv(P, pages_per_block) * pages_per_block

    block_seq, block_q0 = _q_block_schedule(cu_q_lens, num_seqs, NC * block_q, num_blocks)
    tile_seq = jnp.repeat(block_seq, NC)
    tile_q0 = (block_q0[:, None] + jnp.arange(NC, dtype=jnp.int32) * block_q).reshape(-1)
    token, head, used = _block_rows(cu_q_lens, tile_seq, tile_q0, Q, block_q, T)
    qg = q.reshape(T, K, Q, H)
    q_blocks = qg[token, :, head]  # [NB * NC, ROWS, K, H]
    q_blocks = jnp.where(used[:, :, None, None], q_blocks, 0).transpose(0, 2, 1, 3)
    page_table = _clamped_page_table(page_indices, kv_lens, G, P_pad)

    BK = pages_per_block * G
    transforms = swizzled(q.dtype)
    num_tiles = num_blocks * NC
    if C == 1:
        out_type = jax.ShapeDtypeStruct((num_tiles, K, ROWS, H), q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((C, num_tiles, K, ROWS, H), jnp.float32),
            jax.ShapeDtypeStruct((C, num_tiles, K, ROWS), jnp.float32),
            jax.ShapeDtypeStruct((C, num_tiles, K, ROWS), jnp.float32),
        )
    kernel_kw = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_queries_per_kv=Q,
        block_q=block_q,
        pages_per_block=pages_per_block,
        num_kv_splits=C,
        num_stages=num_stages,
    )
    if warp_specialized:
        scratch = [
            plgpu.SMEM((NC, ROWS, H), q.dtype, transforms=transforms),  # q, then the output
            plgpu.SMEM((num_stages, BK, H), q.dtype, transforms=transforms),
            plgpu.SMEM((num_stages, BK, H), q.dtype, transforms=transforms),
            plgpu.SMEM((NC, ROWS, BK), q.dtype, transforms=transforms) if p_in_smem else None,
            plgpu.SMEM((NC, ROWS, H), jnp.float32) if C > 1 else None,
            plgpu.SMEM((NC, 2, ROWS), jnp.float32) if C > 1 else None,
            plgpu.Barrier(num_barriers=NC),  # q_ready
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),  # k_ready
            plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),  # v_ready
            plgpu.Barrier(num_arrivals=NC, num_barriers=num_stages),  # k_free
            plgpu.Barrier(num_arrivals=NC, num_barriers=num_stages),  # v_free
            plgpu.Barrier(num_arrivals=NC) if NC > 1 else None,  # turn (ping-pong)
            plgpu.Barrier() if NC > 1 else None,  # tail_done
        ]
        call = plgpu.kernel(
            functools.partial(_rpa_kernel_ws, **kernel_kw, num_consumers=NC),
            out_type=out_type,
            scratch_types=scratch,
            grid=(num_blocks, K, C),
            grid_names=("b", "h", "c"),
            num_threads=NC + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=interpret,
        )
    else:
        call = _single_warpgroup_call(
            kernel_kw, out_type, q.dtype, H, BK, num_blocks, K, p_in_smem, interpret
        )
    outs = call(kv_lens, page_table, cu_q_lens, block_seq, block_q0, q_blocks, k_pages, v_pages)

    if C == 1:
        o_blocks = outs  # [NB * NC, K, ROWS, H]
    else:
        o_blocks = online_softmax.combine_splits(*outs, base2=True)  # [NB * NC, K, ROWS, H]
    # Scatter the tiles' rows back to [T, K, Q, H]; unused rows point past the end (dropped).
    dest = jnp.where(used, token, T)
    out = jnp.zeros((T, K, Q, H), o_blocks.dtype)
    out = out.at[dest, :, head].set(o_blocks.transpose(0, 2, 1, 3), mode="drop")
    o = out.reshape(T, N, H)
    valid = jnp.arange(T) < cu_q_lens[num_seqs[0]]  # padding rows are 0
    return jnp.where(valid[:, None, None], o, 0.0).astype(q.dtype)


def _single_warpgroup_call(kernel_kw, out_type, dtype, H, BK, num_blocks, K, p_in_smem, interpret):
    """The plgpu.kernel of the single-warpgroup variant (_rpa_kernel)."""
    C, num_stages = kernel_kw["num_kv_splits"], kernel_kw["num_stages"]
    ppb = kernel_kw["pages_per_block"]
    transforms = swizzled(dtype)
    scratch = [
        plgpu.SMEM((ROWS, H), dtype, transforms=transforms),  # q, then the output (C == 1)
        plgpu.SMEM((num_stages, BK, H), dtype, transforms=transforms),
        plgpu.SMEM((num_stages, BK, H), dtype, transforms=transforms),
        # P for the P V wgmma
        plgpu.SMEM((ROWS, BK), dtype, transforms=transforms) if p_in_smem else None,
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=ppb, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=ppb, num_barriers=num_stages),
    ]
    if C > 1:
        scratch += [plgpu.SMEM((ROWS, H), jnp.float32), plgpu.SMEM((2, ROWS), jnp.float32)]
    return plgpu.kernel(
        functools.partial(_rpa_kernel, **kernel_kw),
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_blocks, K, C),
        grid_names=("b", "h", "c"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )

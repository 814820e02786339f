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
before its P V read (tried on purpose), so the pipeline's ordering rests on the code's structure:
a slot is refilled only after the step's accumulator has been read, which waits for its wgmmas.

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
    base2_scores,
    check_dtype,
    interpret_params,
    online_softmax_step,
    swizzled,
)
from kernels_pallas.mgpu_common import fit_num_stages as fit_stages
from kernels_pallas.online_softmax import MASK_VALUE
from kernels_pallas.ragged_paged_attention.kernel_gpu import (
    _q_block_schedule,
    choose_num_kv_splits,
)
from kernels_pallas.ragged_paged_attention.tuning import (
    MGPU_KEYS_PER_BLOCK,
    MGPU_NUM_STAGES,
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
    num_stages: int, H: int, BK: int, itemsize: int, split: bool, p_in_smem: bool = True
) -> int:
    """SMEM the kernel allocates: q/out tile, K and V slots, P tile if staged (+ float32
    partials with split-KV)."""
    n = (ROWS * H + 2 * num_stages * BK * H + (ROWS * BK if p_in_smem else 0)) * itemsize
    return n + ((ROWS * H + 2 * ROWS) * 4 if split else 0)


def fit_num_stages(
    num_stages: int, H: int, BK: int, itemsize: int, split: bool, p_in_smem: bool = True
) -> int:
    """The most stages, up to `num_stages`, that fit SMEM; raises if not even one does."""
    return fit_stages(
        num_stages,
        lambda n: smem_bytes(n, H, BK, itemsize, split, p_in_smem),
        f"KV step of {BK} keys at head_dim {H}",
    )


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
        q0 = block_q0_ref[b]
        q_start = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start
        kv_len = kv_lens_ref[seq]
        first_pos = kv_len - q_len + q0  # position of the block's first token
        hi_key = kv_len - q_len + jnp.minimum(q0 + BQ, q_len)
        if sliding_window is None:
            lo_blk = jnp.int32(0)
        else:
            lo_blk = jnp.maximum(0, first_pos - sliding_window + 1) // BK
        hi_blk = (hi_key + BK - 1) // BK
        if C > 1:
            per_split = (hi_blk - lo_blk + C - 1) // C
            lo_blk = lo_blk + split * per_split
            hi_blk = jnp.minimum(hi_blk, lo_blk + per_split)
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

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
            s = base2_scores(s, sm_scale, soft_cap)
            key = blk * BK + col
            visible = (key <= pos) & (key < kv_len)
            if sliding_window is not None:
                visible = visible & (pos - key < sliding_window)
            s = jnp.where(visible, s, MASK_VALUE)
            p, m_new, denom, acc = online_softmax_step(s, m, denom, acc)
            plgpu.barrier_wait(v_bars.at[slot])

            @pl.when(blk == last_blk)
            def _zero_v_tail():  # V rows at or past kv_len: 0, whatever the page holds
                v = v_smem.at[slot]
                vkey = blk * BK + plgpu.broadcasted_iota(
                    jnp.int32, (BK, H), 0, layout=plgpu.Layout.WGMMA
                )
                v[...] = jnp.where(vkey < kv_len, v[...], jnp.zeros_like(v[...]))
                plgpu.commit_smem()

            p = p.astype(dtype)
            if p_smem is not None:
                p_smem[...] = p
                plgpu.commit_smem()
                p = p_smem

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, H), jnp.float32))

            @pl.when(step + num_stages < num_steps)
            def _refill():
                issue(step + num_stages, slot)

            return acc, m_new, denom

        acc = plgpu.layout_cast(jnp.zeros((ROWS, H), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(
            jnp.full((ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
        )
        denom = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, denom = jax.lax.fori_loop(0, num_steps, kv_step, (acc, m, denom))

        safe = jnp.where(denom == 0.0, 1.0, denom)
        o = acc / jax.lax.broadcast_in_dim(safe, acc.shape, [0])
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
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(T, S, K, P, G, block_q, pages_per_block)
    C = num_kv_splits
    interpret = interpret_params(interpret)
    if p_in_smem is None:
        p_in_smem = bool(interpret)
    num_stages = fit_num_stages(
        num_stages, H, pages_per_block * G, q.dtype.itemsize, C > 1, p_in_smem
    )
    num_blocks = min(T, pl.cdiv(T, block_q) + S)
    P_pad = pl.cdiv(P, pages_per_block) * pages_per_block

    block_seq, block_q0 = _q_block_schedule(cu_q_lens, num_seqs, block_q, num_blocks)
    token, head, used = _block_rows(cu_q_lens, block_seq, block_q0, Q, block_q, T)
    qg = q.reshape(T, K, Q, H)
    q_blocks = qg[token, :, head]  # [NB, ROWS, K, H]
    q_blocks = jnp.where(used[:, :, None, None], q_blocks, 0).transpose(0, 2, 1, 3)
    page_table = _clamped_page_table(page_indices, kv_lens, G, P_pad)

    BK = pages_per_block * G
    transforms = swizzled(q.dtype)
    scratch = [
        plgpu.SMEM((ROWS, H), q.dtype, transforms=transforms),  # q, then the output (C == 1)
        plgpu.SMEM((num_stages, BK, H), q.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, BK, H), q.dtype, transforms=transforms),
        # P for the P V wgmma
        plgpu.SMEM((ROWS, BK), q.dtype, transforms=transforms) if p_in_smem else None,
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=num_stages),
    ]
    if C > 1:
        scratch += [plgpu.SMEM((ROWS, H), jnp.float32), plgpu.SMEM((2, ROWS), jnp.float32)]
    if C == 1:
        out_type = jax.ShapeDtypeStruct((num_blocks, K, ROWS, H), q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((C, num_blocks, K, ROWS, H), jnp.float32),
            jax.ShapeDtypeStruct((C, num_blocks, K, ROWS), jnp.float32),
            jax.ShapeDtypeStruct((C, num_blocks, K, ROWS), jnp.float32),
        )
    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_queries_per_kv=Q,
        block_q=block_q,
        pages_per_block=pages_per_block,
        num_kv_splits=C,
        num_stages=num_stages,
    )
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_blocks, K, C),
        grid_names=("b", "h", "c"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    outs = call(kv_lens, page_table, cu_q_lens, block_seq, block_q0, q_blocks, k_pages, v_pages)

    if C == 1:
        o_blocks = outs  # [NB, K, ROWS, H]
    else:
        o_blocks = online_softmax.combine_splits(*outs, base2=True)  # [NB, K, ROWS, H]
    # Scatter the tiles' rows back to [T, K, Q, H]; unused rows point past the end (dropped).
    dest = jnp.where(used, token, T)
    out = jnp.zeros((T, K, Q, H), o_blocks.dtype)
    out = out.at[dest, :, head].set(o_blocks.transpose(0, 2, 1, 3), mode="drop")
    o = out.reshape(T, N, H)
    valid = jnp.arange(T) < cu_q_lens[num_seqs[0]]  # padding rows are 0
    return jnp.where(valid[:, None, None], o, 0.0).astype(q.dtype)

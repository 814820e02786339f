"""What the Mosaic GPU kernels (kernel_mgpu.py in each kernel folder) share: the SMEM budget and
how many pipeline stages fit it, the swizzled tile layout of their wgmma operands, scores in base
2, and the interpreter switch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.online_softmax import MASK_VALUE

LOG2E = math.log2(math.e)
SWIZZLE_BYTES = 128
# sm_90's 227 KiB of SMEM per block, less Mosaic GPU's own 2 KiB (measured: a kernel of 230400
# bytes of buffers and 160 of barriers lowered to 232608) and 1 KiB for the barriers.
SMEM_BUDGET = 227 * 1024 - 3072
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_dtype(dtype, kernel: str) -> None:
    """wgmma has no full-float32 path: raise a ValueError naming `kernel` for anything but
    bfloat16 / float16."""
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(
            f"the Mosaic GPU {kernel} kernel takes bfloat16 or float16 (wgmma has no "
            f"full-float32 path), got {jnp.dtype(dtype).name}; use implementation='gpu' "
            "(Triton) for float32"
        )


def swizzled(dtype) -> tuple:
    """SMEM transforms of a wgmma operand: 8-row tiles of one 128-byte swizzle row each."""
    return (
        plgpu.TilingTransform((8, SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(SWIZZLE_BYTES),
    )


def fit_num_stages(num_stages: int, smem_bytes: Callable[[int], int], step: str) -> int:
    """The most stages, up to `num_stages`, whose `smem_bytes(stages)` fits SMEM_BUDGET; raises
    a ValueError naming `step` (what one stage holds) if not even one does."""
    while num_stages > 1 and smem_bytes(num_stages) > SMEM_BUDGET:
        num_stages -= 1
    if smem_bytes(num_stages) > SMEM_BUDGET:
        raise ValueError(
            f"one {step} needs {smem_bytes(1)} bytes of SMEM with the rest of the kernel's "
            f"buffers, over {SMEM_BUDGET}"
        )
    return num_stages


def base2_scores(s: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """q.k -> the score in base 2 (times log2 e, for exp2): scaled, then soft-capped."""
    if soft_cap is None:
        return s * (sm_scale * LOG2E)
    return (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))


def interpret_params(interpret, num_warpgroups: int = 1):
    """False -> compile; True -> Mosaic GPU's interpreter (the CPU); an InterpretGPUParams (e.g.
    with detect_races=True) is passed through.

    The interpreter runs each warpgroup of a block as a thread that executes on XLA's CPU
    runtime; a warpgroup blocked on an mbarrier holds its XLA thread, so a kernel of
    `num_warpgroups` > 1 needs as many: XLA's CPU client runs max(cores, CPU devices) at once.
    With fewer, the interpreted kernel can hang (observed: 3 warpgroups, 2 cores, 1 or 2
    devices), so that raises here, saying how to get more (the tests run with 8 devices)."""
    if interpret is False or interpret is None:
        return False
    cores = os.cpu_count() or 1
    if cores < num_warpgroups:
        try:
            threads = max(cores, jax.device_count("cpu"))
        except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS)
            threads = cores
        if threads < num_warpgroups:
            raise RuntimeError(
                f"interpreting a kernel of {num_warpgroups} warpgroups needs {num_warpgroups} XLA "
                f"CPU threads, and this process has {threads} (the larger of its {cores} cores "
                "and its CPU devices): with fewer the interpreter can "
                "deadlock. Start Python with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "(before jax is imported), or run the kernel with num_consumers=1 / "
                "warp_specialized=False where it has them"
            )
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams()


def online_softmax_step(s, m, denom, acc):
    """Fold one block of base-2 scores s [M, BK] (float32, WGMMA layout, masked entries
    MASK_VALUE) into the running (m, denom, acc) -> (p [M, BK] float32, m, denom, acc)."""
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
    denom = denom * alpha + p.sum(axis=1)
    acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, m_new, denom, acc


def init_softmax_state(rows: int, head_dim: int):
    """(acc [rows, H], m [rows], denom [rows]) float32 in the WGMMA layouts: 0, MASK_VALUE, 0."""
    row = plgpu.Layout.WGMMA.reduce(1)
    return (
        plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((rows,), MASK_VALUE, jnp.float32), row),
        plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row),
    )


def qk(q_smem, k_smem, after_issue: Callable[[], None] | None = None) -> jax.Array:
    """S = q K^T (wgmma, float32 [rows, keys]) from q [rows, H] and K [keys, H] in SMEM;
    `after_issue` runs once the matmul is issued, before its result is waited for."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        if after_issue is not None:
            after_issue()
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def stage_p(p: jax.Array, p_smem):
    """P (in the input dtype) as the P V matmul's operand: from registers, or (p_smem not None:
    the interpreter's wgmma takes SMEM operands only) written to p_smem first."""
    if p_smem is None:
        return p
    p_smem[...] = p
    plgpu.commit_smem()
    return p_smem


def add_pv(acc: jax.Array, p, v_smem) -> jax.Array:
    """acc + P V (wgmma, float32) with V [keys, H] in SMEM."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem)
        return acc_ref[...]

    return acc + pl.run_scoped(body, plgpu.ACC(acc.shape, jnp.float32))


def normalize(acc: jax.Array, denom: jax.Array) -> jax.Array:
    """acc / denom per row; 0 for a row that saw no visible key (denom 0)."""
    safe = jnp.where(denom == 0.0, 1.0, denom)
    return acc / jax.lax.broadcast_in_dim(safe, acc.shape, [0])


def take_turn(turn) -> None:
    """Ping-pong between two consumer warpgroups: arrive at `turn` (two arrivals a phase) and
    wait for the phase; the two leave one phase apart, so their matmuls alternate."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def mask_scores(s, key, pos, sliding_window: int | None, kv_len=None) -> jax.Array:
    """Scores [rows, keys] of keys a row may not see -> MASK_VALUE: past the row's position
    `pos` (causal), at or past `kv_len` (when given), or out of the sliding window."""
    visible = key <= pos
    if kv_len is not None:
        visible = visible & (key < kv_len)
    if sliding_window is not None:
        visible = visible & (pos - key < sliding_window)
    return jnp.where(visible, s, MASK_VALUE)


def zero_rows_from(v_smem, first_key, kv_len) -> None:
    """Rows of a KV block in SMEM (keys first_key ..) at or past kv_len -> 0, whatever a page
    holds there (a masked P is 0, but 0 * NaN is NaN), committed for the wgmma that reads it."""
    rows, H = v_smem.shape
    key = first_key + plgpu.broadcasted_iota(jnp.int32, (rows, H), 0, layout=plgpu.Layout.WGMMA)
    v_smem[...] = jnp.where(key < kv_len, v_smem[...], jnp.zeros_like(v_smem[...]))
    plgpu.commit_smem()

"""The grouped matmul over packed expert weights: a mixture's projections when its experts are
packed (llmjax/model/quant.py's EXPERT_MATRICES: float [out, in] on a CPU, int8 or GGUF blocks).

    y = grouped_qdot(rows, w, group_sizes)   # rows [M, in] grouped, w packed [E, out, in]

Rows come sorted by expert (group g's group_sizes[g] rows after group g-1's, as
kernels_pallas/grouped_matmul takes them) and each group's rows are multiplied by its expert's
matrix; rows past the groups give zeros. As `qdot`, the form is chosen per backend
(`lax.platform_dependent`, decided at lowering):

  CPU   the C++ grouped kernels (kernels_cpu: grouped_dense_matmul for float and weight-only int8
        values, grouped_qmatmul for int8 W8A8 and the GGUF blocks) where their ungrouped forms
        win (the same token ranges as `qdot`'s, applied to the step's M rows): each group one
        product over its rows, reading its expert in place, so a decode step reads only the
        experts it routed to, with no slice of the [L, E, ...] stack copied. Above those ranges
        (prefill), the tile loop of kernels_pallas/grouped_matmul/tiled.py, each visit one
        `qdot`-form product with its expert's matrix (a view of the stack at (layer, expert)).
  else  the experts dequantized into the platform's grouped matmul (ragged_dot on GPUs, megablox
        on TPUs): XLA fuses the dequantization into the operand where it can.

Per row, the CPU kernels compute exactly what `qdot` computes for that row with its expert's
matrix on the same number of rows (tests/test_moe_packed.py).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from llmjax.model import quant
from llmjax.model.quant import PackedWeight

logger = logging.getLogger(__name__)


def grouped_qdot(rows: jax.Array, w: PackedWeight, group_sizes: jax.Array) -> jax.Array:
    """rows [M, in] grouped @ w's matrices (w packed, batch shape (G,), plain [in, out] each)
    -> [M, out] float32."""
    G = group_sizes.shape[0]
    if w.batch_shape != (G,):
        raise ValueError(f"want an expert stack of {G} matrices, got batch shape {w.batch_shape}")
    if rows.shape[-1] != w.num_in:
        raise ValueError(f"rows have {rows.shape[-1]} features, the experts take {w.num_in}")
    return jax.lax.platform_dependent(
        rows, w, group_sizes, cpu=_cpu_grouped, default=_dequantized_grouped
    )


def matrix(w: PackedWeight, g) -> PackedWeight:
    """A view of expert g (traced) of an expert stack, as one matrix: the [L, G, ...] (or
    [G, ...]) arrays seen as [L * G, ...] (a bitcast) with `layer` = layer * G + g, so a kernel
    reads it in place and other forms slice just it."""
    G = w.batch_shape[0]
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[len(a.shape) - _rank(w, a) :])
    index = g if w.layer is None else w.layer * G + g
    return dataclasses.replace(
        w, values=flat(w.values), scales=flat(w.scales), mins=flat(w.mins), layer=index
    )


def _rank(w: PackedWeight, a) -> int:
    """The rank of one matrix's part of `a` (values: 2; scales and mins: 1 or 2)."""
    lead = 1 + (w.layer is not None)  # the experts axis, and the layers axis of a view
    return a.ndim - lead


def _dequantized_grouped(rows, w: PackedWeight, group_sizes) -> jax.Array:
    from kernels_pallas.grouped_matmul import grouped_matmul

    w = w.one_layer()
    dtype = w.values.dtype if w.fmt == "dense" else rows.dtype
    m = quant.dequantize_matrix(w, dtype)  # [G, out, in]
    return grouped_matmul(rows.astype(dtype), jnp.swapaxes(m, 1, 2), group_sizes)


def _cpu_grouped(rows, w: PackedWeight, group_sizes) -> jax.Array:
    y = _cpu_grouped_kernel(rows, w, group_sizes)
    if y is not None:
        return y
    from kernels_pallas.grouped_matmul import tuning
    from kernels_pallas.grouped_matmul.tiled import grouped_tiles

    M, G = rows.shape[0], group_sizes.shape[0]
    tile = tuning.row_tile(M, G, w.num_in, w.num_out)
    dot = lambda x, g: quant.cpu_dot(x, matrix(w, g))
    return grouped_tiles(rows, group_sizes, tile=tile, num_out=w.num_out, dot=dot)


def _cpu_grouped_kernel(rows, w: PackedWeight, group_sizes):
    """The C++ grouped kernel's result where it takes these rows (M within the ungrouped
    kernel's range, as `quant.cpu_dot` decides), else None."""
    M = rows.shape[0]
    layer = w.layer
    try:
        if w.fmt in ("dense", *quant.WEIGHT_ONLY_INT8):
            wo = w.fmt in quant.WEIGHT_ONLY_INT8
            if quant.dense_kernel_for(w.values.dtype, M, w.fmt) is None:
                return None
            from kernels_cpu.dense_matmul import grouped_dense_matmul

            x = rows.astype(jnp.float32 if wo else w.values.dtype)
            y = grouped_dense_matmul(
                x, w.values, group_sizes, layer=layer, round_x=w.fmt == "int8_a16"
            )
            if wo:  # each row by its expert's per-output scales
                scales = w.scales if layer is None else w.scales[layer]  # [G, out]
                expert = jnp.repeat(
                    jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=M
                )
                y = y * scales[expert]
            return y
        if quant.qmatmul_kernel_for(w.fmt, M) is None:
            return None
        from kernels_cpu.qmatmul import grouped_qmatmul

        return grouped_qmatmul(
            rows, w.values, w.scales, w.mins, group_sizes=group_sizes, fmt=w.fmt, layer=layer
        )
    except ValueError as e:  # a shape the kernel does not take (checked while tracing)
        logger.debug("grouped kernel refused %s %s: %s; the tile loop", w.fmt, w.shape, e)
        return None

"""Many LoRA adapters in one ragged batch (Punica's shrink / expand; S-LoRA): the device slots
and the delta each projection adds, in one of two forms (`LoRAConfig.kernel`).

The device holds `max_loras` slots (S) of rank R = `max_lora_rank` for each target projection,
every layer's in one array (a smaller rank: zero columns; B holds PEFT's scaling, alpha / r or
alpha / sqrt(r), folded in). `params["lora"]` = {"columns": [S R] int32 (each rank column's
slot), target: (a, b), ...}, the targets by the model's weight names (wq, wk, wv, wo, w_gate,
w_up, w_down). A step's tokens carry their slot (`StepInput.lora_slots` [T] int32; -1: the base
model). For a projection y = x W:

  masked    a [L, in, S R], b [L, S R, out]: the slots side by side along the rank.
                y += ((x @ a) * [slot(t) == columns]) @ b
            One matmul pair for the whole batch whatever mix of adapters it holds; the other
            slots' columns are zeroed exactly, so a token's output does not depend on its
            batch. 2 T (in + out) S R FLOPs a projection: cheap while S R is a small share of
            the projection (S R = 64 beside 4096 for a 7B: 3 %), not with many slots on a small
            model.
  grouped   a [L, S, in, R], b [L, S, R, out]: one [in, R] / [R, out] pair per slot.
                rows = x[order]          the step's tokens sorted by slot (base tokens last)
                y += (grouped(grouped(rows, a), b))[inverse]
            Punica's SGMV: each token times its own adapter only, 2 T (in + out) R FLOPs, by the
            platform's grouped matmul (kernels_pallas/grouped_matmul: the tile loop on a CPU,
            megablox on a TPU, ragged_dot on a GPU; the MoE layers' kernel); rows past the
            groups (base tokens) give zeros. The sort is computed once a step (`batch_view`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import LORA_TARGETS, ModelConfig
from llmjax.config import lora_projection_dims as projection_dims
from llmjax.model.quant import linear


def allocate_slots(
    config: ModelConfig, targets, max_loras: int, max_rank: int, dtype, grouped: bool = False
) -> dict:
    """`params["lora"]` with every slot empty (zeros: a slot of the base model) for the PEFT
    `targets` (LoRAConfig.targets_for), in the masked or the `grouped` layout."""
    dims = projection_dims(config)
    S, R, L = max_loras, max_rank, config.num_layers
    out = {"columns": jnp.asarray(np.arange(S * R) // R, jnp.int32)}
    for target in targets:
        name = LORA_TARGETS[target]
        n_in, n_out = dims[name]
        if grouped:
            out[name] = (jnp.zeros((L, S, n_in, R), dtype), jnp.zeros((L, S, R, n_out), dtype))
        else:
            out[name] = (jnp.zeros((L, n_in, S * R), dtype), jnp.zeros((L, S * R, n_out), dtype))
    return out


def is_grouped(lora: dict) -> bool:
    """Whether `params["lora"]` is in the grouped layout."""
    return next(iter(weights(lora).values()))[0].ndim == 4


def write_slot(lora: dict, slot: int, arrays: dict, max_rank: int) -> dict:
    """`lora` with slot `slot` holding `arrays` (the model's weight name -> (a [L, in, r],
    b [L, r, out]), r <= max_rank; a target it lacks: zeros), in either layout. Jit it with
    `lora` donated (the runner does): the slot's part is written in place."""
    out = dict(lora)
    for name, (a, b) in weights(lora).items():
        L, n_in, n_out = a.shape[0], a.shape[-2], b.shape[-1]
        pad_a = jnp.zeros((L, n_in, max_rank), a.dtype)
        pad_b = jnp.zeros((L, max_rank, n_out), b.dtype)
        if name in arrays:
            new_a, new_b = arrays[name]
            r = new_a.shape[-1]
            pad_a = pad_a.at[:, :, :r].set(new_a.astype(a.dtype))
            pad_b = pad_b.at[:, :r, :].set(new_b.astype(b.dtype))
        if a.ndim == 4:  # grouped: [L, S, in, R], [L, S, R, out]
            a = jax.lax.dynamic_update_slice(a, pad_a[:, None], (0, slot, 0, 0))
            b = jax.lax.dynamic_update_slice(b, pad_b[:, None], (0, slot, 0, 0))
        else:
            start = slot * max_rank
            a = jax.lax.dynamic_update_slice(a, pad_a, (0, 0, start))
            b = jax.lax.dynamic_update_slice(b, pad_b, (0, start, 0))
        out[name] = (a, b)
    return out


def weights(lora: dict) -> dict:
    """The targets' [L, ...] (a, b) pairs of `lora` (what a scan over layers slices)."""
    return {n: w for n, w in lora.items() if n != "columns"}


def batch_view(lora: dict | None, slots) -> dict | None:
    """What every layer's projections share in a step: the tokens' slots and the slots'
    columns; in the grouped layout also the tokens sorted by slot (`order`, base tokens last),
    its inverse and the group sizes [S]. None without adapters."""
    if lora is None:
        return None
    view = {"slots": slots, "columns": lora["columns"]}
    if is_grouped(lora):
        S = next(iter(weights(lora).values()))[0].shape[1]
        key = jnp.where(slots >= 0, slots, S)  # the base model's tokens after every group
        order = jnp.argsort(key, stable=True)
        view |= {
            "order": order,
            "inverse": jnp.argsort(order),
            "group_sizes": jnp.bincount(key, length=S + 1)[:S].astype(jnp.int32),
        }
    return view


def layer_view(view: dict | None, lora: dict, layer_weights: dict | None = None, i=None):
    """What one layer's projections read (`delta`): the step's `batch_view` and the layer's
    (a, b) by weight name: `layer_weights` (a scan's slice of `weights(lora)`) or layer `i`'s
    of `lora`. None without adapters."""
    if view is None:
        return None
    if layer_weights is None:
        layer_weights = {n: (a[i], b[i]) for n, (a, b) in weights(lora).items()}
    return {**view, **layer_weights}


def delta(x: jax.Array, lora: dict | None, name: str):
    """x [T, *in] -> what the tokens' adapters add to projection `name`'s output, [T, out]
    (flat), or None where no adapter slot holds `name`."""
    if lora is None or name not in lora:
        return None
    a, b = lora[name]
    x2 = x.reshape(x.shape[0], -1)
    if a.ndim == 3:  # grouped: a [S, in, R], b [S, R, out]
        from kernels_pallas.grouped_matmul import grouped_matmul

        sizes = lora["group_sizes"]
        t = grouped_matmul(x2[lora["order"]], a, sizes).astype(x.dtype)  # rows past: 0
        y = grouped_matmul(t, b, sizes)[lora["inverse"]]
        return jnp.where((lora["slots"] >= 0)[:, None], y, 0).astype(x.dtype)
    t = x2 @ a  # [T, S R]: every slot's shrink
    keep = lora["slots"][:, None] == lora["columns"][None, :]
    return jnp.where(keep, t, jnp.zeros((), t.dtype)) @ b  # [T, out]


def project(x: jax.Array, w, lora: dict | None, name: str) -> jax.Array:
    """x [T, *in] @ the weight `w` (plain or packed) of projection `name`, plus the tokens'
    adapters' delta where a slot holds `name` -> [T, *out]."""
    y = linear(x, w)
    d = delta(x, lora, name)
    return y if d is None else y + d.reshape(y.shape).astype(y.dtype)

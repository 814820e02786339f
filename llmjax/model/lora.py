"""Many LoRA adapters in one ragged batch (Punica's shrink / expand; S-LoRA): the device slots
and the delta each projection adds.

The device holds `max_loras` slots of rank R = `max_lora_rank` for each target projection
(`LoRAConfig`), every layer's in one array, the slots side by side along the rank:

    a  [L, in, S * R]    slot s's A in columns s R .. s R + R - 1 (a smaller rank: zero columns)
    b  [L, S * R, out]   its B (times PEFT's scaling, alpha / r or alpha / sqrt(r)) in those rows

`params["lora"]` = {"columns": [S * R] int32 (each column's slot), target: (a, b), ...}, with the
targets by the model's weight names (wq, wk, wv, wo, w_gate, w_up, w_down). A step's tokens carry
their slot (`StepInput.lora_slots` [T] int32; -1: the base model). For a projection y = x W:

    y += ((x @ a) * [slot(t) == columns]) @ b        shrink for every slot, keep the token's,
                                                      expand

one matmul pair for the whole batch whatever mix of adapters it holds: the other slots' columns
are zeroed exactly, so a token's output does not depend on what it is batched with. It costs
2 T (in + out) S R FLOPs a projection (S R = 64 against in = out = 4096 for a 7B model: 3 % of
the projection). Grouping tokens by adapter (`ragged_dot`, Punica's SGMV) would cost T (in + out)
R instead, worth it once S R is a large share of the projection; the masked form is what runs
here (one shape per step bucket, no sort).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import LORA_TARGETS, ModelConfig
from llmjax.config import lora_projection_dims as projection_dims
from llmjax.model.quant import linear


def allocate_slots(config: ModelConfig, targets, max_loras: int, max_rank: int, dtype) -> dict:
    """`params["lora"]` with every slot empty (zeros: a slot of the base model) for the PEFT
    `targets` (LoRAConfig.targets_for)."""
    dims = projection_dims(config)
    SR, L = max_loras * max_rank, config.num_layers
    out = {"columns": jnp.asarray(np.arange(SR) // max_rank, jnp.int32)}
    for target in targets:
        name = LORA_TARGETS[target]
        n_in, n_out = dims[name]
        out[name] = (jnp.zeros((L, n_in, SR), dtype), jnp.zeros((L, SR, n_out), dtype))
    return out


def write_slot(lora: dict, slot: int, arrays: dict, max_rank: int) -> dict:
    """`lora` with slot `slot` holding `arrays` (the model's weight name -> (a [L, in, r],
    b [L, r, out]), host arrays, r <= max_rank; a target it lacks: zeros). Jit it with `lora`
    donated (`LoRASlots` does): the slot's columns are written in place."""
    out = dict(lora)
    start = slot * max_rank
    for name, (a, b) in weights(lora).items():
        pad_a = jnp.zeros((a.shape[0], a.shape[1], max_rank), a.dtype)
        pad_b = jnp.zeros((b.shape[0], max_rank, b.shape[2]), b.dtype)
        if name in arrays:
            new_a, new_b = arrays[name]
            r = new_a.shape[-1]
            pad_a = pad_a.at[:, :, :r].set(new_a.astype(a.dtype))
            pad_b = pad_b.at[:, :r, :].set(new_b.astype(b.dtype))
        a = jax.lax.dynamic_update_slice(a, pad_a, (0, 0, start))
        b = jax.lax.dynamic_update_slice(b, pad_b, (0, start, 0))
        out[name] = (a, b)
    return out


def weights(lora: dict) -> dict:
    """The targets' [L, ...] (a, b) pairs of `lora` (what a scan over layers slices)."""
    return {n: w for n, w in lora.items() if n != "columns"}


def layer_view(lora: dict | None, slots, layer_weights: dict | None = None, i=None):
    """What one layer's projections read (`delta`): {"slots": [T], "columns": [S R], name:
    (a [in, S R], b [S R, out])}: `layer_weights` (a scan's slice of `weights(lora)`) or layer
    `i`'s of `lora`. None without adapters."""
    if lora is None:
        return None
    if layer_weights is None:
        layer_weights = {n: (a[i], b[i]) for n, (a, b) in weights(lora).items()}
    return {"slots": slots, "columns": lora["columns"], **layer_weights}


def delta(x: jax.Array, lora: dict | None, name: str):
    """x [T, *in] -> what the tokens' adapters add to projection `name`'s output, [T, out]
    (flat), or None where no adapter slot holds `name`."""
    if lora is None or name not in lora:
        return None
    a, b = lora[name]  # [in, S R], [S R, out]
    x2 = x.reshape(x.shape[0], -1)
    t = x2 @ a  # [T, S R]: every slot's shrink
    keep = lora["slots"][:, None] == lora["columns"][None, :]
    return jnp.where(keep, t, jnp.zeros((), t.dtype)) @ b  # [T, out]


def project(x: jax.Array, w, lora: dict | None, name: str) -> jax.Array:
    """x [T, *in] @ the weight `w` (plain or packed) of projection `name`, plus the tokens'
    adapters' delta where a slot holds `name` -> [T, *out]."""
    y = linear(x, w)
    d = delta(x, lora, name)
    return y if d is None else y + d.reshape(y.shape).astype(y.dtype)

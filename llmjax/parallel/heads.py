"""How tensor parallelism splits a model's attention heads.

Each of the tp devices takes K' / tp kv heads and the Q' query heads of each (query heads of a kv
head stay together, so GQA attention runs per device on its local heads). Three layouts:

  as_is      tp divides K: K' = K, N' = N.
  replicate  K < tp, tp = r * K and r divides Q: every kv head is repeated r times (K' = tp,
             Q' = Q / r). The query heads keep their order, so only wk/wv (bk/bv) change. Each
             device holds the copy its query heads use: vLLM's KV-head replication.
  pad        otherwise, with ParallelConfig(pad_heads=True): K' = K rounded up to a multiple of
             tp; the new kv heads and their Q query heads have zero weights (wq, wk, wv, wo rows,
             biases). A zero query head attends zero keys and values (output 0) and its wo rows
             are 0, so outputs are exact; the cost is K'/K times the KV memory.
Without pad_heads an uneven split is an error that names the numbers.

In (as_is / replicate / pad):   K=2 Q=2 tp=2 -> K'=2 Q'=2;  K=2 Q=2 tp=4 -> K'=4 Q'=1 (wk: kv
heads [a a b b]);  K=3 Q=3 tp=2 -> K'=4 Q'=3 (wq heads 9..11 and kv head 3 are zeros).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmjax.config import ModelConfig, tp_head_counts


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    kind: str  # 'as_is' | 'replicate' | 'pad'
    num_kv_heads: int  # K' (a multiple of tp)
    num_heads: int  # N' = K' * Q'
    kv_repeats: int = 1  # replicate: r
    num_pad_kv_heads: int = 0  # pad: K' - K

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """The config of the equivalent model that the devices run (head_dim kept)."""
        if self.kind == "as_is":
            return config
        return config.replace(
            num_kv_heads=self.num_kv_heads, num_heads=self.num_heads, head_dim=config.head_dim
        )


def tp_head_layout(config: ModelConfig, tp: int, pad_heads: bool = False) -> HeadLayout:
    """The layout of `config`'s heads over `tp` devices (the counts: `tp_head_counts`, which
    EngineConfig checks too); an uneven split without `pad_heads` raises a ValueError."""
    return HeadLayout(*tp_head_counts(config.num_heads, config.num_kv_heads, tp, pad_heads))


# Leaf name -> (axis of the kv-head dim to repeat/pad, or None; axis of the q-head dim to pad)
_HEAD_AXES = {
    "wq": (None, 1),  # [D, N, H]
    "bq": (None, 0),  # [N, H]
    "wo": (None, 0),  # [N, H, D]
    "wk": (1, None),  # [D, K, H]
    "wv": (1, None),
    "bk": (0, None),  # [K, H]
    "bv": (0, None),
}


def transform_weight(name: str, x, layout: HeadLayout, num_queries_per_kv: int):
    """One layer weight (numpy or jax array, by its leaf name) in the original layout -> in
    `layout`. Weights without head axes pass through."""
    if layout.kind == "as_is" or name not in _HEAD_AXES:
        return x
    xp = np if isinstance(x, np.ndarray) else _jnp()
    kv_axis, q_axis = _HEAD_AXES[name]
    if layout.kind == "replicate":
        return x if kv_axis is None else xp.repeat(x, layout.kv_repeats, axis=kv_axis)
    axis = kv_axis if kv_axis is not None else q_axis
    n = layout.num_pad_kv_heads * (1 if kv_axis is not None else num_queries_per_kv)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n)
    return xp.pad(x, widths)


def transform_params(params, config: ModelConfig, layout: HeadLayout):
    """The whole tree (original layout) -> the layout's tree."""
    Q = config.num_heads // config.num_kv_heads
    out = dict(params)
    out["layers"] = [
        {k: transform_weight(k, v, layout, Q) for k, v in layer.items()}
        for layer in params["layers"]
    ]
    return out


def _jnp():
    import jax.numpy as jnp

    return jnp


# The LoRA slots (llmjax/model/lora.py) of projections with head axes: the flat head axis
# of B (out: wq, wk, wv) or of A (in: wo), laid out as the base weight's.
_LORA_HEAD_SIDE = {"wq": "b", "wk": "b", "wv": "b", "wo": "a"}


def transform_lora(name: str, a, b, layout: HeadLayout, config: ModelConfig):
    """One target's LoRA weights in the original layout, a [L, in, r] and b [L, r, out] (the
    flat head axis N H or K H where the target has one) -> in `layout`, as `transform_weight`
    moves the base weight's heads (repeated or zero-padded kv heads, zero query heads)."""
    side = _LORA_HEAD_SIDE.get(name)
    if layout.kind == "as_is" or side is None:
        return a, b
    xp = np if isinstance(a, np.ndarray) else _jnp()
    H, Q = config.head_dim, config.num_heads // config.num_kv_heads
    if side == "b":  # [L, r, heads * H] -> [L * r, heads, H] (the head axis where wq's is)
        L, r, n = b.shape
        heads = transform_weight(name, b.reshape(L * r, n // H, H), layout, Q)
        return a, heads.reshape(L, r, -1)
    L, n, r = a.shape  # wo's A: [L, N H, r] -> [N, H, L r] (wo's [N, H, D])
    x = xp.transpose(a, (1, 0, 2)).reshape(n // H, H, L * r)
    x = transform_weight(name, x, layout, Q).reshape(-1, L, r)
    return xp.transpose(x, (1, 0, 2)), b

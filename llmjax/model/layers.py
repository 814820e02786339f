"""Building blocks of the decoder: RMSNorm (Llama's and Gemma's), rotary embeddings (one table
per attention kind), the gated MLP (SwiGLU, GeGLU).

Letters: T tokens, D model dim, F MLP hidden dim, N heads, H head dim, R attention kinds
(`ModelConfig.attention_kinds`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import ModelConfig, RopeScaling
from llmjax.model.lora import project


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """x: [..., D], scale: [D]. Normalizes in float32 and returns x's dtype. Llama (HF's
    LlamaRMSNorm): the normalized x rounded to x's dtype, times `scale`. `plus_one` (Gemma's
    RMSNorm): times (1 + scale), all in float32, rounded once."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * x32.astype(x.dtype)


def norm(x: jax.Array, scale: jax.Array | None, config: ModelConfig) -> jax.Array:
    """The model's RMSNorm (`config.norm_plus_one` picks Llama's or Gemma's); `scale` None (a
    norm this architecture does not have: its weight is absent from the tree) returns x."""
    if scale is None:
        return x
    return rms_norm(x, scale, config.rms_norm_eps, config.norm_plus_one)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [H/2] in float32, with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "freq_factors":
        factors = np.asarray(scaling.freq_factors, np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"{factors.size} rope freq_factors for head_dim {head_dim} (want {inv_freq.size})"
            )
        return (inv_freq / factors).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions: [T] int32 -> cos, sin: [R, T, H/2] float32, one table per attention kind
    (`config.attention_kinds`: a kind's RoPE base and scaling); a layer of kind r takes
    `layer_rope(cos, sin, r)`."""
    inv_freq = np.stack(
        [
            rope_inv_freq(config.head_dim, kind.rope_theta, kind.rope_scaling)
            for kind in config.attention_kinds
        ]
    )  # [R, H/2]
    angles = positions.astype(jnp.float32)[None, :, None] * jnp.asarray(inv_freq)[:, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def layer_rope(cos: jax.Array, sin: jax.Array, kind) -> tuple[jax.Array, jax.Array]:
    """The [T, H/2] tables of attention kind `kind` (an int, or a traced index in a layer scan)
    from `rope_cos_sin`'s [R, T, H/2]."""
    if cos.shape[0] == 1:  # one kind (Llama): no index to trace
        return cos[0], sin[0]
    return cos[kind], sin[kind]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x: [T, N, H] in HF's half-split layout (pairs are (i, i + H/2)); cos/sin: [T, H/2]."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, N, H/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen)
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU (Gemma)
}


def gated_mlp(
    x: jax.Array, w_gate, w_up, w_down, act: str = "silu", lora: dict | None = None
) -> jax.Array:
    """x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D] (plain, or packed: llmjax/model/quant.py)
    -> act(x @ w_gate) * (x @ w_up) @ w_down [T, D]; `act` one of ACTIVATIONS
    (`ModelConfig.hidden_act`); `lora`: a layer's LoRA view (llmjax/model/lora.py), whose
    adapters add to the three projections."""
    gate = project(x, w_gate, lora, "w_gate").astype(jnp.float32)
    up = project(x, w_up, lora, "w_up").astype(jnp.float32)
    # In float32, rounded once to x's dtype (a no-op for float32): in bfloat16 XLA:CPU otherwise
    # rounds after every op of the activation (neg, exp, add, divide, multiply), slower and less
    # exact.
    return project((ACTIVATIONS[act](gate) * up).astype(x.dtype), w_down, lora, "w_down")


def swiglu_mlp(x: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """The SwiGLU MLP (`gated_mlp` with silu)."""
    return gated_mlp(x, w_gate, w_up, w_down, "silu")

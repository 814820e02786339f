"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), computed exactly.

Letters: T tokens, D model dim, E experts, k experts per token (top-k), Fe an expert's hidden dim,
Fs the shared expert's, M = T * k (token, expert) pairs.

Each token's MLP output is the weighted sum of its top-k experts' gated MLPs (HF's
`*SparseMoeBlock`): the router scores the experts (x @ router, a softmax in float32), the k best
are kept, their weights renormalized to sum to 1 where the model does (`norm_topk_prob`). No
token is dropped and there is no capacity factor: the M pairs are sorted by expert so that each
expert's rows are contiguous, and every projection is one grouped matmul over them
(`grouped_matmul`: rows [M, Din] with `group_sizes` [E] times per-expert weights [E, Din, Dout]).
Routing changes only the group sizes, never a shape, so a step compiles once per token bucket.

Qwen2-MoE adds a shared expert every token takes, scaled by sigmoid(x . ws_score).

In/Out example (T=2, k=2, E=3): experts [[2, 0], [0, 1]] -> flat [2, 0, 0, 1], sorted pairs
order [1, 2, 3, 0] (expert 0's two rows, then 1's, then 2's), group_sizes [2, 1, 1]; rows = x[[0,
1, 1, 0]]; the grouped output's row j belongs to pair order[j].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import ModelConfig
from llmjax.model.layers import ACTIVATIONS, gated_mlp


def route(
    x: jax.Array, router: jax.Array, top_k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """x [T, D] @ router [D, E] -> (weights [T, k] float32, experts [T, k] int32): the top-k of
    the softmax over experts (in float32, of logits in x's dtype, as HF), renormalized to sum to
    1 where `normalize`. Ties go to the lower expert index (`lax.top_k`, as torch.topk)."""
    logits = jnp.einsum("td,de->te", x, router)  # [T, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """experts [T, k] -> (order [M]: the (token, slot) pairs, flattened t * k + slot, sorted by
    expert (stable: tokens in order within an expert), group_sizes [E] int32: rows per expert)."""
    flat = experts.reshape(-1)  # [M]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, Din] (grouped: the first group_sizes[0] rows are expert 0's, ...) @ w [E, Din,
    Dout] -> [M, Dout] in rows' dtype (accumulated in float32). `jax.lax.ragged_dot`: the
    readable reference every grouped-matmul kernel is tested against."""
    out = jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(rows.dtype)


def experts_mlp(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k] float32
    experts: jax.Array,  # [T, k] int32
    we_gate: jax.Array,  # [E, D, Fe]
    we_up: jax.Array,  # [E, D, Fe]
    we_down: jax.Array,  # [E, Fe, D]
    act: str = "silu",
) -> jax.Array:
    """Each token's routed experts' gated MLPs, weighted and summed -> [T, D] in x's dtype."""
    T, k = experts.shape
    order, group_sizes = sort_by_expert(experts, we_gate.shape[0])
    rows = x[order // k]  # [M, D], grouped by expert
    gate = grouped_matmul(rows, we_gate, group_sizes).astype(jnp.float32)  # [M, Fe]
    up = grouped_matmul(rows, we_up, group_sizes).astype(jnp.float32)
    h = (ACTIVATIONS[act](gate) * up).astype(x.dtype)
    out = grouped_matmul(h, we_down, group_sizes)  # [M, D], pair order[j] at row j
    pairs = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # [M, D] pair order
    y = jnp.einsum("tkd,tk->td", pairs.reshape(T, k, -1).astype(jnp.float32), weights)
    return y.astype(x.dtype)


def moe_mlp(layer: dict, x: jax.Array, config: ModelConfig) -> jax.Array:
    """The layer's mixture of experts on its normed input x [T, D] -> [T, D] (plus the shared
    expert, sigmoid-gated, where the layer has one: Qwen2-MoE)."""
    weights, experts = route(x, layer["router"], config.num_experts_per_tok, config.norm_topk_prob)
    y = experts_mlp(
        x, weights, experts, layer["we_gate"], layer["we_up"], layer["we_down"], config.hidden_act
    )
    if "ws_score" in layer:
        shared = gated_mlp(x, layer["ws_gate"], layer["ws_up"], layer["ws_down"], config.hidden_act)
        score = jax.nn.sigmoid(jnp.einsum("td,d->t", x, layer["ws_score"]))[:, None]  # [T, 1]
        y = y + (score * shared).astype(y.dtype)
    return y

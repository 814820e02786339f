"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), computed exactly.

Letters: T tokens, D model dim, E experts, k experts per token (top-k), Fe an expert's hidden dim,
Fs the shared expert's, M = T * k (token, expert) pairs.

Each token's MLP output is the weighted sum of its top-k experts' gated MLPs (HF's
`*SparseMoeBlock`): the router scores the experts (x @ router, a softmax in float32), the k best
are kept, their weights renormalized to sum to 1 where the model does (`norm_topk_prob`). No
token is dropped and there is no capacity factor: the M pairs are sorted by expert so that each
expert's rows are contiguous, and every projection is one grouped matmul over them
(`grouped_matmul`: rows [M, Din] with `group_sizes` [E] times per-expert weights [E, Din, Dout];
the platform's kernel from kernels_pallas/grouped_matmul, specified by `jax.lax.ragged_dot`; for
experts packed per expert -- float [out, in] on a CPU, int8, GGUF blocks -- grouped_qdot.py).
Routing changes only the group sizes, never a shape, so a step compiles once per token bucket.

Qwen2-MoE adds a shared expert every token takes, scaled by sigmoid(x . ws_score).

In/Out example (T=2, k=2, E=3): experts [[2, 0], [0, 1]] -> flat [2, 0, 0, 1], sorted pairs
order [1, 2, 3, 0] (expert 0's two rows, then 1's, then 2's), group_sizes [2, 1, 1]; rows = x[[0,
1, 1, 0]]; the grouped output's row j belongs to pair order[j].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llmjax.config import ModelConfig
from llmjax.model.grouped_qdot import grouped_qdot
from llmjax.model.layers import ACTIVATIONS, gated_mlp
from llmjax.model.quant import is_packed


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
    Dout] -> [M, Dout] in rows' dtype (accumulated in float32), by the platform's grouped
    matmul (kernels_pallas/grouped_matmul: megablox's kernel on TPU, a tile loop on the CPU,
    `jax.lax.ragged_dot`, the specification, on GPUs)."""
    return _grouped(rows, w, group_sizes).astype(rows.dtype)


def _grouped(rows, w, group_sizes) -> jax.Array:
    if is_packed(w):  # packed per expert (float [out, in] on a CPU, int8, GGUF blocks)
        return grouped_qdot(rows, w, group_sizes)
    from kernels_pallas.grouped_matmul import grouped_matmul as kernel

    return kernel(rows, w, group_sizes)


def _grouped_mlp(rows, group_sizes, we_gate, we_up, we_down, act) -> jax.Array:
    """rows [M, D] grouped by expert -> each row's expert's gated MLP [M, D] in float32 (rows
    past the groups give zeros)."""
    gate = grouped_matmul(rows, we_gate, group_sizes).astype(jnp.float32)  # [M, Fe]
    up = grouped_matmul(rows, we_up, group_sizes).astype(jnp.float32)
    h = (ACTIVATIONS[act](gate) * up).astype(rows.dtype)
    return _grouped(h, we_down, group_sizes)


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
    out = _grouped_mlp(rows, group_sizes, we_gate, we_up, we_down, act).astype(x.dtype)
    pairs = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # [M, D] pair order
    y = jnp.einsum("tkd,tk->td", pairs.reshape(T, k, -1).astype(jnp.float32), weights)
    return y.astype(x.dtype)


def _dispatched_experts(xs, ws, es, wg, wu, wd, *, act, ep, split_hidden, dtype) -> jax.Array:
    """One device's part of `expert_parallel_mlp` (inside shard_map): its tokens xs [t, D] with
    their routing ws/es [t, k] (expert E = none: padding) -> their MoE output [t, D] float32.

    The pairs are sorted by expert, hence by the expert group (device of 'ep') that holds it;
    each goes into the send buffer [ep, C, D] at its destination's block, C = t * k rows per
    destination (every pair could go to one group: exact, nothing dropped). One all-to-all
    delivers the blocks; the receiver groups the rows by its local expert (ids sent beside
    them), runs its experts, and a second all-to-all returns each row to its block and slot."""
    t, k = es.shape
    E_local = wg.shape[0]
    M = t * k
    flat = es.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    dest = sorted_e // E_local  # ep for padding pairs: dropped below
    counts = jnp.zeros(ep + 1, jnp.int32).at[dest].add(1)[:ep]
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(M, dtype=jnp.int32) - starts[jnp.minimum(dest, ep - 1)]
    send = (
        jnp.zeros((ep, M, xs.shape[-1]), xs.dtype).at[dest, slot].set(xs[order // k], mode="drop")
    )
    send_ids = (
        jnp.full((ep, M), E_local, jnp.int32)
        .at[dest, slot]
        .set(sorted_e - dest * E_local, mode="drop")
    )
    recv = jax.lax.all_to_all(send, "ep", 0, 0, tiled=True).reshape(ep * M, -1)
    recv_ids = jax.lax.all_to_all(send_ids, "ep", 0, 0, tiled=True).reshape(ep * M)
    order2, group_sizes = sort_by_expert(recv_ids, E_local + 1)  # the last group: empty slots
    out = _grouped_mlp(recv[order2], group_sizes[:E_local], wg, wu, wd, act)  # [ep * M, D]
    out = out.astype(dtype)  # sent back in the activations' dtype, as the one-device path
    out = jnp.zeros_like(out).at[order2].set(out, unique_indices=True).reshape(ep, M, -1)
    back = jax.lax.all_to_all(out, "ep", 0, 0, tiled=True)  # [ep, M, D]: my pairs' results
    valid = (dest < ep)[:, None]
    got = jnp.where(valid, back[jnp.minimum(dest, ep - 1), slot], 0)  # [M, D] sorted order
    pairs = jnp.zeros_like(got).at[order].set(got, unique_indices=True)
    y = jnp.einsum("tkd,tk->td", pairs.reshape(t, k, -1).astype(jnp.float32), ws)
    if split_hidden:  # each device of the group holds a slice of every expert's hidden dim
        y = jax.lax.psum(y, "tp")
    return y


def expert_parallel_mlp(
    x, weights, experts, we_gate, we_up, we_down, mesh, act: str = "silu"
) -> jax.Array:
    """`experts_mlp` with the experts split over the mesh's 'ep' axis (ParallelConfig.ep): each
    of the ep expert groups takes 1/ep of the step's tokens (padded to a multiple of ep), routes
    them, sends each (token, expert) pair to the group holding its expert and combines what
    comes back (`_dispatched_experts`: two all-to-alls of fixed shape, so routing changes no
    shape); the devices of a group split each expert's hidden dim over 'tp' (a psum). The
    result [T, D] is gathered over 'ep' by XLA where the residual stream needs it."""
    from jax.sharding import PartitionSpec as P

    T = experts.shape[0]
    E, _, Fe = we_gate.shape
    ep, group = mesh.shape["ep"], mesh.shape["tp"]
    pad = -T % ep
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=E)  # routed nowhere
    split_hidden = group > 1 and Fe % group == 0  # else replicated (llmjax/parallel/mesh.py)
    hidden = "tp" if split_hidden else None
    w_in, w_out = P("ep", None, hidden), P("ep", hidden, None)
    tokens = P("ep", None)
    f = functools.partial(
        _dispatched_experts, act=act, ep=ep, split_hidden=split_hidden, dtype=x.dtype
    )
    y = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
        out_specs=tokens,
        check_vma=False,
    )(x, weights, experts, we_gate, we_up, we_down)
    return y[:T].astype(x.dtype)


def expert_mesh():
    """The mesh in context when it splits experts (its 'ep' axis > 1), else None. The engine's
    step traces under its mesh (llmjax/engine/runner/); the pipeline's stages under theirs."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("ep", 1) == 1:
        return None
    return mesh


def moe_mlp(layer: dict, x: jax.Array, config: ModelConfig) -> jax.Array:
    """The layer's mixture of experts on its normed input x [T, D] -> [T, D] (plus the shared
    expert, sigmoid-gated, where the layer has one: Qwen2-MoE)."""
    weights, experts = route(x, layer["router"], config.num_experts_per_tok, config.norm_topk_prob)
    w = (layer["we_gate"], layer["we_up"], layer["we_down"])
    mesh = expert_mesh()
    if mesh is not None:
        y = expert_parallel_mlp(x, weights, experts, *w, mesh, config.hidden_act)
    else:
        y = experts_mlp(x, weights, experts, *w, config.hidden_act)
    if "ws_score" in layer:
        shared = gated_mlp(x, layer["ws_gate"], layer["ws_up"], layer["ws_down"], config.hidden_act)
        score = jax.nn.sigmoid(jnp.einsum("td,d->t", x, layer["ws_score"]))[:, None]  # [T, 1]
        y = y + (score * shared).astype(y.dtype)
    return y

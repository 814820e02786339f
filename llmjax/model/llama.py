"""The decoder (Llama, Mistral, Qwen2/3, Gemma 2/3; Mixtral, Qwen2/3-MoE) as one pure function
over a paged KV cache.

Einsum letters:
    T  tokens of the flat ragged batch        D  model dim (hidden_size)
    N  query heads                            K  kv heads
    H  head dim                               F  MLP hidden dim (intermediate_size)
    V  vocabulary                             L  rows whose logits are returned

`forward(params, kv_pages, step, config)` runs one step of any mix of prefill chunks and decodes:
it embeds `step.token_ids`, writes each token's K/V to its slot, attends over each sequence's pages,
and returns logits only for the rows in `step.logits_indices` (the last new token of each sequence
when serving; every token in tests). Jit it at the boundary with the pages donated (see
`llmjax/engine/runner/`).

The layer loop follows the weights' layout (llmjax/model/params.py): a list of layers is unrolled
(L copies of the layer in the program), stacked layers are scanned (`lax.scan`: one copy,
compiled once whatever the depth) over a stacked KV cache (llmjax/model/kv_cache.py: every
layer's pages in one `[L * num_pages, ...]` array). The scan body hands the attention the whole
cache and the step's page tables and slots moved to its layer's pages (+ i * num_pages), so every
attention backend and kernel runs unchanged. In the hybrid KV layout (`KVGroups`, `kv_groups=`)
a page holds `num_slots` layers and each group of layers has its own page tables: layer i reads
slot `layer_slot[i]` (+ slot * num_pages) with group `layer_group[i]`'s tables, both scanned.

What the families differ in is data (`ModelConfig`'s architecture table, DESIGN principle 17):
a norm, a bias or a query/key norm applies where its weight is in the layer's tree (absent for
an architecture without it: `norm` and the `layer.get`s below), and each layer's attention kind
(sliding window or not, its RoPE) is an index into `config.attention_kinds`: a Python int in the
unrolled loop, a row of the per-layer table (`config.layer_kind_ids`) scanned with the weights
in the scan, where `attend` picks the kind's window with `lax.switch` (one branch per distinct
window: still one compiled layer) and `layer_rope` its RoPE table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import ModelConfig
from llmjax.model import lora
from llmjax.model.attention import AttentionFn, reference_attention
from llmjax.model.kv_cache import KVGroups, KVPages, as_stored, write_kv
from llmjax.model.layers import apply_rope, gated_mlp, layer_rope, norm, rope_cos_sin
from llmjax.model.moe import moe_mlp
from llmjax.model.params import Params, layers_stacked
from llmjax.model.quant import is_packed, qdot, take_rows
from llmjax.model.step_input import StepInput


def _project(x: jax.Array, layer: Params, name: str) -> jax.Array:
    """x: [T, D] @ the layer's weight `name`, [D, heads, H] (plain or packed,
    llmjax/model/quant.py) -> [T, heads, H], as one 2-D matmul (a 3-D einsum made XLA transpose
    the weight every step); plus the tokens' LoRA adapters' delta where the layer has
    `layer["lora"]` (llmjax/model/lora.py)."""
    return lora.project(x, layer[name], layer.get("lora"), name)


def attention_qkv(
    layer: Params, h: jax.Array, cos: jax.Array, sin: jax.Array, config: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The normed input h [T, D] -> q [T, N, H], k, v [T, K, H]: the projections, their biases
    (Qwen2), the per-head query/key norms (Qwen3, Gemma 3), RoPE (cos/sin [T, H/2])."""
    k = _project(h, layer, "wk")  # [T, K, H]
    v = _project(h, layer, "wv")  # [T, K, H]
    if "bk" in layer:  # attention_bias (Qwen2)
        k, v = k + layer["bk"], v + layer["bv"]
    k = norm(k, layer.get("k_norm"), config)
    return attention_q(layer, h, cos, sin, config), apply_rope(k, cos, sin), v


def attention_q(
    layer: Params, h: jax.Array, cos: jax.Array, sin: jax.Array, config: ModelConfig
) -> jax.Array:
    """The query alone (h [T, D] -> [T, N, H]), as `attention_qkv` makes it: InfiniGen's
    speculation makes the next layer's from this layer's input."""
    q = _project(h, layer, "wq")
    if "bq" in layer:
        q = q + layer["bq"]
    return apply_rope(norm(q, layer.get("q_norm"), config), cos, sin)


def attend(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,
    v_pages: jax.Array,
    step: StepInput,
    kind,
    config: ModelConfig,
    attention_fn: AttentionFn,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`attention_fn` with attention kind `kind`'s window (an int, or a traced index: then
    `lax.switch` over the distinct windows, each branch the backend with its window static), the
    model's score scale and soft cap -> [T, N, H]."""
    windows = tuple(dict.fromkeys(k.window for k in config.attention_kinds))

    def with_window(window):
        return lambda: attention_fn(
            q,
            k_pages,
            v_pages,
            step,
            sm_scale=config.attn_scale,
            sliding_window=window,
            soft_cap=config.attn_logit_softcapping,
            new_kv=new_kv,
        )

    kind_windows = [windows.index(k.window) for k in config.attention_kinds]
    if len(windows) == 1:
        return with_window(windows[0])()
    if isinstance(kind, int):
        return with_window(windows[kind_windows[kind]])()
    branch = jnp.asarray(kind_windows, jnp.int32)[kind]
    return jax.lax.switch(branch, [with_window(w) for w in windows])


def _attention_block(
    layer: Params,
    x: jax.Array,  # [T, D]
    kv: tuple[jax.Array, jax.Array],
    step: StepInput,
    cos: jax.Array,
    sin: jax.Array,
    kind,
    config: ModelConfig,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    h = norm(x, layer["attn_norm"], config)
    q, k, v = attention_qkv(layer, h, *layer_rope(cos, sin, kind), config)
    k_pages, v_pages = write_kv(*kv, k, v, step.slot_mapping)
    new_kv = as_stored(k, k_pages), as_stored(v, v_pages)  # what later steps will read
    o = attend(q, k_pages, v_pages, step, kind, config, attention_fn, new_kv=new_kv)  # [T, N, H]
    out = _project(o, layer, "wo")  # [T, N, H] @ [N, H, D]
    return norm(out, layer.get("attn_post_norm"), config), (k_pages, v_pages)


def mlp_block(layer: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """x [T, D] -> x + the layer's MLP of its normed x (post-normed: Gemma): a gated MLP, or a
    mixture of experts where the layer has a router (llmjax/model/moe.py)."""
    h = norm(x, layer["mlp_norm"], config)
    if "router" in layer:
        h = moe_mlp(layer, h, config)
    else:
        h = gated_mlp(
            h, layer["w_gate"], layer["w_up"], layer["w_down"], config.hidden_act,
            layer.get("lora"),
        )  # fmt: skip
    return x + norm(h, layer.get("mlp_post_norm"), config)


def decoder_layer(
    layer: Params,
    x: jax.Array,  # [T, D]
    kv: tuple[jax.Array, jax.Array],
    step: StepInput,
    cos: jax.Array,
    sin: jax.Array,
    config: ModelConfig,
    attention_fn: AttentionFn,
    kind=0,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One pre-norm decoder layer: x + attention, then + gated MLP -> (x [T, D], kv). cos/sin:
    `rope_cos_sin`'s [R, T, H/2]; `kind`: the layer's attention kind (`config.layer_kind_ids[i]`,
    an int or a traced index)."""
    with jax.named_scope("attention"):
        attn_out, kv = _attention_block(layer, x, kv, step, cos, sin, kind, config, attention_fn)
    x = x + attn_out
    with jax.named_scope("mlp"):
        x = mlp_block(layer, x, config)
    return x, kv


def group_step(step: StepInput, group) -> StepInput:
    """`step` with group `group`'s page tables and slots (the hybrid KV layout's; `step` itself
    without groups). `group`: an int or a traced index."""
    if step.group_page_indices is None:
        return step
    return step._replace(
        slot_mapping=step.group_slot_mapping[group], page_indices=step.group_page_indices[group]
    )


def layer_step(
    step: StepInput, slot: jax.Array, num_pages: int, page_size: int, group=None
) -> StepInput:
    """`step` with its page tables and slots moved to layer slot `slot`'s pages of a stacked
    cache, [slots * num_pages, ...] (page 0, the padding sink, becomes the slot's own page 0);
    `group`: the layer's page-table group in the hybrid KV layout (`KVGroups`)."""
    step = group_step(step, group)
    first_page = slot * num_pages
    return step._replace(
        slot_mapping=step.slot_mapping + first_page * page_size,
        page_indices=step.page_indices + first_page,
    )


def scan_layers(
    layers: Params,  # {name: [num_layers, ...]}
    kv_pages: tuple[jax.Array, jax.Array],  # [num_layers * num_pages, G, K, H] each
    x: jax.Array,  # [T, D]
    step: StepInput,
    cos: jax.Array,
    sin: jax.Array,
    config: ModelConfig,
    attention_fn: AttentionFn,
    num_layers: int | None = None,
    layer_kinds=None,
    lora_params: dict | None = None,
    kv_groups: KVGroups | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The decoder layers as one `lax.scan` over stacked weights -> (x [T, D], kv_pages). The
    whole cache is the scan's carry (updated in place). `num_layers`: only the first that many
    (a loop that reads each layer's weights in place: an early-exit draft). `layer_kinds`: the
    per-layer table, each layer's attention kind [L] (default `config.layer_kind_ids`; a
    pipeline stage passes its own layers' rows), scanned with the weights. `lora_params`: the
    LoRA adapter slots (`params["lora"]`, llmjax/model/lora.py), their [L, ...] arrays scanned
    with the weights (not in the early exit of `num_layers`: a draft runs the base model).
    `kv_groups`: the hybrid KV layout (llmjax/model/kv_cache.py), each layer's page-table group
    and slot scanned with the weights (a pipeline stage passes its own rows, arrays, and its
    stage's KV slots: `KVGroups.stage_slots`); None: layer i in slot i of the one table."""
    k_pages, v_pages = kv_pages
    total = jax.tree.leaves(layers)[0].shape[0]
    if layer_kinds is None:
        if total != config.num_layers:
            raise ValueError(f"{total} stacked layers of {config.num_layers}: pass layer_kinds")
        layer_kinds = config.layer_kind_ids
    kinds = jnp.asarray(layer_kinds, jnp.int32)  # [L]
    if kv_groups is None:
        kv_groups = KVGroups.single(total)
    elif len(kv_groups.layer_group) != total:  # (a pipeline stage passes its own rows)
        raise ValueError(f"kv_groups lays out {len(kv_groups.layer_group)} layers, not {total}")
    groups = jnp.asarray(kv_groups.layer_group, jnp.int32)  # [L]
    slots = jnp.asarray(kv_groups.layer_slot, jnp.int32)  # [L]
    num_pages, page_size = k_pages.shape[0] // kv_groups.num_slots, k_pages.shape[1]
    # Packed weights stay whole (loop-invariant) and each step views its layer in them: their
    # C++ kernels read it in place, where scanning over them would copy every layer's slice.
    packed = {name: w for name, w in layers.items() if is_packed(w)}
    sliced = {name: w for name, w in layers.items() if not is_packed(w)}
    if num_layers is not None and num_layers < total:

        def first_layers(i, carry):
            x, k, v = carry
            layer = {
                n: jax.lax.dynamic_index_in_dim(w, i, keepdims=False) for n, w in sliced.items()
            }
            layer |= {name: w.at_layer(i) for name, w in packed.items()}
            at = layer_step(step, slots[i], num_pages, page_size, groups[i])
            x, (k, v) = decoder_layer(
                layer, x, (k, v), at, cos, sin, config, attention_fn, kinds[i]
            )
            return x, k, v

        x, k, v = jax.lax.fori_loop(0, num_layers, first_layers, (x, k_pages, v_pages))
        return x, (k, v)

    def body(carry, xs):
        x, k, v, i = carry
        layer, kind, lora_weights, slot, group = xs
        layer = {**layer, **{name: w.at_layer(i) for name, w in packed.items()}}
        if lora_params is not None:
            layer["lora"] = lora.layer_view(lora_view, lora_params, lora_weights)
        x, (k, v) = decoder_layer(
            layer,
            x,
            (k, v),
            layer_step(step, slot, num_pages, page_size, group),
            cos,
            sin,
            config,
            attention_fn,
            kind,
        )
        return (x, k, v, i + 1), None

    carry = (x, k_pages, v_pages, jnp.int32(0))
    lora_weights = None if lora_params is None else lora.weights(lora_params)
    lora_view = lora.batch_view(lora_params, step.lora_slots)  # the sort: once, not per layer
    xs = (sliced, kinds, lora_weights, slots, groups)
    (x, k, v, _), _ = jax.lax.scan(body, carry, xs, length=total)
    return x, (k, v)


def lm_head(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm + vocabulary projection of the rows `x` [L, D] -> logits [L, V] float32, soft
    capped where the model caps them (Gemma 2)."""
    x = norm(x, params["final_norm"], config)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    if is_packed(head):
        logits = qdot(x, head, jnp.float32)
    elif config.tie_word_embeddings:
        logits = jnp.einsum("ld,vd->lv", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("ld,dv->lv", x, params["lm_head"], preferred_element_type=jnp.float32)
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def embed_tokens(params: Params, token_ids: jax.Array, config: ModelConfig) -> jax.Array:
    """Rows of the embedding table (plain or packed) in the activations' dtype (the norms'),
    times sqrt(hidden_size) in that dtype where `config.scale_embeddings` (Gemma) -> [T, D]."""
    x = take_rows(params["embed"], token_ids).astype(params["final_norm"].dtype)
    if config.scale_embeddings:
        x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
    return x


def forward(
    params: Params,
    kv_pages: KVPages,
    step: StepInput,
    config: ModelConfig,
    attention_fn: AttentionFn = reference_attention,
    num_layers: int | None = None,
    kv_groups: KVGroups | None = None,
) -> tuple[jax.Array, KVPages]:
    """One model step -> (logits [L, V] float32, updated kv_pages), with the layers unrolled or
    scanned as `params` and `kv_pages` are laid out (see the module doc). `attention_fn`: see
    llmjax/model/attention.py (`make_attention_fn` picks one by backend name). The pipeline-
    parallel step (llmjax/parallel/pipeline.py) runs the same pieces split over stages.
    `num_layers`: run only the first that many layers, then the final norm and the LM head (an
    early exit, speculative decoding's draft; the other layers' KV pages are untouched).
    `params["lora"]` (llmjax/model/lora.py): LoRA adapter slots, each token's chosen by
    `step.lora_slots` (the draft's early exit runs without them). `kv_groups`: the hybrid KV
    layout (llmjax/model/kv_cache.py `KVGroups`; the step then carries every group's page
    tables), None for one page table of every layer."""
    if (kv_groups is not None and kv_groups.hybrid) != (step.group_page_indices is not None):
        raise ValueError("a hybrid KV layout needs the step's group_page_indices, and only it")
    lora_params = params.get("lora") if num_layers is None else None
    if lora_params is not None and step.lora_slots is None:
        raise ValueError("params hold LoRA slots: the step needs lora_slots [T] (-1: none)")
    x = embed_tokens(params, step.token_ids, config)  # [T, D]
    cos, sin = rope_cos_sin(step.positions, config)  # [R, T, H/2]
    if layers_stacked(params):
        with jax.named_scope("layers"):
            x, new_kv_pages = scan_layers(
                params["layers"], kv_pages, x, step, cos, sin, config, attention_fn, num_layers,
                lora_params=lora_params, kv_groups=kv_groups,
            )  # fmt: skip
    else:
        new_kv_pages = list(kv_pages)
        kinds = config.layer_kind_ids
        groups = kv_groups or KVGroups.single(config.num_layers)
        lora_view = lora.batch_view(lora_params, step.lora_slots)
        for i, layer in enumerate(params["layers"][:num_layers]):
            if lora_params is not None:
                layer = {**layer, "lora": lora.layer_view(lora_view, lora_params, i=i)}
            slot = groups.layer_slot[i]
            with jax.named_scope(f"layer_{i}"):
                x, kv = decoder_layer(
                    layer, x, new_kv_pages[slot], group_step(step, groups.layer_group[i]),
                    cos, sin, config, attention_fn, kinds[i],
                )  # fmt: skip
                new_kv_pages[slot] = kv
    with jax.named_scope("lm_head"):
        logits = lm_head(params, x[step.logits_indices], config)  # [L, V]
    return logits, new_kv_pages

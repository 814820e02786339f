"""The model step with the KV cache in a host pool: full fetches (`offload`) or InfiniGen's
speculated, selective fetches (`infinigen`), ALGORITHMS.md §11.3 and §13.2.

`sparse_forward(params, pool, partial_keys, weights, step, config, sparse, host)` runs one ragged
step like `llmjax.model.llama.forward`, but every layer's K/V pages live in `pool` (a JAX host
memory kind when `host`: gathers and writes run on the host under `compute_on('device_host')`,
and only what they return crosses to the device).

Per layer i of a step:
  - the new tokens' K/V go to their pool slots (and, for speculated layers, their skewed partial
    keys to the device-resident `partial_keys`);
  - a *dense* layer (every layer of a step that has prefill tokens, every layer in `offload`,
    the first `num_dense_layers` in `infinigen`) fetches all pages of each sequence and attends
    over them (`fetch_pages` + the jnp reference, evicted pages masked);
  - a *sparse* layer attends over the rows selected for it while the previous layer ran
    (`speculate`: the next layer's query from this layer's attention input, skewed and cut to the
    partial columns, against the partial key cache; `fetch_rows` gathers them through the page
    table), plus the new token's own K/V (decode-only steps: the pool does not hold it yet when
    the fetch is issued).
  Which of the two a step takes is decided at run time (`lax.cond` on "every sequence decodes one
  token"), so each shape bucket compiles once.

Variants (SparseKVConfig): `query_source='own_layer'` selects inside each sparse layer with its
own query against its partial keys (`_select_in_layer`, as the oracle, Quest and H2O do), so the
fetch no longer overlaps the previous layer; `page_residual` keeps, beside the partial keys, each
page's min and max of the skewed columns the cut leaves out (`write_partial`, `quest_update`)
and adds that interval's midpoint or upper end to each token's partial score
(`speculated_scores`).

Selection is per query token and *kv head* (GQA: a token is fetched for a kv head when any of its
query heads' speculated logits is within `alpha` of that head's best; with one query per kv head
this is InfiniGen's per-head rule). Fetch units are rows [H] of K and V per (token, kv head).

Letters: T tokens, S sequences, P pages per sequence, G page size, C = P * G key positions,
K kv heads, Q query heads per kv head, N = K * Q, H head dim, c partial columns, M fetched rows.

Static shapes: a decode-only step's tokens are its first S rows (one per sequence), so the fetch
buffer is [S, K, M, H] (M = sink + recent + max_num_kv) and XLA copies it whole: the bytes an
accelerator moves are bounded by `max_num_kv`; the rows actually selected (what InfiniGen
transfers) are counted and returned as `SparseStats`.

In place: layer i+1's pool pages and partial keys are read during layer i (speculation, fetch)
and written by layer i+1; optimization barriers order the writes after the reads, without which
XLA copied both every step (tests/test_sparse_infinigen.py checks the compiled HLO).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from llmjax.config import ModelConfig, SparseKVConfig
from llmjax.model.attention import token_seq_ids
from llmjax.model.kv_cache import KVPages
from llmjax.model.layers import layer_rope, norm, rope_cos_sin
from llmjax.model.llama import attention_q, attention_qkv, embed_tokens, lm_head, mlp_block
from llmjax.model.params import Params, unstack_layers
from llmjax.model.quant import linear
from llmjax.model.step_input import StepInput
from llmjax.sparse import h2o

# the step's parts, re-exported (callers read them as `infinigen.X`): pool.py, attend.py
from llmjax.sparse.attend import (  # noqa: F401
    dense_attention,
    oracle_scores,
    quest_page_scores,
    sparse_attention,
    sparse_attention_pallas,
    speculate,
    speculated_scores,
)
from llmjax.sparse.pool import (  # noqa: F401
    HOST_MEMORY_KIND,
    allocate_partial_keys,
    allocate_pool,
    fetch_pages,
    fetch_rows,
    pool_memory_kind,
    quest_update,
    speculation_weights,
    stored_rows,
    write_partial,
    write_pool,
)
from llmjax.sparse.select import page_of, select_rows


class SparseStats(NamedTuple):
    """Per step, from the device: `sparse` whether the step took the sparse path; `rows` [T] the
    (token, kv head) rows each query token fetched over all speculated layers (sink, recent and
    its own row included); `page_hits` [S, P] how often each page index of each sequence was
    speculatively selected (over layers and kv heads; the counter eviction policy's input)."""

    sparse: jax.Array
    rows: jax.Array
    page_hits: jax.Array


# ---- the step --------------------------------------------------------------------------------


def decode_only(step: StepInput) -> jax.Array:
    """Every sequence of the step decodes one token (no prefill chunk): the sparse path's steps."""
    n = step.num_seqs[0]
    return (step.cu_q_lens[n] == n) & (n > 0)


def sparse_forward(
    params: Params,
    pool: KVPages,
    partial_keys: list,
    weights: list,
    step: StepInput,
    config: ModelConfig,
    sparse: SparseKVConfig,
    host: bool,
    pallas: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, KVPages, list, SparseStats]:
    """One model step over the host pool -> (logits [L, V] float32, pool, partial_keys, stats).
    `weights`: `speculation_weights` (None entries for dense layers). `pallas`: attend with the
    ragged paged attention kernel `implementation` (None: the platform's) over the fetched pages
    and over the fetched rows instead of jnp; needs a pool without holes (capacity 1)."""
    L = config.num_layers
    T = step.token_ids.shape[0]
    S, P = step.page_indices.shape
    G = pool[0][0].shape[1]
    scale, cap = config.attn_scale, config.attn_logit_softcapping
    kinds = config.layer_kind_ids  # per layer: its window and RoPE (Gemma's local layers)
    seq_ids = token_seq_ids(step.cu_q_lens, T)
    # A decode-only step has one token per sequence, so its tokens are the first D = S rows
    # (S <= T): speculation, fetch buffers and sparse attention are sized for them.
    D = S
    use_sparse = decode_only(step) if sparse.selective else jnp.bool_(False)
    in_layer = sparse.selects_in_layer  # selection by the layer's own query or state
    K = config.num_kv_heads
    x = embed_tokens(params, step.token_ids, config)
    tables = rope_cos_sin(step.positions, config)  # one per attention kind
    rows = jnp.zeros(T, jnp.int32)
    hits = jnp.zeros((S, P), jnp.int32)
    fetched = None  # (k_rows, v_rows, valid) for this layer, fetched while the previous ran
    pool = list(pool)
    new_pool, new_partial = [], list(partial_keys)
    layers = unstack_layers(params)["layers"]  # either layout; this loop is unrolled
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer_{i}"):
            window = config.layer_window(i)
            h = norm(x, layer["attn_norm"], config)
            q, k, v = attention_qkv(layer, h, *layer_rope(*tables, kinds[i]), config)
            k_pages = write_pool(pool[i][0], k, step.slot_mapping, host)
            v_pages = write_pool(pool[i][1], v, step.slot_mapping, host)
            new_pool.append((k_pages, v_pages))
            # the step's own rows as the pool holds them (a quantized pool: dequantized), which
            # the sparse path attends and the selection metadata is computed from
            k, v = stored_rows(k, k_pages), stored_rows(v, v_pages)
            if partial_keys[i] is not None and sparse.mode == "h2o":
                new_partial[i] = h2o.reset(new_partial[i], step.slot_mapping)
            elif partial_keys[i] is not None and sparse.mode == "quest":
                new_partial[i] = quest_update(new_partial[i], k, step.slot_mapping, G)
            elif partial_keys[i] is not None:
                new_partial[i] = write_partial(new_partial[i], k, weights[i], step.slot_mapping, G)

            heavy = sparse.mode == "h2o" and i >= sparse.num_dense_layers

            def dense(
                q=q, k_pages=k_pages, v_pages=v_pages, acc=new_partial[i], heavy=heavy,
                window=window,
            ):  # fmt: skip
                if heavy:  # H2O: evicted tokens masked, every query's probabilities added
                    k_all = fetch_pages(k_pages, step.page_indices, host, q.dtype)
                    v_all = fetch_pages(v_pages, step.page_indices, host, q.dtype)
                    return h2o.dense_attention(
                        q, k_all, v_all, acc, step, seq_ids, scale, window, cap
                    )
                o = dense_attention(
                    q, k_pages, v_pages, step, host, scale, window, pallas, implementation, cap
                )
                return o, acc

            row_slots = None
            if in_layer and i >= sparse.num_dense_layers:
                fetched, n_rows, top, new_partial[i], row_slots = _select_in_layer(
                    q, k_pages, v_pages, new_partial[i], step, seq_ids, sparse, host, use_sparse,
                    scale, window, D, G, config.num_kv_heads, weights[i],
                )  # fmt: skip
                rows = rows.at[:D].add(n_rows)
                hits = hits.at[seq_ids[:D, None, None], top[0] // G].add(top[1])
            if fetched is None:
                o, new_partial[i] = dense()
            else:
                k_rows, v_rows, valid = fetched

                def sparse_path(
                    q=q, k=k, v=v, k_rows=k_rows, v_rows=v_rows, valid=valid,
                    acc=new_partial[i], heavy=heavy, row_slots=row_slots,
                ):  # fmt: skip
                    args = (q[:D], k_rows, v_rows, valid, k[:D], v[:D], scale, cap)
                    if heavy:
                        o, probs = sparse_attention(*args, with_probs=True)
                        own = jnp.broadcast_to(step.slot_mapping[:D, None, None], (D, K, 1))
                        slots = jnp.concatenate([row_slots, own], axis=-1)
                        acc = h2o.accumulate(acc, probs, slots, seq_ids[:D] < step.num_seqs[0])
                    elif pallas:
                        o = sparse_attention_pallas(*args, implementation=implementation)
                    else:
                        o = sparse_attention(*args)
                    return jnp.concatenate([o, jnp.zeros((T - D, *o.shape[1:]), o.dtype)]), acc

                o, new_partial[i] = jax.lax.cond(use_sparse, sparse_path, dense)
            x = x + norm(linear(o, layer["wo"]), layer.get("attn_post_norm"), config)
            fetched = None
            if i + 1 < L and weights[i + 1] is not None and not in_layer:
                # Speculate layer i+1 from this layer's attention input and issue its fetch
                # now, so the copy can overlap the rest of this layer. Only the selection is
                # conditional: a fetch inside lax.cond made XLA copy the whole pool layer to
                # keep it for the read before layer i+1 writes it; outside, a dense step
                # fetches D x K x M rows of the reserved page (all masked).
                nxt = layers[i + 1]
                a_part, partial_next = weights[i + 1], new_partial[i + 1]

                def spec(h=h, nxt=nxt, a_part=a_part, partial_next=partial_next, j=i + 1):
                    cos, sin = layer_rope(*tables, kinds[j])  # layer j's norm, RoPE, window
                    q_next = attention_q(nxt, h[:D], cos[:D], sin[:D], config)
                    return speculate(
                        q_next, partial_next, a_part, step, seq_ids[:D], sparse, scale,
                        config.layer_window(j),
                    )  # fmt: skip

                def no_spec():
                    shape = (D, config.num_kv_heads, fetch_buffer_rows(sparse, P * G, G))
                    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool)

                positions, valid = jax.lax.cond(use_sparse, spec, no_spec)
                positions, valid, new_partial[i + 1] = jax.lax.optimization_barrier(
                    (positions, valid, partial_next)
                )  # as for the pool below: layer i+1's partial-key write waits for this read
                slots = page_of(step, seq_ids[:D], positions, G) * G + positions % G
                slots = jnp.where(valid, slots, 0)
                pool_next = pool[i + 1]
                k_rows = fetch_rows(pool_next[0], slots, host, k.dtype)
                v_rows = fetch_rows(pool_next[1], slots, host, k.dtype)
                # Layer i+1 writes its pages in place only after these reads: the barrier makes
                # the write depend on them (without it XLA copied the pool layer every step).
                k_rows, v_rows, pool_next = jax.lax.optimization_barrier(
                    (k_rows, v_rows, pool_next)
                )
                pool[i + 1] = pool_next
                fetched = (k_rows, v_rows, valid)
                real = seq_ids[:D] < step.num_seqs[0]
                valid_real = valid & real[:, None, None]
                own = real * k.shape[1]  # each token's own rows (from the step, not the pool)
                rows = rows.at[:D].add(jnp.where(use_sparse, valid_real.sum(axis=(1, 2)) + own, 0))
                top = valid_real.at[:, :, : sparse.num_sink_tokens + sparse.num_recent_tokens - 1]
                top = top.set(False)
                hits = hits.at[seq_ids[:D, None, None], positions // G].add(top.astype(jnp.int32))
        with jax.named_scope("mlp"):
            x = mlp_block(layer, x, config)
    with jax.named_scope("lm_head"):
        logits = lm_head(params, x[step.logits_indices], config)
    return logits, new_pool, new_partial, SparseStats(use_sparse, rows, hits)


def _select_in_layer(
    q, k_pages, v_pages, bounds, step, seq_ids, sparse, host, use_sparse, scale, window, D, G, K,
    weights=None,
):  # fmt: skip
    """Oracle, Quest, H2O and InfiniGen with query_source='own_layer': the rows this layer's
    decode tokens attend to, chosen with the layer's own query (exact scores over every key,
    Quest's page bounds, InfiniGen's partial keys) or its accumulated attention (H2O, which
    evicts the rest) and fetched from the pool -> ((k_rows, v_rows, valid),
    rows fetched per token [D], (positions, selected [D, K, M]) for the page-hit counts, the
    layer's state (bounds or accumulated attention), the rows' slots). The fetch runs outside
    the condition, as speculate's does."""
    P = step.page_indices.shape[1]

    def select(q=q):
        if sparse.mode == "oracle":
            s = oracle_scores(q[:D], k_pages, step, seq_ids[:D], host) * scale
            return (
                *select_rows(s, None, step, seq_ids[:D], sparse, G, window, alpha=None),
                bounds,
            )
        if sparse.mode == "h2o":
            return h2o.select(bounds, step, seq_ids[:D], sparse, window)
        if sparse.mode == "infinigen":
            return (
                *speculate(q[:D], bounds, weights, step, seq_ids[:D], sparse, scale, window),
                bounds,
            )
        pages = quest_page_scores(q[:D], bounds, step, seq_ids[:D])
        return (
            *select_rows(None, pages, step, seq_ids[:D], sparse, G, window, alpha=None),
            bounds,
        )

    def none():
        shape = (D, K, fetch_buffer_rows(sparse, P * G, G))
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool), bounds

    positions, valid, bounds = jax.lax.cond(use_sparse, select, none)
    slots = page_of(step, seq_ids[:D], positions, G) * G + positions % G
    slots = jnp.where(valid, slots, 0)
    k_rows = fetch_rows(k_pages, slots, host, q.dtype)
    v_rows = fetch_rows(v_pages, slots, host, q.dtype)
    real = seq_ids[:D] < step.num_seqs[0]
    valid_real = valid & real[:, None, None]
    n_rows = jnp.where(use_sparse, valid_real.sum(axis=(1, 2)) + real * K, 0)
    top = valid_real.at[:, :, : sparse.num_sink_tokens + sparse.num_recent_tokens - 1].set(False)
    return (k_rows, v_rows, valid), n_rows, (positions, top.astype(jnp.int32)), bounds, slots


def fetch_buffer_rows(sparse: SparseKVConfig, C: int, G: int) -> int:
    """M: the fetch buffer's rows per (token, kv head): sinks, recent tokens but the token
    itself, and the speculated ones (`cap` tokens, or `cap // G` whole pages)."""
    cap = C if sparse.max_num_kv is None else min(sparse.max_num_kv, C)
    if sparse.granularity == "page" or sparse.mode == "quest":
        cap = max(cap // G, 1) * G
    return sparse.num_sink_tokens + sparse.num_recent_tokens - 1 + cap

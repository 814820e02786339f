"""Speculative decoding's early-exit draft: the target model's own first layers, its final norm
and its LM head propose the next tokens greedily (self-speculation, as in LayerSkip or Draft &
Verify; `SpeculativeConfig(method="draft", num_draft_layers=d)`), with no second checkpoint.

The draft runs over the target's KV pages: the first d layers' KV of the context is exactly
what the draft needs (the same weights on the same tokens), so it only adds the KV of the tokens
it drafts, at the positions the verification then overwrites with every layer's (identical in
the first d layers for an accepted token). Sequence i drafts `num_proposals[i]` tokens in as
many passes, one token per pass, each a decode of one row per sequence through d layers.
In the hybrid KV layout (`kv_groups`) the page tables are every group's, [groups, S, P], as
`StepInput.group_page_indices`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmjax.config import KVGroups, ModelConfig
from llmjax.model.attention import AttentionFn
from llmjax.model.llama import forward
from llmjax.model.sampler import greedy_ids
from llmjax.model.step_input import RESERVED_PAGE, StepInput


def draft_proposals(
    params,
    kv_pages,
    tokens: jax.Array,  # [S] int32: each sequence's last token (not yet in the cache)
    positions: jax.Array,  # [S] int32: its position
    page_indices: jax.Array,  # [S, P] int32: the page tables (pages for every drafted token)
    num_proposals: jax.Array,  # [S] int32: tokens to draft (0: a padding row)
    config: ModelConfig,
    attention_fn: AttentionFn,
    *,
    num_layers: int,
    max_proposals: int,
    page_size: int,
    kv_groups: KVGroups | None = None,
):
    """-> (proposals [S, max_proposals] int32, kv_pages). Pass j feeds each live sequence's
    token j (its last token, then its drafts) at position + j through the first `num_layers`
    layers and takes the argmax; a sequence with fewer proposals idles (its writes go to the
    reserved page and it reads only its own context). With `kv_groups` (hybrid),
    `page_indices` is [groups, S, P]."""
    S = tokens.shape[0]
    G = page_size
    rows = jnp.arange(S)
    hybrid = kv_groups is not None and kv_groups.hybrid
    tables = page_indices if hybrid else page_indices[None]  # [groups, S, P]

    def one_pass(j, carry):
        kv, token, out = carry
        live = j < num_proposals
        pos = positions + jnp.where(live, j, 0)
        page = tables[:, rows, pos // G]  # [groups, S]
        slots = jnp.where(live, page * G + pos % G, RESERVED_PAGE * G)
        step = StepInput(
            token_ids=token,
            positions=pos,
            slot_mapping=slots[0],
            cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
            kv_lens=pos + 1,
            page_indices=tables[0],
            num_seqs=jnp.array([S], jnp.int32),
            logits_indices=rows.astype(jnp.int32),
        )
        if hybrid:
            step = step._replace(group_page_indices=tables, group_slot_mapping=slots)
        logits, kv = forward(
            params,
            kv,
            step,
            config,
            attention_fn,
            num_layers=num_layers,
            kv_groups=kv_groups if hybrid else None,
        )
        drafted = greedy_ids(logits)
        out = out.at[:, j].set(jnp.where(live, drafted, -1))
        return kv, jnp.where(live, drafted, token), out

    out = jnp.full((S, max_proposals), -1, jnp.int32)
    kv_pages, _, out = jax.lax.fori_loop(0, max_proposals, one_pass, (kv_pages, tokens, out))
    return out, kv_pages

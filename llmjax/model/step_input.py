"""`StepInput`: the metadata of one ragged step, named after the attention kernels' arguments.

A NamedTuple, so it is a pytree with no registration and this module needs no jax: the host-side
packer (`llmjax/engine/batch.py`) fills it with numpy arrays; the jitted step gets device arrays.

One step carries a flat batch of T tokens from S sequences (prefill chunks and decodes mixed).
Tokens of sequence s are `token_ids[cu_q_lens[s]:cu_q_lens[s+1]]`. Everything is padded to a shape
bucket: padded tokens write their K/V to the reserved page 0 and their outputs are dropped; padded
sequences have zero-length queries.

Example, two sequences, a 3-token prefill chunk and a decode at position 6, page_size 4, T=8, S=4:

    token_ids      [t0 t1 t2 t3 0  0  0  0]
    positions      [0  1  2  6  0  0  0  0]
    slot_mapping   [20 21 22 14 0  0  0  0]    # seq 0 owns page 5, seq 1 owns pages 2, 3
    cu_q_lens      [0 3 4 4 4]
    kv_lens        [3 7 0 0]
    page_indices   [[5 0] [2 3] [0 0] [0 0]]
    num_seqs       [2]
    logits_indices [2 3 0 0]                   # last new token of each sequence
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# Page 0 is never handed to a request: padded tokens write their K/V there.
RESERVED_PAGE = 0


class StepInput(NamedTuple):
    token_ids: Any  # [T] int32
    positions: Any  # [T] int32, position of each token in its sequence
    slot_mapping: Any  # [T] int32, page * page_size + offset where the token's K/V is written
    cu_q_lens: Any  # [S + 1] int32, cumulative new-token counts per sequence
    kv_lens: Any  # [S] int32, tokens in each sequence's cache after this step
    page_indices: Any  # [S, max_pages] int32, each sequence's page table
    num_seqs: Any  # [1] int32, sequences in use (the rest is padding)
    logits_indices: Any  # [num_logits] int32, flat token rows whose logits are returned
    # [T] int32, each token's LoRA adapter slot (llmjax/model/lora.py; -1: the base model), or
    # None: an engine without adapters
    lora_slots: Any = None
    # The hybrid KV layout (llmjax/model/kv_cache.py `KVGroups`): every group's page tables
    # [num_groups, S, max_pages] and slots [num_groups, T] (group 0's are page_indices and
    # slot_mapping); None with one page table for every layer
    group_page_indices: Any = None
    group_slot_mapping: Any = None


def contiguous_prefill(sequences, n: int, page_size: int) -> tuple[StepInput, np.ndarray]:
    """One step prefilling the first `n` tokens of each row of `sequences` [B, >= n], row b on
    its own run of pages (1 + b * pages_per_row, ...; page 0 stays the sink) sized for the whole
    row; logits of each row's last prefilled token. Returns (step, page tables [B, pages])."""
    sequences = np.asarray(sequences)
    B, total = sequences.shape
    pages_per_row = -(-total // page_size)
    tables = 1 + np.arange(B * pages_per_row, dtype=np.int32).reshape(B, pages_per_row)
    pos = np.arange(n)
    slots = tables[:, pos // page_size] * page_size + pos % page_size  # [B, n]
    step = StepInput(
        token_ids=sequences[:, :n].reshape(-1).astype(np.int32),
        positions=np.tile(pos, B).astype(np.int32),
        slot_mapping=slots.reshape(-1).astype(np.int32),
        cu_q_lens=(np.arange(B + 1) * n).astype(np.int32),
        kv_lens=np.full(B, n, np.int32),
        page_indices=tables,
        num_seqs=np.array([B], np.int32),
        logits_indices=(np.arange(1, B + 1) * n - 1).astype(np.int32),
    )
    return step, tables


def with_groups(step: StepInput, num_groups: int) -> StepInput:
    """`step` with every group of a hybrid KV layout reading its own page tables as group 0's
    (for steps built without groups: all-padding ones, whose tables are the reserved page)."""
    return step._replace(
        group_page_indices=np.broadcast_to(
            np.asarray(step.page_indices), (num_groups, *np.shape(step.page_indices))
        ),
        group_slot_mapping=np.broadcast_to(
            np.asarray(step.slot_mapping), (num_groups, *np.shape(step.slot_mapping))
        ),
    )

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

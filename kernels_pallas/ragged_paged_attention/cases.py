"""Random ragged batches for the ragged paged attention kernels: what the tests
(tests/kernels/) check every implementation on and scripts/bench_kernels.py times.

A case is what the engine hands the kernel: a flat batch of query rows from several sequences
(decodes, prefill chunks that start mid-page and cross pages), each reading its KV through a
shuffled page table, padded to T rows and S sequences. Values are random normals, never zeros.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    q: np.ndarray  # [T, N, H]
    k_pages: np.ndarray  # [num_pages, G, K, H]
    v_pages: np.ndarray  # [num_pages, G, K, H]
    kv_lens: np.ndarray  # [S] int32
    page_indices: np.ndarray  # [S, P] int32
    cu_q_lens: np.ndarray  # [S + 1] int32
    num_seqs: np.ndarray  # [1] int32

    @property
    def args(self) -> tuple:
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
        )


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    page_size: int = 16,
    num_kv_heads: int = 2,
    num_queries_per_kv: int = 4,
    head_dim: int = 64,
    dtype=np.float32,
    num_tokens: int | None = None,  # padded T (default: sum(q_lens) rounded up to 8)
    max_num_seqs: int | None = None,  # padded S (default: len(q_lens) + 1)
    pages_per_seq: int | None = None,  # P (default: enough for the longest kv_len, + 1)
    seed: int = 0,
) -> Case:
    """Sequence i has q_lens[i] new tokens, the last of its kv_lens[i] keys (q_len <= kv_len)."""
    if len(q_lens) != len(kv_lens) or any(
        not 0 < q <= k for q, k in zip(q_lens, kv_lens, strict=True)
    ):
        raise ValueError(f"need 0 < q_len <= kv_len for each sequence: {q_lens=} {kv_lens=}")
    rng = np.random.default_rng(seed)
    K, Q, H, G = num_kv_heads, num_queries_per_kv, head_dim, page_size
    n = len(q_lens)
    S = max_num_seqs or n + 1
    T = num_tokens or max(8, -(-sum(q_lens) // 8) * 8)
    P = pages_per_seq or max(-(-k // G) for k in kv_lens) + 1
    if n > S or sum(q_lens) > T:
        raise ValueError(f"padding too small: {S=} {T=}")
    num_pages = 1 + sum(-(-k // G) for k in kv_lens) + 3  # page 0 reserved, a few unused
    free = rng.permutation(np.arange(1, num_pages))  # shuffled page tables
    page_indices = np.zeros((S, P), np.int32)
    used = 0
    for i, k in enumerate(kv_lens):
        m = -(-k // G)
        page_indices[i, :m] = free[used : used + m]
        used += m
    cu = np.zeros(S + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    lens = np.zeros(S, np.int32)
    lens[:n] = kv_lens

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    return Case(
        q=normal(T, K * Q, H),
        k_pages=normal(num_pages, G, K, H),
        v_pages=normal(num_pages, G, K, H),
        kv_lens=lens,
        page_indices=page_indices,
        cu_q_lens=cu,
        num_seqs=np.array([n], np.int32),
    )


# Named ragged batches every kernel is checked on (q_lens, kv_lens, page_size).
RAGGED_CASES = {
    "one_decode": ([1], [1], 16),
    "decodes": ([1, 1, 1, 1], [1, 16, 17, 40], 16),
    "prefill_one_page": ([16], [16], 16),
    "prefill_page_plus_one": ([17], [17], 16),
    "chunk_mid_page_crossing": ([20], [29], 16),  # starts at 9, ends at 28
    "mixed": ([1, 7, 1, 12, 1], [33, 7, 2, 40, 16], 16),
    "small_pages": ([3, 1, 9], [11, 5, 9], 8),
}

"""Pack a `ScheduledBatch` into numpy arrays padded to a shape bucket (the only host -> array seam).

Three bucketed dimensions keep the number of compiled step variants small: tokens T, sequences S
and pages per sequence P, each rounded up to a power of two within [min, max]. Padded tokens write
to the reserved page 0; padded sequences have empty queries and an all-zero page table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmjax.engine.block_manager import pages_needed
from llmjax.engine.scheduler import ScheduledBatch
from llmjax.model.step_input import RESERVED_PAGE, StepInput


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded step shapes: T tokens and P pages per sequence round up to powers of two; the
    sequence rows S = min(T, max_num_seqs) follow from T (a step never has more sequences than
    tokens), so the compiled variants are |token_buckets| x |page_buckets|."""

    token_buckets: tuple[int, ...]
    page_buckets: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def create(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        ragged_pages: bool = False,
    ) -> Buckets:
        """`ragged_pages`: the attention reads only each sequence's `kv_lens` worth of its page
        table (the CPU kernel), so one P, the longest table, serves every step: no variants
        per context length."""
        pages = (max_pages_per_seq,) if ragged_pages else None
        return cls(
            token_buckets=_pow2_buckets(1, max_num_batched_tokens),
            page_buckets=pages or _pow2_buckets(min(4, max_pages_per_seq), max_pages_per_seq),
            max_num_seqs=max_num_seqs,
        )

    def shape_for(self, num_tokens: int, num_seqs: int, max_pages: int) -> tuple[int, int, int]:
        if num_seqs > min(num_tokens, self.max_num_seqs):
            raise ValueError(f"{num_seqs=} exceeds min({num_tokens=}, {self.max_num_seqs=})")
        T = _round_up(num_tokens, self.token_buckets)
        return T, min(T, self.max_num_seqs), _round_up(max_pages, self.page_buckets)

    def likely_next(
        self, shape: tuple[int, int, int], num_running: int
    ) -> list[tuple[int, int, int]]:
        """The shapes steps after one of `shape` are likely to take, with `num_running`
        requests running: the same batch once its contexts cross into the next page bucket,
        and the decode-only batch of the running requests (now and in the next page bucket)."""
        T, S, P = shape
        bigger = [b for b in self.page_buckets if b > P][:1]
        out = [(T, S, p) for p in bigger]
        n = min(max(num_running, 1), self.max_num_seqs)
        if n <= self.token_buckets[-1]:
            Td = _round_up(n, self.token_buckets)
            out += [(Td, min(Td, self.max_num_seqs), p) for p in [P, *bigger]]
        return [s for s in dict.fromkeys(out) if s != shape]

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) a step can take, for precompilation."""
        return [
            (T, min(T, self.max_num_seqs), P) for T in self.token_buckets for P in self.page_buckets
        ]


def step_shape(step) -> tuple[int, int, int]:
    """A packed StepInput's bucket: (T tokens, S sequence rows, P pages per sequence)."""
    S, P = np.shape(step.page_indices)
    return int(np.shape(step.token_ids)[0]), int(S), int(P)


@dataclasses.dataclass
class SamplingInput:
    """Per-sequence sampling arrays, [S] each, padded like the step."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    all_greedy: bool


def pack(
    batch: ScheduledBatch,
    page_tables: dict[str, list[int]],
    page_size: int,
    buckets: Buckets,
) -> tuple[StepInput, SamplingInput]:
    seqs = batch.seqs
    num_tokens = batch.num_tokens
    max_pages = max(pages_needed(s.start + s.num_new_tokens, page_size) for s in seqs)
    T, S, P = buckets.shape_for(num_tokens, len(seqs), max_pages)

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, RESERVED_PAGE * page_size, np.int32)
    cu_q_lens = np.full(S + 1, num_tokens, np.int32)
    kv_lens = np.zeros(S, np.int32)
    page_indices = np.full((S, P), RESERVED_PAGE, np.int32)
    logits_indices = np.zeros(S, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    counters = np.zeros(S, np.int32)

    offset = 0
    cu_q_lens[0] = 0
    for i, seq in enumerate(seqs):
        req, n, start = seq.request, seq.num_new_tokens, seq.start
        table = np.asarray(page_tables[req.request_id], np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        token_ids[offset : offset + n] = req.token_ids_slice(start, start + n)
        positions[offset : offset + n] = pos
        slot_mapping[offset : offset + n] = table[pos // page_size] * page_size + pos % page_size
        offset += n
        cu_q_lens[i + 1] = offset
        kv_lens[i] = start + n
        used = pages_needed(start + n, page_size)
        page_indices[i, :used] = table[:used]
        logits_indices[i] = offset - 1
        params = req.sampling_params
        temperature[i] = params.temperature
        top_k[i] = params.top_k
        top_p[i] = params.top_p
        seeds[i] = req.seed
        counters[i] = len(req.output_token_ids)

    step = StepInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_indices=page_indices,
        num_seqs=np.array([len(seqs)], np.int32),
        logits_indices=logits_indices,
    )
    sampling = SamplingInput(
        temperature, top_k, top_p, seeds, counters, all_greedy=not temperature.any()
    )
    return step, sampling

"""Pack a `ScheduledBatch` into numpy arrays padded to a shape bucket (the only host -> array seam).

Three bucketed dimensions keep the number of compiled step variants small: tokens T, sequences S
and pages per sequence P. P rounds up to a power of two; T to one of `per_octave` steps between
powers of two (`token_buckets`: 4 per octave gives 64, 80, 96, 112, 128, 160, ..., so a step
pays at most 25 % padding, where powers of two alone pay up to 100 %: 16 decodes beside a
128-token prefill chunk are 144 tokens, run as 160 instead of 256); S follows from T. Padded
tokens write to the reserved page 0; padded sequences have empty queries and an all-zero page
table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmjax.engine.block_manager import pages_needed
from llmjax.engine.request import PENDING_TOKEN
from llmjax.engine.scheduler import ScheduledBatch
from llmjax.model.step_input import RESERVED_PAGE, StepInput
from llmjax.sampling_params import MAX_LOGPROBS


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


TOKEN_ALIGN = 8  # a token bucket that is not a power of two is a multiple of this


def token_buckets(max_tokens: int, per_octave: int = 1) -> tuple[int, ...]:
    """The token counts steps are padded to, up to `max_tokens`: the powers of two and, between
    each pair, `per_octave - 1` steps of b / per_octave rounded up to a multiple of
    TOKEN_ALIGN (fewer where the octave is too narrow for them). In/Out: (512, 4) -> 1, 2, 4,
    8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512;
    (512, 1) -> 1, 2, 4, ..., 512."""
    if per_octave < 1:
        raise ValueError(f"{per_octave=} must be >= 1")
    out, b = [], 1
    while b < max_tokens:
        step = -(-b // (per_octave * TOKEN_ALIGN)) * TOKEN_ALIGN if b >= TOKEN_ALIGN else b
        out += [v for v in range(b, 2 * b, step) if v < max_tokens]
        b *= 2
    return (*out, max_tokens)


def _round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded step shapes: T tokens round up to `token_buckets` (powers of two and
    `per_octave` steps between them), P pages per sequence to powers of two; the sequence rows
    S = min(T, max_num_seqs) follow from T (a step never has more sequences than tokens), so
    the compiled variants are |token_buckets| x |page_buckets|."""

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
        per_octave: int = 1,
    ) -> Buckets:
        """`ragged_pages`: the attention reads only each sequence's `kv_lens` worth of its page
        table (the CPU kernel), so one P, the longest table, serves every step: no variants
        per context length. `per_octave`: token buckets per power of two (`token_buckets`;
        EngineConfig.token_buckets_per_octave)."""
        pages = (max_pages_per_seq,) if ragged_pages else None
        return cls(
            token_buckets=token_buckets(max_num_batched_tokens, per_octave),
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


BIAS_BUCKETS = (8, 64, 1024)  # logit-bias slots per row (logit_bias + min_tokens' stop ids)
MAX_BIAS_SLOTS = BIAS_BUCKETS[-1]


@dataclasses.dataclass
class ProcessingInput:
    """Logits processing and log probabilities for a step that asks for them (`SamplingParams.
    processes_logits` or `logprobs`), padded like the step; a row without them is neutral
    (no bias, penalties 0 and 1, min_p 0). B rounds up to BIAS_BUCKETS; L, the history of
    prompt and output tokens the penalties count, is 1 unless a row has penalties, then the
    longest sequence a request can have (so few compiled variants). `num_logprobs` is
    MAX_LOGPROBS if a sampled row asks for logprobs, else 0."""

    min_p: np.ndarray  # [S] float32
    bias_ids: np.ndarray  # [S, B] int32, -1 pads
    bias_values: np.ndarray  # [S, B] float32
    history_ids: np.ndarray  # [S, L] int32, -1 pads
    history_is_output: np.ndarray  # [S, L] bool
    presence: np.ndarray  # [S] float32
    frequency: np.ndarray  # [S] float32
    repetition: np.ndarray  # [S] float32
    num_logprobs: int

    def arrays(self) -> tuple:
        return (
            self.min_p,
            self.bias_ids,
            self.bias_values,
            self.history_ids,
            self.history_is_output,
            self.presence,
            self.frequency,
            self.repetition,
        )


@dataclasses.dataclass
class PromptLogprobsInput:
    """A step that computes prompt logprobs (`SamplingParams.prompt_logprobs`) returns logits for
    every token row (`StepInput.logits_indices` = all T rows); `last_rows` [S] picks each
    sequence's sampling row from them, `targets` [T] is the next prompt token each row predicts
    (-1: none wanted), whose log probability and the top MAX_LOGPROBS come back."""

    last_rows: np.ndarray  # [S] int32
    targets: np.ndarray  # [T] int32


@dataclasses.dataclass
class SpecInput:
    """A step that verifies proposals (speculative decoding): `StepInput.logits_indices` then
    has R = min(T, S * (K + 1)) rows, each sequence's from `first_rows[i]`: every row of a
    sequence with proposals (its last token's, then one per proposal), the last row of the
    others; `proposals` [S, K] (-1 pads) and `num_proposals` [S] say what to verify
    (llmjax.model.sampler.verify_proposals). K is `SpeculativeConfig.num_speculative_tokens`, so
    a step with proposals compiles one more variant per (T, S, P) bucket, not one per count."""

    first_rows: np.ndarray  # [S] int32
    proposals: np.ndarray  # [S, K] int32
    num_proposals: np.ndarray  # [S] int32
    row_seq: np.ndarray  # [R] int32: each logits row's sequence
    row_pos: np.ndarray  # [R] int32: its index among the sequence's rows (K + 1: padding)

    def arrays(self) -> tuple:
        """verify_proposals' arguments after the logits and greedy ids."""
        return (self.first_rows, self.row_seq, self.row_pos, self.proposals, self.num_proposals)

    @classmethod
    def empty(cls, S: int, K: int, R: int) -> SpecInput:
        """No proposals: one padding row per logits row."""
        return cls(
            first_rows=np.zeros(S, np.int32),
            proposals=np.full((S, K), -1, np.int32),
            num_proposals=np.zeros(S, np.int32),
            row_seq=np.zeros(R, np.int32),
            row_pos=np.full(R, K + 1, np.int32),
        )


def spec_rows(T: int, S: int, K: int) -> int:
    """Logits rows of a (T, S) step that verifies up to K proposals per sequence."""
    return min(T, S * (K + 1))


@dataclasses.dataclass
class SamplingInput:
    """Per-sequence sampling arrays, [S] each, padded like the step; `processing` when a row
    processes its logits or wants logprobs."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    all_greedy: bool
    processing: ProcessingInput | None = None
    prompt: PromptLogprobsInput | None = None
    # structured outputs: () -> the step's token bitmask [S, W] int32, called by the runner
    # once the forward is dispatched, so the host fills it while the device runs
    bitmask_fn: object = None
    spec: SpecInput | None = None  # speculative decoding: the proposals to verify
    # async scheduling: [T] int32, for each token row whose id is not on the host yet (a
    # pending token), the row of the previous step's sampled ids that holds it; -1 elsewhere
    token_rows: np.ndarray | None = None


def fill_pending(step: StepInput, token_rows: np.ndarray | None, last_ids) -> StepInput:
    """`step` with each pending token's id (`SamplingInput.token_rows`) taken from the last
    step's sampled ids: on the host, what `ModelRunner._pending_filled` does on the device (the
    simulated device and the tests' fake model use it)."""
    if token_rows is None:
        return step
    ids = np.asarray(step.token_ids).copy()
    ids[token_rows >= 0] = np.asarray(last_ids)[token_rows[token_rows >= 0]]
    return step._replace(token_ids=ids)


def stop_ids_while_short(req) -> list[int]:
    """The token ids min_tokens masks while `req` is short of it: EOS (unless ignore_eos) and
    its stop_token_ids."""
    params = req.sampling_params
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(req.eos_token_ids)
    return sorted(ids)


def _processing(seqs, S: int, history_len: int) -> ProcessingInput | None:
    """The processing arrays of the rows that sample this step, or None if none asks."""
    rows = [
        (i, s.request)
        for i, s in enumerate(seqs)
        if s.samples
        and (
            s.request.sampling_params.processes_logits
            or s.request.sampling_params.logprobs is not None
        )
    ]
    if not rows:
        return None
    biases = {}
    for i, req in rows:
        params = req.sampling_params
        entries = list(params.logit_bias)
        if req.num_output_tokens < params.min_tokens:
            entries += [(t, -np.inf) for t in stop_ids_while_short(req)]
        biases[i] = entries
    need = max(len(e) for e in biases.values())
    B = next(b for b in BIAS_BUCKETS if b >= need)
    penalties = any(req.sampling_params.has_penalties for _, req in rows)
    L = history_len if penalties else 1
    out = ProcessingInput(
        min_p=np.zeros(S, np.float32),
        bias_ids=np.full((S, B), -1, np.int32),
        bias_values=np.zeros((S, B), np.float32),
        history_ids=np.full((S, L), -1, np.int32),
        history_is_output=np.zeros((S, L), np.bool_),
        presence=np.zeros(S, np.float32),
        frequency=np.zeros(S, np.float32),
        repetition=np.ones(S, np.float32),
        num_logprobs=MAX_LOGPROBS
        if any(req.sampling_params.logprobs is not None for _, req in rows)
        else 0,
    )
    for i, req in rows:
        params = req.sampling_params
        out.min_p[i] = params.min_p
        for k, (token, value) in enumerate(biases[i]):
            out.bias_ids[i, k], out.bias_values[i, k] = token, value
        if params.has_penalties:
            n_prompt = len(req.prompt_token_ids)
            n = req.num_tokens
            out.history_ids[i, :n_prompt] = req.prompt_token_ids
            out.history_ids[i, n_prompt:n] = req.output_token_ids
            out.history_is_output[i, n_prompt:n] = True
            out.presence[i] = params.presence_penalty
            out.frequency[i] = params.frequency_penalty
            out.repetition[i] = params.repetition_penalty
    return out


def pack(
    batch: ScheduledBatch,
    page_tables: dict[str, list[int]],
    page_size: int,
    buckets: Buckets,
    num_speculative_tokens: int = 0,
    pending_rows: dict[str, int] | None = None,
    group_tables: dict[str, list[list[int]]] | None = None,
) -> tuple[StepInput, SamplingInput]:
    """The batch as padded arrays. `num_speculative_tokens` (K): the most proposals a sequence
    may verify (`SpeculativeConfig`); a batch with proposals gets a `SpecInput`.
    `pending_rows` (async scheduling): request id -> its row in the step in flight, whose
    sampled id fills the request's pending token (`SamplingInput.token_rows`).
    `group_tables` (the hybrid KV layout, `BlockManager.group_tables`): each request's windowed
    groups' page tables, packed after group 0's into `group_page_indices` / `group_slot_mapping`
    (None: one page table for every layer)."""
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
    num_groups = 1 + len(next(iter(group_tables.values()), ())) if group_tables else 1
    if group_tables is not None:
        group_slots = np.full((num_groups, T), RESERVED_PAGE * page_size, np.int32)
        group_pages = np.full((num_groups, S, P), RESERVED_PAGE, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    counters = np.zeros(S, np.int32)
    token_rows = None

    offset = 0
    cu_q_lens[0] = 0
    for i, seq in enumerate(seqs):
        req, n, start = seq.request, seq.num_new_tokens, seq.start
        table = np.asarray(page_tables[req.request_id], np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        k = len(seq.spec)
        token_ids[offset : offset + n - k] = req.token_ids_slice(start, start + n - k)
        token_ids[offset + n - k : offset + n] = seq.spec
        positions[offset : offset + n] = pos
        slot_mapping[offset : offset + n] = table[pos // page_size] * page_size + pos % page_size
        used = pages_needed(start + n, page_size)
        page_indices[i, :used] = table[:used]
        if group_tables is not None:  # (group 0's are page_indices and slot_mapping)
            for g, t in enumerate(group_tables[req.request_id], 1):
                t = np.asarray(t, np.int32)
                group_slots[g, offset : offset + n] = t[pos // page_size] * page_size
                group_slots[g, offset : offset + n] += pos % page_size
                group_pages[g, i, :used] = t[:used]
        offset += n
        cu_q_lens[i + 1] = offset
        kv_lens[i] = start + n
        logits_indices[i] = offset - 1
        params = req.sampling_params
        temperature[i] = params.temperature
        top_k[i] = params.top_k
        top_p[i] = params.top_p
        seeds[i] = req.seed
        counters[i] = req.num_output_tokens
        if req.num_pending_tokens and token_ids[offset - n] == PENDING_TOKEN:
            if pending_rows is None or req.request_id not in pending_rows:
                raise ValueError(f"request {req.request_id!r}'s pending token has no source row")
            if token_rows is None:
                token_rows = np.full(T, -1, np.int32)
            token_rows[offset - n] = pending_rows[req.request_id]
            token_ids[offset - n] = 0

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
    if group_tables is not None:
        group_pages[0], group_slots[0] = page_indices, slot_mapping
        step = step._replace(group_page_indices=group_pages, group_slot_mapping=group_slots)
    processing = _processing(seqs, S, buckets.page_buckets[-1] * page_size)
    prompt = _prompt_logprobs(seqs, cu_q_lens, logits_indices, T)
    sampling = SamplingInput(
        temperature,
        top_k,
        top_p,
        seeds,
        counters,
        all_greedy=not temperature.any(),
        processing=processing,
        prompt=prompt,
        token_rows=token_rows,
    )
    if prompt is not None:
        step = step._replace(logits_indices=np.arange(T, dtype=np.int32))
    elif batch.num_spec_tokens:
        if not 0 < max(len(s.spec) for s in seqs) <= num_speculative_tokens:
            raise ValueError(f"proposals exceed {num_speculative_tokens=}")
        K = num_speculative_tokens
        R = spec_rows(T, S, K)
        rows = np.zeros(R, np.int32)
        spec = SpecInput.empty(S, K, R)
        r = 0
        for i, seq in enumerate(seqs):
            k = len(seq.spec)
            spec.first_rows[i] = r
            spec.num_proposals[i] = k
            spec.proposals[i, :k] = seq.spec
            rows[r : r + k + 1] = np.arange(cu_q_lens[i + 1] - k - 1, cu_q_lens[i + 1])
            spec.row_seq[r : r + k + 1] = i
            spec.row_pos[r : r + k + 1] = np.arange(k + 1)
            r += k + 1
        step = step._replace(logits_indices=rows)
        sampling.spec = spec
    return step, sampling


def _prompt_logprobs(seqs, cu_q_lens, logits_indices, T: int) -> PromptLogprobsInput | None:
    """The rows whose next prompt token's logprob a request wants and has not yet got, or None."""
    targets = np.full(T, -1, np.int32)
    any_wanted = False
    for i, seq in enumerate(seqs):
        req = seq.request
        if req.sampling_params.prompt_logprobs is None or req.prompt_logprobs is None:
            continue
        prompt = req.prompt_token_ids
        for j in range(seq.num_new_tokens):
            p = seq.start + j  # this row's position; it predicts token p + 1
            if len(req.prompt_logprobs) <= p + 1 < len(prompt):  # not recorded yet
                targets[cu_q_lens[i] + j] = prompt[p + 1]
                any_wanted = True
    if not any_wanted:
        return None
    return PromptLogprobsInput(last_rows=logits_indices.copy(), targets=targets)

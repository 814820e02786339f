"""A host-only fake model over a simulated paged KV cache, for scheduler tests (no jax).

`FakePagedModel.run(step)` does what the real step does with the cache, on one int array of
`num_pages * page_size` slots: it writes every token id of the step at `step.slot_mapping`
(padded tokens land in the reserved page 0), then reads each sequence's tokens 0..kv_len-1 back
through its row of `step.page_indices` and returns, per sequence, `next_token(tokens)`: a hash of
the whole sequence read back. With LoRA adapters (`run`'s `lora_ids`) a token's slot holds
`lora_encoded` token (its id and the adapter that wrote it), so a prefix computed under another
adapter reads back wrong. A request's output therefore depends only on its own tokens *as
read through its pages*, so it is independent of the batch iff the paging is right, and it can be
recomputed from the prompt alone (`reference_generation`).

The model also asserts the layout contract of `StepInput` (see llmjax/model/step_input.py) that
the real attention relies on: positions, slots that agree with the page table, padding confined
to page 0, logits rows, empty padded sequences.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from llmjax.engine.batch import fill_pending
from llmjax.model.step_input import RESERVED_PAGE, StepInput

UNWRITTEN = -1  # slots never written, or poisoned after their page was freed
LORA_SHIFT = 32  # a slot holds token + (adapter id << LORA_SHIFT)


def lora_encoded(tokens, lora_id: int = 0) -> np.ndarray:
    """Tokens as a slot of the fake cache holds them when written under adapter `lora_id`."""
    return np.asarray(tokens, np.int64) + (np.int64(lora_id) << LORA_SHIFT)


def next_token(tokens: Sequence[int] | np.ndarray, vocab_size: int) -> int:
    """The fake model's greedy next token: a deterministic hash of the whole sequence."""
    return zlib.crc32(np.asarray(tokens, np.int64).tobytes()) % vocab_size


def reference_generation(
    prompt: Sequence[int],
    *,
    max_tokens: int,
    max_model_len: int,
    vocab_size: int,
    stop_token_ids: Iterable[int] = (),
    eos_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    lora_id: int = 0,
) -> tuple[list[int], str]:
    """What one request generates alone (under adapter `lora_id`, 0: the base model),
    recomputed from its prompt: (tokens, finish_reason).

    Stop conditions in the engine's order: a stop token or EOS ('stop'), then max_tokens, then
    max_model_len ('length')."""
    stop = set(stop_token_ids) | (set() if ignore_eos else set(eos_token_ids))
    seq, out = list(prompt), []
    while True:
        token = next_token(lora_encoded(seq, lora_id), vocab_size)
        seq.append(token)
        out.append(token)
        if token in stop:
            return out, "stop"
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return out, "length"


class FakePagedModel:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv = np.full(num_pages * page_size, UNWRITTEN, np.int64)
        self.reads: list[np.ndarray] = []  # per real sequence of the last step: tokens read back
        self.last_spec = None  # speculative decoding: the last step's (tokens, accepted)

    def poison(self, pages: Iterable[int]) -> None:
        """Mark `pages` (e.g. the free ones) unwritten, so a later read of them is caught."""
        ps = self.page_size
        for page in pages:
            self.kv[page * ps : (page + 1) * ps] = UNWRITTEN

    def run(self, step: StepInput, spec=None, lora_ids=None) -> np.ndarray:
        """One step: write the new tokens, read every sequence back, return [S] next token ids
        (padded sequence rows get 0). `spec` (a SpecInput, speculative decoding): sequence i's
        last `num_proposals[i]` tokens are proposals; each row j of it predicts from the tokens
        up to it, the proposals are accepted while they equal those predictions, and
        `last_spec` = (tokens [S, K + 1], accepted [S]) as the real verification returns them.
        `lora_ids` [T]: each token's adapter (0: none); its slot records it (`lora_encoded`)."""
        ps = self.page_size
        S = len(step.kv_lens)
        num_seqs = int(step.num_seqs[0])
        cu = np.asarray(step.cu_q_lens)
        slots = np.asarray(step.slot_mapping)
        num_tokens = int(cu[num_seqs])
        assert len(step.token_ids) == len(step.positions) == len(slots)
        assert cu.shape == (S + 1,) and cu[0] == 0 and (np.diff(cu) >= 0).all(), cu
        assert 1 <= num_seqs <= S and num_tokens <= len(slots)
        assert (cu[num_seqs:] == num_tokens).all(), f"padded sequences have queries: {cu}"
        assert (np.asarray(step.kv_lens)[num_seqs:] == 0).all()
        assert ((slots >= 0) & (slots < self.kv.size)).all(), "slot outside the cache"
        real, pad = slots[:num_tokens], slots[num_tokens:]
        assert (real // ps != RESERVED_PAGE).all(), f"a real token writes the reserved page: {real}"
        assert (pad // ps == RESERVED_PAGE).all(), f"a padded token writes a real page: {pad}"
        assert len(set(real.tolist())) == num_tokens, f"two tokens write one slot: {real}"

        written = np.asarray(step.token_ids, np.int64)
        if lora_ids is not None:
            written = written + (np.asarray(lora_ids, np.int64) << LORA_SHIFT)
        self.kv[slots] = written  # padding writes land in page 0

        next_ids = np.zeros(S, np.int32)
        K = 0 if spec is None else spec.proposals.shape[1]
        spec_tokens = np.zeros((S, K + 1), np.int32)
        accepted = np.zeros(S, np.int32)
        self.reads = []
        for i in range(num_seqs):
            lo, hi, kv_len = int(cu[i]), int(cu[i + 1]), int(step.kv_lens[i])
            assert 1 <= hi - lo <= kv_len, f"seq {i}: {hi - lo} new tokens, kv_len {kv_len}"
            pos = np.arange(kv_len)
            assert (step.positions[lo:hi] == pos[kv_len - (hi - lo) :]).all(), f"seq {i} positions"
            table = np.asarray(step.page_indices[i])
            used = -(-kv_len // ps)
            assert used <= len(table), f"seq {i}: kv_len {kv_len} needs {used} pages"
            assert (table[:used] != RESERVED_PAGE).all(), f"seq {i} reads the reserved page"
            seq_slots = table[pos // ps] * ps + pos % ps
            assert (slots[lo:hi] == seq_slots[kv_len - (hi - lo) :]).all(), (
                f"seq {i}: slot_mapping disagrees with its page table"
            )
            tokens = self.kv[seq_slots]
            self.reads.append(tokens)
            if spec is None:
                assert step.logits_indices[i] == hi - 1, f"seq {i}: logits row"
                next_ids[i] = next_token(tokens, self.vocab_size)
                continue
            k, first = int(spec.num_proposals[i]), int(spec.first_rows[i])
            assert 1 + k <= hi - lo, f"seq {i}: {k} proposals in {hi - lo} new tokens"
            rows = step.logits_indices[first : first + k + 1]
            assert (rows == np.arange(hi - k - 1, hi)).all(), f"seq {i}: logits rows {rows}"
            proposed = spec.proposals[i, :k]
            ids = tokens[kv_len - k :] & ((1 << LORA_SHIFT) - 1)  # without the adapter
            assert (proposed == ids).all(), f"seq {i}: proposals not its tokens"
            for j in range(k + 1):
                spec_tokens[i, j] = next_token(tokens[: kv_len - k + j], self.vocab_size)
                if j == k or spec_tokens[i, j] != proposed[j]:
                    accepted[i] = j
                    break
            next_ids[i] = spec_tokens[i, 0]
        self.last_spec = None if spec is None else (spec_tokens, accepted)
        return next_ids


class FakeRunner:
    """Stands in for `llmjax.engine.runner.ModelRunner` (the engine's only jax module): the fake
    paged model, plus page export / import of its slots (disaggregation)."""

    pipelined = False  # the pipeline path is covered by the scheduler tests' pipeline_depth
    ragged_page_tables = False  # page-count buckets, as with the jnp reference

    def __init__(self, config, params, num_pages: int, skew=None, devices=None):
        self.page_size = config.cache.page_size
        self.model = FakePagedModel(num_pages, self.page_size, config.model.vocab_size)
        self.num_compiles = 0

    num_in_flight = 0

    def run(self, step, sampling) -> np.ndarray:
        next_ids = self.model.run(step, sampling.spec)
        self.last_spec = self.model.last_spec
        return next_ids

    _last_ids = None  # the last launched step's ids (async scheduling's pending tokens)

    def launch(self, step, sampling, tag=None):
        """As ModelRunner.launch; the fake model runs at once (`collect` hands it back). Rows
        named by `sampling.token_rows` take the last launched step's ids, as on the device."""
        step = fill_pending(step, sampling.token_rows, self._last_ids)
        self._last_ids = self.run(step, sampling)
        return tag, self._last_ids

    @staticmethod
    def collect(launched):
        return launched

    def export_pages(self, pages) -> np.ndarray:
        return self.model.kv.reshape(-1, self.page_size)[np.asarray(pages, np.int64)].copy()

    def import_pages(self, pages, data) -> None:
        assert data.shape == (len(pages), self.page_size), data.shape
        self.model.kv.reshape(-1, self.page_size)[np.asarray(pages, np.int64)] = data

    # the KV tiers (llmjax/engine/kv_tiers.py): a page's slots as a [1, 1, n, page_size] block
    kv_dtype = np.dtype(np.int64)

    def transfer_shape(self, num_pages: int) -> tuple[int, ...]:
        return (1, 1, num_pages, self.page_size)

    def export_host_pages(self, pages) -> np.ndarray:
        return self.export_pages(pages)[None, None]

    def import_host_pages(self, pages, data) -> None:
        self.import_pages(pages, np.asarray(data)[0, 0])

    def precompile(self, shapes, progress=None) -> None:
        pass

    def compile_ahead(self, shapes) -> None:
        pass

    @staticmethod
    def annotate(name: str, **metadata):
        return contextlib.nullcontext()

    annotate_step = annotate

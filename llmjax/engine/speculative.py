"""Speculative decoding on the host: who speculates, what they propose, and what came of it.

The scheduler asks the `Speculator` for each decoding request's proposals
(`Scheduler._schedule_decodes`), charges them to the step's token budget and gives them pages if
free ones allow (a proposal never preempts); `batch.pack` lays the request's last token and its
proposals out as one short chunk and asks the step for logits at every one of its rows; the
device verifies them (`llmjax.model.sampler.verify_proposals`: greedy rows keep the proposals
equal to the argmax, sampled rows use rejection sampling) and `Scheduler.update` appends the
accepted proposals and the target's next token, rolling back the pages of rejected ones.

Methods (`SpeculativeConfig.method`):
  ngram  prompt lookup (`ngram_proposals`): the request's own prompt and output are searched for
         an earlier occurrence of its last n tokens, the longest n in [prompt_lookup_min,
         prompt_lookup_max] that occurs; the tokens that followed its latest occurrence are the
         proposals.
  draft  the target's first `num_draft_layers` layers, final norm and LM head (early exit,
         llmjax/model/draft.py): the scheduler reserves k proposals per decode, then the
         engine has the device draft them greedily, one pass per token over the same KV pages,
         before the step verifies them.

A request stops speculating for `acceptance_window` decode steps when fewer than
`min_acceptance_rate` of its last `acceptance_window` proposed tokens were accepted (free chat
rarely repeats its context, so its proposals mostly fail and would only cost verification rows).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from llmjax.config import SpeculativeConfig
from llmjax.engine.block_manager import pages_needed
from llmjax.engine.step import Step, StepFeature


@dataclasses.dataclass
class SpecState:
    """One request's speculation counters (`RequestMetrics.spec_decode`)."""

    num_drafts: int = 0  # steps in which it verified proposals
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_decode_steps: int = 0  # decode steps (with proposals or not)
    num_decode_tokens: int = 0  # tokens those steps gave it
    window_draft_tokens: int = 0  # since the window started
    window_accepted_tokens: int = 0
    off_steps: int = 0  # decode steps left with speculation off (acceptance was low)
    ngram: object = dataclasses.field(default=None, repr=False)  # NgramIndex (method ngram)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step gave (accepted proposals + the target's token), averaged
        over the steps that had proposals (vLLM's mean acceptance length)."""
        if not self.num_drafts:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    @property
    def tokens_per_decode_step(self) -> float | None:
        """Generated tokens per decode step: the request's speedup in steps over decoding one
        token a step (1.0 without speculation)."""
        if not self.num_decode_steps:
            return None
        return self.num_decode_tokens / self.num_decode_steps


def ngram_proposals(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: for n from `max_n` down to `min_n`, the latest earlier occurrence of the
    last n tokens; the (up to) k tokens after it, or [] if none of them occurs."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = t[L - n :]
        # windows starting at 0 .. L - n - 1 (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return t[start : start + k].tolist()
    return []


PRIOR_TOKENS = 8  # proposals' worth of weight the pooled acceptance has in a request's
# Proposals are verified only if that is predicted to raise the step's tokens per second by this
# factor: the acceptance estimates are optimistic for requests about to diverge, and near
# break-even the host's work per proposal decides (measured on free chat at batch 8 on a CPU).
SELECT_MARGIN = 1.1


class StepCost:
    """What a decode-only step costs, measured: seconds per padded token count T (an
    exponential moving average per T seen), predicted for an unseen T by a least-squares line
    through the seen ones (`fitted` once there are two); the seconds of a draft (method
    'draft'), and the acceptance rate pooled over requests (a moving average)."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.seconds: dict[int, float] = {}
        self.draft_s = 0.0
        self.acceptance = 0.5  # before any verification
        self.explore = False

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else (
            self.decay * old + (1 - self.decay) * seconds
        )  # fmt: skip

    def observe_draft(self, seconds: float) -> None:
        self.draft_s = seconds if not self.draft_s else (
            self.decay * self.draft_s + (1 - self.decay) * seconds
        )  # fmt: skip

    def observe_acceptance(self, rate: float) -> None:
        self.acceptance = 0.95 * self.acceptance + 0.05 * rate

    @property
    def fitted(self) -> bool:
        return len(self.seconds) >= 2

    def predict(self, num_tokens: int) -> float:
        if num_tokens in self.seconds:
            return self.seconds[num_tokens]
        t = np.array(list(self.seconds), np.float64)
        y = np.array(list(self.seconds.values()), np.float64)
        slope, intercept = np.polyfit(t, y, 1)
        floor = min(y)  # a step never costs less than the cheapest one seen
        return max(float(intercept + slope * num_tokens), floor)


class Speculator:
    """Proposals for decoding requests, and the auto-off rule (module doc). Subclasses say how
    a request's next tokens are proposed (`_propose`)."""

    # The proposals are placeholders that the device drafts after scheduling (LLMEngine._draft)
    drafts_on_device = False

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.cost = StepCost()

    @staticmethod
    def eligible(req) -> bool:
        """Whether `req` may speculate at all: not with logits processing, logprobs or
        structured outputs (their sampler works one row per request)."""
        params = req.sampling_params
        return not (
            params.processes_logits or params.logprobs is not None or req.matcher is not None
        )

    def propose(self, req, max_k: int) -> list[int]:
        """Up to `max_k` proposals for `req`'s next tokens ([] while it is off)."""
        state = _state(req)
        if state.off_steps > 0 or max_k <= 0 or not self.eligible(req):
            return []
        return self._propose(req, min(max_k, self.config.num_speculative_tokens))

    def _propose(self, req, k: int) -> list[int]:
        raise NotImplementedError

    # ---- which proposals a step verifies ------------------------------------------------------

    token_bucket = staticmethod(lambda n: n)  # the step's padded token count (the engine's)

    def observe(self, num_tokens: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A decode-only step of `num_tokens` padded tokens took `seconds` (the whole step,
        host work included), plus `draft_seconds` drafting (method 'draft')."""
        self.cost.observe(num_tokens, seconds)
        if draft_seconds:
            self.cost.observe_draft(draft_seconds)

    def acceptance(self, req) -> float:
        """`req`'s estimated chance that a proposal is accepted: its own accepted / proposed,
        shrunk towards every request's (`PRIOR_TOKENS` proposals' worth)."""
        state = _state(req)
        prior = self.cost.acceptance
        return (state.num_accepted_tokens + PRIOR_TOKENS * prior) / (
            state.num_draft_tokens + PRIOR_TOKENS
        )

    def select(
        self, offers: list[tuple[object, list[int]]], num_tokens: int, num_decodes: int
    ) -> list[int]:
        """How many of each offered request's proposals to verify this step, for a step that
        has `num_tokens` tokens, `num_decodes` of them decodes, without them. Not `adaptive`:
        all. Adaptive: the choice that
        maximizes expected tokens per second, under the measured step cost (`StepCost`) of the
        padded token count and each request's estimated acceptance a (k proposals give
        a + a^2 + ... + a^k tokens more, if each is accepted with chance a after the ones
        before): the requests most likely accepted first, each with at most c proposals, over
        every count of requests and every cap c, if it beats verifying nothing by
        `SELECT_MARGIN`. Until the cost is known at two sizes the steps alternate between
        verifying everything and nothing (exploration)."""
        counts = [len(p) for _, p in offers]
        if not self.config.adaptive:
            return counts
        cost = self.cost
        if not cost.fitted:
            cost.explore = not cost.explore
            return counts if cost.explore else [0] * len(counts)
        alphas = [min(self.acceptance(req), 0.999) for req, _ in offers]
        order = sorted(range(len(offers)), key=lambda i: -alphas[i])
        plain = cost.predict(self.token_bucket(num_tokens))
        best, best_rate = [0] * len(offers), SELECT_MARGIN * num_decodes / plain
        for cap in range(1, max(counts) + 1):
            gain, extra, chosen = 0.0, 0, []
            for i in order:
                k = min(counts[i], cap)
                a = alphas[i]
                gain += a * (1 - a**k) / (1 - a)
                extra += k
                chosen.append((i, k))
                seconds = cost.predict(self.token_bucket(num_tokens + extra)) + cost.draft_s
                rate = (num_decodes + gain) / seconds
                if rate > best_rate:
                    best_rate, best = rate, [0] * len(offers)
                    for j, kj in chosen:
                        best[j] = kj
        return best

    def record(self, req, num_proposed: int, num_accepted: int, num_tokens: int) -> None:
        """One decode step of `req`: it proposed `num_proposed` tokens, `num_accepted` of them
        were accepted, and it gained `num_tokens` tokens."""
        if num_proposed:
            self.cost.observe_acceptance(num_accepted / num_proposed)
        state = _state(req)
        state.num_decode_steps += 1
        state.num_decode_tokens += num_tokens
        if state.off_steps > 0:
            state.off_steps -= 1
        if not num_proposed:
            return
        cfg = self.config
        state.num_drafts += 1
        state.num_draft_tokens += num_proposed
        state.num_accepted_tokens += num_accepted
        state.window_draft_tokens += num_proposed
        state.window_accepted_tokens += num_accepted
        if state.window_draft_tokens >= cfg.acceptance_window:
            rate = state.window_accepted_tokens / state.window_draft_tokens
            if rate < cfg.min_acceptance_rate:
                state.off_steps = cfg.acceptance_window
            state.window_draft_tokens = state.window_accepted_tokens = 0


class NgramIndex:
    """`ngram_proposals` kept up to date as a request's tokens grow: for every n in [min_n,
    max_n], the end of each n-gram's latest occurrence that ends before the last token, so a
    lookup is one dict probe per n (a request's tokens only ever grow; preemption keeps them)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in

    def propose(self, req, k: int) -> list[int]:
        L = req.num_tokens
        if L < 2 or k <= 0:
            return []
        lo = max(0, self.indexed - self.max_n + 1)
        window = req.token_ids_slice(lo, L)  # the new n-grams' tokens, and the suffix
        for end in range(self.indexed, L - 1):  # n-grams ending at end (<= L - 2)
            at = end - lo
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(window[at - n + 1 : at + 1])] = end
        self.indexed = max(self.indexed, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(window[len(window) - n :]))
            if end is not None:
                return req.token_ids_slice(end + 1, min(end + 1 + k, L))
        return []


class NgramSpeculator(Speculator):
    """Prompt lookup (`ngram_proposals`) over the request's own tokens, on the host, through an
    incremental index per request (`NgramIndex`)."""

    def _propose(self, req, k: int) -> list[int]:
        state = _state(req)
        if state.ngram is None:
            state.ngram = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return state.ngram.propose(req, k)


DRAFT_PLACEHOLDER = -1  # a proposal the device drafts after scheduling


class DraftSpeculator(Speculator):
    """The early-exit draft (llmjax/model/draft.py): the scheduler reserves k proposals (budget
    and pages) as placeholders; the engine has the device draft them before the step."""

    drafts_on_device = True

    def _propose(self, req, k: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * k


def make_speculator(config: SpeculativeConfig) -> Speculator:
    """The speculator for `config.method`."""
    kinds = {"ngram": NgramSpeculator, "draft": DraftSpeculator}
    if config.method not in kinds:
        raise ValueError(f"no speculator for method {config.method!r}")
    return kinds[config.method](config)


def _state(req) -> SpecState:
    state = req.metrics.spec_decode
    if state is None:
        state = req.metrics.spec_decode = SpecState()
    return state


class SpeculationStep(StepFeature):
    """Speculative decoding's part of the engine step (a `StepFeature`; `engine` gives the
    scheduler, runner, block manager, buckets and stats).

    - `scheduled`: a step that computes prompt logprobs cannot verify, so its proposals are
      dropped; the early-exit draft (method 'draft') then fills in the proposals the scheduler
      reserved, on the device, before the step is packed.
    - `collect`: each verifying sequence's new tokens (its accepted proposals and the target's
      token) replace its entry in `step.new_tokens`; every decode's outcome goes to its
      request's counters and the engine's.
    - `update`: a step of decodes only that compiled nothing tells the speculator what a step
      of its size costs (wall time, host work included), to size the next proposals."""

    def __init__(self, engine):
        self.engine = engine
        self.speculator = engine.speculator

    def scheduled(self, step: Step) -> None:
        batch, engine = step.batch, self.engine
        if not batch:
            return
        step.compiles = engine._compile_counts()
        if batch.num_spec_tokens and any(map(_blocks_speculation, batch.seqs)):
            engine.scheduler.drop_speculation(batch)
        if batch.num_spec_tokens and self.speculator.drafts_on_device:
            with engine.runner.annotate("llmjax.draft"):
                t = time.perf_counter()
                self._draft(batch)
                step.draft_s = time.perf_counter() - t

    def _draft(self, batch) -> None:
        """The device drafts the proposals the scheduler reserved; they replace the
        placeholders."""
        engine = self.engine
        seqs = [s for s in batch.seqs if s.spec]
        bm = engine.block_manager
        ps = bm.page_size
        max_pages = max(pages_needed(s.start + s.num_new_tokens, ps) for s in seqs)
        _, S, P = engine.buckets.shape_for(len(seqs), len(seqs), max_pages)
        tokens, positions, num = (np.zeros(S, np.int32) for _ in range(3))
        pages = np.zeros((bm.num_groups, S, P), np.int32)  # every group's tables (hybrid KV)
        for i, seq in enumerate(seqs):
            used = pages_needed(seq.start + seq.num_new_tokens, ps)
            tokens[i] = seq.request.token_ids_slice(seq.start, seq.start + 1)[0]
            positions[i] = seq.start
            for g, table in enumerate(bm.tables_of(seq.request.request_id)):
                pages[g, i, :used] = table[:used]
            num[i] = len(seq.spec)
        proposals = engine.runner.draft(
            tokens, positions, pages if bm.groups is not None else pages[0], num
        )
        for i, seq in enumerate(seqs):
            seq.spec = tuple(int(t) for t in proposals[i, : num[i]])

    def collect(self, step: Step) -> None:
        result = self.engine.runner.last_spec
        stats = self.engine.stats
        for i, seq in enumerate(step.batch.seqs):
            if not (seq.is_decode or seq.spec) or seq.request.status.is_done:
                continue
            k = len(seq.spec)
            accepted = 0
            if k:
                tokens, num_accepted = result
                accepted = int(num_accepted[i])
                step.new_tokens[i] = tokens[i, : accepted + 1].tolist()
                stats.num_spec_drafts += 1
                stats.num_spec_draft_tokens += k
                stats.num_spec_accepted_tokens += accepted
            self.speculator.record(seq.request, k, accepted, accepted + 1)

    def update(self, step: Step) -> None:
        if all(s.is_decode for s in step.batch.seqs) and (
            self.engine._compile_counts() == step.compiles
        ):
            seconds = time.perf_counter() - step.t_start - step.draft_s
            self.speculator.observe(len(step.step_input.token_ids), seconds, step.draft_s)


def _blocks_speculation(seq) -> bool:
    """Whether a step holding `seq` cannot verify proposals: it computes prompt logprobs (that
    step returns logits for every token row). Rows with logits processing, logprobs or
    structured outputs share a step with verifications (their sampler takes each sequence's
    first logits row)."""
    return seq.request.sampling_params.prompt_logprobs is not None and not seq.is_decode

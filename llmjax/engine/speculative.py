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

import numpy as np

from llmjax.config import SpeculativeConfig


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


class Speculator:
    """Proposals for decoding requests, and the auto-off rule (module doc). Subclasses say how
    a request's next tokens are proposed (`_propose`)."""

    # The proposals are placeholders that the device drafts after scheduling (LLMEngine._draft)
    drafts_on_device = False

    def __init__(self, config: SpeculativeConfig):
        self.config = config

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

    def record(self, req, num_proposed: int, num_accepted: int, num_tokens: int) -> None:
        """One decode step of `req`: it proposed `num_proposed` tokens, `num_accepted` of them
        were accepted, and it gained `num_tokens` tokens."""
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


class NgramSpeculator(Speculator):
    """Prompt lookup (`ngram_proposals`) over the request's own tokens, on the host."""

    def _propose(self, req, k: int) -> list[int]:
        cfg = self.config
        tokens = req.token_ids_slice(0, req.num_tokens)
        return ngram_proposals(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)


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

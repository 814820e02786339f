"""Speculative decoding (`SpeculativeConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llmjax.config.checks import _check_positive

SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`, names as vLLM spells them;
    llmjax/engine/speculative.py, docs/speculative.md).

    `method`:
      none    off (the default).
      ngram   prompt lookup: the proposals are the tokens that followed the latest earlier
              occurrence of the request's last n tokens in its own prompt and output, for the
              longest n in [`prompt_lookup_min`, `prompt_lookup_max`] that occurs (host only).
      draft   the target's own first `num_draft_layers` layers, its final norm and its LM head
              (early exit: no second checkpoint) propose greedily, one token per draft pass
              over the same KV pages (those layers' KV of the context is the target's); with
              all the layers the draft is the target (every proposal accepted: a check).
    Each decoding request proposes up to `num_speculative_tokens` (k) tokens; one step verifies
    them and samples one more (k + 1 rows of the request, like a short prefill chunk), so a
    request gains up to k + 1 tokens a step. Greedy rows keep the leading proposals equal to the
    target's argmax, so greedy output is the same as without speculation; sampled rows use
    rejection sampling (accept a proposal x with probability p(x), else sample p without x,
    renormalized: the target distribution, exactly, for point-mass proposals). The token
    budget counts the proposals; they never preempt (a request speculates only as far as the
    free pages and the budget left allow), and pages of rejected proposals are given back.
    A request stops speculating for `acceptance_window` decode steps when fewer than
    `min_acceptance_rate` of its last `acceptance_window` proposed tokens were accepted (then it
    tries again), and nobody speculates while more than `disable_by_batch_size` requests run
    (None: no bound; vLLM's). `adaptive`: each step verifies the proposals worth their cost:
    the engine measures what decode steps cost per (padded) token count and estimates each
    request's acceptance, and keeps the proposals that maximize expected tokens per second
    (the likeliest requests first, capped per request; `Speculator.select`); off: every
    proposal is verified. Requests with logits processing, logprobs or structured outputs
    decode one token a step beside the others' verifications; a step that computes prompt
    logprobs verifies nothing.
    """

    method: str = "none"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_draft_layers: int = 4
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 32
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose one of {SPECULATIVE_METHODS}"
            )
        _check_positive(
            self,
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "num_draft_layers",
            "acceptance_window",
            "disable_by_batch_size",
        )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"{self.min_acceptance_rate=} must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @classmethod
    def coerce(cls, value) -> SpeculativeConfig:
        """A SpeculativeConfig from itself, None (off) or vLLM's dict
        (`{"method": "ngram", "num_speculative_tokens": 4, ...}`), naming unknown keys."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict or SpeculativeConfig: {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**value)

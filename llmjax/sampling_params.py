"""`SamplingParams`: how one request is decoded. Plain Python, validated on construction."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding options of one request (names as in vLLM).

    max_tokens: new tokens to generate at most.
    temperature: 0 decodes greedily; > 0 samples from softmax(logits / temperature).
    top_k: sample among the k most likely tokens (0 = all).
    top_p: sample among the smallest set of tokens whose probability reaches top_p (1 = all).
    seed: makes sampling reproducible whatever the request is batched with (None = engine-chosen).
    stop_token_ids: extra token ids that end the request (the model's EOS ids always do, unless
        ignore_eos).
    ignore_eos: keep generating past EOS until max_tokens.
    stop: strings that end the request when the generated text contains one (a str or a list);
        the text ends before it (with it if include_stop_str_in_output); the token ids end with
        the token that completed it. Needs a tokenizer.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list | set):
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(t, str) or not t for t in self.stop):
            raise ValueError(f"stop must be non-empty strings, got stop={self.stop!r}")
        if isinstance(self.stop_token_ids, list | set):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be an integer >= 1, got max_tokens={self.max_tokens!r}"
            )
        if not self.temperature >= 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got temperature={self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 disables), got top_k={self.top_k!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got seed={self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

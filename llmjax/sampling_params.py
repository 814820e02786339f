"""`SamplingParams`: how one request is decoded. Plain Python, validated on construction."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained request's output must be (vLLM's `StructuredOutputsParams`): exactly
    one of `json` (a JSON schema, a dict or its JSON text), `regex`, `choice` (one of these
    strings), `grammar` (a Lark-style context-free grammar, llguidance's dialect) or
    `json_object` (any JSON object). Enforced token by token with llguidance (the `structured`
    extra): a mask of the tokens the grammar allows is applied to the logits before sampling."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON without optional whitespace (vLLM's option)

    def __post_init__(self):
        import json as json_module

        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json_module.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"structured_outputs.choice must be non-empty strings: {choice!r}")
            object.__setattr__(self, "choice", choice)
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        names = ("json", "regex", "choice", "grammar")
        return next(n for n in names if getattr(self, n) is not None)


MAX_LOGIT_BIAS = 512  # entries of logit_bias (OpenAI allows 300)


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

    Logits processing, as vLLM defines it, in this order before sampling (each row on its own,
    so a request's tokens never depend on its batch):
    logit_bias: {token id: bias} added to the logits (OpenAI's range [-100, 100]).
    min_tokens: until this many tokens are generated, EOS (unless ignore_eos) and the
        stop_token_ids cannot be sampled.
    repetition_penalty: > 0; a token already in the prompt or the output has its logit divided
        by it if positive, multiplied if not (1 = off).
    frequency_penalty, presence_penalty: in [-2, 2]; subtracted from a token's logit once per
        time it was generated, and once if it was generated at all (0 = off).
    min_p: in [0, 1]; after temperature, tokens whose probability is below min_p x the most
        likely token's are dropped (0 = off).
    Greedy decoding (temperature 0) takes the argmax after logit_bias, min_tokens and the
    penalties.

    Outputs:
    logprobs: None, or the number (0-20) of most likely tokens whose log probabilities come
        with each generated token, beside the sampled token's own (log-softmax of the model's
        raw logits, before any processing, as vLLM's default).
    prompt_logprobs: the same for each prompt token after the first (given the ones before
        it); such a request computes its whole prompt (no prefix-cache hit), as in vLLM.
    structured_outputs: a `StructuredOutputsParams` (or a dict of its fields): the output
        follows a JSON schema, a regex, a choice or a grammar (llguidance's token mask, applied
        to the logits before everything else; the request stops when the grammar is complete).
    n: samples to generate from the prompt (each its own seed stream: seed + i with a seed);
        they share the prompt's KV pages through the prefix cache.
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
        self._check_processing()

    def _check_processing(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got n={self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {name}={value!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty=}".replace(
                    "self.", ""
                )
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got min_p={self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                f"min_tokens={self.min_tokens!r}"
            )
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
        elif bias is None:
            bias = ()
        else:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        for token, value in bias:
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {value}"
                )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(
                self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs)
            )
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                f"got {type(self.structured_outputs).__name__}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got "
                    f"{name}={value!r}"
                )

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processing (bias, min_tokens, penalties, min_p, structured
        outputs) is on."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.has_penalties
            or self.min_p > 0
            or self.structured_outputs is not None
        )

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

"""Structured outputs' grammars (`SamplingParams.structured_outputs`) with llguidance (the
`structured` extra): a grammar per request, a token bitmask per step. (The step feature that
uses them is structured.py's `StructuredStep`; a request advances its matcher here.)

    outputs = StructuredOutputs(tokenizer, vocab_size, eos_token_ids)
    matcher = outputs.matcher(params.structured_outputs)    # InvalidRequest if it is no grammar
    mask = outputs.bitmask([(row, matcher), ...], S)         # [S, ceil(V / 32)] int32
    outputs.advance(matcher, token)                          # after the token is appended

A JSON schema, a regex, a list of choices or a Lark grammar becomes an llguidance grammar; its
`LLMatcher` follows the request's tokens and, before each sampling step, fills the request's
row of the bitmask: bit t of row s set if token t may come next (rows without a grammar allow
everything). The engine computes the mask while the device runs the step's forward (JAX
dispatches asynchronously) and the sampler applies it before any other processing
(llmjax/model/sampler.py). Host only: no jax.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np

logger = logging.getLogger(__name__)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "structured outputs need llguidance: pip install 'llmjax[structured]' "
            "(or llguidance==1.9.1)"
        ) from e
    return llguidance


def grammar_of(spec) -> str:
    """The llguidance grammar of a `StructuredOutputsParams`."""
    m = _llguidance().LLMatcher
    kind = spec.kind
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if kind == "json":
        return m.grammar_from_json_schema(spec.json, defaults=options)
    if kind == "json_object":
        return m.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=options)
    if kind == "regex":
        return m.grammar_from_regex(spec.regex)
    if kind == "choice":
        return m.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    return m.grammar_from_lark(spec.grammar)


class StructuredOutputs:
    """llguidance over one engine's tokenizer (the module doc). `tokenizer`: llmjax's (its
    `tokenizers` backend is what llguidance reads); built on first use (about 0.2 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self.words = (vocab_size + 31) // 32

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            llg = _llguidance()
            self._ll_tokenizer = llg.LLTokenizer(
                self.tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids or None,
            )
        return self._ll_tokenizer

    def check(self, spec) -> None:
        """ValueError naming the grammar's problem, if `spec` is not a valid grammar."""
        self.matcher(spec)

    def matcher(self, spec):
        """A fresh matcher for `spec`; ValueError with llguidance's message if it is invalid."""
        llg = _llguidance()
        try:
            grammar = grammar_of(spec)
        except Exception as e:  # llguidance's compilers raise on bad schemas and regexes
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {e}") from None
        m = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid structured_outputs.{spec.kind}: {m.get_error()}")
        return m

    def bitmask(self, rows, num_rows: int) -> np.ndarray:
        """[num_rows, words] int32: every row allows everything but the `rows` ((row index,
        matcher) pairs), each the tokens its matcher allows next."""
        from llguidance.numpy import fill_next_token_bitmask

        mask = np.full((num_rows, self.words), -1, np.int32)
        for i, m in rows:
            fill_next_token_bitmask(m, mask, i)
        return mask

    @staticmethod
    def advance(matcher, token: int) -> str | None:
        """Feed the sampled token; None, or why the request must end: 'stop' (the grammar is
        complete) or an error message (the token was not allowed: never, with the mask)."""
        if not matcher.consume_token(int(token)):
            return f"structured outputs: token {token} broke the grammar ({matcher.get_error()})"
        if matcher.is_stopped():
            return "stop"
        return None

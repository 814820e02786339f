"""`IncrementalDetokenizer`: turns a stream of generated ids into printable text pieces;
`StopStringMatcher`: finds the first stop string in a request's generated text as it grows;
`TextStream`: a request's growing outputs -> the text pieces to show (LLM.stream, the server).

No jax here: the engine's host side uses this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmjax.tokenizer.tokenizer import Tokenizer

# Generated tokens decoded together with the last few prompt tokens, so a leading space survives.
_PROMPT_CONTEXT_LEN = 6


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into newly printable text.

    Text is decoded over a small window of recent ids and held back while it ends in U+FFFD (a
    UTF-8 character split across byte-level tokens) or in a run of sentencepiece byte tokens
    (<0xNN>), so no piece ends in a partial character. The pieces from `add`, followed by
    `finish()`, concatenate to `tokenizer.decode(generated_ids)`. With
    `prompt_ids`, the last few prompt tokens are decoded along with the first generated ones, so
    decoders that strip a leading space (sentencepiece) keep the space a continuation starts with.

        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        for token_id in generated: print(detok.add(token_id), end="")
        print(detok.finish())
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or [])[-_PROMPT_CONTEXT_LEN:]
        if self._decode(context).endswith("\ufffd"):
            context = []  # a prompt ending mid-character: decode the continuation on its own
        self._ids = context  # the window: ids[:_read] were already turned into text
        self._read = len(context)
        self._read_text = self._decode(context)
        self.token_ids: list[int] = []
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _emit(self, text: str) -> str:
        if text.startswith(self._read_text):
            piece = text[len(self._read_text) :]
        else:  # not seen with byte-level or sentencepiece decoders; keep going without crashing
            pairs = zip(text, self._read_text, strict=False)
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(self._read_text))
            piece = text[same:]
        # Slide the window: the ids just read become the context for the next ones.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        self.text += piece
        return piece

    def add(self, token_id: int) -> str:
        """Appends one generated id; returns the text it completes ('' while a character is split
        across tokens, or for a skipped special token)."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        if self._in_byte_run():
            return ""
        text = self._decode(self._ids)
        if len(text) > len(self._read_text) and not text.endswith("\ufffd"):
            return self._emit(text)
        return ""

    def _in_byte_run(self) -> bool:
        """Whether the last id that decodes to text is a byte-fallback token."""
        byte_ids = self._tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        skipped = self._tokenizer.special_ids if self._skip else frozenset()
        last = next((i for i in reversed(self._ids) if i not in skipped), None)
        return last in byte_ids

    def finish(self) -> str:
        """Returns the held-back text (e.g. a trailing incomplete character, as U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        return self._emit(self._decode(self._ids))


class StopStringMatcher:
    """Watches a request's generated text for stop strings (`SamplingParams.stop`).

    `add(token_id)` returns True once the text decoded so far (the same text as
    `tokenizer.decode(generated_ids)`, held back only inside a split character) contains a stop
    string; `text_end` is then where the request's text ends: before the earliest match, or after
    it with `include_stop_str`. Only the tail that a new piece can complete is searched.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], include_stop_str: bool = False):
        if not stop:
            raise ValueError("StopStringMatcher needs at least one stop string")
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._longest = max(len(s) for s in self._stop)
        self._include = include_stop_str
        self.matched: str | None = None
        self.text_end: int | None = None

    def add(self, token_id: int) -> bool:
        if self.matched is not None:
            return True
        old = len(self._detok.text)
        if not self._detok.add(token_id):
            return False
        text = self._detok.text
        lo = max(0, old - self._longest + 1)  # a match must end in the new piece
        hits = [(i, s) for s in self._stop if (i := text.find(s, lo)) >= 0]
        if not hits:
            return False
        index, self.matched = min(hits, key=lambda h: (h[0], -len(h[1])))
        self.text_end = index + len(self.matched) if self._include else index
        return True


class TextStream:
    """The text of one request as its outputs arrive, in pieces that join to its final text.

    `update(token_ids, finished, text)` takes the request's cumulative generated ids (as in each
    `RequestOutput`; outputs may be skipped, e.g. when a slow reader merges several steps) and
    returns the text that is new since the last call. With stop strings, the last
    len(longest) - 1 characters are held back until they cannot be the start of one, and the
    final call returns the rest of the engine's `text` (cut at the stop string), so the pieces
    always join to `RequestOutput.text`.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._cut = bool(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._num_seen = 0
        self._num_emitted = 0  # characters returned so far

    def update(self, token_ids: Sequence[int], finished: bool = False, text: str = "") -> str:
        for token_id in token_ids[self._num_seen :]:
            self._detok.add(token_id)
        self._num_seen = len(token_ids)
        if finished:  # the final text: cut at a stop string, held-back bytes in
            self._detok.finish()
            final = text if self._cut else self._detok.text
            piece = final[self._num_emitted :]
            self._num_emitted = len(final)
            return piece
        safe = len(self._detok.text) - self._hold
        if safe <= self._num_emitted:
            return ""
        piece = self._detok.text[self._num_emitted : safe]
        self._num_emitted = safe
        return piece

"""Prompts of semantic functions as token ids.

A task's prompt is its function's pieces up to its output, each tokenized on its own and
concatenated: literal text, each input's text, each earlier output's text. Piece by piece, the
tokens of a template's literal prefix (and of a shared variable) are the same in every call, so
calls that share them share KV pages in the radix cache; the reference runner
(`llmjax.program.reference`) renders with the same code, so both see the same tokens.

Only the first piece may get the tokenizer's BOS. A chat function (`chat=True`) is framed by the
model's chat template: the frame's text around a system and a user message is found once per
tokenizer by rendering sentinel messages, and the pieces go between.
"""

from __future__ import annotations

from llmjax.program.function import Piece, SemanticFunction
from llmjax.program.graph import Task

_SYSTEM, _USER = "\x00llmjax-system\x00", "\x00llmjax-user\x00"


class Renderer:
    """Token ids of tasks' prompts with `tokenizer` (anything with encode(text,
    add_special_tokens) and decode(ids)); caches the tokens of literal text and variables."""

    def __init__(self, tokenizer):
        if tokenizer is None:
            raise ValueError("semantic functions need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self._text: dict[tuple[str, bool], list[int]] = {}
        self._frames: dict[bool, tuple[str, ...]] = {}

    def encode(self, text: str, first: bool) -> list[int]:
        key = (text, first)
        ids = self._text.get(key)
        if ids is None:
            ids = self._text[key] = list(self.tokenizer.encode(text, add_special_tokens=first))
            if len(self._text) > 65536:  # a bound for long-running servers
                self._text.clear()
        return ids

    def check(self, fn: SemanticFunction) -> None:
        """Raise ValueError if `fn` cannot be rendered with this tokenizer (a chat function
        for a model without a chat template, or one whose template rewrites the messages)."""
        if fn.chat:
            self.frame(fn.system is not None, fn.name)

    def frame(self, has_system: bool, function: str = "?") -> tuple[str, ...]:
        """The chat template's text around the messages: (head, tail) or, with a system
        message, (head, between, tail)."""
        frame = self._frames.get(has_system)
        if frame is not None:
            return frame
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"semantic function {function!r} is chat=True but the model has no chat template"
            )
        messages = [{"role": "user", "content": _USER}]
        if has_system:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        marks = [_SYSTEM, _USER] if has_system else [_USER]
        parts, rest = [], text
        for mark in marks:
            if rest.count(mark) != 1:
                raise ValueError(
                    f"semantic function {function!r}: the model's chat template does not keep "
                    "a message's content verbatim; use chat=False and write the frame yourself"
                )
            head, rest = rest.split(mark)
            parts.append(head)
        parts.append(rest)
        frame = self._frames[has_system] = tuple(parts)
        return frame

    def pieces(self, fn: SemanticFunction, index: int) -> list[Piece]:
        """Task `index`'s prompt as pieces (chat frame included), up to its output."""
        body: list[Piece] = []
        seen = 0
        for p in fn.pieces:
            if p.kind == "output":
                if seen == index:
                    break
                seen += 1
            body.append(p)
        if not fn.chat:
            return body
        frame = self.frame(fn.system is not None, fn.name)
        if fn.system is None:
            return [Piece("text", frame[0]), *body, Piece("text", frame[1])]
        return [
            Piece("text", frame[0]),
            *fn.system_pieces,
            Piece("text", frame[1]),
            *body,
            Piece("text", frame[2]),
        ]

    def prompt_ids(self, fn: SemanticFunction, index: int, values: dict[str, str]) -> list[int]:
        """Token ids of output `index`'s prompt, `values` giving each input's and earlier
        output's text by placeholder name."""
        ids: list[int] = []
        first = not fn.chat  # a chat frame writes its own special tokens
        for p in self.pieces(fn, index):
            text = p.value if p.kind == "text" else values[p.value]
            if not text:
                continue
            ids += self.encode(text, first)
            first = False
        return ids

    def task_prompt_ids(self, task: Task) -> list[int]:
        call = task.call
        values = {name: task.app.vars[vid].content for name, vid in call.inputs.items()}
        for name, vid in call.outputs.items():
            var = task.app.vars[vid]
            if var.content is not None:
                values[name] = var.content
        return self.prompt_ids(task.function, task.index, values)

    def output_text(self, out, engine_decodes: bool) -> str:
        """A task's value: its output's text, as the engine cut it at a stop string when the
        engine has a tokenizer (`engine_decodes`), else decoded here."""
        return out.text if engine_decodes else self.tokenizer.decode(out.token_ids)

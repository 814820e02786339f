"""Semantic functions: prompt templates whose placeholders are Semantic Variables (Parrot,
OSDI'24; ALGORITHMS.md §9.1).

    @semantic_function
    def summarize(chunk: Input, summary: Output(max_tokens=48, stop=["\\n\\n"])):
        '''Summarize this passage in one sentence.

        {{chunk}}

        Summary:{{summary}}'''

    # the same, without a decorator
    summarize = SemanticFunction("summarize", "...{{chunk}}...Summary:{{summary}}",
                                 outputs={"summary": SamplingParams(max_tokens=48)})

A template is text with `{{name}}` placeholders. An *input* is filled with its variable's text;
an *output* is generated: the model reads everything before it (earlier outputs included, as
generated) and writes it with that output's `SamplingParams`, until a stop condition. Outputs
are generated in template order, each one request to the engine.

With `chat=True` the template is the user's message (and `system`, a template too, the system
message), rendered with the model's own chat template; such a function has one output, at the
end of its template.

Checked when declared (each error names the function and the placeholder): placeholders are
identifiers; every declared input and output appears; an output appears once, after some text
or input; nothing but whitespace follows the last output.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence

from llmjax.sampling_params import SamplingParams

PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")


class TemplateError(ValueError):
    """A template that cannot be a semantic function; names the function and the placeholder."""

    def __init__(self, function: str, message: str, placeholder: str | None = None):
        where = f"semantic function {function!r}"
        if placeholder is not None:
            where += f", placeholder {{{{{placeholder}}}}}"
        super().__init__(f"{where}: {message}")
        self.function, self.placeholder = function, placeholder


class Input:
    """Marks a parameter of a `@semantic_function` as an input placeholder."""


class Output:
    """Marks a parameter of a `@semantic_function` as an output placeholder, generated with
    `sampling_params` (or SamplingParams(**kwargs))."""

    def __init__(self, sampling_params: SamplingParams | None = None, **kwargs):
        if sampling_params is not None and kwargs:
            raise ValueError("Output: give a SamplingParams or its keyword arguments, not both")
        self.sampling_params = sampling_params or SamplingParams(**kwargs)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One part of a template: 'text' (literal), 'input' or 'output' (a placeholder's name)."""

    kind: str
    value: str


def parse_template(function: str, template: str) -> tuple[Piece, ...]:
    """Split `template` into pieces (text and placeholders, in order; empty text dropped)."""
    pieces, pos = [], 0
    for m in PLACEHOLDER.finditer(template):
        name = m.group(1)
        if not name.isidentifier():
            raise TemplateError(function, "a placeholder's name must be an identifier", name)
        if m.start() > pos:
            pieces.append(Piece("text", template[pos : m.start()]))
        pieces.append(Piece("placeholder", name))
        pos = m.end()
    if pos < len(template):
        pieces.append(Piece("text", template[pos:]))
    for p in pieces:
        if p.kind == "text" and ("{{" in p.value or "}}" in p.value):
            bad = p.value[max(0, p.value.find("{{")) :][:20]
            raise TemplateError(function, f"unbalanced braces near {bad!r}")
    return tuple(pieces)


class SemanticFunction:
    """A prompt template with typed placeholders (the module doc). Calling it inside a
    `Program` records a call and returns its output variable (a tuple of them, in template
    order, when it has several); inputs are `SemanticVariable`s or plain strings (constants).

    name: names the function in errors and in the server's JSON.
    template: the prompt (with `chat`: the user message) with {{placeholders}}.
    outputs: output name -> SamplingParams, for each output placeholder.
    inputs: the input placeholders, in the order positional arguments fill them (default: as
        they first appear in `system`, then in `template`).
    chat: render `system` and `template` as a conversation with the model's chat template.
    system: the system message's template (chat only; inputs allowed, no outputs)."""

    def __init__(
        self,
        name: str,
        template: str,
        outputs: Mapping[str, SamplingParams | Output],
        inputs: Sequence[str] | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a semantic function needs a name, got {name!r}")
        self.name, self.template, self.chat, self.system = name, template, chat, system
        if not isinstance(template, str):
            raise TemplateError(name, f"the template must be a string, got {type(template)}")
        if system is not None and not chat:
            raise TemplateError(name, "system= is the system message of a chat function")
        self.outputs: dict[str, SamplingParams] = {}
        for out, params in outputs.items():
            params = params.sampling_params if isinstance(params, Output) else params
            if not isinstance(params, SamplingParams):
                raise TemplateError(name, f"needs SamplingParams, got {params!r}", out)
            self.outputs[out] = params
        self.pieces = self._typed(parse_template(name, template))
        self.system_pieces = self._typed(parse_template(name, system or ""))
        seen = [p.value for p in self.system_pieces + self.pieces if p.kind == "input"]
        self.inputs = tuple(inputs) if inputs is not None else tuple(dict.fromkeys(seen))
        self._check()

    def _typed(self, pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
        return tuple(
            Piece("output" if p.value in self.outputs else "input", p.value)
            if p.kind == "placeholder"
            else p
            for p in pieces
        )

    def _check(self) -> None:
        name = self.name
        used = {p.value for p in self.system_pieces + self.pieces if p.kind == "input"}
        for inp in self.inputs:
            if inp in self.outputs:
                raise TemplateError(name, "is declared both an input and an output", inp)
            if inp not in used:
                raise TemplateError(name, "is a declared input that the template never uses", inp)
        for inp in used - set(self.inputs):
            raise TemplateError(name, "is neither a declared input nor an output", inp)
        if len(set(self.inputs)) != len(self.inputs):
            raise TemplateError(name, f"inputs {list(self.inputs)} name one twice")
        for p in self.system_pieces:
            if p.kind == "output":
                raise TemplateError(name, "an output cannot be in the system message", p.value)
        order = [p.value for p in self.pieces if p.kind == "output"]
        for out in self.outputs:
            if order.count(out) != 1:
                raise TemplateError(
                    name, f"an output must appear exactly once (found {order.count(out)})", out
                )
        if not order:
            raise TemplateError(name, "has no output placeholder: nothing to generate")
        first = next(i for i, p in enumerate(self.pieces) if p.kind == "output")
        if first == 0:
            raise TemplateError(name, "an output needs a prompt before it", order[0])
        last = max(i for i, p in enumerate(self.pieces) if p.kind == "output")
        trailing = self.pieces[last + 1 :]
        for p in trailing:
            if p.kind == "input":
                raise TemplateError(
                    name,
                    f"comes after the last output {{{{{order[-1]}}}}}: never sent to the model",
                    p.value,
                )
        text = "".join(p.value for p in trailing).strip()
        if text:
            raise TemplateError(
                name, f"{text[:30]!r} after the last output is never sent to the model", order[-1]
            )
        if self.chat and (len(order) != 1 or last != len(self.pieces) - 1 - self._trailing()):
            raise TemplateError(
                name, "a chat function has one output, at the end of its template", order[0]
            )

    def _trailing(self) -> int:
        return int(self.pieces[-1].kind == "text")

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(p.value for p in self.pieces if p.kind == "output")

    def bind(self, args: Sequence, kwargs: Mapping) -> dict:
        """Positional and keyword arguments -> {input name: value}; errors name the input."""
        if len(args) > len(self.inputs):
            raise TypeError(
                f"semantic function {self.name!r} takes {len(self.inputs)} inputs "
                f"{list(self.inputs)}, got {len(args)} positional arguments"
            )
        bound = dict(zip(self.inputs, args, strict=False))
        for key, value in kwargs.items():
            if key in self.outputs:
                raise TypeError(
                    f"semantic function {self.name!r}: {{{{{key}}}}} is an output; it is "
                    "generated, not passed"
                )
            if key not in self.inputs:
                raise TypeError(
                    f"semantic function {self.name!r} has no input {{{{{key}}}}} "
                    f"(inputs: {list(self.inputs)})"
                )
            if key in bound:
                raise TypeError(f"semantic function {self.name!r}: input {key!r} given twice")
            bound[key] = value
        missing = [i for i in self.inputs if i not in bound]
        if missing:
            raise TypeError(
                f"semantic function {self.name!r}: missing input "
                + ", ".join(f"{{{{{m}}}}}" for m in missing)
            )
        return bound

    def __call__(self, *args, **kwargs):
        from llmjax.program.context import current_program

        outs = current_program(self.name).call(self, self.bind(args, kwargs))
        return outs[0] if len(outs) == 1 else outs

    # ---- the server's JSON (docs/programs.md) ----------------------------------------------

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "template": self.template,
            "inputs": list(self.inputs),
            "outputs": {k: sampling_to_dict(v) for k, v in self.outputs.items()},
            "chat": self.chat,
            "system": self.system,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> SemanticFunction:
        """The inverse of `to_dict` (the server's JSON); TemplateError for anything wrong."""
        missing = [k for k in ("name", "template", "outputs") if k not in d]
        if missing:
            raise TemplateError(str(d.get("name", "?")), f"missing fields {missing}")
        try:
            outputs = {k: SamplingParams(**v) for k, v in dict(d["outputs"]).items()}
        except (TypeError, ValueError) as e:
            raise TemplateError(str(d.get("name")), f"bad output sampling parameters: {e}") from e
        return cls(
            d["name"],
            d["template"],
            outputs,
            d.get("inputs"),
            chat=bool(d.get("chat", False)),
            system=d.get("system"),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, SemanticFunction) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.name, self.template))

    def __repr__(self) -> str:
        return (
            f"SemanticFunction({self.name!r}, inputs={list(self.inputs)}, "
            f"outputs={list(self.outputs)}, chat={self.chat})"
        )


def sampling_to_dict(params: SamplingParams) -> dict:
    """The SamplingParams fields that differ from the defaults, JSON-ready."""
    default = SamplingParams()
    out = {}
    for f in dataclasses.fields(SamplingParams):
        v = getattr(params, f.name)
        if v != getattr(default, f.name):
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def semantic_function(fn=None, *, chat: bool = False, system: str | None = None, name=None):
    """Declare a `SemanticFunction` from a Python function: its docstring is the template
    (dedented), its parameters the placeholders, annotated `Input` or `Output(...)`:

        @semantic_function(chat=True)
        def answer(question: Input, reply: Output(max_tokens=64)):
            '''{{question}}{{reply}}'''
    """

    def build(f) -> SemanticFunction:
        fname = name or f.__name__
        doc = inspect.getdoc(f)
        if not doc:
            raise TemplateError(fname, "needs a docstring: it is the prompt template")
        inputs, outputs = [], {}
        try:  # annotations are strings under `from __future__ import annotations`
            signature = inspect.signature(f, eval_str=True)
        except Exception as e:
            raise TemplateError(fname, f"cannot evaluate its annotations: {e}") from e
        for pname, param in signature.parameters.items():
            ann = param.annotation
            if ann is Input or isinstance(ann, Input):
                inputs.append(pname)
            elif isinstance(ann, Output):
                outputs[pname] = ann.sampling_params
            elif ann is Output:
                outputs[pname] = SamplingParams()
            else:
                raise TemplateError(fname, "annotate each parameter Input or Output(...)", pname)
        return SemanticFunction(fname, doc, outputs, inputs, chat=chat, system=system)

    return build(fn) if fn is not None else build

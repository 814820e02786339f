"""The frontend: semantic variables as futures, plain Python building the program (Parrot's API;
docs/programs.md compares SGLang's).

    from llmjax import LLM
    from llmjax.program import Program, semantic_function, Input, Output, variable

    @semantic_function
    def summarize(chunk: Input, summary: Output(max_tokens=48)):
        '''Summarize: {{chunk}}
        Summary:{{summary}}'''

    with Program(LLM()) as p:                           # or Program("http://127.0.0.1:8000")
        parts = [summarize(chunk=c) for c in chunks]    # futures: nothing runs yet
        print(parts[0].get(criteria="latency"))         # the only sync point

Calling a semantic function inside `with Program(...)` records a call and returns its output
variable(s) at once; strings passed as inputs become constant variables. `get(criteria=...)`
sends every call recorded since the last `get` to the service with the variables asked for and
their criteria ('latency' or 'throughput': how the service should run what they need), and
blocks until they have values. The service (`ProgramExecutor`, in this process or behind the
server's /v1/programs) sees the whole DAG: dependent calls never come back to the client. A
variable that failed raises `ProgramError` on `get`, naming the function and placeholder where
it failed. Leaving the `with` block cancels whatever is still running.
"""

from __future__ import annotations

import itertools

from llmjax.program.context import _CURRENT, current_program
from llmjax.program.function import SemanticFunction
from llmjax.program.graph import CRITERIA, CallSpec, ProgramError


class SemanticVariable:
    """A future for a piece of text: a constant, or an output of a call. `get()` returns it."""

    def __init__(self, program: Program, var_id: str, name: str, content: str | None = None):
        self.program, self.id, self.name = program, var_id, name
        self._content = content
        self._error: ProgramError | None = None
        self.is_constant = content is not None

    @property
    def done(self) -> bool:
        return self._content is not None or self._error is not None

    def get(self, criteria: str = "latency") -> str:
        """The text, computing what it needs first under `criteria` ('latency' or
        'throughput'); raises ProgramError if it failed."""
        return self.program.get(self, criteria)

    def _resolve(self, content: str | None, error: ProgramError | None) -> None:
        if self.done:
            raise RuntimeError(f"variable {self.id!r} resolved twice")
        self._content, self._error = content, error

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"SemanticVariable({self.id!r}, {self.name!r}, {state})"


class Program:
    """One program (Parrot's session) against `backend`: an `LLM`, `LLMEngine` or
    `SimCluster` (an in-process `ProgramExecutor` under `config`), a `ProgramExecutor` (shared
    by several programs), the URL of an llmjax server (`model`, `api_key` for it), or a
    backend object (`LocalBackend`'s methods)."""

    def __init__(self, backend, *, config=None, model: str | None = None, api_key=None):
        from llmjax.program.executor import ProgramExecutor

        if isinstance(backend, str):
            from llmjax.program.remote import RemoteBackend

            self.backend = RemoteBackend(backend, model=model, api_key=api_key)
        elif isinstance(backend, ProgramExecutor):
            self.backend = LocalBackend(backend)
        elif hasattr(backend, "run") and hasattr(backend, "open"):  # a backend already
            self.backend = backend
        else:
            self.backend = LocalBackend(ProgramExecutor(backend, config))
        self.id = self.backend.open()
        self._var_ids = itertools.count()
        self._call_ids = itertools.count()
        self.vars: dict[str, SemanticVariable] = {}
        self._constants: dict[str, str] = {}  # content -> var id (strings passed as inputs)
        self._functions: dict[str, SemanticFunction] = {}
        self._sent_functions: set[str] = set()
        self._unsent_constants: dict[str, str] = {}
        self._unsent_calls: list[CallSpec] = []
        self.calls: list[CallSpec] = []  # every call recorded, in order
        self.constants: dict[str, str] = {}  # every constant variable: id -> content
        self._tokens: list = []
        self.closed = False

    # ---- building ------------------------------------------------------------------------------

    def variable(self, content: str, name: str | None = None) -> SemanticVariable:
        """A constant variable holding `content`."""
        if not isinstance(content, str):
            raise TypeError(f"a variable's content must be a string, got {type(content).__name__}")
        self._check_open()
        vid = f"v{next(self._var_ids)}"
        var = self.vars[vid] = SemanticVariable(self, vid, name or vid, content)
        self._unsent_constants[vid] = content
        self.constants[vid] = content
        return var

    def call(self, fn: SemanticFunction, inputs: dict) -> tuple[SemanticVariable, ...]:
        """Record a call of `fn` with {input: variable or string}; its output variables."""
        self._check_open()
        known = self._functions.get(fn.name)
        if known is not None and known != fn:
            raise ValueError(f"two different semantic functions are named {fn.name!r}")
        self._functions[fn.name] = fn
        bound = {}
        for name, value in inputs.items():
            if isinstance(value, str):
                vid = self._constants.get(value)
                if vid is None:
                    vid = self._constants[value] = self.variable(value).id
                value = self.vars[vid]
            if not isinstance(value, SemanticVariable):
                raise TypeError(
                    f"semantic function {fn.name!r}, input {{{{{name}}}}}: pass a "
                    f"SemanticVariable or a string, got {type(value).__name__}"
                )
            if value.program is not self:
                raise ValueError(
                    f"semantic function {fn.name!r}, input {{{{{name}}}}}: the variable "
                    "belongs to another program"
                )
            bound[name] = value.id
        call_id = f"c{next(self._call_ids)}"
        outs = []
        for out in fn.output_names:
            vid = f"v{next(self._var_ids)}"
            self.vars[vid] = SemanticVariable(self, vid, f"{fn.name}.{out}")
            outs.append(self.vars[vid])
        spec = CallSpec(
            call_id, fn.name, bound, dict(zip(fn.output_names, (v.id for v in outs), strict=True))
        )
        self._unsent_calls.append(spec)
        self.calls.append(spec)
        return tuple(outs)

    @property
    def functions(self) -> dict[str, SemanticFunction]:
        """The semantic functions called so far, by name."""
        return dict(self._functions)

    # ---- running -------------------------------------------------------------------------------

    def get(self, variables, criteria: str = "latency"):
        """The text of a variable (or a list of texts for a list), computed under `criteria`
        (the module doc). Raises ProgramError for one that failed."""
        if criteria not in CRITERIA:
            raise ValueError(f"criteria must be one of {CRITERIA}, got {criteria!r}")
        single = isinstance(variables, SemanticVariable)
        variables = [variables] if single else list(variables)
        for v in variables:
            if not isinstance(v, SemanticVariable) or v.program is not self:
                raise ValueError(f"get: {v!r} is not a variable of this program")
        wanted = [v for v in variables if not v.done]
        if wanted or self._unsent_calls or self._unsent_constants:
            self._check_open()
            functions = [
                self._functions[n] for n in self._functions if n not in self._sent_functions
            ]

            def submitted() -> None:  # the service took the calls: never send them again
                self._sent_functions.update(f.name for f in functions)
                self._unsent_constants.clear()
                self._unsent_calls.clear()

            results = self.backend.run(
                self.id,
                functions,
                dict(self._unsent_constants),
                list(self._unsent_calls),
                [v.id for v in wanted],
                criteria,
                submitted,
            )
            for vid, (content, error) in results.items():
                var = self.vars[vid]
                if not var.done:
                    var._resolve(content, error)
        for v in variables:
            if v._error is not None:
                raise v._error
        texts = [v._content for v in variables]
        return texts[0] if single else texts

    def cancel(self) -> None:
        """Abort what the program is running (its pages freed); its pending variables fail."""
        if not self.closed:
            self.backend.cancel(self.id)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.close(self.id)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"program {self.id!r} is closed")

    @property
    def executor(self):
        """The in-process `ProgramExecutor` (None for a server's program)."""
        return getattr(self.backend, "executor", None)

    def scope(self):
        """A context in which calls go to this program, without closing it at the end (the
        `with Program(...)` block closes it): build a program over several notebook cells,

            p = Program(llm)
            with p.scope():
                parts = [summarize(chunk=c) for c in chunks]
            ...
            p.close()
        """
        return _Scope(self)

    def __enter__(self) -> Program:
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())
        self.close()


class _Scope:
    def __init__(self, program: Program):
        self.program, self._token = program, None

    def __enter__(self) -> Program:
        self._token = _CURRENT.set(self.program)
        return self.program

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)


class LocalBackend:
    """A `ProgramExecutor` in this process: `run` submits, activates and steps it until the
    variables are done (other programs on the executor progress meanwhile)."""

    def __init__(self, executor):
        self.executor = executor

    def open(self) -> str:
        return self.executor.open()

    def run(self, app_id, functions, constants, calls, var_ids, criteria, submitted) -> dict:
        """Submit (then `submitted()`), activate, run; {var id: (content, error)}."""
        ex = self.executor
        ex.submit(app_id, functions, constants, calls)
        submitted()
        ex.activate(app_id, var_ids, criteria)
        vars_ = [ex.var(app_id, v) for v in var_ids]
        ex.run_until(lambda: all(v.done for v in vars_))
        return {v.id: (v.content, v.error) for v in vars_}

    def cancel(self, app_id: str) -> None:
        self.executor.cancel(app_id)

    def close(self, app_id: str) -> None:
        self.executor.close(app_id)


def variable(content: str, name: str | None = None) -> SemanticVariable:
    """A constant variable in the current program (`with Program(...)`)."""
    return current_program("variable").variable(content, name)


def get(variables, criteria: str = "latency"):
    """`Program.get` on the variables' program."""
    first = variables if isinstance(variables, SemanticVariable) else next(iter(variables))
    return first.program.get(variables, criteria)

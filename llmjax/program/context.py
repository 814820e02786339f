"""The program a semantic function call records into: the innermost `with Program(...)` block of
this thread or task (a context variable). frontend.py's `Program` sets it; function.py's
`SemanticFunction.__call__` and frontend.py's `variable()` read it (`current_program`)."""

from __future__ import annotations

import contextvars

# The innermost active frontend.Program (None outside every `with Program(...)`).
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("llmjax_program", default=None)


def current_program(what: str):
    """The active frontend.Program; RuntimeError naming `what` when there is none."""
    program = _CURRENT.get()
    if program is None:
        raise RuntimeError(
            f"{what!r} needs a program: call it inside `with llmjax.program.Program(llm):`"
        )
    return program

"""Semantic-variable programs (Parrot, OSDI'24; ALGORITHMS.md §9; docs/programs.md).

An application's LLM calls are declared as `SemanticFunction`s (prompt templates with input and
output placeholders) and called with `SemanticVariable`s (futures), so the service receives the
whole DAG of calls, learns from each `get(criteria=...)` whether the application wants latency
or throughput, and schedules accordingly (`ProgramExecutor` with Parrot's global scheduler and
the engine's `ProgramHints`).

    frontend.py    Program, SemanticVariable, variable(), get()
    context.py     the program calls record into (the innermost `with Program(...)`)
    function.py    SemanticFunction, @semantic_function, Input, Output
    graph.py       the serving side's DAG: tasks, variables, performance deduction
    scheduler.py   Parrot's global scheduler (app FIFO, grouping, context-aware placement, caps)
    executor.py    ProgramExecutor: dispatch, step, resolve (or the request-level baseline)
    render.py      prompts as token ids, piece by piece
    targets.py     one engine (real or simulated) or a simulated cluster
    remote.py      the client of the server's /v1/programs
    reference.py   the same calls one by one in dependency order (the semantics' reference)
    apps/          chain and map-reduce summarization, multi-agent, a mixed workload
"""

from llmjax.config import ProgramConfig
from llmjax.program.executor import ProgramExecutor
from llmjax.program.frontend import Program, SemanticVariable, get, variable
from llmjax.program.function import (
    Input,
    Output,
    SemanticFunction,
    TemplateError,
    semantic_function,
)
from llmjax.program.graph import CallSpec, ProgramError

__all__ = [
    "CallSpec",
    "Input",
    "Output",
    "Program",
    "ProgramConfig",
    "ProgramError",
    "ProgramExecutor",
    "SemanticFunction",
    "SemanticVariable",
    "TemplateError",
    "get",
    "semantic_function",
    "variable",
]

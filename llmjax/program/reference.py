"""The reference semantics of a program: its calls run one at a time, in dependency order, each
output a lone request (`run_sequential`). A program served by `ProgramExecutor` must give every
variable the same value (greedy decoding), whatever the scheduling policy, batching or
placement: the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmjax.program.function import SemanticFunction
from llmjax.program.graph import App, CallSpec, ProgramError
from llmjax.program.render import Renderer
from llmjax.program.targets import make_target


def run_sequential(
    target,
    functions: Mapping[str, SemanticFunction] | Iterable[SemanticFunction],
    constants: Mapping[str, str],
    calls: Iterable[CallSpec],
    tokenizer=None,
) -> dict[str, tuple[str | None, ProgramError | None]]:
    """Every variable's (text, None), or (None, error) for an output whose request the engine
    rejected or whose input failed. `target`: an LLM or LLMEngine (nothing else may run on it
    meanwhile)."""
    if isinstance(functions, Mapping):
        functions = functions.values()
    target = make_target(target)
    renderer = Renderer(tokenizer or target.tokenizer)
    app = App("reference", 0.0)
    tasks = app.add(list(functions), dict(constants), list(calls))
    pending = list(tasks)
    results: dict[str, tuple[str | None, ProgramError | None]] = {
        vid: (v.content, None) for vid, v in app.vars.items() if v.producer is None
    }
    n = 0
    while pending:
        task = next(t for t in pending if all(d.done for d in t.deps))
        pending.remove(task)
        failed = task.failed_input()
        if failed is not None:
            task.var.error = ProgramError(f"input {{{{{failed[0]}}}}} failed: {failed[1]}")
        else:
            ids = renderer.task_prompt_ids(task)
            rid = f"reference-{n}"
            n += 1
            target.add(0, ids, task.function.outputs[task.output], rid, None, None)
            out = None
            while out is None:
                out = next((o for o in target.step() if o.request_id == rid and o.finished), None)
            if out.finish_reason == "error":
                task.var.error = ProgramError(out.error)
            else:
                task.var.content = renderer.output_text(out, target.engine_decodes)
        results[task.var.id] = (task.var.content, task.var.error)
    return results

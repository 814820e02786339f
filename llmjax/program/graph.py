"""The serving side's view of a program: variables, tasks and Parrot's performance deduction
(ALGORITHMS.md §9.2).

A call of a semantic function with k outputs becomes k *tasks*, one engine request each: task j
writes output j, reading the template up to it. Its dependencies are the variables in that
prompt: the inputs placed before output j and the call's earlier outputs. So a task is ready
when every dependency has a value, and fails (with the cause) when one fails.

    app = App("a0", arrival_time=0.0)
    app.add(functions, constants, calls)      # CallSpecs naming variables by id
    newly = app.activate(["v7"], "latency")   # performance deduction from a `get`

Performance deduction (Parrot's `graph_traverse.py`): `get(var, criteria)` activates the task
producing `var` and, walking backwards, every task it depends on that is not yet active, each
with the same criteria; a task's depth is 1 + the deepest of its dependencies' (a constant's is
0), so the reduce of a map-reduce is deeper than its maps. Tasks nobody asked for stay pending:
they never run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from llmjax.engine.request import LATENCY, THROUGHPUT
from llmjax.program.function import SemanticFunction

CRITERIA = (LATENCY, THROUGHPUT)


class ProgramError(RuntimeError):
    """A variable that has no value: its call failed (the engine rejected it, an input failed)
    or it was cancelled. `function` and `placeholder` name where it failed first."""

    def __init__(self, message: str, function: str | None = None, placeholder: str | None = None):
        super().__init__(message)
        self.function, self.placeholder = function, placeholder


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One call as the executor receives it (an item of the server's "calls"): `function` by
    name, `inputs` {input placeholder: variable id}, `outputs` {output placeholder: new
    variable id}."""

    id: str
    function: str
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]

    @classmethod
    def from_dict(cls, d: Mapping) -> CallSpec:
        return cls(str(d["id"]), str(d["function"]), dict(d["inputs"]), dict(d["outputs"]))

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "function": self.function,
            "inputs": dict(self.inputs),
            "outputs": dict(self.outputs),
        }


class Var:
    """A semantic variable on the serving side: a constant (content given) or a task's output."""

    def __init__(self, id: str, content: str | None = None, producer: Task | None = None):
        self.id, self.content, self.producer = id, content, producer
        self.error: ProgramError | None = None
        self.consumers: list[Task] = []

    @property
    def done(self) -> bool:
        return self.content is not None or self.error is not None

    def __repr__(self) -> str:
        state = "value" if self.content is not None else ("error" if self.error else "pending")
        return f"Var({self.id!r}, {state})"


# Task states, in order: pending (nobody asked) -> waiting (activated, inputs not ready) -> ready
# (queued for dispatch) -> running (an engine request) -> done | failed | cancelled.
PENDING, WAITING, READY, RUNNING, DONE, FAILED, CANCELLED = (
    "pending", "waiting", "ready", "running", "done", "failed", "cancelled"
)  # fmt: skip
FINAL = (DONE, FAILED, CANCELLED)


class Task:
    """One output of one call: one engine request (the module doc)."""

    def __init__(self, app: App, call: CallSpec, function: SemanticFunction, index: int):
        self.app, self.call, self.function, self.index = app, call, function, index
        self.output = function.output_names[index]
        self.id = f"{app.id}/{call.id}/{self.output}"
        self.var: Var = app.vars[call.outputs[self.output]]
        self.deps: list[Var] = []  # filled by App.add, in prompt order
        self.state = PENDING
        self.criteria: str | None = None
        self.depth = 0
        # set by the executor
        self.prompt_ids: list[int] | None = None
        self.request_id: str | None = None
        self.instance: int | None = None
        self.ready_time: float | None = None
        self.dispatch_time: float | None = None
        self.finish_time: float | None = None
        self.result = None  # the engine's RequestOutput

    @property
    def consumers(self) -> frozenset[str]:
        """Ids of the tasks that read this task's output (Parrot's consumer requests)."""
        return frozenset(t.id for t in self.var.consumers)

    @property
    def inputs_done(self) -> bool:
        return all(d.content is not None for d in self.deps)

    def failed_input(self) -> tuple[str, ProgramError] | None:
        """(placeholder, its error) of the first dependency that failed, or None."""
        for d in self.deps:
            if d.error is not None:
                return self._placeholder_of(d), d.error
        return None

    def _placeholder_of(self, var: Var) -> str:
        for name, vid in list(self.call.inputs.items()) + list(self.call.outputs.items()):
            if vid == var.id:
                return name
        return var.id

    def __repr__(self) -> str:
        return f"Task({self.id!r}, {self.state}, criteria={self.criteria}, depth={self.depth})"


class App:
    """One program (application, Parrot's session) on the serving side: its functions,
    variables and tasks. `add` takes a submission; `activate` a `get`."""

    def __init__(self, app_id: str, arrival_time: float):
        self.id, self.arrival_time = app_id, arrival_time
        self.functions: dict[str, SemanticFunction] = {}
        self.vars: dict[str, Var] = {}
        self.tasks: dict[str, Task] = {}
        self.calls: dict[str, CallSpec] = {}
        self.cancelled = False

    def add(
        self,
        functions: Iterable[SemanticFunction],
        constants: Mapping[str, str],
        calls: Iterable[CallSpec],
    ) -> list[Task]:
        """Take a submission (checked whole before anything changes; a ValueError names the
        call, function, placeholder or variable at fault). Returns the new tasks."""
        functions = list(functions)
        calls = list(calls)
        known_fns = dict(self.functions)
        for fn in functions:
            old = known_fns.get(fn.name)
            if old is not None and old != fn:
                raise ValueError(f"semantic function {fn.name!r} is already defined differently")
            known_fns[fn.name] = fn
        new_ids = set()
        for vid, content in constants.items():
            if vid in self.vars or vid in new_ids:
                raise ValueError(f"variable {vid!r} is defined twice")
            if not isinstance(content, str):
                raise ValueError(f"variable {vid!r}: content must be a string, got {content!r}")
            new_ids.add(vid)
        seen_calls = set()
        for c in calls:
            if c.id in self.calls or c.id in seen_calls:
                raise ValueError(f"call {c.id!r} is submitted twice")
            seen_calls.add(c.id)
            fn = known_fns.get(c.function)
            if fn is None:
                raise ValueError(f"call {c.id!r}: unknown semantic function {c.function!r}")
            if set(c.inputs) != set(fn.inputs):
                raise ValueError(
                    f"call {c.id!r} of {fn.name!r}: inputs {sorted(c.inputs)} != the function's "
                    f"{sorted(fn.inputs)}"
                )
            if set(c.outputs) != set(fn.outputs):
                raise ValueError(
                    f"call {c.id!r} of {fn.name!r}: outputs {sorted(c.outputs)} != the "
                    f"function's {sorted(fn.outputs)}"
                )
            for out, vid in c.outputs.items():
                if vid in self.vars or vid in new_ids:
                    raise ValueError(f"call {c.id!r}: output {out!r} variable {vid!r} exists")
                new_ids.add(vid)
        for c in calls:
            for name, vid in c.inputs.items():
                if vid not in self.vars and vid not in new_ids:
                    raise ValueError(
                        f"call {c.id!r} of {c.function!r}: input {{{{{name}}}}} names an unknown "
                        f"variable {vid!r}"
                    )
        _check_acyclic(calls, self.vars)
        # Checked: apply.
        self.functions = known_fns
        for vid, content in constants.items():
            self.vars[vid] = Var(vid, content)
        new_tasks = []
        for c in calls:
            self.calls[c.id] = c
            fn = known_fns[c.function]
            for index in range(len(fn.outputs)):
                out = fn.output_names[index]
                var = self.vars[c.outputs[out]] = Var(c.outputs[out])
                task = Task(self, c, fn, index)
                var.producer = task
                self.tasks[task.id] = task
                new_tasks.append(task)
        for task in new_tasks:
            for vid in _prompt_var_ids(task.function, task.call, task.index):
                dep = self.vars[vid]
                if dep not in task.deps:
                    task.deps.append(dep)
                    dep.consumers.append(task)
        if self.cancelled:
            for task in new_tasks:
                task.state = CANCELLED
                task.var.error = ProgramError(f"program {self.id!r} was cancelled")
        return new_tasks

    def activate(self, var_ids: Iterable[str], criteria: str) -> list[Task]:
        """Performance deduction from `get(var_ids, criteria)` (the module doc): every pending
        task that the variables need becomes waiting, tagged with `criteria` and its depth.
        Returns the newly activated tasks (dependencies before dependents)."""
        if criteria not in CRITERIA:
            raise ValueError(f"criteria must be one of {CRITERIA}, got {criteria!r}")
        activated: list[Task] = []
        for vid in var_ids:
            var = self.vars.get(vid)
            if var is None:
                raise ValueError(f"get: unknown variable {vid!r} in program {self.id!r}")
            if var.producer is None or var.producer.state != PENDING:
                continue
            # Iterative post-order walk (chains can be thousands of calls long).
            stack = [(var.producer, False)]
            while stack:
                task, expanded = stack.pop()
                if task.state != PENDING:
                    continue
                if not expanded:
                    stack.append((task, True))
                    stack.extend(
                        (d.producer, False)
                        for d in reversed(task.deps)
                        if d.producer is not None and d.producer.state == PENDING
                    )
                    continue
                task.depth = 1 + max(
                    (d.producer.depth for d in task.deps if d.producer is not None), default=0
                )
                task.criteria = criteria
                task.state = WAITING
                activated.append(task)
        return activated

    @property
    def num_unfinished(self) -> int:
        return sum(t.state not in FINAL and t.state != PENDING for t in self.tasks.values())


def _prompt_var_ids(fn: SemanticFunction, call: CallSpec, index: int) -> list[str]:
    """The variables in task `index`'s prompt, in order: inputs of the system message and of
    the template before output `index`, and the earlier outputs."""
    ids = [call.inputs[p.value] for p in fn.system_pieces if p.kind == "input"]
    seen = 0
    for p in fn.pieces:
        if p.kind == "output":
            if seen == index:
                break
            ids.append(call.outputs[p.value])
            seen += 1
        elif p.kind == "input":
            ids.append(call.inputs[p.value])
    return ids


def _check_acyclic(calls: list[CallSpec], existing: Mapping[str, Var]) -> None:
    """A submission's calls may name each other's outputs in any order, but not in a cycle."""
    producer = {vid: c for c in calls for vid in c.outputs.values()}
    state: dict[str, int] = {}  # call id -> 1 visiting, 2 done
    for start in calls:
        stack = [(start, iter(start.inputs.values()))]
        if state.get(start.id) == 2:
            continue
        state[start.id] = 1
        while stack:
            call, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[call.id] = 2
                stack.pop()
                continue
            dep = producer.get(nxt)
            if dep is None or nxt in existing:
                continue
            if state.get(dep.id) == 1:
                raise ValueError(f"calls {dep.id!r} and {call.id!r} depend on each other (a cycle)")
            if state.get(dep.id) != 2:
                state[dep.id] = 1
                stack.append((dep, iter(dep.inputs.values())))

"""`ProgramExecutor`: the serving side of semantic-variable programs (Parrot, ALGORITHMS.md §9.2).

    ex = ProgramExecutor(llm)                           # or an LLMEngine, or a SimCluster
    app = ex.open()
    ex.submit(app, functions, constants, calls)         # the program's DAG (CallSpecs)
    ex.activate(app, ["v9"], "latency")                 # a `get`: performance deduction
    ex.run_until(lambda: ex.var(app, "v9").done)        # or ex.step() in your own loop

The executor holds every open program's graph (llmjax/program/graph.py). Each `step()`:

1. dispatches ready tasks: in 'parrot' mode through Parrot's global scheduler
   (llmjax/program/scheduler.py: app FIFO, graph and context grouping, context-aware
   placement, LATENCY caps), each as an engine request carrying `ProgramHints` (criteria,
   application arrival for app-level FIFO); in 'request' mode (the request-level baseline) each
   ready task waits `client_rtt_s` after its last input was computed (the client's round trip)
   and goes out as a plain request, the target's router placing it;
2. steps the target (one engine step; with nothing to run before the next release, the target
   waits for it: a sleep on a wall clock, a jump on a virtual one);
3. takes each finished request's text as its output variable's value, which may make other
   tasks ready; a failed request fails its variable and, transitively, everything that reads it
   (the error names the function and the placeholder); requests that are not a program's pass
   through (returned), so a server can drive the executor as its engine.

Tasks of one program never wait for a client: a dependent call is dispatched in the same step
that computes its last input. `cancel(app)` aborts the program's running requests (their pages
are freed) and fails its unfinished variables. `records` has one row per finished task (times,
instance, tokens) for timelines and benchmarks.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping

from llmjax.config import ProgramConfig
from llmjax.engine.request import ProgramHints, RequestOutput
from llmjax.program.function import SemanticFunction
from llmjax.program.graph import (
    CANCELLED,
    DONE,
    FAILED,
    FINAL,
    PENDING,
    READY,
    RUNNING,
    WAITING,
    App,
    CallSpec,
    ProgramError,
    Task,
    Var,
)
from llmjax.program.render import Renderer
from llmjax.program.scheduler import UNBOUNDED, EngineSlot, GlobalScheduler
from llmjax.program.targets import make_target

logger = logging.getLogger(__name__)

REQUEST_PREFIX = "prog:"  # engine request ids of program tasks: prog:<app>/<call>/<output>


class ProgramExecutor:
    """Runs semantic-variable programs on `target` (an LLM, an LLMEngine or a SimCluster) under
    `config` (ProgramConfig: 'parrot' or 'request' mode and Parrot's switches); `tokenizer`
    defaults to the target's. See the module doc."""

    def __init__(self, target, config: ProgramConfig | None = None, tokenizer=None):
        self.config = config or ProgramConfig()
        self.target = make_target(target)
        self.clock = self.target.clock
        self.renderer = Renderer(tokenizer or self.target.tokenizer)
        self.apps: dict[str, App] = {}
        self._ids = itertools.count()
        self._by_request: dict[str, Task] = {}
        self._delayed: list[tuple[float, int, Task]] = []  # request mode: (release, seq, task)
        self._seq = itertools.count()
        self._event_time = self.clock.now()  # the latest finish seen (virtual clocks)
        n = self.target.num_instances
        slots = []
        for i in range(n):
            _, tokens = self.target.capacity(i)
            cfg = self.config
            slots.append(
                EngineSlot(
                    i,
                    cfg.tasks_capacity or UNBOUNDED,
                    cfg.tokens_capacity or tokens,
                    self.target.page_size(),
                )
            )
        self.scheduler = GlobalScheduler(self.config, slots, self.target.cached_prefix)
        self.records: collections.deque[dict] = collections.deque(maxlen=1 << 20)
        self.on_var_done: Callable[[App, Var], None] | None = None
        self.num_dispatched = 0

    # ---- programs ------------------------------------------------------------------------------

    def open(self, app_id: str | None = None, arrival_time: float | None = None) -> str:
        """Start a program (Parrot's session); returns its id."""
        app_id = app_id if app_id is not None else f"a{next(self._ids)}"
        if app_id in self.apps:
            raise ValueError(f"program {app_id!r} is already open")
        if arrival_time is None:
            arrival_time = self._now()
        self.apps[app_id] = App(app_id, arrival_time)
        return app_id

    def submit(
        self,
        app_id: str,
        functions: Iterable[SemanticFunction] = (),
        constants: Mapping[str, str] | None = None,
        calls: Iterable[CallSpec] = (),
    ) -> list[Task]:
        """Add functions, constant variables and calls to a program (checked whole: a
        ValueError names what is wrong and changes nothing). Nothing runs until a `get`
        (`activate`) asks for a variable."""
        app = self._app(app_id)
        functions = list(functions)
        for fn in functions:
            self.renderer.check(fn)
        tasks = app.add(functions, constants or {}, calls)
        for task in tasks:  # an input that already failed fails the task at once
            if task.failed_input() is not None:
                self._fail_consumers(task.failed_input()[1], [task])
        return tasks

    def activate(self, app_id: str, var_ids: Iterable[str], criteria: str = "latency") -> None:
        """A `get(var_ids, criteria)`: performance deduction (graph.py), then every activated
        task whose inputs are computed is ready."""
        app = self._app(app_id)
        for task in app.activate(list(var_ids), criteria):
            if task.state == WAITING and task.inputs_done:
                self._ready(task, self._ready_time(task))

    def var(self, app_id: str, var_id: str) -> Var:
        app = self._app(app_id)
        if var_id not in app.vars:
            raise KeyError(f"program {app_id!r} has no variable {var_id!r}")
        return app.vars[var_id]

    def cancel(self, app_id: str, reason: str | None = None) -> int:
        """Abort the program's running requests (their pages are freed), drop its queued
        tasks and fail its unfinished variables; returns the number of requests aborted."""
        app = self._app(app_id)
        app.cancelled = True
        error = ProgramError(reason or f"program {app_id!r} was cancelled")
        aborted = 0
        for task in app.tasks.values():
            if task.state in FINAL:
                continue
            if task.state == RUNNING:
                aborted += bool(self.target.abort(task.request_id))
                self._release_slot(task)
                del self._by_request[task.request_id]
            elif task.state == READY:
                self.scheduler.remove(task)
                self._delayed = [d for d in self._delayed if d[2] is not task]
                heapq.heapify(self._delayed)
            task.state = CANCELLED
            if task.var.error is None and task.var.content is None:
                task.var.error = error
                self._notify(app, task.var)
        return aborted

    def close(self, app_id: str) -> None:
        """Cancel what is left of the program and forget it."""
        if app_id in self.apps:
            self.cancel(app_id)
            del self.apps[app_id]

    # ---- driving -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.queue or self._delayed or self.target.has_unfinished())

    def step(self) -> list[RequestOutput]:
        """Dispatch, step the target, take its outputs (the module doc); returns the outputs of
        requests that are not program tasks."""
        self._dispatch()
        if not self.target.has_unfinished():
            if self._delayed:
                self.target.wait_until(self._delayed[0][0])
                self._dispatch()
            if not self.target.has_unfinished():
                return []
        if self.scheduler.queue and not self.target.has_unfinished():  # no live engine left
            for task in list(self.scheduler.queue):
                self.scheduler.remove(task)
                self._fail(task, "found no live engine to run on")
            return []
        passthrough = []
        for out in self.target.step():
            task = self._by_request.get(out.request_id)
            if task is None:
                passthrough.append(out)
            elif out.finished:
                self._finish(task, out)
        return passthrough

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until `done()`; raises RuntimeError if nothing is left to run first."""
        while not done():
            if not self.has_unfinished():
                raise RuntimeError("nothing left to run, but the program is not done")
            self.step()

    def run(self, app_id: str, var_ids: Iterable[str], criteria: str = "latency") -> list[Var]:
        """`activate` and run until the variables are done; returns them."""
        var_ids = list(var_ids)
        self.activate(app_id, var_ids, criteria)
        vars_ = [self.var(app_id, v) for v in var_ids]
        self.run_until(lambda: all(v.done for v in vars_))
        return vars_

    # ---- internals -----------------------------------------------------------------------------

    def _app(self, app_id: str) -> App:
        app = self.apps.get(app_id)
        if app is None:
            raise KeyError(f"no open program {app_id!r}")
        return app

    def _now(self) -> float:
        return max(self._event_time, self.clock.now()) if self.target.virtual else self.clock.now()

    def _ready_time(self, task: Task) -> float:
        times = [d.producer.finish_time for d in task.deps if d.producer is not None]
        return max([t for t in times if t is not None], default=self._now())

    def _ready(self, task: Task, t: float) -> None:
        task.state, task.ready_time = READY, t
        try:
            task.prompt_ids = self.renderer.task_prompt_ids(task)
        except Exception as e:  # a tokenizer failure is this task's, not the executor's
            self._fail(task, f"could not render its prompt: {type(e).__name__}: {e}")
            return
        if self.config.mode == "request":  # the client sends it once it has its inputs
            waited = any(d.producer is not None for d in task.deps)
            release = t + (self.config.client_rtt_s if waited else 0.0)
            heapq.heappush(self._delayed, (release, next(self._seq), task))
            return
        try:
            self.scheduler.submit(task)
        except OverflowError as e:
            self._fail(task, str(e))

    def _dispatch(self) -> None:
        now = self.clock.now()
        if self.config.mode == "request":
            while self._delayed and self._delayed[0][0] <= now:
                release, _, task = heapq.heappop(self._delayed)
                self._send(task, None, None, release)
            return
        for task, slot in self.scheduler.schedule():
            cfg = self.config
            hints = ProgramHints(
                task.app.id,
                task.criteria,
                task.app.arrival_time if cfg.app_fifo else None,
                task.depth,
            )
            self._send(task, slot, hints, max(task.ready_time, self._event_time))

    def _send(self, task: Task, slot: int | None, hints, arrival: float) -> None:
        task.state, task.instance = RUNNING, slot
        task.request_id = REQUEST_PREFIX + task.id
        task.dispatch_time = arrival if self.target.virtual else self.clock.now()
        self._by_request[task.request_id] = task
        params = task.function.outputs[task.output]
        self.num_dispatched += 1
        self.target.add(
            slot,
            task.prompt_ids,
            params,
            task.request_id,
            arrival if self.target.virtual else None,
            hints,
        )

    def _finish(self, task: Task, out: RequestOutput) -> None:
        del self._by_request[task.request_id]
        self._release_slot(task)
        task.result = out
        m = out.metrics
        task.finish_time = m.finished_time if m.finished_time is not None else self._now()
        self._event_time = max(self._event_time, task.finish_time)
        if out.finish_reason in ("error", "rejected", "abort"):
            what = "was aborted" if out.finish_reason == "abort" else f"failed: {out.error}"
            self._fail(task, what, record=out)
            return
        task.state = DONE
        task.var.content = self.renderer.output_text(out, self.target.engine_decodes)
        self._record(task, out)
        self._notify(task.app, task.var)
        for consumer in task.var.consumers:
            if consumer.state == WAITING and consumer.inputs_done:
                self._ready(consumer, self._ready_time(consumer))

    def _fail(self, task: Task, what: str, record: RequestOutput | None = None) -> None:
        fn = task.function.name
        error = ProgramError(
            f"semantic function {fn!r}, output {{{{{task.output}}}}} (call {task.call.id!r}) "
            f"{what}",
            fn,
            task.output,
        )
        task.state = FAILED
        if record is not None:
            self._record(task, record)
        task.var.error = error
        self._notify(task.app, task.var)
        self._fail_consumers(error, list(task.var.consumers))

    def _fail_consumers(self, cause: ProgramError, tasks: list[Task]) -> None:
        """Every task reading a failed variable fails with it as the cause, transitively."""
        stack = list(tasks)
        while stack:
            task = stack.pop()
            if task.state in FINAL or task.state in (RUNNING, READY):
                continue
            failed = task.failed_input()
            if failed is None:
                continue
            placeholder, error = failed
            fn = task.function.name
            task.state = FAILED
            task.var.error = ProgramError(
                f"semantic function {fn!r}, input {{{{{placeholder}}}}} (call {task.call.id!r}) "
                f"failed: {error}",
                fn,
                placeholder,
            )
            self._notify(task.app, task.var)
            stack.extend(task.var.consumers)

    def _release_slot(self, task: Task) -> None:
        if task.instance is not None:
            self.scheduler.finish(task.id, task.instance)

    def _notify(self, app: App, var: Var) -> None:
        if self.on_var_done is not None:
            self.on_var_done(app, var)

    def _record(self, task: Task, out: RequestOutput) -> None:
        m = out.metrics
        self.records.append(
            {
                "task": task.id,
                "app": task.app.id,
                "call": task.call.id,
                "function": task.function.name,
                "output": task.output,
                "state": task.state,
                "criteria": task.criteria,
                "depth": task.depth,
                "instance": task.instance,
                "ready": task.ready_time,
                "dispatch": task.dispatch_time,
                "first_token": m.first_token_time,
                "finish": task.finish_time,
                "prompt_tokens": len(task.prompt_ids or ()),
                "cached_tokens": out.num_cached_tokens,
                "output_tokens": len(out.token_ids),
            }
        )


__all__ = ["PENDING", "ProgramExecutor"]

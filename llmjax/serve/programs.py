"""Semantic-variable programs over HTTP: `POST /v1/programs` and `DELETE /v1/programs/{id}`
(docs/programs.md, "Over HTTP"; the client is llmjax/program/remote.py).

The engine thread drives a `ProgramExecutor` around the engine: `ProgramEngine` is the engine as
`AsyncEngine` sees it, its `step()` the executor's, so program tasks are dispatched between
steps (a dependent call in the step that computes its last input: no client round trip) and
share the batch with plain completions.

    event loop (handlers)                          engine thread
    ---------------------                          -------------
    POST: parse functions, calls, gets (400s)
    await call(sessions.submit)             -->    open or find the session (404), submit
                                                   (400), activate each get, add a waiter
    await the waiter or a disconnect               steps; on_var_done counts waiters down
                                            <--    after the step: settle the waiter (values,
                                                   errors, usage); close the session unless kept
    a disconnect: call(sessions.abandon)    -->    cancel and close the session
    DELETE: call(sessions.delete)           -->    cancel (abort its requests) and close

Only the engine thread touches `ProgramSessions` and its executor. A session kept open
(`keep_session`) closes after `ServerConfig.program_idle_s` without a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmjax.program.executor import ProgramExecutor
from llmjax.program.function import SemanticFunction, TemplateError
from llmjax.program.graph import CRITERIA, CallSpec, Var
from llmjax.program.targets import EngineTarget
from llmjax.serve.app import APIError, _or_disconnect
from llmjax.serve.async_engine import AsyncEngine, EngineDeadError, settle
from llmjax.serve.protocol import ProgramRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Submission:
    """One POST, parsed and checked on its own (the session's state is checked on the engine
    thread)."""

    session_id: str | None
    functions: list[SemanticFunction]
    constants: dict[str, str]
    calls: list[CallSpec]
    gets: list[tuple[list[str], str]]  # (variable ids, criteria)
    keep_session: bool


def parse(body: ProgramRequest) -> Submission:
    """The request's functions, variables, calls and gets; APIError 400 naming the field."""
    if body.unknown_fields():
        logger.warning("ignored unknown request fields %s", body.unknown_fields())
    functions = []
    for i, d in enumerate(body.functions):
        try:
            functions.append(SemanticFunction.from_dict(d))
        except TemplateError as e:  # names the function and the placeholder
            raise APIError(400, str(e), "functions") from None
        except KeyError as e:
            raise APIError(400, f"functions[{i}]: missing field {e}", "functions") from None
        except (TypeError, ValueError) as e:
            raise APIError(400, f"functions[{i}]: {e}", "functions") from None
    constants = {}
    for v in body.variables:
        if v.id in constants:
            raise APIError(400, f"variable {v.id!r} is given twice", "variables")
        constants[v.id] = v.content
    calls = []
    for i, d in enumerate(body.calls):
        try:
            calls.append(CallSpec.from_dict(d))
        except KeyError as e:
            raise APIError(400, f"calls[{i}]: missing field {e}", "calls") from None
        except (TypeError, ValueError) as e:
            raise APIError(400, f"calls[{i}]: {e}", "calls") from None
    for g in body.get:
        if g.criteria not in CRITERIA:
            raise APIError(400, f"criteria must be one of {CRITERIA}, got {g.criteria!r}", "get")
    gets = [(list(g.variables), g.criteria) for g in body.get]
    return Submission(body.session_id, functions, constants, calls, gets, body.keep_session)


# ------------------------------------------------------------------------------------------------
# Engine thread.


class _Waiter:
    """A POST waiting for its variables; settled with the response body."""

    def __init__(self, future: asyncio.Future, session: _Session, variables: list[Var]):
        self.future, self.session, self.vars = future, session, variables
        self.pending = {v.id for v in variables if not v.done}
        self.usage_before = dict(session.usage)


class _Session:
    def __init__(self, session_id: str, now: float):
        self.id = session_id
        self.waiters: list[_Waiter] = []
        self.close_when_idle = False  # the latest request did not ask to keep it
        self.last_used = now
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


class _ServedTarget:
    """The executor's target (the engine's, or a cluster's: llmjax/program/targets.py), keeping
    each step's outputs (program tasks' included: the metrics count them) and counting the
    aborts of program requests."""

    def __init__(self, target, metrics):
        self.inner, self.metrics = target, metrics
        self.outputs: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self) -> list:
        self.outputs = self.inner.step()
        return self.outputs

    def abort(self, request_id: str) -> bool:
        aborted = self.inner.abort(request_id)
        if aborted and self.metrics is not None:
            self.metrics.record_abort(request_id)
        return aborted


class ProgramSessions:
    """The server's program sessions on one engine: a `ProgramExecutor` (under
    `program_config`), the requests waiting on it, idle expiry. Engine thread only, except
    `engine_view`, which is what `AsyncEngine` drives."""

    def __init__(
        self, engine, program_config=None, metrics=None, idle_s: float = 600.0, target=None
    ):
        """`engine`: what AsyncEngine drives (an LLMEngine, or a cluster's serving view);
        `target`: what the executor runs tasks on (default: `engine` itself; a Cluster's
        `ClusterTarget` for a cluster, so Parrot's scheduler places tasks on its instances)."""
        self.target = _ServedTarget(target or EngineTarget(engine), metrics)
        self.executor = ProgramExecutor(self.target, program_config)
        self.executor.on_var_done = self._on_var_done
        self.metrics = metrics
        self.idle_s = idle_s
        self.sessions: dict[str, _Session] = {}
        self._settled: list[_Waiter] = []  # waiters whose variables are all done
        self.engine_view = ProgramEngine(engine, self)

    # ---- what the handlers call (through AsyncEngine.call)

    def submit(self, sub: Submission, future: asyncio.Future) -> str:
        """Open or find the session, submit, activate; `future` gets the response body once
        every variable asked for is done. Returns the session id; raises APIError."""
        self.expire()
        ex = self.executor
        new = sub.session_id is None
        if new:
            session_id = ex.open(f"s-{uuid.uuid4().hex[:12]}")
            session = self.sessions[session_id] = _Session(session_id, time.monotonic())
        else:
            session = self.sessions.get(sub.session_id)
            if session is None:
                raise APIError(
                    404,
                    f"no open program session {sub.session_id!r} (closed, cancelled, or idle "
                    f"longer than {self.idle_s:g} s)",
                    "session_id",
                )
        try:
            self._check_gets(session.id, sub)
            try:
                ex.submit(session.id, sub.functions, sub.constants, sub.calls)
            except ValueError as e:  # names the call, function, placeholder or variable
                raise APIError(400, str(e), _param_of(str(e))) from None
        except APIError:
            if new:
                self._close(session)
            raise
        if self.metrics is not None:
            self.metrics.program_calls.inc(len(sub.calls))
        wanted: dict[str, None] = {}
        for var_ids, criteria in sub.gets:
            ex.activate(session.id, var_ids, criteria)
            wanted |= dict.fromkeys(var_ids)
        waiter = _Waiter(future, session, [ex.var(session.id, v) for v in wanted])
        session.waiters.append(waiter)
        session.close_when_idle = not sub.keep_session
        session.last_used = time.monotonic()
        if not waiter.pending:
            self._settled.append(waiter)
        self.flush()
        return session.id

    def delete(self, session_id: str) -> dict:
        """Cancel the session (its running requests aborted) and close it."""
        session = self._session(session_id)
        cancelled = self.executor.cancel(session.id)
        self.flush()  # its waiters answer with the cancellation errors
        self._close(session)
        return {"session_id": session.id, "cancelled": cancelled}

    def abandon(self, session_id: str) -> None:
        """The client went away while waiting: cancel and close the session."""
        session = self.sessions.get(session_id)
        if session is not None:
            self.executor.cancel(session.id, "the client disconnected")
            self.flush()
            self._close(session)

    def expire(self) -> None:
        """Close the sessions nobody waits on that are idle for longer than `idle_s`."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if not session.waiters and now - session.last_used > self.idle_s:
                logger.info("closing program session %s: idle for %.0f s", session.id, self.idle_s)
                self._close(session)

    def shutdown(self, reason: str) -> None:
        """Cancel every session; their waiting requests fail with EngineDeadError."""
        for session in list(self.sessions.values()):
            for waiter in session.waiters:
                settle(waiter.future, error=EngineDeadError(reason))
            session.waiters.clear()
            self.executor.cancel(session.id, reason)
            self._close(session)
        self._settled.clear()

    # ---- bookkeeping

    def flush(self) -> None:
        """Answer the waiters whose variables are all done; close the sessions asked to close
        once nobody waits on them. Called where the executor is between operations (after a
        step, after a submission): closing inside `on_var_done` would cancel tasks under the
        executor's feet."""
        while self._settled:
            waiter = self._settled.pop(0)
            session = waiter.session
            if waiter not in session.waiters:
                continue
            session.waiters.remove(waiter)
            session.last_used = time.monotonic()
            settle(waiter.future, self._answer(waiter))
            if session.close_when_idle and not session.waiters:
                self._close(session)

    def _on_var_done(self, app, var: Var) -> None:
        session = self.sessions.get(app.id)
        task = var.producer
        if task is not None and task.criteria is not None:  # an activated task ended
            if self.metrics is not None:
                self.metrics.program_tasks[task.state].inc()
            out = task.result
            if out is not None and session is not None:
                session.usage["prompt_tokens"] += len(task.prompt_ids or ())
                session.usage["completion_tokens"] += len(out.token_ids)
                session.usage["cached_tokens"] += out.num_cached_tokens
        if session is not None:
            for waiter in session.waiters:
                if var.id in waiter.pending:
                    waiter.pending.discard(var.id)
                    if not waiter.pending:
                        self._settled.append(waiter)

    def _answer(self, waiter: _Waiter) -> dict:
        values, errors = {}, {}
        for var in waiter.vars:
            if var.content is not None:
                values[var.id] = var.content
            else:
                e = var.error
                errors[var.id] = {
                    "message": str(e),
                    "function": e.function,
                    "placeholder": e.placeholder,
                }
        usage = {k: v - waiter.usage_before[k] for k, v in waiter.session.usage.items()}
        return {
            "object": "program",
            "session_id": waiter.session.id,
            "values": values,
            "errors": errors,
            "usage": usage,
        }

    def _check_gets(self, session_id: str, sub: Submission) -> None:
        known = self.executor.apps[session_id].vars
        new = set(sub.constants) | {v for c in sub.calls for v in c.outputs.values()}
        for var_ids, _ in sub.gets:
            for vid in var_ids:
                if vid not in known and vid not in new:
                    raise APIError(
                        400,
                        f"get: unknown variable {vid!r} in program session {session_id!r}",
                        "get",
                    )

    def _session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"no open program session {session_id!r}", "session_id")
        return session

    def _close(self, session: _Session) -> None:
        self.sessions.pop(session.id, None)
        self.executor.close(session.id)


def _param_of(message: str) -> str:
    """The request field a submission error is about."""
    if message.startswith("semantic function"):
        return "functions"
    if message.startswith("variable"):
        return "variables"
    return "calls"


class ProgramEngine:
    """The engine as `AsyncEngine` drives it when the server runs programs: every attribute is
    the engine's except `step` (the executor's step; returns every output, program tasks'
    included: the streams take their own, the metrics count all), `has_unfinished_requests`
    (the executor's: ready tasks count) and `abort_all` (every session is cancelled first)."""

    def __init__(self, engine, sessions: ProgramSessions):
        self.engine, self.sessions = engine, sessions

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self) -> list:
        target = self.sessions.target
        target.outputs = []
        self.sessions.executor.step()
        self.sessions.flush()
        return target.outputs

    def has_unfinished_requests(self) -> bool:
        return self.sessions.executor.has_unfinished()

    def abort_all(self) -> list[str]:
        self.sessions.shutdown("the server is shutting down")
        return self.engine.abort_all()


# ------------------------------------------------------------------------------------------------
# Event loop.


class ProgramRoutes:
    """The handlers of /v1/programs over `async_engine` (whose engine is
    `sessions.engine_view`)."""

    def __init__(self, async_engine: AsyncEngine, sessions: ProgramSessions):
        self.engine, self.sessions = async_engine, sessions

    async def post(self, body: ProgramRequest, request: Request):
        sub = parse(body)
        future = None
        try:
            future = self.engine.future()
            session_id = await self.engine.call(lambda: self.sessions.submit(sub, future))
            answer = await _or_disconnect(future, request)
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not serving: {e}") from None
        finally:
            if future is not None:
                future.cancel()  # a no-op once settled; else nobody will settle it
        if answer is None:  # the client went away: its session is cancelled
            with contextlib.suppress(EngineDeadError):
                await self.engine.call(lambda: self.sessions.abandon(session_id))
            return Response(status_code=499)
        return JSONResponse(answer)

    async def delete(self, session_id: str) -> dict:
        try:
            return await self.engine.call(lambda: self.sessions.delete(session_id))
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not serving: {e}") from None

    async def expire_forever(self) -> None:
        """Close idle sessions every so often (the server's lifespan runs it)."""
        interval = min(60.0, max(0.01, self.sessions.idle_s / 2))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.engine.call(self.sessions.expire)
            except EngineDeadError:
                return

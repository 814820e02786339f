"""`AsyncEngine`: one thread owns the `LLMEngine` (every JAX call happens there); an asyncio event
loop adds requests and reads their outputs.

    engine thread                                 event loop (HTTP handlers)
    -------------                                 --------------------------
    block on the command queue while idle   <--   add_requests(...) -> OutputStream
    apply every queued command (add, abort)  <--   close(stream): abort what has not finished
      (call: run fn, settle its future)      <--   await call(fn): fn() between two steps
    LLMEngine.step(); metrics.record_step
    loop.call_soon_threadsafe(deliver, outs) -->   each stream keeps its requests' latest output

A step's outputs cross threads in one call. A stream holds only the newest `RequestOutput` of each
of its requests (outputs are cumulative, so a slow reader merges the steps it missed instead of
queueing them): the engine never waits for a client and nothing grows with a client's slowness.
If the engine thread dies, every open stream fails with the reason, `error` is set (the server's
/health turns 503) and new requests are refused; the exception is logged. The futures of `call`
(and any made with `future()`) fail the same way, with EngineDeadError.

`engine` may be any object with the `LLMEngine` methods the thread uses (the server gives a view
that steps a `ProgramExecutor`: llmjax/serve/programs.py).

No jax here: the engine's own modules import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence

from llmjax.engine.engine import LLMEngine
from llmjax.engine.request import RequestOutput
from llmjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (it failed, or the server is shutting down)."""


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than the server admits (`max_num_queued`)."""


class OutputStream:
    """The outputs of the requests of one call (a completion with several prompts has several),
    in the order they change. `async for outputs in stream` yields lists of the outputs that
    changed since the last read (each the request's newest, cumulative) until all have finished;
    it raises EngineDeadError if the engine stops first. With `final_only`, the reader is woken
    once, when all have finished."""

    def __init__(self, request_ids: Sequence[str], final_only: bool):
        self.request_ids = list(request_ids)
        self._open = set(self.request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._final_only = final_only
        self._event = asyncio.Event()
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return not self._open

    @property
    def unfinished_ids(self) -> list[str]:
        return [r for r in self.request_ids if r in self._open]

    def _put(self, out: RequestOutput) -> None:
        self._pending[out.request_id] = out
        if out.finished:
            self._open.discard(out.request_id)
        if not self._final_only or not self._open:
            self._event.set()

    def _fail(self, error: str) -> None:
        self.error = error
        self._event.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[RequestOutput]:
        while not self._pending:
            if self.error is not None:
                raise EngineDeadError(self.error)
            if not self._open:
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
        outputs = list(self._pending.values())
        self._pending.clear()
        return outputs


class AsyncEngine:
    """Serves an `LLMEngine` from its own thread to one asyncio loop (see the module docstring).

    metrics: a `ServingMetrics` (llmjax/serve/metrics.py) fed after every step, or None.
    max_num_queued: at most this many requests wait (accepted, not yet running); further calls
        of `add_requests` raise EngineOverloadedError. None: no bound.
    """

    def __init__(self, engine: LLMEngine, metrics=None, max_num_queued: int | None = None):
        if max_num_queued is not None and max_num_queued < 0:
            raise ValueError(f"{max_num_queued=} must be >= 0 (None: no bound)")
        self.engine = engine
        self.metrics = metrics
        self.max_num_queued = max_num_queued
        self.error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._futures: set[asyncio.Future] = set()  # futures to fail if the thread stops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Waiting requests = adds not yet applied by the engine thread + its waiting queue.
        self._num_added = 0  # event loop: requests submitted
        self._num_applied = 0  # engine thread: requests handed to the engine
        self._num_engine_waiting = 0  # engine thread: the scheduler's waiting queue, last step

    # ------------------------------------------------------------------------------------------
    # Event loop side.

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread, delivering to `loop` (default: the running loop)."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="llmjax-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests accepted and not yet running (as of the engine's last step)."""
        return self._num_added - self._num_applied + self._num_engine_waiting

    def add_requests(
        self,
        requests: Sequence[tuple[list[int], SamplingParams]],
        *,
        request_id: str,
        arrival_time: float | None = None,
        prompts: Sequence[str | None] | None = None,
        final_only: bool = False,
        lora_request=None,
    ) -> OutputStream:
        """Queue (prompt token ids, sampling params) pairs as requests `request_id-0`, `-1`, ...,
        under the LoRA adapter `lora_request` (None: the base model); returns their stream.
        Raises EngineDeadError if the engine is not running and EngineOverloadedError if they
        would take the waiting requests past max_num_queued (nothing is queued then)."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine is not running")
        if self.max_num_queued is not None and self.num_waiting + len(requests) > (
            self.max_num_queued
        ):
            raise EngineOverloadedError(
                f"{self.num_waiting} requests are waiting; this server queues at most "
                f"{self.max_num_queued} (max_num_queued): retry later"
            )
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        prompts = prompts or [None] * len(requests)
        extra = {} if lora_request is None else {"lora_request": lora_request}
        items = [
            (f"{request_id}-{i}", ids, params, prompt, arrival_time, extra)
            for i, ((ids, params), prompt) in enumerate(zip(requests, prompts, strict=True))
        ]
        stream = OutputStream([item[0] for item in items], final_only)
        for rid in stream.request_ids:
            self._streams[rid] = stream
        self._num_added += len(items)
        self._commands.put(("add", items))
        return stream

    def future(self) -> asyncio.Future:
        """A future of the event loop that fails with EngineDeadError if the engine thread
        stops before it is settled (the engine thread settles it with `settle`). Raises
        EngineDeadError if the engine is not running."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine is not running")
        future = self._loop.create_future()
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return future

    async def call(self, fn):
        """`fn()` on the engine thread, between two steps (where only that thread may touch the
        engine and what drives it); returns its result or raises its exception. Raises
        EngineDeadError if the engine stops first."""
        future = self.future()
        self._commands.put(("call", (fn, future)))
        return await future

    def close(self, stream: OutputStream) -> None:
        """Done reading `stream`: its unfinished requests are aborted (their pages freed) before
        the engine's next step. Call it in a `finally`, so a client that goes away (a cancelled
        handler) aborts its requests."""
        unfinished = stream.unfinished_ids
        for rid in stream.request_ids:
            self._streams.pop(rid, None)
        if unfinished and self.error is None:
            self._commands.put(("abort", unfinished))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: every unfinished request is aborted and its stream fails."""
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %s s", timeout)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """On the engine thread: hand `outputs` made outside a step (a pause's aborts) to their
        streams."""
        if self.metrics is not None:
            for out in outputs:
                if out.finish_reason == "abort":
                    self.metrics.record_abort(out.request_id)
        if outputs:
            self._to_loop(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # closed by its reader
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_request(self, request_id: str, error: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream._fail(error)

    def _fail_all(self, error: str) -> None:
        for stream in set(self._streams.values()):
            stream._fail(error)
        self._streams.clear()
        for future in list(self._futures):
            if not future.done():
                future.set_exception(EngineDeadError(error))
        self._futures.clear()

    # ------------------------------------------------------------------------------------------
    # Engine thread.

    def _run(self) -> None:
        engine = self.engine
        # (a paused or sleeping engine has requests but no step to run: wait for a command)
        busy = lambda: engine.has_unfinished_requests() and getattr(engine, "can_step", True)
        try:
            while self._apply_commands(block=not busy()):
                if not busy():
                    self._set_queues()
                    continue
                t = time.perf_counter()
                outputs = engine.step()
                seconds = time.perf_counter() - t
                self._num_engine_waiting = len(engine.scheduler.waiting)
                if self.metrics is not None:
                    self.metrics.record_step(
                        engine.stats,
                        outputs,
                        seconds,
                        len(engine.scheduler.running),
                        self.num_waiting,
                    )
                    if getattr(engine, "lora", None) is not None:
                        self.metrics.record_loras(*engine.lora_names())
                if outputs:
                    self._to_loop(self._deliver, outputs)
        except BaseException as e:  # the engine's state is unknown: stop serving
            logger.exception("the engine thread failed; the server stops serving")
            self.error = f"the engine failed: {type(e).__name__}: {e}"
            self._to_loop(self._fail_all, self.error)
            return
        self.error = "the server is shutting down"
        self._to_loop(self._fail_all, self.error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command, waiting for one first if `block`; False once stopped."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind == "stop":
                for rid in self.engine.abort_all():
                    if self.metrics is not None:
                        self.metrics.record_abort(rid)
                return False
            if kind == "add":
                for rid, ids, params, prompt, arrival, extra in payload:
                    try:
                        self.engine.add_request(
                            ids, params, rid, prompt=prompt, arrival_time=arrival, **extra
                        )
                    except Exception as e:  # this request only: the engine is untouched
                        logger.warning("could not add request %s: %s", rid, e)
                        self._to_loop(self._fail_request, rid, f"{type(e).__name__}: {e}")
                self._num_applied += len(payload)
                self._num_engine_waiting = len(self.engine.scheduler.waiting)
            elif kind == "abort":
                for rid in payload:
                    self._abort(rid)
            elif kind == "call":
                fn, future = payload
                try:
                    result = fn()
                except Exception as e:  # the caller's: the engine thread goes on
                    settle(future, error=e)
                else:
                    settle(future, result)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _abort(self, request_id: str) -> None:
        if self.engine.abort_request(request_id) and self.metrics is not None:
            self.metrics.record_abort(request_id)

    def _set_queues(self) -> None:
        if self.metrics is not None:
            engine = self.engine
            self.metrics.set_queues(
                len(engine.scheduler.running), self.num_waiting, engine.stats.page_usage
            )

    def _to_loop(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)


def settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """Set `future`'s result (or exception) from any thread; a future already done (its
    reader gave up) is left alone."""

    def set_() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
        future.get_loop().call_soon_threadsafe(set_)

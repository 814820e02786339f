"""Drive an `LLMEngine` with a workload, in real time or all at once.

The replayer adds each request once its arrival time has passed, stamped with that intended
arrival (so time spent waiting for the engine's current step counts as queueing, as in a server),
steps the engine while anything is unfinished, and sleeps only when the engine is idle and the next
arrival is in the future. Every request decodes greedily for exactly `output_len` tokens.

A dependent request (`RequestSpec.parent`, e.g. a chat's next turn) becomes due only when its
parent's output has finished: its prompt is then known (the parent's prompt + the tokens the
parent generated + its own ids) and it arrives its `arrival_time` (think time) later.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence

from llmjax.bench.specs import RequestSpec, with_token_ids
from llmjax.engine.clock import WALL_CLOCK
from llmjax.engine.request import RequestMetrics, RequestOutput
from llmjax.progress import progress_bar
from llmjax.sampling_params import SamplingParams

FAILED_FINISH_REASONS = ("error", "abort")  # a parent finishing so has no conversation to continue


def replay(
    engine,
    specs: Sequence[RequestSpec],
    *,
    realtime: bool = True,
    seed: int = 0,
    clock: Callable[[], float] | None = None,
    progress: str | None = None,
) -> list[RequestOutput]:
    """Run `specs` through `engine` (an `LLMEngine` with no unfinished requests); returns one
    finished `RequestOutput` per spec, in the order of `specs`.

    realtime: add request i at start + specs[i].arrival_time (seconds on the engine's clock,
        `engine.clock`: wall time, or a simulated device's virtual clock, which an idle engine
        advances to the next arrival instead of sleeping; passed to `add_request` as its arrival
        time); False adds all at once, arriving at the start.
    seed: for the random token ids of length-only specs (`with_token_ids`).
    clock: a shared clock for multi-process runs (every process must see the same arrivals at
        the same step: `llmjax.parallel.distributed.leader_clock` gives process 0's
        time.perf_counter to all); then dependents also arrive relative to that clock's reading
        when their parent's output is seen, not to the parent's local finished_time.
    progress: a description for a progress bar of finished requests (on a terminal only).

    Dependent specs (`parent` set) are added only once the parent's output has finished, with the
    prompt token ids parent prompt + parent output + own ids (and no text `prompt`), arriving
    `arrival_time` seconds after the parent's `finished_time` (realtime) or at that finish time,
    added at once (not realtime). A dependent whose parent failed (an error, or finish_reason
    'error' or 'abort') is not run: its output is finished, finish_reason 'error', no tokens, an
    `error` naming the parent and why it failed, request_id 'not-run-<index>', and arrival and
    finish times when that became known; its own dependents are skipped alike.
    """
    if engine.has_unfinished_requests():
        raise ValueError("replay needs an idle engine: it has unfinished requests")
    specs = with_token_ids(
        specs, engine.config.model.vocab_size, tokenizer=engine.tokenizer, seed=seed
    )
    children: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.parent is not None:
            children.setdefault(spec.parent, []).append(i)
    shared = clock is not None
    engine_clock = getattr(engine, "clock", WALL_CLOCK)  # a duck-typed engine: wall time
    clock = clock or engine_clock.now
    advance_to = None if shared else getattr(engine_clock, "advance_to", None)
    start = clock()
    # Requests due to be added, as (due time, index, arrival stamp, prompt token ids): ties go in
    # list order. Independent ones from the start; a dependent one when its parent finishes.
    due: list[tuple[float, int, float, list[int]]] = []
    for i, spec in enumerate(specs):
        if spec.parent is None:
            t = start + spec.arrival_time
            due.append((t, i, t if realtime else start, list(spec.prompt_token_ids)))
    heapq.heapify(due)
    results: list[RequestOutput | None] = [None] * len(specs)
    index_of: dict[str, int] = {}
    bar = progress_bar(len(specs), progress, unit="req") if progress else None

    def finished(i: int, out: RequestOutput) -> None:
        """Record request i's output and release (or skip) its dependents."""
        stack = [(i, out)]
        while stack:
            i, out = stack.pop()
            results[i] = out
            if bar is not None:
                bar.update(1)
            for c in children.get(i, ()):
                spec = specs[c]
                ids = [*out.prompt_token_ids, *out.token_ids, *spec.prompt_token_ids]
                if out.error is not None or out.finish_reason in FAILED_FINISH_REASONS:
                    why = out.error or f"finish_reason={out.finish_reason!r}"
                    error = f"not run: its parent (request {i}) failed: {why}"
                    stack.append((c, _not_run(c, ids, error, clock())))
                else:
                    end = None if shared else out.metrics.finished_time
                    end = clock() if end is None else end
                    t = end + spec.arrival_time
                    heapq.heappush(due, (t, c, t if realtime else end, ids))

    while due or engine.has_unfinished_requests():
        now = clock()
        while due and (not realtime or due[0][0] <= now):
            _, i, arrival, ids = heapq.heappop(due)
            spec = specs[i]
            rid = engine.add_request(
                ids,
                SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                prompt=spec.prompt if spec.parent is None else None,
                arrival_time=arrival,
            )
            index_of[rid] = i
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in index_of:
                    finished(index_of[out.request_id], out)
        elif due and advance_to is not None:
            advance_to(due[0][0])  # a virtual clock: nothing runs until the next arrival
        elif due:
            time.sleep(max(0.0, due[0][0] - now))
    if bar is not None:
        bar.close()
    missing = [i for i, out in enumerate(results) if out is None]
    if missing:
        raise RuntimeError(f"the engine went idle without finishing requests {missing[:10]}")
    return results


def _not_run(index: int, prompt_token_ids: list[int], error: str, now: float) -> RequestOutput:
    return RequestOutput(
        request_id=f"not-run-{index}",
        prompt=None,
        prompt_token_ids=prompt_token_ids,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="error",
        metrics=RequestMetrics(arrival_time=now, finished_time=now),
        error=error,
    )


def warm_up(engine, specs: Sequence[RequestSpec], *, max_output_len: int = 64, seed: int = 0):
    """Compile the step shapes a run of `specs` will need, before measuring: replay them all at
    once with staggered short outputs (request i makes min(output_len, 1 + i % max_output_len)
    tokens), so prefill shapes and a falling number of concurrent decodes are both visited
    (dependent requests follow their parents at once, on the parents' shorter outputs). Shapes
    that only real-time arrivals produce may still compile later; compare `engine.num_compiles`
    before and after a measured run."""
    staggered = [
        dataclasses.replace(
            s, arrival_time=0.0, output_len=min(s.output_len, 1 + i % max_output_len)
        )
        for i, s in enumerate(specs)
    ]
    return replay(engine, staggered, realtime=False, seed=seed)

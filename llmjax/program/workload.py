"""Many programs arriving over time on one `ProgramExecutor` (the benchmark's driver).

    job = record("chain-0", lambda p: chain_summary(p, chunks), arrival=0.0)
    results = run_jobs(executor, [job, ...])      # JobResult per job: start, end, latency

`record` builds a program with the frontend against no service (nothing runs) and keeps its
functions, constants, calls and gets. `run_jobs` submits each job when its arrival time comes
(seconds after the run starts, on the executor's clock: wall time for a real engine, simulated
time for a simulated one), activates its gets and steps the executor until every job is done;
while nothing runs it waits for the next arrival (a sleep, or a jump of the virtual clock).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from llmjax.program.frontend import Program
from llmjax.program.graph import CallSpec


@dataclasses.dataclass
class Job:
    """A recorded program: what to submit and which variables to get, with what criteria."""

    name: str
    arrival: float
    functions: list
    constants: dict[str, str]
    calls: list[CallSpec]
    gets: list[tuple[str, str]]  # (variable id, criteria)
    kind: str = ""


@dataclasses.dataclass
class JobResult:
    name: str
    kind: str
    arrival: float  # seconds after the run's start
    end: float  # when its last asked-for variable was computed (seconds after the start)
    values: dict[str, str | None]
    errors: dict[str, str]
    app_id: str
    start: float = 0.0  # the run's start on the executor's clock (records' times minus it)

    @property
    def latency(self) -> float:
        return self.end - self.arrival


def tpot(record: dict) -> float | None:
    """A task's time per output token after its first (from `ProgramExecutor.records`)."""
    n = record["output_tokens"]
    if n < 2 or record["first_token"] is None:
        return None
    return (record["finish"] - record["first_token"]) / (n - 1)


class _Recorder:
    """A backend that runs nothing (`record`)."""

    def open(self) -> str:
        return "recording"

    def run(self, *args, **kwargs):
        raise RuntimeError("a recorded program cannot `get`: run it with run_jobs")

    def cancel(self, app_id: str) -> None:
        pass

    def close(self, app_id: str) -> None:
        pass


def record(
    name: str, build: Callable[[Program], list], arrival: float = 0.0, kind: str = ""
) -> Job:
    """A Job from `build(program)`, which calls semantic functions and returns [(variable,
    criteria)] to get."""
    with Program(_Recorder()) as program:
        gets = build(program)
    return Job(
        name,
        arrival,
        list(program.functions.values()),
        dict(program.constants),
        list(program.calls),
        [(v.id, c) for v, c in gets],
        kind,
    )


def run_jobs(
    executor, jobs: list[Job], on_step: Callable[[], None] | None = None
) -> list[JobResult]:
    """Run `jobs` (the module doc); results in the jobs' order."""
    clock = executor.clock
    t0 = clock.now()
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    open_jobs: dict[int, str] = {}
    results: dict[int, JobResult] = {}
    while pending or open_jobs:
        now = clock.now() - t0
        while pending and jobs[pending[0]].arrival <= now + 1e-12:
            i = pending.pop(0)
            job = jobs[i]
            app = executor.open(f"{job.name}", arrival_time=t0 + job.arrival)
            executor.submit(app, job.functions, job.constants, job.calls)
            for var_id, criteria in job.gets:
                executor.activate(app, [var_id], criteria)
            open_jobs[i] = app
        for i, app in list(open_jobs.items()):
            vars_ = [executor.var(app, v) for v, _ in jobs[i].gets]
            if all(v.done for v in vars_):
                end = max(
                    (
                        v.producer.finish_time
                        for v in vars_
                        if v.producer and v.producer.finish_time
                    ),
                    default=t0 + jobs[i].arrival,
                )
                results[i] = JobResult(
                    jobs[i].name,
                    jobs[i].kind,
                    jobs[i].arrival,
                    end - t0,
                    {v.id: v.content for v in vars_},
                    {v.id: str(v.error) for v in vars_ if v.error is not None},
                    app,
                    t0,
                )
                del open_jobs[i]
        if not pending and not open_jobs:
            break
        if executor.has_unfinished():
            executor.step()
            if on_step is not None:
                on_step()
        elif pending:
            executor.target.wait_until(t0 + jobs[pending[0]].arrival)
        elif open_jobs:
            raise RuntimeError(f"jobs {sorted(open_jobs)} cannot finish: nothing is running")
    return [results[i] for i in range(len(jobs))]

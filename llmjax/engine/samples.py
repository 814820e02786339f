"""n > 1 (`SamplingParams.n`): a request's samples, each its own request, emitted as one output.

The first sample keeps the request's id, the others are "<id>#<i>", each with its own seed
(seed + i, or drawn). With a prefix cache the others wait until the first has computed its
prompt, then find its pages cached; without one they start at once.
"""

from __future__ import annotations

import dataclasses

from llmjax.engine.request import CompletionOutput, Request, RequestMetrics, RequestStatus
from llmjax.engine.step import Step, StepFeature
from llmjax.tokenizer.detokenizer import StopStringMatcher


class Samples(StepFeature):
    """The engine's samples of n > 1 requests. Hooks: `update` releases the samples whose first
    has computed its prompt; `emit` folds each group's outputs into one (the first's fields,
    every sample in `outputs`)."""

    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[str, list[Request]] = {}  # request id -> its samples, first first
        self.group_of: dict[str, str] = {}  # sample id -> request id
        self.pending: dict[str, list[Request]] = {}  # waiting for the first's prompt

    def add(self, first: Request) -> None:
        """`first` asked for n > 1: make its other n - 1 samples (the module doc)."""
        engine = self.engine
        params, rid = first.sampling_params, first.request_id
        n = params.n
        seeds = [first.seed]
        for i in range(1, n):
            if params.seed is not None:
                seeds.append((params.seed + i) % 2**32)
            else:
                seeds.append(int(engine._seed_rng.integers(0, 2**32)))
        first.sampling_params = dataclasses.replace(params, n=1, seed=seeds[0])
        others = []
        for i in range(1, n):
            sample = dataclasses.replace(
                first,
                request_id=f"{rid}#{i}",
                sampling_params=dataclasses.replace(params, n=1, seed=seeds[i]),
                seed=seeds[i],
                output_token_ids=[],
                metrics=RequestMetrics(first.metrics.arrival_time),
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                stop_matcher=None,
                loaded_tokens={},
                matcher=None if first.matcher is None else first.matcher.deep_copy(),
            )
            if params.stop and engine.tokenizer is not None:
                sample.stop_matcher = StopStringMatcher(
                    engine.tokenizer, params.stop, params.include_stop_str_in_output
                )
            others.append(sample)
            engine._live.add(sample.request_id)
        self.groups[rid] = [first, *others]
        for r in self.groups[rid]:
            self.group_of[r.request_id] = rid
        if engine.block_manager.caching:
            self.pending[rid] = others
        else:
            for r in others:
                engine.scheduler.add(r)

    def abort(self, request_id: str) -> bool | None:
        """Abort every sample of `request_id`; None if it has no samples."""
        samples = self.groups.pop(request_id, None)
        if samples is None:
            return None
        engine = self.engine
        pending = {r.request_id for r in self.pending.pop(request_id, [])}
        now = engine.clock.now()
        aborted = False
        for r in samples:
            self.group_of.pop(r.request_id, None)
            if r.request_id in pending:
                engine._live.discard(r.request_id)
                r.finish("abort", now, RequestStatus.ABORTED)
                aborted = True
            else:
                aborted |= engine._abort_one(r.request_id)
        return aborted

    def is_sample(self, request_id: str) -> bool:
        """Whether `request_id` is a sample other than its group's first."""
        return self.group_of.get(request_id, request_id) != request_id

    def update(self, step: Step) -> None:
        """Samples whose first has computed its prompt (or ended) join the waiting queue."""
        for rid, others in list(self.pending.items()):
            first = self.groups[rid][0]
            if first.output_token_ids or first.status.is_done:
                for r in others:
                    self.engine.scheduler.add(r)
                del self.pending[rid]

    def emit(self, step: Step) -> None:
        """One output per request that got a token: a request with n samples once, all its
        samples in it (after the outputs of requests without samples)."""
        if not self.groups:
            return
        outputs, groups = [], []
        for o in step.outputs:
            rid = self.group_of.get(o.request_id)
            if rid is None:
                outputs.append(o)
            elif rid not in groups:
                groups.append(rid)
        step.outputs = outputs + [self._group_output(rid) for rid in groups]

    def _group_output(self, rid: str):
        """The output of a request with n samples: the first's fields, every sample in
        `outputs`, finished once all are (then the group is forgotten)."""
        samples = self.groups[rid]
        outs = [self.engine._output(r) for r in samples]
        first = outs[0]
        first.request_id = rid
        first.outputs = [
            CompletionOutput(
                i,
                o.text,
                o.token_ids,
                o.finish_reason,
                o.stop_reason,
                o.logprobs,
                o.cumulative_logprob,
            )
            for i, o in enumerate(outs)
        ]
        first.finished = all(o.finished for o in outs)
        if first.finished:
            del self.groups[rid]
            for r in samples:
                self.group_of.pop(r.request_id, None)
        return first

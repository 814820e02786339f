"""Logprobs and prompt logprobs (`SamplingParams.logprobs`, `prompt_logprobs`): the sampler's
results recorded on their requests, a step feature."""

from __future__ import annotations

from llmjax.engine.request import Logprob
from llmjax.engine.step import Step, StepFeature


class LogprobsStep(StepFeature):
    """Hook `collect`: each sampling row that asked for logprobs gets its new token's entry,
    each prompt-logprob row its prompt token's, from the runner's `last_logprobs` and
    `last_prompt_logprobs` (set only when a row of the step asked)."""

    def __init__(self, runner):
        self.runner = runner

    def collect(self, step: Step) -> None:
        logprobs = getattr(self.runner, "last_logprobs", None)
        if logprobs is not None:
            _record_logprobs(step.batch, step.next_ids, logprobs)
        prompt = getattr(self.runner, "last_prompt_logprobs", None)
        if step.sampling.prompt is not None and prompt is not None:
            _record_prompt_logprobs(step.batch, step.sampling.prompt.targets, prompt)


def _record_logprobs(batch, next_ids, logprobs) -> None:
    """Each sampling row that asked for logprobs gets its new token's {id: Logprob} (the top
    `logprobs` and the sampled one) before `Scheduler.update` appends the token."""
    top_ids, top_values, chosen, rank = logprobs
    for i, seq in enumerate(batch.seqs):
        req = seq.request
        k = req.sampling_params.logprobs
        if not seq.samples or k is None or req.status.is_done:
            continue
        entry = {
            int(t): Logprob(float(v), r + 1)
            for r, (t, v) in enumerate(zip(top_ids[i, :k], top_values[i, :k], strict=True))
        }
        token = int(next_ids[i])
        entry.setdefault(token, Logprob(float(chosen[i]), int(rank[i])))
        req.logprobs.append(entry)
        req.cumulative_logprob += float(chosen[i])


def _record_prompt_logprobs(batch, targets, results) -> None:
    """Each prompt-logprob row's entry, appended to its request in prompt order."""
    target_lp, rank, top_ids, top_values = results
    row = 0
    for seq in batch.seqs:
        req, n = seq.request, seq.num_new_tokens
        k = req.sampling_params.prompt_logprobs
        for j in range(n):
            r = row + j
            if k is None or targets[r] < 0 or req.prompt_logprobs is None:
                continue
            if len(req.prompt_logprobs) != seq.start + j + 1:  # recorded before a preemption
                continue
            entry = {
                int(t): Logprob(float(v), q + 1)
                for q, (t, v) in enumerate(zip(top_ids[r, :k], top_values[r, :k], strict=True))
            }
            entry.setdefault(int(targets[r]), Logprob(float(target_lp[r]), int(rank[r])))
            req.prompt_logprobs.append(entry)
        row += n

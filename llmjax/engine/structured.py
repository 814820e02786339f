"""Structured outputs' part of the engine step: `StructuredStep` fills the constrained rows'
token bitmask from their grammars (grammar.py: llguidance's matchers, `StructuredOutputs`) while
the device runs the step's forward."""

from __future__ import annotations

from llmjax.engine.grammar import StructuredOutputs, grammar_of
from llmjax.engine.step import Step, StepFeature

__all__ = ["StructuredOutputs", "StructuredStep", "grammar_of"]


class StructuredStep(StepFeature):
    """Structured outputs' part of the engine step (a `StepFeature`). Hook `prepare`: a step
    with constrained rows gives the runner `sampling.bitmask_fn`, which fills their rows of the
    bitmask; the runner calls it after dispatching the forward, so the grammar work on the host
    overlaps the device's. (The sampled token advances each matcher in `Scheduler.update`.)"""

    def __init__(self, engine):
        self.engine = engine

    def prepare(self, step: Step) -> None:
        constrained = [
            (i, s.request.matcher)
            for i, s in enumerate(step.batch.seqs)
            if s.samples and s.request.matcher is not None
        ]
        if constrained:
            rows = len(step.sampling.temperature)
            outputs = self.engine.structured
            step.sampling.bitmask_fn = lambda: outputs.bitmask(constrained, rows)

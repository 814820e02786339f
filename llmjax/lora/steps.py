"""`LoRASteps`: the engine step's LoRA stage work (llmjax/engine/step.py's protocol)."""

from __future__ import annotations

import numpy as np

from llmjax.engine.step import Step, StepFeature


class LoRASteps(StepFeature):
    """With adapters (EngineConfig.lora): hook `scheduled` gives the batch's adapters their
    device slots (`LoRAManager.slots_for`, writing the missing ones before the step is
    launched); hook `prepare` marks each token row with its request's slot
    (`StepInput.lora_slots`; -1: the base model, and the padding)."""

    def __init__(self, engine):
        self.manager = engine.lora
        self._slots: dict[int, int] = {}

    def scheduled(self, step: Step) -> None:
        if step.batch:
            ids = (s.request.lora_int_id for s in step.batch.seqs)
            self._slots = self.manager.slots_for(i for i in ids if i)

    def prepare(self, step: Step) -> None:
        if not step.batch:
            return
        si = step.step_input
        slots = np.full(len(si.token_ids), -1, np.int32)
        cu = np.asarray(si.cu_q_lens)
        for i, seq in enumerate(step.batch.seqs):
            if seq.request.lora_int_id:
                slots[cu[i] : cu[i + 1]] = self._slots[seq.request.lora_int_id]
        step.step_input = si._replace(lora_slots=slots)

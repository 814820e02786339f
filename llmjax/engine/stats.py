"""Engine-level counters: steps, tokens per step, preemptions, page usage, host vs device time."""

from __future__ import annotations

import dataclasses

from llmjax.engine.scheduler import ScheduledBatch


@dataclasses.dataclass
class EngineStats:
    num_pages: int  # usable KV pages
    num_steps: int = 0
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    num_decode_tokens: int = 0  # steps' single-token decodes
    num_preemptions: int = 0
    num_used_pages: int = 0
    peak_used_pages: int = 0
    host_time_s: float = 0.0  # schedule + pack + update
    device_time_s: float = 0.0  # the jitted step, including the transfer of its results

    def record_step(
        self, batch: ScheduledBatch, host_s: float, device_s: float, num_used_pages: int
    ) -> None:
        self.num_steps += 1
        for seq in batch.seqs:
            is_decode = seq.num_new_tokens == 1 and seq.start >= len(seq.request.prompt_token_ids)
            if is_decode:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += seq.num_new_tokens
        self.num_batched_tokens += batch.num_tokens
        self.num_preemptions += len(batch.preempted)
        self.num_used_pages = num_used_pages
        self.peak_used_pages = max(self.peak_used_pages, num_used_pages)
        self.host_time_s += host_s
        self.device_time_s += device_s

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / max(self.num_steps, 1)

    @property
    def page_usage(self) -> float:
        return self.num_used_pages / max(self.num_pages, 1)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d |= {"tokens_per_step": self.tokens_per_step, "page_usage": self.page_usage}
        return d

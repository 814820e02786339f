"""Engine-level counters: steps, tokens per step, preemptions, page usage, prefix-cache hits and
evictions, host vs device time."""

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
    num_cached_prefill_tokens: int = 0  # prompt (and recomputed) tokens taken from the cache
    num_preemptions: int = 0
    num_used_pages: int = 0  # held by running requests (private, or shared and locked)
    peak_used_pages: int = 0
    num_cached_pages: int = 0  # in the prefix cache (shared or evictable)
    num_evicted_pages: int = 0  # evicted from the prefix cache
    evictions_base: int = 0  # the cache's eviction count when these stats started
    host_time_s: float = 0.0  # schedule + pack + update
    device_time_s: float = 0.0  # the jitted step, including the transfer of its results

    def record_step(
        self,
        batch: ScheduledBatch,
        host_s: float,
        device_s: float,
        num_used_pages: int,
        num_cached_pages: int = 0,
        num_evictions: int = 0,
    ) -> None:
        self.num_steps += 1
        for seq in batch.seqs:
            is_decode = seq.num_new_tokens == 1 and seq.start >= len(seq.request.prompt_token_ids)
            if is_decode:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += seq.num_new_tokens
        self.num_batched_tokens += batch.num_tokens
        self.num_cached_prefill_tokens += batch.num_cached_tokens
        self.num_preemptions += len(batch.preempted)
        self.num_used_pages = num_used_pages
        self.peak_used_pages = max(self.peak_used_pages, num_used_pages)
        self.num_cached_pages = num_cached_pages
        self.num_evicted_pages = num_evictions - self.evictions_base
        self.host_time_s += host_s
        self.device_time_s += device_s

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / max(self.num_steps, 1)

    @property
    def page_usage(self) -> float:
        return self.num_used_pages / max(self.num_pages, 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefill tokens taken from the cache / prefill tokens needed (cached + computed)."""
        total = self.num_cached_prefill_tokens + self.num_prefill_tokens
        return self.num_cached_prefill_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["evictions_base"]
        d |= {
            "tokens_per_step": self.tokens_per_step,
            "page_usage": self.page_usage,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }
        return d

"""Engine-level counters: steps, tokens per step, preemptions, page usage, prefix-cache hits and
evictions, host vs device time; with pipeline parallelism, the bubbles.

Pipeline bubbles (pp > 1, llmjax/parallel/pipeline.py): every tick runs all stages at the size of
its largest micro-batch, so a stage holding a smaller micro-batch (or none) idles for the
difference. `pipeline_bubble_fraction` = 1 - (tokens the stages computed) / (pp x the largest
micro-batch's tokens, summed over ticks): the share of stage time spent waiting, counted in
tokens (a shape-level measure that holds on fake devices; token count stands in for time).
`pipeline_idle_fraction` counts whole empty stage-ticks (pipeline fill and drain). On a
simulated device (llmjax/sim/), whose runner knows each stage's modeled seconds,
`pipeline_time_bubble_fraction` is the same share in time: 1 - (busy stage seconds) / (pp x the
ticks' seconds)."""

from __future__ import annotations

import dataclasses

from llmjax.engine.scheduler import ScheduledBatch


@dataclasses.dataclass
class EngineStats:
    num_pages: int  # usable KV pages
    num_steps: int = 0
    num_batched_tokens: int = 0
    # the steps' token buckets: num_batched_tokens plus the padding each step ran as (the
    # compiled shape's T; a simulated or pipelined step that knows none counts its real tokens)
    num_padded_tokens: int = 0
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
    num_pipeline_ticks: int = 0
    pipeline_stage_tokens: int = 0  # sum over ticks and stages of the micro-batch's tokens
    pipeline_capacity_tokens: int = 0  # sum over ticks of pp x the tick's largest micro-batch
    num_idle_stage_ticks: int = 0  # (tick, stage) pairs with no micro-batch
    num_stage_ticks: int = 0  # (tick, stage) pairs
    pipeline_busy_s: float = 0.0  # simulated device: sum over ticks and stages of busy seconds
    pipeline_tick_s: float = 0.0  # simulated device: sum over ticks of pp x the tick's seconds
    # sparse_kv (llmjax/sparse/): KV bytes fetched host -> device. `h2d_bytes` counts the rows
    # each step needs (full fetches: every cached token of every layer; InfiniGen: the selected
    # rows of speculated layers); `h2d_buffer_bytes` what the static-shape buffers copy.
    h2d_bytes: int = 0
    h2d_buffer_bytes: int = 0
    decode_h2d_bytes: int = 0  # in decode-only steps
    num_decode_only_tokens: int = 0  # tokens of decode-only steps
    num_sparse_steps: int = 0  # steps that took InfiniGen's sparse path
    num_pool_evictions: int = 0  # pages the host pool evicted (SparseKVConfig.capacity < 1)
    # Speculative decoding (vLLM's spec_decode counters): decodes that verified proposals,
    # the proposals verified, and those accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    def record_step(
        self,
        batch: ScheduledBatch,
        host_s: float,
        device_s: float,
        num_used_pages: int,
        num_cached_pages: int = 0,
        num_evictions: int = 0,
        num_padded_tokens: int | None = None,
    ) -> None:
        """`num_padded_tokens`: the tokens the step's shape bucket holds (None: no padding)."""
        self.num_steps += 1
        for seq in batch.seqs:
            if seq.is_decode:
                self.num_decode_tokens += 1  # its proposals: num_spec_draft_tokens
            else:
                self.num_prefill_tokens += seq.num_new_tokens
        self.num_batched_tokens += batch.num_tokens
        self.num_padded_tokens += max(num_padded_tokens or 0, batch.num_tokens)
        self.num_cached_prefill_tokens += batch.num_cached_tokens
        self.num_preemptions += len(batch.preempted)
        self.num_used_pages = num_used_pages
        self.peak_used_pages = max(self.peak_used_pages, num_used_pages)
        self.num_cached_pages = num_cached_pages
        self.num_evicted_pages = num_evictions - self.evictions_base
        self.host_time_s += host_s
        self.device_time_s += device_s

    def record_tick(self, stage_tokens: list[int], stage_seconds: list[float] | None = None):
        """One pipeline tick: each stage's micro-batch size in tokens (0: empty) and, where the
        runner models them, its busy seconds."""
        if stage_seconds is not None:
            self.pipeline_busy_s += sum(stage_seconds)
            self.pipeline_tick_s += len(stage_seconds) * max(stage_seconds)
        self.num_pipeline_ticks += 1
        self.pipeline_stage_tokens += sum(stage_tokens)
        self.pipeline_capacity_tokens += len(stage_tokens) * max(stage_tokens)
        self.num_idle_stage_ticks += sum(t == 0 for t in stage_tokens)
        self.num_stage_ticks += len(stage_tokens)

    def record_fetch(
        self, h2d_bytes: int, buffer_bytes: int, decode_only: bool, sparse: bool, tokens: int
    ) -> None:
        """One sparse_kv step's host -> device KV traffic."""
        self.h2d_bytes += h2d_bytes
        self.h2d_buffer_bytes += buffer_bytes
        self.num_sparse_steps += sparse
        if decode_only:
            self.decode_h2d_bytes += h2d_bytes
            self.num_decode_only_tokens += tokens

    @property
    def h2d_bytes_per_decode_token(self) -> float:
        """KV bytes fetched per generated token in decode-only steps (InfiniGen's metric)."""
        return self.decode_h2d_bytes / max(self.num_decode_only_tokens, 1)

    @property
    def pipeline_bubble_fraction(self) -> float:
        cap = self.pipeline_capacity_tokens
        return 1.0 - self.pipeline_stage_tokens / cap if cap else 0.0

    @property
    def pipeline_time_bubble_fraction(self) -> float | None:
        """Simulated device: the bubble share in modeled time (None when not modeled)."""
        return 1.0 - self.pipeline_busy_s / self.pipeline_tick_s if self.pipeline_tick_s else None

    @classmethod
    def merge(cls, stats: list[EngineStats]) -> EngineStats:
        """Several engines' counters as one (every field summed: a cluster's totals)."""
        if not stats:
            raise ValueError("no stats to merge")
        total = cls(num_pages=0)
        for f in dataclasses.fields(cls):
            setattr(total, f.name, sum(getattr(s, f.name) for s in stats))
        return total

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (None before any verification)."""
        if not self.num_spec_draft_tokens:
            return None
        return self.num_spec_accepted_tokens / self.num_spec_draft_tokens

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verifying decode gave: 1 + accepted proposals per verification (vLLM's mean
        acceptance length; None before any)."""
        if not self.num_spec_drafts:
            return None
        return 1 + self.num_spec_accepted_tokens / self.num_spec_drafts

    @property
    def pipeline_idle_fraction(self) -> float:
        return self.num_idle_stage_ticks / self.num_stage_ticks if self.num_stage_ticks else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / max(self.num_steps, 1)

    @property
    def padded_tokens_per_step(self) -> float:
        return self.num_padded_tokens / max(self.num_steps, 1)

    @property
    def padding_fraction(self) -> float:
        """Of the tokens the steps ran (their buckets), the share that was padding."""
        return (
            1.0 - self.num_batched_tokens / self.num_padded_tokens
            if self.num_padded_tokens
            else 0.0
        )

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
            "padded_tokens_per_step": self.padded_tokens_per_step,
            "padding_fraction": self.padding_fraction,
            "page_usage": self.page_usage,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "pipeline_bubble_fraction": self.pipeline_bubble_fraction,
            "pipeline_idle_fraction": self.pipeline_idle_fraction,
            "pipeline_time_bubble_fraction": self.pipeline_time_bubble_fraction,
            "h2d_bytes_per_decode_token": self.h2d_bytes_per_decode_token,
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "spec_mean_accepted_length": self.spec_mean_accepted_length,
        }
        return d

"""Async scheduling (`EngineConfig.async_scheduling`; vLLM's name, SGLang's overlap scheduler):
the host schedules and packs step N + 1 while the device runs step N.

    launch N        (JAX dispatches it and returns at once; the device runs N)
    schedule N + 1  against the state N will leave: each request that samples in N counts one
                    more token, pending (`Scheduler.advance`), so a running decode is decoded
                    again; a request whose pending token is its last (max_tokens,
                    max_model_len) is not
    prepare N + 1   a pending token's id is named by its row in N's sampled ids
                    (`SamplingInput.token_rows`); the device fills it in before the forward
                    (`ModelRunner._pending_filled`), with no round trip to the host
    launch N + 1
    collect N       wait for N's tokens (the device is already busy with N + 1)
    update N        fill the pending tokens in; a request that N finished (EOS, a stop token or
                    string) gives back its step-N + 1 row's work (its tokens and pages), and
                    N + 1's update skips it; an abort or a preemption between the two steps is
                    handled the same way (requests in a step in flight are never preempted)
    emit N

So host work (schedule, pack, update, emit) hides behind the device's step instead of adding to
it. Outputs are the same as the synchronous loop's: a request's tokens do not depend on what
it was batched with, and sampling draws from (seed, token index), which the pending tokens
count.

What needs a token on the host before the next step is shaped:
- per step: a request in the step in flight with structured outputs (the next bitmask follows
  the grammar) or penalties (they count the generated tokens) makes the engine land that step
  before scheduling the next (`Overlap.before_schedule`; `num_sync_steps` counts them);
- per engine (`overlap_blockers`): speculative decoding (proposals come from the newest
  tokens and verification rewrites them), pp > 1 (its ticks already overlap micro-batches),
  sparse_kv, the KV tiers and the prefill role (their bookkeeping reads each step's pages and
  parks on the first token) run the synchronous loop.
"""

from __future__ import annotations

from llmjax.engine.step import Step


def overlap_blockers(engine) -> list[str]:
    """What keeps `engine` in the synchronous loop (empty: it may overlap)."""
    cfg = engine.config
    why = []
    if engine.speculator is not None:
        why.append("speculative decoding")
    if cfg.parallel.pp > 1:
        why.append("pp > 1")
    if cfg.sparse_kv.enabled:
        why.append(f"sparse_kv={cfg.sparse_kv.mode!r}")
    if engine.kv_tiers is not None:
        why.append("the KV tiers")
    if engine.role == "prefill":
        why.append("the prefill role")
    return why


class Overlap:
    """Which launched steps the engine collects and updates when (the module doc). With
    `enabled` False every step lands right after its launch (the synchronous loop)."""

    def __init__(self, engine, enabled: bool):
        self.scheduler = engine.scheduler
        self.enabled = enabled
        self.in_flight: Step | None = None  # launched, not yet collected
        self.num_sync_steps = 0  # steps landed early: the next one needed their tokens

    def before_schedule(self) -> list[Step]:
        """The step in flight, if the next step needs one of its tokens on the host (a request
        in it with structured outputs or penalties), else nothing."""
        prev = self.in_flight
        if prev is None or not any(
            s.samples and s.request.needs_host_tokens for s in prev.batch.seqs
        ):
            return []
        self.in_flight = None
        self.num_sync_steps += 1
        return [prev]

    def pending_rows(self) -> dict[str, int] | None:
        """Request id -> its row in the step in flight, for the requests it samples."""
        prev = self.in_flight
        if prev is None:
            return None
        return {s.request.request_id: i for i, s in enumerate(prev.batch.seqs) if s.samples}

    def after_launch(self, step: Step) -> list[Step]:
        """The steps to collect and update now: synchronously, `step` (if launched); with
        overlap, the one launched before it, while `step` stays in flight."""
        launched = step.launched is not None
        if not self.enabled:
            return [step] if launched else []
        prev, self.in_flight = self.in_flight, None
        if launched:
            self.scheduler.advance(step.batch)
            self.in_flight = step
        return [] if prev is None else [prev]

"""Property tests of the host-side scheduler, block manager and packer, with a fake paged model.

For each policy, hypothesis draws a small KV cache (so that decodes preempt), page size, budgets,
`max_model_len` and requests (arrival steps, aborts, stop tokens, EOS, prompts that must be
rejected). A loop that mirrors `LLMEngine.step` (schedule -> pack -> run -> update) serves them
with `FakePagedModel`, whose next token is a hash of the request's tokens *read back through its
page table* from a simulated cache.

After every step: `BlockManager.check_invariants()` (no page leaked, owned twice or reserved);
only running requests own pages, enough for their computed tokens; the batch respects the token
budget and `max_num_seqs`, schedules no request twice and every scheduled request has pages for its
new tokens; preempted requests are the newest running ones and wait at the front of the queue with
`num_computed_tokens == 0` and their generated tokens kept; per policy: `sarathi`/`splitfuse` skip
no decode and leave budget unused only when nothing more can run (or when `fit_to_buckets` cut
the step's last prefill chunk to its token bucket: exactly when that defers fewer tokens than the
padding it saves, never a decode, never to nothing), `prefill_first` steps are
prefill-only or decode-only and prefer admissions, `decode_first` admits only when nothing runs.
Each step's tokens are read back from the simulated cache exactly. In the speculative mode an
oracle proposes a few of each decode's true next tokens and then wrong ones; the fake model
verifies them (accepting while they equal its own), the proposals' pages are taken without
preempting and those of rejected ones given back (no running request holds pages beyond its
tokens), and outputs stay those of the request alone. The loop must end within a
step bound (else: livelock). At the end every request is finished, aborted or rejected (rejected
iff invalid), all pages are free, and every output equals the output recomputed from the request's
prompt alone, with the right finish reason (a paging or packing error changes the hash). Some
requests run under LoRA adapters (ids 1-3, `max_loras` 1 or 2): at most `max_loras` distinct
ones run at once, and a prefix cached under one adapter never serves another (the fake cache
records which adapter wrote a slot).

No jax: the loop uses only host-side modules (checked in a subprocess, since conftest imports jax
for its gpu marker).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, target
from hypothesis import strategies as st

from configs.tiny import TINY
from llmjax.config import (
    SCHEDULER_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from llmjax.engine.batch import Buckets, pack, token_buckets
from llmjax.engine.block_manager import BlockManager, pages_needed
from llmjax.engine.engine import InvalidRequest, LLMEngine
from llmjax.engine.policies import make_scheduler
from llmjax.engine.radix_cache import RadixCache, make_prefix_cache
from llmjax.engine.request import Request, RequestStatus
from llmjax.engine.speculative import Speculator
from llmjax.lora import LoRARequest
from llmjax.model.step_input import RESERVED_PAGE
from llmjax.sampling_params import SamplingParams
from tests.fake_model import (
    UNWRITTEN,
    FakePagedModel,
    FakeRunner,
    lora_encoded,
    next_token,
    reference_generation,
)

CHUNKED = ("sarathi", "splitfuse")

PROPERTY_SETTINGS = settings(
    max_examples=250,  # x 12 cases (the async engine property test adds 8 x 40)
    deadline=None,
    # The same examples on every run of one process's imports (Hypothesis also draws constants
    # from the loaded modules, so the full suite's examples differ from this file's alone).
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # no explain phase: tracing every line of a failing example took CI over 15 minutes
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


# ---- scenarios -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int  # step at which it is added
    abort_at: int | None  # step at which it is aborted (before that step's schedule), if any
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    lora: int = 0  # its LoRA adapter's id (0: the base model)


@dataclasses.dataclass(frozen=True)
class Scenario:
    policy: str
    page_size: int
    num_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    requests: tuple[RequestSpec, ...]
    watermark: float = 0.0
    vocab_size: int = 256
    prefix_cache: str = "none"
    admission_order: str = "fcfs"
    # Pipeline parallelism: a batch's tokens come back this many steps after it is scheduled
    # (LLMEngine.step with pp > 1); meanwhile its requests are in flight (Scheduler.in_flight).
    pipeline_depth: int = 1
    # SchedulerConfig.balance_micro_batches (with pipeline_depth > 1): at most
    # ceil(decoding requests / depth) decodes per batch.
    balance_micro_batches: bool = False
    # Speculative decoding: up to this many proposals per decode (0: off), from an oracle
    # that gets a random number of leading tokens right (`OracleSpeculator`).
    num_speculative_tokens: int = 0
    # EngineConfig.token_buckets_per_octave: the token counts steps are packed to
    token_buckets_per_octave: int = 4
    # SchedulerConfig.fit_to_buckets: the last prefill chunk cut to land on a token bucket
    fit_to_buckets: bool = True
    # SchedulerConfig.fit_min_tokens (drawn small: the default, 128, is past these budgets)
    fit_min_tokens: int = 128
    # LoRAConfig.max_loras: at most this many distinct adapters run at once (None: no LoRA)
    max_loras: int | None = None

    def config(self) -> EngineConfig:
        return EngineConfig(
            model=TINY.replace(vocab_size=self.vocab_size),
            cache=CacheConfig(
                page_size=self.page_size,
                num_pages=self.num_pages,
                watermark=self.watermark,
                prefix_cache=self.prefix_cache,
            ),
            scheduler=SchedulerConfig(
                policy=self.policy,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                admission_order=self.admission_order,
                balance_micro_batches=self.balance_micro_batches,
                fit_to_buckets=self.fit_to_buckets,
                fit_min_tokens=self.fit_min_tokens,
            ),
            max_model_len=self.max_model_len,
            token_buckets_per_octave=self.token_buckets_per_octave,
            compilation_cache_dir="",
            speculative=SpeculativeConfig(
                method="ngram" if self.num_speculative_tokens else "none",
                num_speculative_tokens=max(1, self.num_speculative_tokens),
                adaptive=False,
            ),
        )

    def is_valid(self, spec: RequestSpec) -> bool:
        """Whether the engine must accept `spec` (independent of `LLMEngine.validate_request`)."""
        n = len(spec.prompt)
        total = min(n + spec.max_tokens, self.max_model_len)
        return (
            1 <= n < self.max_model_len
            and all(0 <= t < self.vocab_size for t in spec.prompt)
            and pages_needed(total, self.page_size) <= self.num_pages - 1
        )

    def expected(self, spec: RequestSpec) -> tuple[list[int], str]:
        return reference_generation(
            spec.prompt,
            max_tokens=spec.max_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            stop_token_ids=spec.stop_token_ids,
            eos_token_ids=TINY.eos_token_ids,
            ignore_eos=spec.ignore_eos,
            lora_id=spec.lora,
        )


class OracleSpeculator(Speculator):
    """Proposals for the fake model: its true next tokens (`next_token` of the request's
    tokens and the proposals before), the first `c` of them kept and the rest changed, `c`
    drawn from a hash of the request's tokens (so a run is deterministic)."""

    def __init__(self, config, vocab_size: int):
        super().__init__(config)
        self.vocab_size = vocab_size

    def propose(self, req, max_k: int) -> list[int]:
        k = min(max_k, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        tokens = req.token_ids_slice(0, req.num_tokens)
        rng = np.random.default_rng(next_token(tokens, 1 << 30))
        keep = int(rng.integers(0, k + 1))
        out = []
        for j in range(k):
            t = next_token(lora_encoded(tokens + out, req.lora_int_id), self.vocab_size)
            if j >= keep:
                t = (t + 1 + int(rng.integers(0, self.vocab_size - 1))) % self.vocab_size
            out.append(t)
        return out

    def select(self, offers, num_tokens, num_decodes):
        """Keep a hash-drawn number of each request's proposals (the adaptive choice keeps
        any prefix of them)."""
        out = []
        for req, proposals in offers:
            tokens = req.token_ids_slice(0, req.num_tokens)
            out.append(next_token(tokens, 1 << 20) % (len(proposals) + 2))
        return [min(k, len(p)) for k, (_, p) in zip(out, offers, strict=True)]


def _output_alone(spec: RequestSpec, max_model_len: int, vocab_size: int) -> list[int]:
    """What `spec` generates alone ([] if it would be rejected)."""
    if not 0 < len(spec.prompt) < max_model_len or max(spec.prompt) >= vocab_size:
        return []
    out, _ = reference_generation(
        spec.prompt,
        max_tokens=spec.max_tokens,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        stop_token_ids=spec.stop_token_ids,
        eos_token_ids=TINY.eos_token_ids,
        ignore_eos=spec.ignore_eos,
        lora_id=spec.lora,
    )
    return out


@st.composite
def scenarios(draw, policy: str, prefix_cache: str = "none", admission_order: str = "fcfs"):
    """A random `Scenario`. With a prefix cache, prompts share prefixes: some start with part of
    one of a few common sequences, some continue an earlier request's prompt and the output it
    generates (a chat's next turn)."""
    page_size = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(2, 80))
    max_num_seqs = draw(st.integers(1, 8))
    if policy in CHUNKED:
        budget = draw(st.integers(1, 64))
    else:  # whole prompts: EngineConfig requires a budget for the longest one
        budget = draw(st.integers(max_model_len, max_model_len + 32))
    watermark = draw(st.sampled_from([0.0, 0.1, 0.3]))
    vocab_size = draw(st.sampled_from([256, 16, 4]))  # small vocabularies stop (EOS=2) often
    tokens = st.integers(0, vocab_size - 1)

    max_prompt_len = min(60, max_model_len - 1)
    # LoRA adapters (ids 1-3) on some requests, at most max_loras of them running at once
    max_loras = draw(st.sampled_from([None, None, 1, 2]), label="max_loras")
    shared = []
    if prefix_cache != "none":
        common = st.lists(tokens, min_size=1, max_size=max_prompt_len)
        shared = draw(st.lists(common, min_size=1, max_size=3), label="common prefixes")

    specs = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["ok"] * 8 + ["empty", "too_long", "bad_token"]))
        if kind == "empty":
            prompt = []
        elif kind == "too_long":
            prompt = draw(st.lists(tokens, min_size=max_model_len, max_size=max_model_len + 3))
        else:
            prompt = draw(st.lists(tokens, min_size=1, max_size=max_prompt_len))
            source = (
                draw(st.sampled_from(["fresh", *["shared", "next_turn"] * 2])) if shared else ""
            )
            if source == "shared":
                base = draw(st.sampled_from(shared))
                prompt = (base[: draw(st.integers(1, len(base)))] + prompt)[:max_prompt_len]
            elif source == "next_turn" and specs:
                prev = draw(st.sampled_from(specs))
                out = _output_alone(prev, max_model_len, vocab_size)
                prompt = (list(prev.prompt) + out + prompt)[:max_prompt_len]
            if kind == "bad_token":
                prompt[draw(st.integers(0, len(prompt) - 1))] = vocab_size + draw(st.integers(0, 9))
        arrival = draw(st.integers(0, 12))
        abort_at = None
        if draw(st.integers(0, 5)) == 0:
            abort_at = arrival + draw(st.integers(0, 30))
        specs.append(
            RequestSpec(
                prompt=tuple(prompt),
                max_tokens=draw(st.integers(1, 20)),
                arrival=arrival,
                abort_at=abort_at,
                stop_token_ids=tuple(draw(st.lists(tokens, max_size=2))),
                ignore_eos=draw(st.booleans()),
                lora=draw(st.integers(0, 3)) if max_loras else 0,
            )
        )

    # A small cache: mostly every request fits alone but not all together, so that decodes
    # preempt; sometimes roomy; sometimes too small for some requests (rejected).
    needs = [
        pages_needed(min(len(r.prompt) + r.max_tokens, max_model_len), page_size) for r in specs
    ]
    big = max(needs)
    cache = draw(st.sampled_from(["tight", "tight", "roomy", "tiny"]))
    if cache == "tight":
        num_pages = 1 + big + draw(st.integers(0, big // 2))
    elif cache == "roomy":
        num_pages = 1 + draw(st.integers(big, max(big, sum(needs))))
    else:
        num_pages = 1 + draw(st.integers(1, big))
    return Scenario(
        policy=policy,
        prefix_cache=prefix_cache,
        admission_order=admission_order,
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        requests=tuple(specs),
        watermark=watermark,
        vocab_size=vocab_size,
        pipeline_depth=(depth := draw(st.sampled_from([1, 1, 2, 3]), label="pipeline depth")),
        balance_micro_batches=depth > 1 and draw(st.booleans(), label="balance micro-batches"),
        num_speculative_tokens=0 if depth > 1 else draw(st.sampled_from([0, 0, 1, 3])),
        token_buckets_per_octave=draw(st.sampled_from([1, 2, 4]), label="token buckets"),
        fit_to_buckets=draw(st.sampled_from([True, True, False]), label="fit to buckets"),
        fit_min_tokens=draw(st.sampled_from([1, 1, 1, 8]), label="fit min tokens"),
        max_loras=max_loras,
    )


# ---- the loop ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    requests: dict[str, Request]  # by id: str(index in scenario.requests)
    num_steps: int
    num_preemptions: int
    peak_running: int  # most requests running at once
    num_proposed: int = 0  # speculative decoding: proposals verified
    num_accepted: int = 0  # and accepted
    num_fitted: int = 0  # steps cut to their token bucket (SchedulerConfig.fit_to_buckets)


def max_steps(sc: Scenario) -> int:
    """A bound on the steps of any sane schedule; more means a livelock (or starvation).

    Serving the requests one at a time, each prompt in chunks of the budget, takes `serial` steps
    after the last arrival; in thousands of random scenarios no policy took more than `serial`
    steps in all, preemptions included. Four times that is a generous bound."""
    budget = sc.max_num_batched_tokens
    serial = sum(-(-len(r.prompt) // budget) + r.max_tokens for r in sc.requests)
    serial *= sc.pipeline_depth  # each step's tokens come back pipeline_depth steps later
    return max(r.arrival for r in sc.requests) + 1 + 4 * serial + 20


def run_scenario(sc: Scenario) -> Result:
    """Serve `sc` through schedule -> pack -> fake model -> update, checking invariants after
    every step; returns the requests in their final state. With `pipeline_depth` d > 1 a batch
    runs on the fake model when scheduled (its reads are checked then) but updates its requests
    d - 1 steps later, as the engine's pipeline does; an empty step then only drains."""
    config = sc.config()
    ps, mml = sc.page_size, sc.max_model_len
    bm = BlockManager(sc.num_pages, ps, make_prefix_cache(sc.prefix_cache, ps))
    sched = make_scheduler(config, bm)
    sched.num_micro_batches = sc.pipeline_depth  # the engine's pp (the tiny model has 2 layers)
    sched.max_loras = sc.max_loras
    K = sc.num_speculative_tokens
    if K:
        sched.speculator = OracleSpeculator(config.speculative, sc.vocab_size)
    buckets = Buckets.create(
        sc.max_num_batched_tokens,
        sc.max_num_seqs,
        pages_needed(mml, ps),
        per_octave=config.token_buckets_per_octave,
    )
    model = FakePagedModel(sc.num_pages, ps, sc.vocab_size)
    # for validate_request (no tokenizer: these requests have no stop strings)
    engine_like = types.SimpleNamespace(config=config, block_manager=bm, tokenizer=None)

    requests: dict[str, Request] = {}
    order = sorted(range(len(sc.requests)), key=lambda i: (sc.requests[i].arrival, i))
    num_preempted = peak_running = num_proposed = num_accepted = num_fitted = 0
    bound = max_steps(sc)
    pipeline: deque = deque()  # (batch, next_ids) in flight, newest first
    for step in range(bound):
        # 1. Arrivals, validated as LLMEngine.add_request does.
        for i in order:
            spec = sc.requests[i]
            if spec.arrival != step:
                continue
            rid = str(i)
            req = Request(
                request_id=rid,
                prompt_token_ids=list(spec.prompt),
                sampling_params=SamplingParams(
                    max_tokens=spec.max_tokens,
                    stop_token_ids=spec.stop_token_ids,
                    ignore_eos=spec.ignore_eos,
                ),
                eos_token_ids=frozenset(config.model.eos_token_ids),
                seed=0,
                lora_request=LoRARequest(f"a{spec.lora}", spec.lora, f"/a{spec.lora}")
                if spec.lora
                else None,
            )
            req.metrics.arrival_time = step + i * 1e-3  # FCFS, deterministic
            requests[rid] = req
            try:
                LLMEngine.validate_request(engine_like, req.prompt_token_ids, req.sampling_params)
                error = None
            except InvalidRequest as e:
                error = str(e)
            assert (error is None) == sc.is_valid(spec), f"request {rid}: validation {error=}"
            if error:
                req.error = error
                req.finish("error", 0.0, RequestStatus.REJECTED)
            else:
                sched.add(req)

        # 2. Aborts.
        for i, spec in enumerate(sc.requests):
            if spec.abort_at != step or str(i) not in requests:
                continue
            req = requests[str(i)]
            was_live = not req.status.is_done
            got = sched.abort(req.request_id)
            assert (got is req) if was_live else got is None, f"abort of {req.request_id}"
            assert req.status is (RequestStatus.ABORTED if was_live else req.status)
            assert req.request_id not in bm.page_tables
            check_state(sc, sched, bm, requests)

        if step > max(r.arrival for r in sc.requests) and not sched.has_unfinished():
            break

        # 3. Schedule, checking the batch against the state before it.
        before = Before.of(sched, bm)
        batch = sched.schedule()
        check_batch(sc, sched, bm, batch, before)
        assert not {s.request.request_id for s in batch.seqs} & before.in_flight
        num_preempted += len(batch.preempted)
        num_fitted += batch.num_deferred > 0
        peak_running = max(peak_running, len(sched.running))

        # 4. Pack, run the fake model, update.
        if batch:
            step_input, sampling = pack(batch, bm.page_tables, ps, buckets, K)
            T, (S, P) = len(step_input.token_ids), step_input.page_indices.shape
            assert T in buckets.token_buckets and P in buckets.page_buckets, (T, P, buckets)
            assert len(batch.seqs) <= S <= sc.max_num_seqs and batch.num_tokens <= T
            lora_ids = np.zeros(len(step_input.token_ids), np.int64)  # as LoRASteps marks rows
            cu = step_input.cu_q_lens
            for i, seq in enumerate(batch.seqs):
                lora_ids[cu[i] : cu[i + 1]] = seq.request.lora_int_id
            next_ids = model.run(step_input, sampling.spec, lora_ids)
            for seq, read in zip(batch.seqs, model.reads, strict=True):
                want = seq.request.all_token_ids[: seq.start + seq.num_new_tokens - len(seq.spec)]
                want += list(seq.spec)
                assert UNWRITTEN not in read, f"{seq.request.request_id} read an unwritten slot"
                # (a prefix cached under another adapter reads back with its id: wrong)
                want = lora_encoded(want, seq.request.lora_int_id).tolist()
                assert read.tolist() == want, f"{seq.request.request_id}: KV read back is wrong"
            next_ids = next_ids[: len(batch.seqs)].tolist()
            if sampling.spec is not None:  # as LLMEngine._verified
                tokens, accepted = model.last_spec
                for i, seq in enumerate(batch.seqs):
                    if seq.spec:
                        next_ids[i] = tokens[i, : accepted[i] + 1].tolist()
                        num_proposed += len(seq.spec)
                        num_accepted += int(accepted[i])
            sched.in_flight.update(s.request.request_id for s in batch.seqs)
            pipeline.appendleft((batch, next_ids))
        else:
            assert not sched.has_unfinished() or sched.in_flight, (
                "stall: an empty step while requests wait or run and none is in flight"
            )
            if any(x is not None for x in pipeline):
                pipeline.appendleft(None)  # an empty micro-batch: the pipeline drains
        if len(pipeline) >= sc.pipeline_depth and (exiting := pipeline.pop()) is not None:
            done_batch, next_ids = exiting
            sched.in_flight.difference_update(s.request.request_id for s in done_batch.seqs)
            sampled = {
                s.request.request_id
                for s in done_batch.seqs
                if s.samples and not s.request.status.is_done  # not aborted in flight
            }
            finished = sched.update(done_batch, next_ids)
            done = {r.request_id for r in requests.values() if r.status is RequestStatus.FINISHED}
            assert {r.request_id for r in finished} == sampled & done
        if all(x is None for x in pipeline):
            pipeline.clear()
        check_state(sc, sched, bm, requests)
        owned = {p for table in bm.page_tables.values() for p in table} | cache_pages(bm)
        model.poison(p for p in range(1, sc.num_pages) if p not in owned)
    else:
        pytest.fail(
            f"livelock: {bound} steps and still {len(sched.running)} running, "
            f"{len(sched.waiting)} waiting: {sc}"
        )
    assert sched.num_preemptions == num_preempted
    assert bm.prefix_cache.num_locked_pages == 0, "a finished request left its prefix locked"
    assert bm.num_available_pages == bm.num_usable_pages, "pages still held at the end"
    return Result(
        requests, step, num_preempted, peak_running, num_proposed, num_accepted, num_fitted
    )


def cache_pages(bm: BlockManager) -> set[int]:
    cache = bm.prefix_cache
    return set(cache._pages) if isinstance(cache, RadixCache) else set()


def fits(sched, req: Request, keep_free: int) -> bool:
    """Whether the pages (and the LoRA adapters running) allow admitting `req` now (as
    `Scheduler._admit` checks)."""
    if sched.max_loras is not None and req.lora_int_id:
        running = {r.lora_int_id for r in sched.running if r.lora_int_id}
        if req.lora_int_id not in running and len(running) >= sched.max_loras:
            return False
    bm = sched.block_manager
    prefix = bm.peek_prefix(sched._match_token_ids(req), req.cache_namespace)
    return bm.can_allocate(req.request_id, req.num_tokens, keep_free, prefix)


@dataclasses.dataclass
class Before:
    """The scheduler's state at the start of a step (after arrivals and aborts)."""

    running: list[Request]
    waiting: list[Request]
    ready: set[str]  # running requests with one token left to compute (decodes), not in flight
    decoding: int  # running requests with one token left to compute, in flight or not
    in_flight: set[str]  # requests whose batch is still in the pipeline
    outputs: dict[str, list[int]]
    head: Request | None  # the first request admission tries
    head_admissible: bool  # it fits now (seqs, pages, watermark)

    @classmethod
    def of(cls, sched, bm) -> Before:
        running, waiting = list(sched.running), list(sched.waiting)
        order = sched._admission_order()
        assert sorted(map(id, order)) == sorted(map(id, waiting)), "admission order loses requests"
        head = order[0] if order else None
        head_admissible = False
        if head and len(running) < sched.config.max_num_seqs:
            head_admissible = fits(sched, head, sched.watermark_pages if running else 0)
        return cls(
            running=running,
            waiting=waiting,
            ready={
                r.request_id
                for r in running
                if r.num_uncomputed_tokens == 1 and r.request_id not in sched.in_flight
            },
            decoding=sum(r.num_uncomputed_tokens == 1 for r in running),
            in_flight=set(sched.in_flight),
            outputs={r.request_id: list(r.output_token_ids) for r in running + waiting},
            head=head,
            head_admissible=head_admissible,
        )


def check_batch(sc: Scenario, sched, bm: BlockManager, batch, before: Before) -> None:
    cfg = sched.config
    seqs = batch.seqs
    ids = [s.request.request_id for s in seqs]
    running_ids = [r.request_id for r in sched.running]
    was_running = {r.request_id for r in before.running}
    was_waiting = {r.request_id for r in before.waiting}
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    assert batch.num_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert len(seqs) <= cfg.max_num_seqs, "max_num_seqs exceeded"
    assert len(running_ids) <= cfg.max_num_seqs, "max_num_seqs running"
    if sc.max_loras is not None:  # vLLM's rule: the running adapters fit the device slots
        adapters = {r.lora_int_id for r in sched.running if r.lora_int_id}
        assert len(adapters) <= sc.max_loras, f"adapters {adapters} run, {sc.max_loras=}"
    for s in seqs:
        req = s.request
        assert req.request_id in running_ids and req.status is RequestStatus.RUNNING
        assert s.num_new_tokens >= 1 and s.start == req.num_computed_tokens
        assert s.start + s.num_new_tokens - len(s.spec) <= req.num_tokens
        if s.spec:  # proposals only after a decode's token, within the limits
            assert s.num_new_tokens == 1 + len(s.spec) <= 1 + sc.num_speculative_tokens
            assert req.num_tokens + len(s.spec) < sc.max_model_len
            assert len(req.output_token_ids) + len(s.spec) < req.sampling_params.max_tokens
        table = bm.page_tables.get(req.request_id, [])
        assert len(table) >= pages_needed(s.start + s.num_new_tokens, sc.page_size), (
            f"{req.request_id} scheduled without pages for its tokens"
        )
    admitted = [i for i in ids if i not in was_running]
    assert set(admitted) <= was_waiting, "a request scheduled from nowhere"
    assert {i for i in running_ids if i not in was_running} == set(admitted)

    # Preempted: the newest running, now waiting at the front of the queue, to be recomputed
    # from scratch with the tokens they generated.
    preempted = [r.request_id for r in batch.preempted]
    assert len(set(preempted)) == len(preempted), "preempted twice"
    for req in batch.preempted:
        rid = req.request_id
        assert rid in was_running, f"{rid} preempted but was not running"
        assert rid not in running_ids and rid not in ids
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        assert req.output_token_ids == before.outputs[rid], "preemption lost generated tokens"
        assert rid not in bm.page_tables
        for other in sched.running:
            if other.request_id in was_running and other.request_id not in before.in_flight:
                assert other.metrics.arrival_time < req.metrics.arrival_time, (
                    f"preempted {rid} while the newer {other.request_id} keeps running"
                )
    head = [r.request_id for r in list(sched.waiting)[: len(preempted)]]
    assert set(head) == set(preempted), "preempted requests are not at the front of the queue"

    # Policies.
    decodes = [s.request.request_id for s in seqs if s.request.request_id in before.ready]
    capped = False
    if sc.balance_micro_batches:  # at most ceil(decoding / depth) decodes, the oldest first
        cap = -(-before.decoding // sc.pipeline_depth)
        assert len(decodes) <= cap, f"{len(decodes)} decodes in a batch, over the share {cap}"
        capped = len(decodes) == cap
    if sc.policy in CHUNKED and not capped:  # stall-free: every decode runs (unless preempted)
        for rid in before.ready - set(preempted):
            assert rid in ids, f"{sc.policy} skipped the decode of {rid}"
    if sc.policy == "prefill_first":  # prefill-only steps of whole prompts, when possible
        assert not admitted or len(admitted) == len(seqs), "prefill_first mixed prefill and decode"
        if before.head_admissible:
            assert before.head.request_id in admitted, "prefill_first did not admit"
    if sc.policy == "decode_first":  # new requests only when none is running
        if before.running:
            assert not admitted, "decode_first admitted a request while others were running"
        elif before.waiting:
            assert before.head.request_id in admitted, "decode_first idles"
    check_fit(sc, sched, batch)
    if sc.policy in CHUNKED and batch.num_tokens + batch.num_deferred < cfg.max_num_batched_tokens:
        # Budget left: nothing running was left out, and the queue's head could not be admitted.
        left_out = set(running_ids) - before.in_flight - set(ids)
        if capped:  # decodes past the share wait for the next micro-batch
            left_out -= before.ready
        assert not left_out, f"{sc.policy} left budget and {left_out} unscheduled"
        if sched.waiting and len(running_ids) < cfg.max_num_seqs:
            # Admission stopped at a request that does not fit (evictions for the admitted ones
            # may have shrunk its cache hit since the order was made: LPM's order is per step).
            head = batch.blocked
            assert head is not None and head in sched.waiting, "admission stopped for no reason"
            if sc.admission_order == "fcfs":
                assert head is sched.waiting[0], "FCFS admission skipped the queue's head"
            assert not fits(sched, head, sched.watermark_pages if running_ids else 0), (
                f"{sc.policy} left budget while {head.request_id} could be admitted"
            )


def check_fit(sc: Scenario, sched, batch) -> None:
    """`fit_to_buckets`: a step lands on its token bucket by cutting its last prefill chunk
    exactly when the bucket below has at least `fit_min_tokens` tokens, the cut leaves the chunk
    a token, defers fewer tokens than the padding it saves, and grows a next step that the
    batch's other sequences make anyway (a token each) by less than this step shrinks; and the
    chunk cut never reaches the end of its prompt."""
    buckets = token_buckets(sc.max_num_batched_tokens, sc.token_buckets_per_octave)
    full = batch.num_tokens + batch.num_deferred  # the step as scheduled before the cut
    if not batch.seqs:
        assert not batch.num_deferred
        return
    bucket = lambda n: next(b for b in buckets if b >= n)
    lo = max((b for b in buckets if b < full), default=0)
    hi, cut, others = bucket(full), full - lo, len(batch.seqs) - 1
    last = batch.seqs[-1]
    # (judged as scheduled: a recomputed chunk cut to one token reads as a decode afterwards)
    was_decode = last.num_new_tokens + batch.num_deferred - len(
        last.spec
    ) == 1 and last.start >= len(last.request.prompt_token_ids)
    fits = (
        sc.fit_to_buckets
        and sc.policy in CHUNKED
        and others >= 1
        and lo >= sc.fit_min_tokens
        and hi != full
        and not last.spec
        and not was_decode
        and cut < hi - full
        and last.num_new_tokens + batch.num_deferred > cut
        and bucket(others + cut) - bucket(others) < hi - lo
    )
    if not fits:
        assert batch.num_deferred == 0, f"cut {batch.num_deferred} tokens off a step of {full}"
        return
    assert batch.num_deferred == cut and batch.num_tokens == lo, (full, lo, hi)
    assert not last.samples, "a cut chunk reaches the end of its prompt"


def check_state(sc, sched, bm, requests) -> None:
    bm.check_invariants()
    running, waiting = list(sched.running), list(sched.waiting)
    assert len(running) <= sc.max_num_seqs
    live = running + waiting
    assert len({id(r) for r in live}) == len(live), "a request queued twice"
    assert set(bm.page_tables) <= {r.request_id for r in running}, (
        "a non-running request owns pages"
    )
    for req in running:
        assert req.status is RequestStatus.RUNNING
        table = bm.page_tables.get(req.request_id, [])
        assert len(table) >= pages_needed(req.num_computed_tokens, sc.page_size), (
            f"{req.request_id}'s pages do not cover its computed tokens"
        )
        # no more than its tokens need (rejected proposals' pages were given back)
        assert len(table) <= max(
            pages_needed(req.num_tokens, sc.page_size), bm.num_shared_pages(req.request_id)
        ), f"{req.request_id} holds pages beyond its tokens"
        assert RESERVED_PAGE not in table
    for req in waiting:
        assert req.status is RequestStatus.WAITING
        assert req.num_computed_tokens == 0
    live_ids = {r.request_id for r in live}
    for req in requests.values():
        assert req.status.is_done != (req.request_id in live_ids), f"{req.request_id} lost"
    n = sum(len(t) - bm.num_shared_pages(rid) for rid, t in bm.page_tables.items())
    assert bm.num_free_pages + n + len(cache_pages(bm)) == bm.num_usable_pages


def check_result(sc: Scenario, result: Result) -> None:
    """Every request ended finished, aborted or rejected, with the output it has alone."""
    assert set(result.requests) == {str(i) for i in range(len(sc.requests))}, "a request never came"
    for i, spec in enumerate(sc.requests):
        req = result.requests[str(i)]
        want, reason = sc.expected(spec)
        assert req.status.is_done, f"request {i} is stuck in {req.status}"
        if req.status is RequestStatus.REJECTED:
            assert not sc.is_valid(spec) and req.error and req.finish_reason == "error"
            assert req.output_token_ids == []
        elif req.status is RequestStatus.ABORTED:
            assert spec.abort_at is not None and req.finish_reason == "abort"
            n = len(req.output_token_ids)
            assert n < len(want) and req.output_token_ids == want[:n], f"request {i} output"
        else:
            assert req.output_token_ids == want, f"request {i}: output differs from alone"
            assert req.finish_reason == reason, f"request {i}: finish_reason"
            assert len(req.prompt_token_ids) + len(want) <= sc.max_model_len
        m = req.metrics
        assert len(m.token_times) == len(req.output_token_ids)
        if req.output_token_ids:
            assert m.first_scheduled_time <= m.first_token_time <= m.token_times[-1]


# ---- tests ---------------------------------------------------------------------------------------


CACHE_VARIANTS = [("none", "fcfs"), ("radix", "fcfs"), ("radix", "lpm")]


@pytest.mark.parametrize("prefix_cache,admission_order", CACHE_VARIANTS)
@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_random_workloads_keep_invariants_and_batch_invariance(
    policy, prefix_cache, admission_order, data
):
    sc = data.draw(scenarios(policy, prefix_cache, admission_order), label="scenario")
    result = run_scenario(sc)
    check_result(sc, result)
    # Coverage, shown by `pytest --hypothesis-show-statistics`.
    cached = sum(r.num_cached_tokens for r in result.requests.values())
    event("cache hits" if cached else "no cache hit")
    event("preempted" if result.num_preemptions else "no preemption")
    for status in {r.status.value for r in result.requests.values()}:
        event(f"some {status}")
    event(f"steps <= {1 << result.num_steps.bit_length()}")
    event("a step cut to its token bucket" if result.num_fitted else "no step cut to a bucket")
    if sc.num_speculative_tokens:
        event("proposals accepted" if result.num_accepted else "no proposal accepted")
        event(
            "proposals rejected"
            if result.num_accepted < result.num_proposed
            else "no proposal rejected"
        )
    # Steer towards crowded small caches.
    target(float(result.num_preemptions), label="preemptions")
    target(float(result.peak_running), label="peak running")
    if prefix_cache != "none":
        target(float(cached), label="cached tokens")


def _workload(policy: str, **kw) -> Scenario:
    rng = np.random.default_rng(0)
    specs = tuple(
        RequestSpec(
            prompt=tuple(rng.integers(3, 256, int(rng.integers(1, 40))).tolist()),
            max_tokens=int(rng.integers(1, 20)),
            arrival=int(rng.integers(0, 6)),
            abort_at=None,
            ignore_eos=True,
        )
        for _ in range(10)
    )
    chunked = policy in CHUNKED
    opts = dict(
        policy=policy,
        page_size=4,
        num_pages=16,
        max_num_seqs=8,
        max_num_batched_tokens=16 if chunked else 64,
        max_model_len=64,
        requests=specs,
    )
    return Scenario(**(opts | kw))


def test_a_recomputed_chunk_cut_to_one_token_is_cut_as_a_chunk():
    """A regression example the full suite's examples found: a preempted request recomputing
    its last two tokens is cut to one by `fit_to_buckets` (its chunk is not a decode, though
    one token is left of it afterwards), beside a decode verifying proposals."""
    z = lambda n: (0,) * n
    spec = lambda p, m, a, ab=None, lora=0: RequestSpec(p, m, a, ab, (), False, lora)
    requests = (
        spec((*z(20), 1, 1, 1, 64, 0, 0), 16, 1), spec((0,), 1, 0, 0), spec((0,), 1, 0, 0),
        spec((*z(7), 5), 7, 3, 17), spec((30, 87, 64, 239, 159, 224), 15, 2, lora=1),
        spec((), 1, 0), spec((0,), 6, 0), spec((0, 0, 0, 53, 1, 0, 23), 10, 1, lora=1),
        spec((), 1, 0),
    )  # fmt: skip
    sc = Scenario(policy="sarathi", page_size=1, num_pages=42, max_num_seqs=3,
                  max_num_batched_tokens=30, max_model_len=41, requests=requests, watermark=0.0,
                  num_speculative_tokens=3, token_buckets_per_octave=1, fit_min_tokens=1,
                  max_loras=1)  # fmt: skip
    result = run_scenario(sc)
    check_result(sc, result)
    assert result.num_fitted and result.num_preemptions


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_small_cache_preempts_and_outputs_match(policy):
    sc = _workload(policy)
    result = run_scenario(sc)
    check_result(sc, result)
    assert result.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED for r in result.requests.values())


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_speculation_in_a_small_cache_preempts_rolls_back_and_outputs_match(policy):
    sc = _workload(policy, num_speculative_tokens=3)
    result = run_scenario(sc)  # pages checked after every step, all free at the end
    check_result(sc, result)
    assert result.num_preemptions > 0
    assert 0 < result.num_accepted < result.num_proposed
    plain = run_scenario(dataclasses.replace(sc, num_speculative_tokens=0))
    assert result.num_steps < plain.num_steps


def test_engine_with_a_fake_runner_rejects_bad_prompts_and_serves_the_others(monkeypatch):
    fake = types.ModuleType("llmjax.engine.runner")
    fake.ModelRunner = FakeRunner
    monkeypatch.setitem(sys.modules, "llmjax.engine.runner", fake)
    # 7 usable pages of 4 tokens: the good requests preempt each other; one cannot fit at all.
    sc = _workload("sarathi", num_pages=8, max_model_len=40)
    engine = LLMEngine(sc.config(), params=None, num_pages=sc.num_pages)
    good = [RequestSpec(tuple(range(3, 3 + n)), 8, 0, None, ignore_eos=True) for n in (5, 9, 14, 3)]
    bad = {
        "empty prompt": RequestSpec((), 4, 0, None),
        "max_model_len=40": RequestSpec((5,) * 40, 4, 0, None),
        "outside the vocabulary": RequestSpec((3, 256), 4, 0, None),
        "KV pages": RequestSpec((5,) * 25, 10, 0, None),  # 35 tokens need 9 pages
    }
    specs = [*good, *bad.values()]
    for i, spec in enumerate(specs):
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
        engine.add_request(list(spec.prompt), params, request_id=str(i))
    outputs = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in outputs, "an output after the request finished"
            if out.finished:
                outputs[out.request_id] = out
    assert set(outputs) == {str(i) for i in range(len(specs))}
    for i, spec in enumerate(good):
        assert outputs[str(i)].token_ids == sc.expected(spec)[0]
        assert outputs[str(i)].finish_reason == "length"
    for i, message in enumerate(bad, start=len(good)):
        out = outputs[str(i)]
        assert out.finish_reason == "error" and message in out.error and not out.token_ids
    assert engine.stats.num_preemptions > 0
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_host_loop_imports_no_jax():
    # conftest imports jax (for the gpu marker), so check a fresh interpreter running one scenario.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys\n"
        "from tests import test_scheduler_properties as t\n"
        "sc = t._workload('sarathi')\n"
        "t.check_result(sc, t.run_scenario(sc))\n"
        "assert 'jax' not in sys.modules, 'the host-side loop imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)

"""`LLMEngine`: requests in, one scheduled step at a time, `RequestOutput`s out.

    def step(self):
        step = self._schedule()       # host: who runs, how many tokens each
        self._prepare(step)           # host: pack the arrays; features add their inputs
        self._launch(step)            # device: the jitted forward + sample, dispatched
        for done in landed(step):     # this step, or with async scheduling the one before it:
            self._collect(done)       #   its tokens on the host; features read their results
            self._update(done)        #   host: append tokens, finish, free pages
        return self._emit(step)       # RequestOutputs

The stages and the features that take part in them (speculation, structured outputs, logprobs,
the KV tiers, sparse KV, n samples, the prefill role, compile-ahead) are in
llmjax/engine/step.py; which launched step lands when (async scheduling) in
llmjax/engine/overlap.py; the roles of disaggregated serving in llmjax/engine/roles.py.

A request that can never run (empty, too long for `max_model_len` or for the whole KV cache, token
ids outside the vocabulary) is rejected: its output says why, and the other requests go on.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from llmjax.config import EngineConfig
from llmjax.engine.batch import Buckets, pack
from llmjax.engine.block_manager import BlockManager, pages_needed
from llmjax.engine.clock import WALL_CLOCK, Clock, VirtualClock
from llmjax.engine.kv_tiers import KVTierSteps, attach_kv_tiers
from llmjax.engine.logprobs import LogprobsStep
from llmjax.engine.outputs import request_output
from llmjax.engine.overlap import Overlap, overlap_blockers
from llmjax.engine.policies import make_scheduler
from llmjax.engine.radix_cache import make_prefix_cache
from llmjax.engine.request import (
    ProgramHints,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from llmjax.engine.roles import ROLES, EngineRoles, PrefillParking
from llmjax.engine.samples import Samples
from llmjax.engine.speculative import SpeculationStep
from llmjax.engine.stats import EngineStats
from llmjax.engine.step import (
    CompileAhead,
    PipelineInFlight,
    SparseAccounting,
    Step,
    StepFeature,
)
from llmjax.engine.structured import StructuredStep
from llmjax.engine.validation import InvalidRequest, check_request
from llmjax.engine.weights import EngineWeights, WeightVersions
from llmjax.kvstore.keys import KeySalt
from llmjax.lora import LoRARequest
from llmjax.progress import progress_bar
from llmjax.sampling_params import SamplingParams
from llmjax.tokenizer.detokenizer import StopStringMatcher

logger = logging.getLogger(__name__)


class LLMEngine(EngineRoles, EngineWeights):
    def __init__(
        self,
        config: EngineConfig,
        params,
        num_pages: int | None,
        tokenizer=None,
        skew=None,
        clock: Clock = WALL_CLOCK,
        role: str = "colocated",
        devices=None,
        kv_store=None,
    ):
        """`role`: 'colocated', 'prefill' or 'decode' (the module doc). `devices`: the devices
        this engine's weights and KV pages live on (its first tp * pp; default all of them), so
        that several engines share a process on disjoint sub-meshes. `clock` stamps every
        request's metrics (arrival, scheduling, tokens, finish): wall time, or a simulated
        device's `VirtualClock` (llmjax/engine/clock.py; with
        `config.device == 'sim'` a fresh one at 0 unless given). `num_pages` None (simulated
        device only): `config.cache.num_pages`, else what the simulated hardware's memory holds
        (`llmjax.sim.runner.sim_num_pages`). `kv_store`: a `llmjax.kvstore.TieredStore` to
        put under this engine's pages, shared with other engines of the same model and layout
        (default: the one `config.kv_store` describes, if any; llmjax/engine/kv_tiers.py)."""
        if role not in ROLES:
            raise ValueError(f"unknown {role=}; choose one of {ROLES}")
        self.role = role
        real = config.device != "sim"
        if role != "colocated" and real and (config.parallel.pp > 1 or config.sparse_kv.enabled):
            raise ValueError(
                f"role={role!r} moves KV pages between instances, which needs pp == 1 and "
                f"sparse_kv='none' on a real device (got pp={config.parallel.pp}, "
                f"sparse_kv={config.sparse_kv.mode!r}); the simulator models any layout"
            )
        if config.device == "sim" and clock is WALL_CLOCK:
            clock = VirtualClock()
        if num_pages is None:
            if config.device != "sim":
                raise ValueError("num_pages is required (None only with device='sim')")
            from llmjax.sim.runner import sim_num_pages

            num_pages = config.cache.num_pages or sim_num_pages(config)
        self.config = config
        self.clock = clock
        self.tokenizer = tokenizer
        page_size = config.cache.page_size
        salt = KeySalt.for_engine(config).digest  # the radix tree keys its pages (kvstore/)
        sched = config.scheduler
        self.block_manager = BlockManager(
            num_pages,
            page_size,
            make_prefix_cache(config.cache.prefix_cache, page_size, salt),
            config.kv_groups,
            # the most tokens a step adds to a request: a chunk under the chunking policies
            # (splitfuse takes pages per chunk; sarathi a whole prompt's at admission, but its
            # windowed groups' per chunk); a whole prompt under the others
            sched.max_num_batched_tokens if sched.policy in ("splitfuse", "sarathi") else None,
        )
        self.scheduler = make_scheduler(config, self.block_manager, clock)
        if config.device == "sim":
            from llmjax.sim.runner import SimRunner

            self.runner = SimRunner(config, num_pages, clock)
        else:
            from llmjax.engine.runner import ModelRunner  # the one jax-importing engine module

            self.runner = ModelRunner(config, params, num_pages, skew=skew, devices=devices)
        self.lora = None  # LoRA adapters (llmjax/lora/): the registry, host cache, slots
        if config.lora is not None:
            from llmjax.lora import LoRAManager, load_peft_adapter

            self.lora = LoRAManager(
                config.lora,
                config.model,
                self.runner.lora_targets,
                self.runner.write_lora_slot,
                getattr(self.runner, "load_lora", load_peft_adapter),  # the simulator's: shapes
            )
            self.scheduler.max_loras = config.lora.max_loras
        self.buckets = Buckets.create(
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            pages_needed(config.max_model_len, page_size),
            ragged_pages=self.runner.ragged_page_tables,
            per_octave=config.token_buckets_per_octave,
        )
        self._ids = itertools.count()
        self._num_step_calls = 0
        self._c_collected = float("-inf")  # the engine's clock at the last collect
        self._seed_rng = np.random.default_rng(config.seed)
        self._rejected: list[Request] = []
        self._live: set[str] = set()  # ids of waiting, running, parked and receiving requests
        self.samples = Samples(self)  # SamplingParams.n > 1 (llmjax/engine/samples.py)
        self._structured = None  # llguidance over the tokenizer, built on first use
        self._init_roles()  # `parked` and `_receiving` (llmjax/engine/roles.py)
        self._init_weights()  # weight updates, pause, sleep (llmjax/engine/weights.py)
        self.kv_tiers = None  # the KV tiers below the device pages (llmjax/engine/kv_tiers.py)
        self.speculator = None  # speculative decoding (llmjax/engine/speculative.py)
        if config.speculative.enabled:
            from llmjax.engine.speculative import make_speculator

            self.speculator = make_speculator(config.speculative)
            self.speculator.token_bucket = lambda n: self.buckets.shape_for(n, 1, 1)[0]
            self.scheduler.speculator = self.speculator
        if kv_store is not None or config.kv_store.enabled:
            self.kv_tiers = attach_kv_tiers(self, kv_store)
        self.stats = self._new_stats()
        self._features = self._build_features()
        blockers = overlap_blockers(self)
        wanted = config.async_scheduling_on()
        if wanted and blockers:
            logger.info("async scheduling: synchronous steps with %s", ", ".join(blockers))
        self._overlap = Overlap(self, wanted and not blockers)
        if hasattr(self.runner, "overlapped"):  # the simulated device models the overlap
            self.runner.overlapped = self._overlap.enabled
        if config.precompile:
            self.precompile()

    def _build_features(self) -> list[StepFeature]:
        """The components that take part in the step (llmjax/engine/step.py), from the
        config, in the order their hooks run."""
        cfg, pipelined = self.config, self.runner.pipelined
        features: list[StepFeature] = []
        if pipelined:
            features.append(PipelineInFlight(self.scheduler))
        if self.kv_tiers is not None:
            features.append(KVTierSteps(self.kv_tiers, self.scheduler))
        if self.speculator is not None:
            features.append(SpeculationStep(self))
        if cfg.device != "sim" and not pipelined:
            features += [StructuredStep(self), LogprobsStep(self.runner)]
        if self.role == "prefill":
            features.append(PrefillParking(self))
        if cfg.compile_ahead and not cfg.precompile and not pipelined:
            features.append(CompileAhead(self))
        features.append(self.samples)
        features.append(WeightVersions(self))
        if self.lora is not None:
            from llmjax.lora.steps import LoRASteps

            features.append(LoRASteps(self))
        if cfg.sparse_kv.enabled:
            features.append(SparseAccounting(self))
        return features

    def _new_stats(self) -> EngineStats:
        cache = self.block_manager.prefix_cache
        return EngineStats(
            num_pages=self.block_manager.num_usable_pages,
            num_cached_pages=cache.num_cached_pages,
            evictions_base=cache.num_evictions,
        )

    def reset_stats(self) -> None:
        """Start the engine counters afresh (e.g. after a benchmark's warm-up)."""
        self.stats = self._new_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, so the next requests start cold (between benchmark runs,
        say). Prefixes that running requests share stay until they finish; returns whether the
        cache is now empty."""
        if self.kv_tiers is not None:
            self.kv_tiers.flush()  # blocks on their way down read the pages first
        ok = self.block_manager.reset_prefix_cache()
        self.stats.num_cached_pages = self.block_manager.prefix_cache.num_cached_pages
        if not ok:
            logger.warning("reset_prefix_cache: running requests still share cached pages")
        return ok

    def precompile(self) -> float:
        """Compile the step for every shape bucket now (loading from JAX's persistent cache when
        it has them), so that serving never compiles. Returns the seconds it took."""
        t = time.perf_counter()
        shapes = self.buckets.shapes()
        bar = progress_bar(len(shapes), "Precompiling step shapes", unit="shape")
        self.runner.precompile(shapes, progress=bar.update)
        bar.close()
        if (self.role != "colocated" or self.kv_tiers is not None) and hasattr(
            self.runner, "precompile_transfer"
        ):  # page moves between instances, or to and from the KV tiers
            self.runner.precompile_transfer(
                pages_needed(self.config.max_model_len, self.block_manager.page_size),
                host=self.kv_tiers is not None,
            )
        seconds = time.perf_counter() - t
        logger.info("precompiled %d step shapes in %.1f s", len(self.buckets.shapes()), seconds)
        return seconds

    # ------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        hints: ProgramHints | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; returns its id. `arrival_time` (seconds on the engine's clock,
        default now) lets a trace replayer stamp the intended arrival. `hints`: what a
        program's executor knows of it (Parrot's criteria and app-level FIFO; see
        `ProgramHints`). `lora_request`: the LoRA adapter it runs under (an engine built with
        `EngineConfig.lora`; read from its directory the first time): a request naming an
        adapter that cannot be served is rejected with the reason, like a bad prompt."""
        sampling_params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._live:  # page tables are keyed by id: two would share pages
            raise ValueError(f"{request_id=} is already waiting or running")
        seed = sampling_params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**32))
        req = Request(
            request_id=request_id,
            prompt_token_ids=[int(t) for t in prompt_token_ids],
            sampling_params=sampling_params,
            eos_token_ids=frozenset(self.config.model.eos_token_ids),
            seed=seed,
            prompt=prompt,
            metrics=RequestMetrics(self.clock.now() if arrival_time is None else arrival_time),
            hints=hints,
            logprobs=[] if sampling_params.logprobs is not None else None,
            prompt_logprobs=[None] if sampling_params.prompt_logprobs is not None else None,
            lora_request=lora_request,
        )
        if sampling_params.stop and self.tokenizer is not None:
            req.stop_matcher = StopStringMatcher(
                self.tokenizer, sampling_params.stop, sampling_params.include_stop_str_in_output
            )
        try:
            self.validate_request(req.prompt_token_ids, sampling_params)
            self._add_lora(lora_request)
        except InvalidRequest as e:
            req.error = str(e)
            req.finish("error", self.clock.now(), RequestStatus.REJECTED)
            self._rejected.append(req)
            logger.warning("rejected request %s: %s", request_id, e)
        else:
            if sampling_params.structured_outputs is not None:
                req.matcher = self.structured.matcher(sampling_params.structured_outputs)
            self.scheduler.add(req)
            self._live.add(request_id)
            if sampling_params.n > 1:
                self.samples.add(req)
        return request_id

    # ---- LoRA adapters (vLLM's LLMEngine methods) ---------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter now (read and checked from its directory), so that requests
        naming it start without reading it; True. Raises LoRAError (and ValueError without
        `EngineConfig.lora`)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (EngineConfig.lora)")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and device slot); False if it is not registered.
        Raises ValueError while a waiting or running request uses it."""
        if self.lora is None:
            return False
        users = [r.request_id for r in self._live_requests() if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(
                f"adapter {lora_int_id} is in use by {len(users)} requests ({users[:3]}...): "
                "abort them or wait for them to finish"
            )
        return self.lora.remove(lora_int_id)

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapter (name) of each running and of each waiting request under one (vLLM's
        `lora_requests_info` metric reads them)."""
        names = lambda rs: tuple(r.lora_request.lora_name for r in rs if r.lora_int_id)
        return names(self.scheduler.running), names(self.scheduler.waiting)

    def list_loras(self) -> dict[int, LoRARequest]:
        """The registered adapters by id."""
        return {} if self.lora is None else dict(self.lora.adapters)

    def _add_lora(self, lora_request: LoRARequest | None) -> None:
        """Register a request's adapter (read on first use); InvalidRequest if it cannot run."""
        if lora_request is None:
            return
        if self.lora is None:
            raise InvalidRequest(
                f"adapter {lora_request.lora_name!r}: this engine serves no LoRA adapters "
                "(build it with enable_lora=True / EngineConfig.lora)",
                "lora_request",
            )
        from llmjax.lora import LoRAError

        try:
            self.lora.add(lora_request)
        except LoRAError as e:
            raise InvalidRequest(str(e), "lora_request") from None

    @property
    def structured(self):
        """llguidance over this engine's tokenizer (llmjax/engine/structured.py)."""
        if self._structured is None:
            from llmjax.engine.grammar import StructuredOutputs

            m = self.config.model
            self._structured = StructuredOutputs(self.tokenizer, m.vocab_size, m.eos_token_ids)
        return self._structured

    def validate_request(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        """Raise InvalidRequest if this request could never run. `add_request` checks it (and
        rejects the request with the message); a front end can ask first, to answer the client
        at once. Reads only what is fixed when the engine is built, so any thread may call it."""
        check_request(self, prompt_token_ids, sampling_params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a waiting, running, parked or receiving request and free its pages (every
        sample of it with n > 1); False if it is not live."""
        aborted = self.samples.abort(request_id)
        return self._abort_one(request_id) if aborted is None else aborted

    def _abort_one(self, request_id: str) -> bool:
        self._live.discard(request_id)
        req = self._abort_moving(request_id)  # parked or receiving (roles.py)
        if req is not None:
            req.finish("abort", self.clock.now(), RequestStatus.ABORTED)
            return True
        return self.scheduler.abort(request_id) is not None

    def abort_all(self) -> list[str]:
        """Abort every waiting and running request; returns their ids."""
        ids = [rid for rid in self._live if not self.samples.is_sample(rid)]
        return [rid for rid in ids if self.abort_request(rid)]

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._rejected or self.samples.pending or self._held_outputs)
            or self._overlap.in_flight is not None
        )

    # ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: an output for every request that got a token, finished or was rejected
        (async scheduling, overlap.py: the step launched in the previous call's). Profiles show
        an `llmjax_step` range with one per stage inside (`llmjax.schedule`, ...)."""
        self._num_step_calls += 1
        held, self._held_outputs = self._held_outputs, []  # landed by a pause or an update
        if self.frozen:  # paused ('keep', 'abort') or asleep: nothing runs (weights.py)
            rejected, self._rejected = self._rejected, []
            return held + [self._output(r) for r in rejected]
        with self.runner.annotate_step(self._num_step_calls):
            landed = self._land(self._overlap.before_schedule())  # its tokens shape this step
            step = self._schedule()
            if step.batch or self.runner.num_in_flight:  # (pp > 1: micro-batches in flight)
                self._prepare(step)
                self._launch(step)
            landed += self._land(self._overlap.after_launch(step))  # this step, or the last
            return held + self._emit(step, landed)

    def _land(self, steps: list[Step]) -> list[Step]:
        """Collect and update launched steps (pp > 1: the micro-batch a tick let out, if any)."""
        for step in steps:
            self._collect(step)
            if step.batch:
                self._update(step)
        return steps

    @property
    def async_scheduling(self) -> bool:
        """Whether this engine overlaps scheduling with the device's step (overlap.py)."""
        return self._overlap.enabled

    # ---- the stages (llmjax/engine/step.py) ----------------------------------------------------

    def _schedule(self) -> Step:
        step = Step(None, [self._output(r) for r in self._rejected])
        self._rejected.clear()
        with self.runner.annotate("llmjax.schedule"):
            step.batch = self.scheduler.schedule()
            for f in self._features:
                f.scheduled(step)
        return step

    def _prepare(self, step: Step) -> None:
        with self.runner.annotate("llmjax.prepare"):
            if step.batch:
                step.step_input, step.sampling = pack(
                    step.batch,
                    self.block_manager.page_tables,
                    self.block_manager.page_size,
                    self.buckets,
                    self.config.speculative.num_speculative_tokens,
                    self._overlap.pending_rows(),
                    self.block_manager.group_tables if self.block_manager.groups else None,
                )
            for f in self._features:
                f.prepare(step)

    def _launch(self, step: Step) -> None:
        batch = step.batch
        step.t_launch, step.c_launch = time.perf_counter(), self.clock.now()
        with self.runner.annotate("llmjax.launch", tokens=batch.num_tokens, seqs=len(batch.seqs)):
            step.launched = self.runner.launch(step.step_input, step.sampling, batch or None)

    def _collect(self, step: Step) -> None:
        with self.runner.annotate("llmjax.collect"):
            done = self.runner.collect(step.launched)
            step.t_collected, now = time.perf_counter(), self.clock.now()
            # the device's time on this step: since its launch, or since the step before it
            # was collected if that was later (async scheduling launches before collecting)
            step.device_s = now - max(step.c_launch, self._c_collected)
            self._c_collected = now
            if self.runner.pipelined:
                self.stats.record_tick(
                    self.runner.last_stage_tokens, getattr(self.runner, "last_stage_seconds", None)
                )
            if done is None:  # pp > 1: no micro-batch left the pipeline this tick
                step.batch = None
                return
            step.batch, step.next_ids = done
            step.new_tokens = step.next_ids[: len(step.batch.seqs)].tolist()
            step.sampled = [
                s.request for s in step.batch.seqs if s.samples and not s.request.status.is_done
            ]
            for f in self._features:
                f.collect(step)

    def _update(self, step: Step) -> None:
        with self.runner.annotate("llmjax.update"):
            step.finished = self.scheduler.update(step.batch, step.new_tokens)
            for req in step.finished:
                self._live.discard(req.request_id)
            for f in self._features:
                f.update(step)
        bm = self.block_manager
        self.stats.record_step(
            step.batch,
            host_s=step.host_s,
            device_s=step.device_s,
            num_used_pages=bm.num_used_pages,
            num_cached_pages=bm.prefix_cache.num_cached_pages,
            num_evictions=bm.prefix_cache.num_evictions,
            num_padded_tokens=None if self.runner.pipelined else len(step.step_input.token_ids),
        )

    def _emit(self, step: Step, landed: list[Step]) -> list[RequestOutput]:
        step.outputs += [self._output(r) for done in landed for r in done.sampled]
        for f in self._features:
            f.emit(step)
        return step.outputs

    def _compile_counts(self) -> tuple:
        r = self.runner
        return (
            r.num_compiles,
            getattr(r, "num_sample_compiles", 0),
            getattr(r, "num_draft_compiles", 0),
        )

    def _output(self, req: Request) -> RequestOutput:
        return request_output(req, self.tokenizer)

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

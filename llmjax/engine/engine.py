"""`LLMEngine`: requests in, one scheduled step at a time, `RequestOutput`s out.

    def step(self):
        batch = self.scheduler.schedule()          # host: who runs, how many tokens each
        out = self.runner.run(batch)               # device: one jitted forward + sample
        return self.scheduler.update(batch, out)   # host: append tokens, finish, free pages

A request that can never run (empty, too long for `max_model_len` or for the whole KV cache, token
ids outside the vocabulary) is rejected: its output says why, and the other requests go on.

Roles (`role`, for disaggregated serving, llmjax/cluster/): a 'colocated' engine runs requests
from prompt to finish. A 'prefill' engine runs prompts (chunked under the token budget as its
policy says) and samples the first token; then it *parks* the request: out of the batch, its KV
pages still held (counted as used) until a decode instance takes it (`export_request`, then
`release_request`) or it is aborted. A 'decode' engine receives such requests in two phases:
`reserve_import` allocates the pages that the KV transfer writes, `commit_import` puts the
request in the running batch as if it had computed its prompt here (`cancel_import` gives the
pages back and recomputes it, or fails it with a reason). `can_accept` is DistServe's pull
condition. A request that finishes at its first token (EOS, max_tokens=1) never parks.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np

from llmjax.config import EngineConfig
from llmjax.engine.batch import Buckets, pack, step_shape
from llmjax.engine.block_manager import BlockManager, pages_needed
from llmjax.engine.clock import WALL_CLOCK, Clock, VirtualClock
from llmjax.engine.policies import make_scheduler
from llmjax.engine.radix_cache import make_prefix_cache
from llmjax.engine.request import (
    CompletionOutput,
    Logprob,
    MigratedRequest,
    ProgramHints,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    cached_tokens_per_tier,
)
from llmjax.engine.stats import EngineStats
from llmjax.kvstore.keys import KeySalt
from llmjax.progress import progress_bar
from llmjax.sampling_params import SamplingParams
from llmjax.tokenizer.detokenizer import StopStringMatcher

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


class InvalidRequest(ValueError):
    """A request the engine can never run; `param` names what is wrong with it: 'prompt'
    (empty, too long, ids outside the vocabulary), 'max_tokens' (prompt + max_tokens need more
    KV pages than the cache has) or 'stop' (stop strings without a tokenizer)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles (a Ray actor's error crosses processes)
        return type(self), (str(self), self.param)


class LLMEngine:
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
        self.block_manager = BlockManager(
            num_pages, page_size, make_prefix_cache(config.cache.prefix_cache, page_size, salt)
        )
        self.scheduler = make_scheduler(config, self.block_manager, clock)
        if config.device == "sim":
            from llmjax.sim.runner import SimRunner

            self.runner = SimRunner(config, num_pages, clock)
        else:
            from llmjax.engine.runner import ModelRunner  # the one jax-importing engine module

            self.runner = ModelRunner(config, params, num_pages, skew=skew, devices=devices)
        self.evictor = None  # InfiniGen's host pool bound (llmjax/sparse/host_pool.py)
        self._pool_tables: dict[str, list[int]] = {}
        sparse = config.sparse_kv
        if sparse.enabled and sparse.capacity < 1:
            from llmjax.sparse.host_pool import PoolEvictor

            self.evictor = PoolEvictor(sparse.eviction, sparse.capacity, page_size)
        self.buckets = Buckets.create(
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            pages_needed(config.max_model_len, page_size),
            ragged_pages=self.runner.ragged_page_tables,
            per_octave=config.token_buckets_per_octave,
        )
        self._ids = itertools.count()
        self._num_step_calls = 0
        self._seed_rng = np.random.default_rng(config.seed)
        self._rejected: list[Request] = []
        self._live: set[str] = set()  # ids of waiting, running, parked and receiving requests
        # SamplingParams.n > 1: a request's samples (the first keeps its id, the others are
        # "<id>#<i>"), and the ones waiting for the first's prompt to be computed and cached.
        self._samples: dict[str, list[Request]] = {}
        self._sample_of: dict[str, str] = {}
        self._pending_samples: dict[str, list[Request]] = {}
        self._structured = None  # llguidance over the tokenizer, built on first use
        # role 'prefill': first token sampled, KV pages kept until a decode instance takes them
        # (insertion order: DistServe's queue of finished prefills)
        self.parked: dict[str, Request] = {}
        # role 'decode': pages reserved for a KV transfer in flight -> (request, KV tokens)
        self._receiving: dict[str, tuple[Request, int]] = {}
        self.kv_tiers = None  # the KV tiers below the device pages (llmjax/engine/kv_tiers.py)
        self.speculator = None  # speculative decoding (llmjax/engine/speculative.py)
        if config.speculative.enabled:
            from llmjax.engine.speculative import make_speculator

            self.speculator = make_speculator(config.speculative)
            self.speculator.token_bucket = lambda n: self.buckets.shape_for(n, 1, 1)[0]
            self.scheduler.speculator = self.speculator
        if kv_store is not None or config.kv_store.enabled:
            self._attach_kv_store(kv_store)
        self.stats = self._new_stats()
        if config.precompile:
            self.precompile()

    def _attach_kv_store(self, store) -> None:
        from llmjax.engine.kv_tiers import KVTiers
        from llmjax.kvstore.tiered import make_store

        if store is not None and store.config is not None:  # a shared store's policies
            self.config = self.config.replace(kv_store=store.config)
        cfg = self.config
        if not hasattr(self.runner, "import_host_pages") or self.runner.pipelined:
            raise ValueError("the KV tiers need a real device with pp == 1 and dense KV")
        block_pages = cfg.kv_store.block_size // cfg.cache.page_size
        if store is not None and store.block_pages != block_pages:
            raise ValueError(
                f"kv_store holds blocks of {store.block_pages} pages; this engine's are "
                f"{block_pages} (kv_store.block_size {cfg.kv_store.block_size})"
            )
        shape = list(self.runner.transfer_shape(block_pages))
        shape[2] = block_pages
        if store is None:
            salt = self.block_manager.prefix_cache.salt
            store = make_store(
                cfg.kv_store, tuple(shape), self.runner.kv_dtype, block_pages, salt.hex()[:16]
            )
        elif store.tiers and tuple(store.tiers[0].block_shape) != tuple(shape):
            raise ValueError(
                f"kv_store holds blocks of shape {store.tiers[0].block_shape}; this engine's "
                f"are {tuple(shape)} (another model, layout or block size)"
            )
        self.kv_tiers = KVTiers(store, self.block_manager, self.runner, cfg.kv_store)
        self.scheduler.prefix_loader = self.kv_tiers.load

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
    ) -> str:
        """Queue a request; returns its id. `arrival_time` (seconds on the engine's clock,
        default now) lets a trace replayer stamp the intended arrival. `hints`: what a
        program's executor knows of it (Parrot's criteria and app-level FIFO; see
        `ProgramHints`)."""
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
        )
        if sampling_params.stop and self.tokenizer is not None:
            req.stop_matcher = StopStringMatcher(
                self.tokenizer, sampling_params.stop, sampling_params.include_stop_str_in_output
            )
        try:
            self.validate_request(req.prompt_token_ids, sampling_params)
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
                self._add_samples(req)
        return request_id

    @property
    def structured(self):
        """llguidance over this engine's tokenizer (llmjax/engine/structured.py)."""
        if self._structured is None:
            from llmjax.engine.structured import StructuredOutputs

            m = self.config.model
            self._structured = StructuredOutputs(self.tokenizer, m.vocab_size, m.eos_token_ids)
        return self._structured

    def _add_samples(self, first: Request) -> None:
        """n > 1: the other n - 1 samples of `first`, each its own request with its own seed
        (seed + i, or drawn), held back until `first` has computed its prompt: they then find
        its pages in the prefix cache (at once without a cache)."""
        params, rid = first.sampling_params, first.request_id
        n = params.n
        seeds = [first.seed]
        for i in range(1, n):
            if params.seed is not None:
                seeds.append((params.seed + i) % 2**32)
            else:
                seeds.append(int(self._seed_rng.integers(0, 2**32)))
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
            if params.stop and self.tokenizer is not None:
                sample.stop_matcher = StopStringMatcher(
                    self.tokenizer, params.stop, params.include_stop_str_in_output
                )
            others.append(sample)
            self._live.add(sample.request_id)
        self._samples[rid] = [first, *others]
        for r in self._samples[rid]:
            self._sample_of[r.request_id] = rid
        if self.block_manager.caching:
            self._pending_samples[rid] = others
        else:
            for r in others:
                self.scheduler.add(r)

    def _release_samples(self) -> None:
        """Samples whose first has computed its prompt (or ended) join the waiting queue."""
        for rid, others in list(self._pending_samples.items()):
            first = self._samples[rid][0]
            if first.output_token_ids or first.status.is_done:
                for r in others:
                    self.scheduler.add(r)
                del self._pending_samples[rid]

    def validate_request(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        """Raise InvalidRequest if this request could never run. `add_request` checks it (and
        rejects the request with the message); a front end can ask first, to answer the client
        at once. Reads only what is fixed when the engine is built, so any thread may call it."""
        n = len(prompt_token_ids)
        max_len = self.config.max_model_len
        if n == 0:
            raise InvalidRequest("empty prompt: at least one token is needed", "prompt")
        if sampling_params.stop and self.tokenizer is None:
            raise InvalidRequest(
                "stop strings need a tokenizer; this engine has none (use stop_token_ids)", "stop"
            )
        if n >= max_len:
            raise InvalidRequest(
                f"prompt has {n} tokens but max_model_len={max_len} leaves no room for a new token",
                "prompt",
            )
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt"
            )
        _validate_processing(self.config, sampling_params)
        spec = sampling_params.structured_outputs
        if spec is not None:
            if self.tokenizer is None or self.config.device == "sim":
                why = "a tokenizer" if self.tokenizer is None else "real logits (not simulated)"
                raise InvalidRequest(f"structured_outputs need {why}", "structured_outputs")
            try:
                self.structured.check(spec)
            except (ValueError, ImportError) as e:
                raise InvalidRequest(str(e), "structured_outputs") from None
        if sampling_params.n > 1 and self.role != "colocated":
            raise InvalidRequest(
                f"n={sampling_params.n} on a {self.role} instance: samples run on colocated "
                "engines (disaggregated n is not supported yet)",
                "n",
            )
        # Alone in the cache, the request must be able to reach its last token.
        total = min(n + sampling_params.max_tokens, max_len)
        need = pages_needed(total, self.block_manager.page_size)
        if need > self.block_manager.num_usable_pages:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens needs {need} KV pages for {total} tokens but "
                f"the whole cache has {self.block_manager.num_usable_pages}; raise num_pages or "
                "lower max_tokens",
                "max_tokens",
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a waiting, running, parked or receiving request and free its pages (every
        sample of it with n > 1); False if it is not live."""
        samples = self._samples.pop(request_id, None)
        if samples is not None:
            pending = {r.request_id for r in self._pending_samples.pop(request_id, [])}
            now = self.clock.now()
            aborted = False
            for r in samples:
                self._sample_of.pop(r.request_id, None)
                if r.request_id in pending:
                    self._live.discard(r.request_id)
                    r.finish("abort", now, RequestStatus.ABORTED)
                    aborted = True
                else:
                    aborted |= self._abort_one(r.request_id)
            return aborted
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> bool:
        self._live.discard(request_id)
        req = self.parked.pop(request_id, None)
        if req is not None:  # its prompt's KV stays in the prefix cache
            self.block_manager.free(request_id, self.scheduler._computed_token_ids(req))
        elif request_id in self._receiving:  # the pages were never (fully) written
            req, _ = self._receiving.pop(request_id)
            self.block_manager.free(request_id)
        if req is not None:
            req.finish("abort", self.clock.now(), RequestStatus.ABORTED)
            return True
        return self.scheduler.abort(request_id) is not None

    def abort_all(self) -> list[str]:
        """Abort every waiting and running request; returns their ids."""
        ids = [rid for rid in self._live if self._sample_of.get(rid, rid) == rid]
        return [rid for rid in ids if self.abort_request(rid)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._rejected or self._pending_samples)

    # ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that got a token, finished or was
        rejected. In a profile (`LLM.profile`) each step is an `llmjax_step` with `llmjax.schedule`,
        `llmjax.pack`, `llmjax.run` and `llmjax.update` ranges inside."""
        self._num_step_calls += 1
        with self.runner.annotate_step(self._num_step_calls):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        outputs = [self._output(r) for r in self._rejected]
        self._rejected.clear()
        if self.runner.pipelined:
            return outputs + self._pipelined_step(t_start)
        trace = self.runner.annotate
        with trace("llmjax.schedule"):
            batch = self.scheduler.schedule()
        tiers = self.kv_tiers
        if tiers is not None:
            tiers.dispatch()  # before the step reuses evicted pages or reads loaded ones
        if not batch:
            return outputs
        if batch.num_spec_tokens and any(map(_blocks_speculation, batch.seqs)):
            self.scheduler.drop_speculation(batch)
        draft_s, observe = 0.0, None
        compiles = self._compile_counts()
        if batch.num_spec_tokens and self.speculator.drafts_on_device:
            with trace("llmjax.draft"):
                t = time.perf_counter()
                self._draft(batch)
                draft_s = time.perf_counter() - t
        with trace("llmjax.pack"):
            step_input, sampling = pack(
                batch,
                self.block_manager.page_tables,
                self.block_manager.page_size,
                self.buckets,
                self.config.speculative.num_speculative_tokens,
            )
        sampled = [s.request for s in batch.seqs if s.samples]
        constrained = [
            (i, s.request.matcher)
            for i, s in enumerate(batch.seqs)
            if s.samples and s.request.matcher is not None
        ]
        if constrained:  # filled by the runner while the device runs the forward
            rows = len(sampling.temperature)
            sampling.bitmask_fn = lambda: self.structured.bitmask(constrained, rows)
        t_run, c_run = time.perf_counter(), self.clock.now()
        with trace("llmjax.run", tokens=batch.num_tokens, seqs=len(batch.seqs)):
            next_ids = self.runner.run(step_input, sampling)
        t_update, c_update = time.perf_counter(), self.clock.now()
        logprobs = getattr(self.runner, "last_logprobs", None)
        if logprobs is not None:
            _record_logprobs(batch, next_ids, logprobs)
        prompt_results = getattr(self.runner, "last_prompt_logprobs", None)
        if sampling.prompt is not None and prompt_results is not None:
            _record_prompt_logprobs(batch, sampling.prompt.targets, prompt_results)
        if tiers is not None:
            tiers.finish()  # store the blocks gathered before the step
            prefill = sum(s.num_new_tokens for s in batch.seqs if not s.is_decode)
            if prefill:
                tiers.record_prefill(batch.num_tokens, c_update - c_run)
        new_tokens = next_ids[: len(batch.seqs)].tolist()
        if self.speculator is not None:
            self._verified(batch, new_tokens)
            # what decode steps cost, per size (not a step that compiled something)
            if all(s.is_decode for s in batch.seqs) and self._compile_counts() == compiles:
                observe = len(step_input.token_ids)
        with trace("llmjax.update"):
            for req in self.scheduler.update(batch, new_tokens):
                self._live.discard(req.request_id)
            if self.role == "prefill":
                self._park(sampled)
        if self.config.compile_ahead and not self.config.precompile:
            likely = self.buckets.likely_next(step_shape(step_input), len(self.scheduler.running))
            self.runner.compile_ahead(likely)
        if self._samples:
            self._release_samples()
        outputs += self._outputs(sampled)
        if self.config.sparse_kv.enabled:
            self._sparse_step_done(batch, step_input)
        if tiers is not None:  # the blocks this step completed start their copy now
            tiers.dispatch()
            if not self.scheduler.has_unfinished():
                tiers.finish()  # idle: nothing to overlap with
            tiers.prefetch(self.scheduler.waiting)  # disk reads for the next admissions
        self._record(batch, t_start, t_run, t_update, c_update - c_run, len(step_input.token_ids))
        if observe is not None:  # the whole step's wall time, host work included
            self.speculator.observe(observe, time.perf_counter() - t_start - draft_s, draft_s)
        return outputs

    def _compile_counts(self) -> tuple:
        r = self.runner
        return (
            r.num_compiles,
            getattr(r, "num_sample_compiles", 0),
            getattr(r, "num_draft_compiles", 0),
        )

    def _draft(self, batch) -> None:
        """The early-exit draft (SpeculativeConfig.method 'draft'): the device drafts the
        proposals the scheduler reserved, which replace the placeholders."""
        seqs = [s for s in batch.seqs if s.spec]
        ps = self.block_manager.page_size
        tables = self.block_manager.page_tables
        max_pages = max(pages_needed(s.start + s.num_new_tokens, ps) for s in seqs)
        _, S, P = self.buckets.shape_for(len(seqs), len(seqs), max_pages)
        tokens, positions, num = (np.zeros(S, np.int32) for _ in range(3))
        pages = np.zeros((S, P), np.int32)
        for i, seq in enumerate(seqs):
            table = tables[seq.request.request_id]
            used = pages_needed(seq.start + seq.num_new_tokens, ps)
            tokens[i] = seq.request.token_ids_slice(seq.start, seq.start + 1)[0]
            positions[i] = seq.start
            pages[i, :used] = table[:used]
            num[i] = len(seq.spec)
        proposals = self.runner.draft(tokens, positions, pages, num)
        for i, seq in enumerate(seqs):
            seq.spec = tuple(int(t) for t in proposals[i, : num[i]])

    def _verified(self, batch, new_tokens: list) -> None:
        """Speculative decoding: each verifying sequence's new tokens (its accepted proposals
        and the target's token) replace its entry in `new_tokens`; every decode's outcome goes
        to its request's counters and the engine's."""
        result = self.runner.last_spec
        stats = self.stats
        for i, seq in enumerate(batch.seqs):
            if not (seq.is_decode or seq.spec) or seq.request.status.is_done:
                continue
            k = len(seq.spec)
            accepted = 0
            if k:
                tokens, num_accepted = result
                accepted = int(num_accepted[i])
                new_tokens[i] = tokens[i, : accepted + 1].tolist()
                stats.num_spec_drafts += 1
                stats.num_spec_draft_tokens += k
                stats.num_spec_accepted_tokens += accepted
            self.speculator.record(seq.request, k, accepted, accepted + 1)

    def _sparse_step_done(self, batch, step_input) -> None:
        """sparse_kv: count the step's host -> device KV bytes; bound the host pool (evict
        pages of requests over `capacity`, counter/LRU/FIFO)."""
        st = self.runner.last_sparse_stats
        m, sparse = self.config.model, self.config.sparse_kv
        row = 2 * m.head_dim * np.dtype(self.config.dtype).itemsize  # one K and one V row
        cached_tokens = sum(seq.start + seq.num_new_tokens for seq in batch.seqs)
        is_sparse = bool(st.sparse)
        dense_layers = sparse.num_dense_layers if is_sparse else m.num_layers
        rows = dense_layers * cached_tokens * m.num_kv_heads + int(st.rows.sum())
        S, P = step_input.page_indices.shape
        G = self.block_manager.page_size
        buffer_rows = dense_layers * S * P * G * m.num_kv_heads
        if is_sparse:
            sparse_layers = m.num_layers - sparse.num_dense_layers
            per_token = self.runner.fetch_rows_per_token(P)
            buffer_rows += sparse_layers * S * m.num_kv_heads * per_token
        decode_only = all(s.is_decode for s in batch.seqs)
        self.stats.record_fetch(
            rows * row, buffer_rows * row, decode_only, is_sparse, len(batch.seqs)
        )
        if self.evictor is None:
            return
        bm = self.block_manager
        for i, seq in enumerate(batch.seqs):
            rid = seq.request.request_id
            table = bm.page_tables.get(rid)
            if table is None:  # finished or aborted
                continue
            if self._pool_tables.get(rid) is not table:  # new, or recomputed after preemption
                self.evictor.forget(rid)
                self._pool_tables[rid] = table
            hits = st.page_hits[i] if is_sparse else None
            self.evictor.record_step(rid, len(table), hits, self.stats.num_steps)
            self.stats.num_pool_evictions += len(
                self.evictor.evict(bm, rid, seq.start + seq.num_new_tokens)
            )
        for rid in [r for r in self._pool_tables if r not in bm.page_tables]:
            self.evictor.forget(rid)
            del self._pool_tables[rid]

    def _record(
        self,
        batch,
        t_start: float,
        t_run: float,
        t_update: float,
        device_s: float,
        num_padded_tokens: int | None = None,
    ) -> None:
        """Host seconds in wall time (the engine's own work, also when simulated); the device's
        on the engine's clock (wall time, or a simulated device's modeled step);
        `num_padded_tokens`, the step's token bucket."""
        bm = self.block_manager
        self.stats.record_step(
            batch,
            host_s=(t_run - t_start) + (time.perf_counter() - t_update),
            device_s=device_s,
            num_used_pages=bm.num_used_pages,
            num_cached_pages=bm.prefix_cache.num_cached_pages,
            num_evictions=bm.prefix_cache.num_evictions,
            num_padded_tokens=num_padded_tokens,
        )

    def _pipelined_step(self, t_start: float) -> list[RequestOutput]:
        """pp > 1: one pipeline tick. A micro-batch of requests not in flight enters stage 0
        (none if nothing can be scheduled); the micro-batch leaving the last stage updates its
        requests. At most pp micro-batches are in flight, one per stage."""
        trace = self.runner.annotate
        with trace("llmjax.schedule"):
            batch = self.scheduler.schedule()
        if not batch and not self.runner.num_in_flight:
            return []
        step_input = sampling = None
        if batch:
            with trace("llmjax.pack"):
                step_input, sampling = pack(
                    batch,
                    self.block_manager.page_tables,
                    self.block_manager.page_size,
                    self.buckets,
                )
            self.scheduler.in_flight.update(s.request.request_id for s in batch.seqs)
        t_run, c_run = time.perf_counter(), self.clock.now()
        with trace("llmjax.run", tokens=batch.num_tokens, seqs=len(batch.seqs)):
            exited, stage_tokens = self.runner.tick(step_input, sampling, batch if batch else None)
        t_update, c_update = time.perf_counter(), self.clock.now()
        self.stats.record_tick(stage_tokens, getattr(self.runner, "last_stage_seconds", None))
        if exited is None:
            return []
        done, next_ids = exited
        self.scheduler.in_flight.difference_update(s.request.request_id for s in done.seqs)
        sampled = [s.request for s in done.seqs if s.samples and not s.request.status.is_done]
        with trace("llmjax.update"):
            for req in self.scheduler.update(done, next_ids[: len(done.seqs)].tolist()):
                self._live.discard(req.request_id)
            if self.role == "prefill":
                self._park(sampled)
        self._record(done, t_start, t_run, t_update, c_update - c_run)
        return self._outputs(sampled)

    # ---- disaggregation (the module doc) ------------------------------------------------------

    def _park(self, sampled: list[Request]) -> None:
        for req in sampled:
            if not req.status.is_done and req.request_id not in self.parked:
                self.scheduler.running.remove(req)
                self.parked[req.request_id] = req

    def export_request(self, request_id: str) -> tuple[MigratedRequest, list[int]]:
        """A parked request (role 'prefill') as it leaves: its state and the pages that hold
        its computed tokens' KV, in order. It stays parked (pages held) until
        `release_request`."""
        req = self.parked.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not parked here (role={self.role!r})")
        n = req.num_computed_tokens
        pages = self.block_manager.page_tables[request_id][
            : pages_needed(n, self.block_manager.page_size)
        ]
        return _migrated(req, n), list(pages)

    def release_request(self, request_id: str) -> None:
        """The parked request's KV has moved on: free its pages here (its prompt's full pages
        stay in the prefix cache)."""
        req = self.parked.pop(request_id)
        self._live.discard(request_id)
        self.block_manager.free(request_id, self.scheduler._computed_token_ids(req))

    def waiting_pages(self) -> int:
        """KV pages the waiting queue's requests will need (all their tokens)."""
        ps = self.block_manager.page_size
        return sum(pages_needed(r.num_tokens, ps) for r in self.scheduler.waiting)

    def can_accept(self, m: MigratedRequest, waiting_page_fraction: float = 0.05) -> bool:
        """DistServe's pull condition for a decode instance: its waiting queue uses less than
        `waiting_page_fraction` of its pages, a sequence slot is free, and `m`'s pages (all its
        tokens so far) fit beside the admission watermark."""
        bm, sched = self.block_manager, self.scheduler
        if len(sched.running) + len(self._receiving) >= self.config.scheduler.max_num_seqs:
            return False
        if self.waiting_pages() >= waiting_page_fraction * bm.num_usable_pages:
            return False
        keep_free = sched.watermark_pages if sched.running else 0
        return bm.can_allocate(m.request_id, m.num_tokens, keep_free)

    def reserve_import(self, m: MigratedRequest) -> list[int]:
        """Take pages for `m` (all its tokens so far); returns the first `m.num_kv_pages` of
        them, in order, for the KV transfer to write. The request is not scheduled until
        `commit_import`."""
        if m.request_id in self._live:
            raise ValueError(f"request_id={m.request_id!r} is already live here")
        req = self._request_from(m)
        self.block_manager.allocate(m.request_id, m.num_tokens)
        if self.kv_tiers is not None:
            self.kv_tiers.dispatch()  # write-backs of the evicted pages, before the import
        self._receiving[m.request_id] = (req, m.num_kv_tokens)
        self._live.add(m.request_id)
        return list(
            self.block_manager.page_tables[m.request_id][
                : m.num_kv_pages(self.block_manager.page_size)
            ]
        )

    def commit_import(self, request_id: str) -> None:
        """The KV transfer into the reserved pages is done: the request joins the running batch
        with its KV tokens computed (its next step is a decode)."""
        req, num_kv_tokens = self._receiving.pop(request_id)
        req.num_computed_tokens = num_kv_tokens
        req.status = RequestStatus.RUNNING
        self.scheduler.running.append(req)
        if self.block_manager.caching:
            self.scheduler._cache_computed(req)

    def cancel_import(self, request_id: str, error: str | None = None) -> None:
        """The KV transfer failed: free the reserved pages and recompute the request here from
        its tokens (like a preempted one), or with `error`, fail it with that reason (its
        output comes with the next step)."""
        req, _ = self._receiving.pop(request_id)
        self.block_manager.free(request_id)
        if error is None:
            self.scheduler.add(req)
        else:
            self._fail(req, error)

    def recompute_request(self, m: MigratedRequest) -> None:
        """Take over `m` without its KV (its source died, or its transfer failed before any
        page was reserved): it waits here and recomputes prompt + output so far."""
        if m.request_id in self._live:
            raise ValueError(f"request_id={m.request_id!r} is already live here")
        self.scheduler.add(self._request_from(m))
        self._live.add(m.request_id)

    def _fail(self, req: Request, error: str) -> None:
        req.error = error
        req.finish("error", self.clock.now(), RequestStatus.REJECTED)
        self._live.discard(req.request_id)
        self._rejected.append(req)
        logger.warning("request %s failed: %s", req.request_id, error)

    def _request_from(self, m: MigratedRequest) -> Request:
        params = m.sampling_params
        req = Request(
            request_id=m.request_id,
            prompt_token_ids=list(m.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=frozenset(self.config.model.eos_token_ids),
            seed=m.seed,
            prompt=m.prompt,
            output_token_ids=list(m.output_token_ids),
            num_cached_tokens=m.num_cached_tokens,
            loaded_tokens=dict(m.loaded_tokens),
            num_preemptions=m.num_preemptions,
            metrics=_copy_metrics(m.metrics),
            hints=m.hints,
            logprobs=None if m.logprobs is None else list(m.logprobs),
            cumulative_logprob=m.cumulative_logprob,
            prompt_logprobs=None if m.prompt_logprobs is None else list(m.prompt_logprobs),
        )
        if params.stop and self.tokenizer is not None:
            req.stop_matcher = StopStringMatcher(
                self.tokenizer, params.stop, params.include_stop_str_in_output
            )
            for t in req.output_token_ids:
                req.stop_matcher.add(t)
        return req

    def _outputs(self, sampled: list[Request]) -> list[RequestOutput]:
        """One output per request that got a token: a request with n samples once, all its
        samples in it."""
        if not self._samples:
            return [self._output(r) for r in sampled]
        out, groups = [], []
        for r in sampled:
            rid = self._sample_of.get(r.request_id)
            if rid is None:
                out.append(self._output(r))
            elif rid not in groups:
                groups.append(rid)
        return out + [self._sample_output(rid) for rid in groups]

    def _sample_output(self, rid: str) -> RequestOutput:
        """The output of a request with n samples: the first's fields, every sample in
        `outputs`, finished once all are (then the group is forgotten)."""
        samples = self._samples[rid]
        outs = [self._output(r) for r in samples]
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
            del self._samples[rid]
            for r in samples:
                self._sample_of.pop(r.request_id, None)
        return first

    def _output(self, req: Request) -> RequestOutput:
        done = req.status.is_done
        text = ""
        if done and self.tokenizer is not None and req.output_token_ids:
            text = self.tokenizer.decode(req.output_token_ids)
            if req.stop_matcher is not None and req.stop_matcher.text_end is not None:
                text = text[: req.stop_matcher.text_end]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=text,
            finished=done,
            finish_reason=req.finish_reason,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            stop_reason=req.stop_reason,
            num_cached_tokens_per_tier=cached_tokens_per_tier(
                req.num_cached_tokens, req.loaded_tokens
            ),
            logprobs=self._decoded_logprobs(req.logprobs) if done else _copy(req.logprobs),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            prompt_logprobs=self._decoded_logprobs(req.prompt_logprobs) if done else None,
        )

    def _decoded_logprobs(self, entries):
        """Logprob entries with each token's text (a tokenizer's), for a finished output."""
        if entries is None or self.tokenizer is None:
            return None if entries is None else list(entries)
        tok = self.tokenizer

        def decoded(e):
            if e is None:
                return None
            return {
                t: dataclasses.replace(lp, decoded_token=tok.decode([t], False))
                for t, lp in e.items()
            }

        return [decoded(e) for e in entries]

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles


def _blocks_speculation(seq) -> bool:
    """Whether a step holding `seq` cannot verify proposals: it computes prompt logprobs (that
    step returns logits for every token row). Rows with logits processing, logprobs or
    structured outputs share a step with verifications (their sampler takes each sequence's
    first logits row)."""
    return seq.request.sampling_params.prompt_logprobs is not None and not seq.is_decode


def _validate_processing(cfg: EngineConfig, params: SamplingParams) -> None:
    """What this engine can do of logits processing, logprobs and n."""
    from llmjax.engine.batch import MAX_BIAS_SLOTS

    logprobs = params.logprobs is not None or params.prompt_logprobs is not None
    if not (params.processes_logits or logprobs):
        return
    if cfg.device == "sim" and logprobs:
        raise InvalidRequest(
            "logprobs: the simulated device computes no logits (its tokens are stand-ins)",
            "logprobs" if params.logprobs is not None else "prompt_logprobs",
        )
    if cfg.parallel.pp > 1 or cfg.sparse_kv.enabled:
        what = "pp > 1" if cfg.parallel.pp > 1 else f"sparse_kv={cfg.sparse_kv.mode!r}"
        raise InvalidRequest(
            f"logits processing and logprobs are not supported with {what} yet (penalties, "
            "logit_bias, min_tokens, min_p and logprobs run in the sampler of dense "
            "single-stage engines)",
            "logprobs" if params.logprobs is not None else "logit_bias",
        )
    slots = len(params.logit_bias)
    if params.min_tokens:
        slots += len(set(params.stop_token_ids) | set(cfg.model.eos_token_ids))
    if slots > MAX_BIAS_SLOTS:
        raise InvalidRequest(
            f"logit_bias and min_tokens' stop tokens need {slots} bias slots; at most "
            f"{MAX_BIAS_SLOTS}",
            "logit_bias",
        )


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


def _copy(items: list | None) -> list | None:
    return None if items is None else list(items)


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


def _copy_metrics(m: RequestMetrics) -> RequestMetrics:
    return dataclasses.replace(m, token_times=list(m.token_times))


def _migrated(req: Request, num_kv_tokens: int) -> MigratedRequest:
    return MigratedRequest(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids),
        sampling_params=req.sampling_params,
        seed=req.seed,
        num_kv_tokens=num_kv_tokens,
        metrics=_copy_metrics(req.metrics),
        prompt=req.prompt,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
        loaded_tokens=dict(req.loaded_tokens),
        hints=req.hints,
        logprobs=None if req.logprobs is None else list(req.logprobs),
        cumulative_logprob=req.cumulative_logprob,
        prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
    )

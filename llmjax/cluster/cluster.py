"""Many engine instances behind one router, colocated or disaggregated (DistServe; issue 21).

    cluster = launch("smollm2-135m", [InstanceSpec("prefill", tp=4), InstanceSpec("decode", tp=4)])
    outputs = cluster.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16))
    replay(cluster, specs)    # llmjax.bench.replay: a Cluster duck-types as one engine

A `Cluster` holds instances (`LocalInstance`s in this process, or the Ray launcher's actor
handles with the same calls) under the cluster's policies (`ClusterCore`, core.py, and the pull
rule of migration.py: the simulated cluster runs the same ones) and does three things each
`step()`:

1. **Route** (at `add_request`): an arriving request goes to a 'colocated' or 'prefill' instance
   chosen by `router` (a name of `llmjax.cluster.router.ROUTERS`) over those instances' loads.
2. **Migrate** (DistServe's pull-based protocol, ALGORITHMS.md §7), first in each `step()`, so
   that arrivals added between two steps are routed before the pulls of that time, as the
   simulated cluster orders its events: prefill instances park each request after its first
   token with its KV pages held. The oldest parked request (across prefill instances) moves
   when a decode instance can take it: its waiting queue uses less than
   `waiting_page_fraction` (5 %) of its pages and the request's pages fit (`LLMEngine.
   can_accept`); among those that can, `decode_router` picks one. Until then the KV stays where
   it is, counted as used there, and no later request overtakes it (FIFO). The move: the prefill
   side gathers and offers the pages (`transport`, llmjax/cluster/transfer.py), the decode side
   reserves pages and pulls; when the array arrives it is scattered into those pages, the
   request joins the decode batch, and the prefill side frees its pages (its prompt stays in
   that side's prefix cache).
3. **Step** every instance that has work (in this process one after the other; Ray's actors in
   parallel) and pass their outputs on: a prefill instance's output carries the first token
   (TTFT), the decode instance's the rest.

tests/test_cluster_same_decisions.py builds one cluster both ways (this one on a virtual clock
advanced by each step's wall time, and the simulated one driven by those recorded times) and
checks that every routing and migration decision is the same.

**The Conductor** (`router="mooncake"` or a `Conductor`, llmjax/cluster/conductor.py) over
prefill and decode instances: at arrival it names the prefill instance, the decode instance the
request will migrate to (step 2 then moves it only there: each decode instance takes its own
pinned requests FIFO, while unpinned requests keep the one FIFO), and whether to fetch a longer
prefix from another prefill instance's cache first (`fetch_prefix`); or it rejects the request,
which then finishes at once with no tokens, `finish_reason='rejected'` and the reason as its
`error`. `conductor_stats` counts its decisions, rejections and fetches; the Conductor hears of
every request that leaves (`Conductor.finished`).

Failures lose no request. A transfer that fails or passes `transfer_timeout_s` makes the decode
side recompute the request from its tokens (`on_transfer_failure='recompute'`), or fail it with
the reason ('fail'). An instance that dies (`kill(i)`, or a Ray actor that is gone) has its
requests recomputed elsewhere: those without a token yet on an entry instance, the others on a
decode (or colocated) instance, from the prompt and the tokens generated so far; with no instance
of the kind left they fail with a reason. Every request ends finished, aborted or failed.

Seeds: the cluster draws each request's seed (when its SamplingParams has none) from its own
generator, so a request samples the same tokens whichever instances serve it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np

from llmjax.cluster.core import ENTRY_ROLES, ClusterCore, ended_output
from llmjax.cluster.migration import choose
from llmjax.cluster.pulls import Pulls
from llmjax.cluster.recovery import FailureRecovery, Record
from llmjax.cluster.router import Router, RouteRequest
from llmjax.cluster.serving_view import ServingView
from llmjax.cluster.stats import TransferStats
from llmjax.cluster.views import LoadView
from llmjax.engine.clock import WALL_CLOCK
from llmjax.engine.request import RequestOutput
from llmjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRANSFER_FAILURE_POLICIES = ("recompute", "fail")


class Cluster(FailureRecovery, Pulls):
    """Instances behind a router, with DistServe's migration between prefill and decode ones
    (the module doc). `instances`: `LocalInstance`s or Ray actor handles (`launch`)."""

    def __init__(
        self,
        instances: Sequence,
        router: Router | str = "round_robin",
        *,
        decode_router: Router | str = "least_outstanding",
        waiting_page_fraction: float = 0.05,
        on_transfer_failure: str = "recompute",
        transfer_timeout_s: float = 30.0,
        seed: int = 0,
        clock=WALL_CLOCK,
    ):
        self.instances = list(instances)
        if not self.instances:
            raise ValueError("a Cluster needs at least one instance")
        roles = [inst.role for inst in self.instances]
        # the routing and migration policies, shared with the simulated cluster
        loras = [inst.config.lora for inst in self.instances]
        self.core = ClusterCore(roles, router, decode_router, waiting_page_fraction, loras)
        if on_transfer_failure not in TRANSFER_FAILURE_POLICIES:
            raise ValueError(f"{on_transfer_failure=} must be one of {TRANSFER_FAILURE_POLICIES}")
        first = self.instances[0].config
        for i, inst in enumerate(self.instances):
            m = inst.config.model
            if (m.vocab_size, tuple(m.eos_token_ids)) != (
                first.model.vocab_size,
                tuple(first.model.eos_token_ids),
            ):
                raise ValueError(f"instance {i} serves another vocabulary than instance 0")
        self.roles = roles
        self.router, self.decode_router = self.core.router, self.core.decode_router
        self.waiting_page_fraction = waiting_page_fraction
        self.on_transfer_failure = on_transfer_failure
        self.transfer_timeout_s = transfer_timeout_s
        self.config = first
        self.tokenizer = self.instances[0].tokenizer
        self.model_name = first.model.name or "llmjax"  # launch() sets the name it loaded
        self.clock = clock
        self.alive = [True] * len(self.instances)
        self._loads = [inst.load() for inst in self.instances]
        self._outstanding = [0] * len(self.instances)
        self._records: dict[str, Record] = {}
        self._errors: list[RequestOutput] = []  # failed by the cluster, out with the next step
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(seed)
        self.transfer_stats = TransferStats()
        self.conductor_stats = self.core.conductor_stats
        self._t_start = time.perf_counter()

    # ---- the engine interface --------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        hints=None,
        instance: int | None = None,
        lora_request=None,
    ) -> str:
        """Route a request to an entry instance now; returns its id. `instance`: the entry
        instance (an index into the entry instances, as `entry_instances` lists them) chosen by
        the caller (a program's scheduler, llmjax/program/) instead of the router or the
        Conductor, if it is alive (`ClusterCore.place`); `hints`: the engine's
        `ProgramHints`, kept if the request is recomputed elsewhere; `lora_request`: the LoRA
        adapter it runs under (`LLMEngine.add_request`'s; every instance it reaches serves it:
        its prefix fetches, its move to a decode instance and any recomputation keep it)."""
        entry = self.entry_instances
        if instance is not None and not 0 <= instance < len(entry):
            raise ValueError(f"{instance=} is not an entry instance (0..{len(entry) - 1})")
        if request_id is None:
            request_id = next(r for r in map(str, self._ids) if r not in self._records)
        elif request_id in self._records:
            raise ValueError(f"{request_id=} is already waiting or running")
        params = sampling_params or SamplingParams()
        seed = params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**32))
            params = dataclasses.replace(params, seed=seed)
        arrival = self.clock.now() if arrival_time is None else float(arrival_time)
        route = RouteRequest(
            request_id,
            tuple(int(t) for t in prompt_token_ids),
            arrival,
            params,
            hints,
            instance,
            lora_request,
        )
        while True:
            alive = lambda i: self.alive[i]
            views = lambda idx: [LoadView(k, self, i) for k, i in enumerate(idx)]
            placement = self.core.place(route, views, route.arrival_time, alive=alive)
            if placement.rejected is not None:
                self.core.commit(placement, route)
                self._reject(route, prompt, placement.rejected)
                return request_id
            i = placement.prefill
            if placement.fetches:
                self.fetch_prefix(
                    placement.fetch_from,
                    i,
                    route.prompt_token_ids[: placement.fetch_tokens],
                    route.cache_namespace,
                )
            try:
                self.instances[i].add_request(
                    list(route.prompt_token_ids),
                    params,
                    request_id,
                    prompt,
                    arrival,
                    hints,
                    lora_request,
                )
                self._loads[i] = self.instances[i].load()  # the next arrival sees it queued
            except ValueError:
                raise
            except Exception as e:  # a dead instance: place it again
                if placement.decision is not None:
                    self.core.left(request_id)
                self.kill(i, reason=f"instance {i} failed: {e!r}")
                continue
            break
        self.core.commit(placement, route)
        self._records[request_id] = Record(route, prompt, seed, i)
        self._outstanding[i] += 1
        return request_id

    def fetch_prefix(
        self, source: int, dest: int, token_ids: Sequence[int], namespace: bytes | None = None
    ) -> int:
        """The Conductor's KV fetch: copy the cached prefix `token_ids` (under `namespace`: a
        LoRA adapter's, None: the base model's) from prefill instance `source`'s prefix cache
        into `dest`'s, with the KV transport (`LocalInstance.
        export_prefix` / `import_prefix`: gather, move, scatter into fresh pages, insert into
        the radix tree); returns the prefix tokens `dest` caches now. Ray actors make the same
        calls on their instances (across processes only the transfer_server transport can
        move the pages; that path is not tested yet). Instances without these calls, or a
        fetch that fails, leave `dest` to recompute the prefix (counted in
        `conductor_stats.num_fetches_recomputed`). Instances that share KV tiers
        (`launch(kv_store=...)`, llmjax/engine/kv_tiers.py) also find each other's prefixes
        there on admission."""
        st = self.conductor_stats
        src, dst = self.instances[source], self.instances[dest]
        if not (hasattr(src, "export_prefix") and hasattr(dst, "import_prefix")):
            st.num_fetches_recomputed += 1
            return 0
        t = time.perf_counter()
        try:
            ns = {} if namespace is None else {"namespace": namespace}
            offer, num_tokens = src.export_prefix(token_ids, **ns)
            if offer is None:
                st.num_fetches_recomputed += 1
                return 0
            before = dst.cached_prefix_tokens([*token_ids, 0], **ns)
            ids = list(token_ids)[:num_tokens]  # (the offer's tokens)
            got = dst.import_prefix(ids, offer, self.transfer_timeout_s, **ns)
        except Exception as e:
            logger.warning("prefix fetch %d -> %d failed (%r): recomputing it", source, dest, e)
            st.num_fetches_recomputed += 1
            return 0
        st.num_fetches += 1
        st.fetched_tokens += max(got - before, 0)
        st.fetch_bytes += offer.nbytes
        st.fetch_seconds += time.perf_counter() - t
        self._loads[dest] = dst.load()
        return got

    def _reject(self, route: RouteRequest, prompt: str | None, reason: str) -> None:
        """The Conductor rejected the request: it finishes with the next step's outputs."""
        self._errors.append(
            ended_output(route, prompt, reason, self.clock.now(), finish_reason="rejected")
        )

    def step(self) -> list[RequestOutput]:
        """Move KV, then step every live instance with work (the module doc); returns every
        output (first tokens from prefill instances, the rest from decode instances)."""
        outputs, self._errors = self._errors, []
        if "decode" in self.roles:  # the pulls first: what the arrivals added since saw stays
            self._migrate()
        busy = [
            i
            for i in range(len(self.instances))
            if self.alive[i] and (self._loads[i].has_unfinished or self._outstanding[i])
        ]
        # Remote instances (Ray actors) start their steps together: `step_begin()` returns a
        # future that `step_end(future)` waits for; a LocalInstance just steps.
        started = {}
        for i in busy:
            begin = getattr(self.instances[i], "step_begin", None)
            if begin is not None:
                try:
                    started[i] = begin()
                except Exception as e:
                    started[i] = e
        for i in busy:
            inst = self.instances[i]
            try:
                if i in started:
                    if isinstance(started[i], Exception):
                        raise started[i]
                    outs, self._loads[i] = inst.step_end(started[i])
                else:
                    outs, self._loads[i] = inst.step()
            except Exception as e:  # a dead instance (e.g. a Ray actor gone)
                logger.error("instance %d failed in step: %r", i, e)
                self.kill(i, reason=f"instance {i} failed: {e!r}")
                continue
            outputs += self._track(outs)
        return outputs + self._take_errors()

    def has_unfinished_requests(self) -> bool:
        return bool(self._records) or bool(self._errors)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request wherever it is (queued, prefilling, parked, moving, decoding)."""
        rec = self._records.pop(request_id, None)
        if rec is None:
            return False
        self._left(request_id)
        self._outstanding[rec.instance] -= 1
        for i in {rec.instance, rec.source} - {None}:
            if self.alive[i]:
                try:
                    self.instances[i].abort_request(request_id)
                except Exception as e:
                    self.kill(i, reason=f"instance {i} failed: {e!r}")
        return True

    def shutdown(self) -> None:
        """Stop every instance (a Ray actor ends; a local one drops its offers)."""
        for i, inst in enumerate(self.instances):
            if self.alive[i]:
                self.alive[i] = False
                with contextlib.suppress(Exception):
                    inst.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def abort_all(self) -> list[str]:
        return [rid for rid in list(self._records) if self.abort_request(rid)]

    @property
    def stats(self) -> list:
        """Each instance's `EngineStats`, in index order (dead ones included, as they were)."""
        return [inst.stats for inst in self.instances]

    @property
    def total_stats(self):
        from llmjax.engine.stats import EngineStats

        return EngineStats.merge(self.stats)

    def reset_stats(self) -> None:
        for i, inst in enumerate(self.instances):
            if self.alive[i]:
                inst.reset_stats()
        self.transfer_stats = TransferStats()
        self._t_start = time.perf_counter()

    def reset_prefix_cache(self) -> bool:
        return all(
            [inst.reset_prefix_cache() for i, inst in enumerate(self.instances) if self.alive[i]]
        )

    # ---- LoRA adapters (every instance serves the same ones: `ClusterCore`'s check) ---------

    @property
    def lora(self):
        """The instances' `LoRAConfig` (they all have one, or none does)."""
        return self.config.lora

    def add_lora(self, lora_request) -> bool:
        """Register (and read) the adapter on every live instance (`LLMEngine.add_lora`)."""
        return all([inst.add_lora(lora_request) for inst in self._live_instances()])

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter on every live instance (`LLMEngine.remove_lora`); refused
        (ValueError) while a request of the cluster runs under it."""
        users = [
            r
            for r, rec in self._records.items()
            if rec.route.lora_request is not None
            and rec.route.lora_request.lora_int_id == lora_int_id
        ]
        if users:
            raise ValueError(
                f"adapter {lora_int_id} is in use by {len(users)} requests ({users[:3]}...): "
                "abort them or wait for them to finish"
            )
        return any([inst.remove_lora(lora_int_id) for inst in self._live_instances()])

    def list_loras(self) -> dict:
        """The adapters served (id -> LoRARequest), as the first live instance lists them."""
        live = self._live_instances()
        return live[0].list_loras() if live else {}

    def _live_instances(self) -> list:
        return [inst for i, inst in enumerate(self.instances) if self.alive[i]]

    @property
    def num_compiles(self) -> int:
        return sum(inst.num_compiles for i, inst in enumerate(self.instances) if self.alive[i])

    def utilization(self) -> list[float]:
        """Per instance: the fraction of wall time since the stats started that it spent in
        device steps (`EngineStats.device_time_s`)."""
        elapsed = max(time.perf_counter() - self._t_start, 1e-9)
        return [s.device_time_s / elapsed for s in self.stats]

    def instance_of(self, request_id: str) -> int:
        """Where the request runs now (KeyError once it ended)."""
        return self._records[request_id].instance

    @property
    def entry_instances(self) -> list[int]:
        """Indices of the instances that take arrivals ('colocated' or 'prefill'), dead or
        alive, in order: what `add_request(instance=k)` numbers."""
        return [i for i, r in enumerate(self.roles) if r in ENTRY_ROLES]

    def serving_view(self) -> ServingView:
        """This cluster as the server drives an engine (`llmjax.serve.make_app(cluster)`)."""
        return ServingView(self)

    def describe(self) -> list[dict]:
        return [
            dict(index=i, alive=self.alive[i], **inst.describe())
            for i, inst in enumerate(self.instances)
        ]

    # ---- convenience -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence,
        sampling_params: SamplingParams | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Run prompts (strings, with a tokenizer, or token id lists) to completion; their
        outputs in order. `lora_request`: a LoRA adapter for all of them, or one per prompt."""
        loras = (
            lora_request
            if isinstance(lora_request, list | tuple)
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} prompts")
        ids = []
        for p, lora in zip(prompts, loras, strict=True):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass token ids")
                ids.append(
                    self.add_request(
                        self.tokenizer.encode(p), sampling_params, prompt=p, lora_request=lora
                    )
                )
            else:
                ids.append(self.add_request(p, sampling_params, lora_request=lora))
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def _left(self, rid: str, num_output_tokens: int | None = None) -> None:
        """`rid` left the cluster (ClusterCore.left: its pin dropped, the router told)."""
        self.core.left(rid, num_output_tokens)

    def _take_errors(self) -> list[RequestOutput]:
        out, self._errors = self._errors, []
        return out

    # ---- internals -------------------------------------------------------------------------

    def _alive_with(self, roles) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r in roles and self.alive[i]]

    def _choose(self, router, route: RouteRequest, candidates: list[int]) -> int:
        views = [LoadView(k, self, i) for k, i in enumerate(candidates)]
        return candidates[choose(router, route, views, route.arrival_time)]

    def _track(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        kept = []
        for out in outs:
            rec = self._records.get(out.request_id)
            if rec is None:  # aborted here meanwhile
                continue
            rec.tokens = list(out.token_ids)
            rec.metrics = out.metrics
            if out.finished:
                del self._records[out.request_id]
                self._outstanding[rec.instance] -= 1
                self._left(out.request_id, None if out.error else len(out.token_ids))
            kept.append(out)
        return kept

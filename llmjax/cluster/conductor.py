"""The Mooncake Conductor (FAST'25; ALGORITHMS.md §10.2-10.3, issue 22 item 3): a (prefill,
decode) pair for each request, chosen around where its prefix's KV already is, with early
rejection of requests predicted to miss their SLOs.

    conductor = Conductor(SimCostModel(prefill_config, decode_config), ttft_slo=30.0,
                          tbt_slo=0.1, rejection="predicted")
    cluster = SimCluster(prefill_engines + decode_engines, conductor)   # or Cluster(...)

Algorithm 1, for a request of n prompt tokens arriving at `now`, over the prefill instances P
(their views, `ConductorLoad`) and the decode instances D:

    local(p)   = p.cached_prefix_tokens(prompt)               the prefix p's cache holds
    best, b    = max over P of local(p) (ties: lowest index)   the longest prefix anywhere
    for p in P:
        T_queue    = sum of prefill_seconds(r) over p.queued_prefills()   (not yet prefilled)
        if best / local(p) > kvcache_balancing_threshold (local 0: inf if best > 0):
            T_transfer = transfer_seconds(best - local(p));  cached = best   (fetch from b)
        else:
            T_transfer = 0;                                  cached = local(p)
        TTFT(p)    = T_queue + T_transfer + prefill_seconds(n, cached)
    p*  = argmin TTFT (ties: lowest index)
    d*  = argmin over D of the predicted TBT (below; ties: lowest index; a decode instance
          whose predicted KV would overflow its cache only if all would)
    reject if rejection != 'none' and (TTFT(p*) > ttft_slo or TBT > tbt_slo)

A queued request's prefill time is `prefill_seconds(tokens, max(computed, cached))` with the
cached tokens this Conductor expected when it routed it (its own record; 0 for one it did not).

**The KV pool** (`schedule(..., pool=)`: Mooncake Store's DRAM pool, the simulator's
`llmjax.sim.kvpool.SimKVPool`; a SimCluster with one passes it; without one the above is
unchanged). The best match anywhere also considers the pool, `stored = pool.match_tokens(
prompt)`: for each p, if stored > the cached tokens of p's option above and best / local's
test passes for stored, the pool option

        TTFT_pool(p) = T_queue + pool_transfer_seconds(stored - local(p))
                       + prefill_seconds(n, stored)

replaces it when it is smaller (`pool_transfer_seconds`: the cost model's, default
`transfer_seconds`). Unlike the instance fetch (Algorithm 1's threshold alone), a pool fetch is
thus taken only when predicted faster than what p would do otherwise (recompute, or fetch from
the best instance): the pool may be given a slower bandwidth than the network's. The decision
says `from_pool` (and `fetch_from` None).

**Decode load.** A decode instance's predicted TBT is `decode_step_seconds(batch, context)` at
the time the request would start decoding, t = now + TTFT(p*) (§10.3's prediction; beyond
the instance's `max_num_seqs` a request gets a token only every batch / max_num_seqs steps): of
the
requests decoding there now (`decode_requests()`: context and output tokens so far) those still
decoding at t, plus the requests this Conductor pinned there that start decoding by t (at their
own predicted start) and are not done by t, plus this one. Every request is assumed to decode
`expected_output_tokens` tokens (None: the running mean over the finished requests the cluster
reports through `finished`, 256 before the first) at the instance's current step time: the
paper's uniform decode time. Their contexts grow by the tokens decoded by t. The chosen decode
instance is always the one with the least predicted TBT (so that the requests of one burst,
routed before any of them decodes, spread over the decode instances).

**Rejection** (`rejection`): 'none' never rejects; 'current' tests the TBT of the chosen decode
instance's current load (what decodes there now, plus this request): §10.3's naive early
rejection, which lags the decode load by the prefill time; 'predicted' tests the predicted TBT
above (neither for a request with max_tokens 1, which never decodes). Both test the predicted
TTFT against `ttft_slo`. An SLO of None is not tested. The reason
(`Decision.rejected`) names the SLO predicted to miss and by how much.

The cost model is any object with `prefill_seconds(num_tokens, num_cached)`,
`decode_step_seconds(batch, context_tokens)` and `transfer_seconds(num_tokens)` (`CostModel`):
`SimCostModel` from the simulator's models of an instance config, or `MeasuredCostModel`, a
linear model for real instances (`from_stats`: fitted from their `EngineStats`). A Conductor
built without one gets the simulator's for its instances in a `SimCluster` and
`MeasuredCostModel()`'s placeholder figures in a real `Cluster`.

As a plain `Router` (`route`, e.g. over colocated instances) it is Algorithm 1's prefill choice
alone: no pinning, no fetch, no rejection.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmjax.cluster.routing import InstanceLoad, RouteRequest

REJECTION_MODES = ("none", "current", "predicted")
POOL = "pool"  # a fetch source: the cluster's KV pool (Mooncake Store's DRAM pool)
DEFAULT_OUTPUT_TOKENS = 256  # the uniform decode length before any request finished


class ConductorLoad(Protocol):
    """What the Conductor reads of an instance beyond `InstanceLoad` (the SimCluster's
    `InstanceView` and the real Cluster's view implement it)."""

    index: int  # its position in the list the Conductor is given

    @property
    def instance_id(self) -> int: ...  # its index in the cluster (stable across calls)

    def cached_prefix_tokens(
        self, prompt_token_ids: Sequence[int], namespace: bytes | None = None
    ) -> int: ...

    def queued_prefills(self) -> Sequence[tuple[str, int, int]]:
        """(request id, tokens to prefill, tokens computed so far) of every request here whose
        prefill is not done: waiting, mid-prefill, or (simulator) fetching its prefix."""
        ...

    def decode_requests(self) -> Sequence[tuple[str, int, int]]:
        """(request id, context tokens, output tokens so far) of every request decoding here,
        waiting here after a preemption, or whose KV is on its way here."""
        ...

    @property
    def kv_capacity_tokens(self) -> int: ...  # usable KV pages x page size

    @property
    def max_num_seqs(self) -> int: ...  # sequences a step decodes at most (optional)


class KVPoolLoad(Protocol):
    """A cluster-wide KV pool as the Conductor reads it (`llmjax.sim.kvpool.SimKVPool`)."""

    def match_tokens(self, prompt_token_ids: Sequence[int]) -> int: ...


class CostModel(Protocol):
    def prefill_seconds(self, num_tokens: int, num_cached: int) -> float: ...

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float: ...

    def transfer_seconds(self, num_tokens: int) -> float: ...

    # optional: the KV of `num_tokens` tokens from the KV pool (default `transfer_seconds`)
    # def pool_transfer_seconds(self, num_tokens: int) -> float: ...


# ---- cost models ---------------------------------------------------------------------------------


class SimCostModel:
    """The simulator's own step model (`llmjax.sim.runner.make_cost_model`: roofline or fitted)
    for a prefill instance config and a decode instance config (default the same).

    prefill_seconds(n, cached): the steps of one request alone, its n - cached new tokens
        (at least 1) in chunks of the prefill config's `max_num_batched_tokens`, each chunk
        attending to everything before it.
    decode_step_seconds(batch, context): one decode-only step of `batch` sequences reading
        `context` keys in all.
    transfer_seconds(tokens): the SimCluster's transfer model for the KV of `tokens` tokens
        into one prefill instance: latency + bytes per device / bandwidth, over the network
        (`Hardware.network_bandwidth`, `network_latency_s`; `transfer_bandwidth` and
        `transfer_latency_s` override them, as in SimCluster).
    pool_transfer_seconds(tokens): the same from the cluster's KV pool (SimCluster's
        `kv_pool_seconds`): `pool_bandwidth` / `pool_latency_s` when given, else as
        transfer_seconds.
    """

    def __init__(
        self,
        prefill_config,
        decode_config=None,
        *,
        transfer_bandwidth: float | None = None,
        transfer_latency_s: float | None = None,
        pool_bandwidth: float | None = None,
        pool_latency_s: float | None = None,
    ):
        from llmjax.sim.roofline import kv_page_bytes_per_device
        from llmjax.sim.runner import make_cost_model

        decode_config = decode_config or prefill_config
        self._prefill = make_cost_model(prefill_config)
        self._decode = make_cost_model(decode_config)
        self.chunk_tokens = prefill_config.scheduler.max_num_batched_tokens
        c = prefill_config
        page = c.cache.page_size
        self._kv_bytes_per_token = (
            kv_page_bytes_per_device(
                c.model, page, c.dtype, c.parallel.tp, c.parallel.pp, c.cache.kv_cache_dtype
            )
            / page
        )
        # the hybrid KV layout moves group 0's pages and each windowed group's window
        self._hybrid = c if c.kv_groups.hybrid else None
        hw = c.sim.hardware
        self._bandwidth = transfer_bandwidth or hw.network_bandwidth
        self._latency = hw.network_latency_s if transfer_latency_s is None else transfer_latency_s
        self._pool_bandwidth = pool_bandwidth or self._bandwidth
        self._pool_latency = self._latency if pool_latency_s is None else pool_latency_s
        self._memo: dict[tuple[int, int], float] = {}

    def prefill_seconds(self, num_tokens: int, num_cached: int) -> float:
        key = (int(num_tokens), int(num_cached))
        seconds = self._memo.get(key)
        if seconds is None:
            from llmjax.sim.cost import StepFeatures

            seconds, start = 0.0, min(max(key[1], 0), max(key[0] - 1, 0))
            while start < key[0]:
                q = min(self.chunk_tokens, key[0] - start)
                kv = start + q
                f = StepFeatures(
                    tokens=q,
                    prefill_attention=q * kv,
                    decodes=0,
                    decode_context=0,
                    prefill_pairs=q * kv - q * (q - 1) // 2,
                    prefill_context=kv,
                    seqs=1,
                    padded_tokens=q,
                    padded_seqs=1,
                )
                seconds += float(self._prefill.step_seconds(f))
                start = kv
            if len(self._memo) > 1 << 16:
                self._memo.clear()
            self._memo[key] = seconds
        return seconds

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        from llmjax.sim.cost import StepFeatures

        b = max(int(batch), 1)
        f = StepFeatures(
            tokens=b,
            prefill_attention=0,
            decodes=b,
            decode_context=int(context_tokens),
            seqs=b,
            padded_tokens=b,
            padded_seqs=b,
        )
        return float(self._decode.step_seconds(f))

    def _kv_bytes(self, num_tokens: int) -> float:
        if self._hybrid is not None:
            from llmjax.sim.transfers import kv_bytes_per_device

            return kv_bytes_per_device(self._hybrid, num_tokens)
        return num_tokens * self._kv_bytes_per_token

    def transfer_seconds(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self._latency + self._kv_bytes(num_tokens) / self._bandwidth

    def pool_transfer_seconds(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self._pool_latency + self._kv_bytes(num_tokens) / self._pool_bandwidth


@dataclasses.dataclass(frozen=True)
class MeasuredCostModel:
    """A linear model for real instances (seconds):

        prefill_seconds(n, cached) = prefill_overhead_s + prefill_s_per_token x (n - cached)
        decode_step_seconds(b, ctx) = decode_step_s + decode_s_per_seq x b
                                      + decode_s_per_context_token x ctx
        transfer_seconds(tokens)   = transfer_latency_s + transfer_s_per_token x tokens

    The defaults are placeholders of the order of the tiny model on this CPU; `from_stats`
    fits the two main terms from the engines' own counters."""

    prefill_s_per_token: float = 1e-3
    prefill_overhead_s: float = 0.0
    decode_step_s: float = 0.02
    decode_s_per_seq: float = 0.0
    decode_s_per_context_token: float = 0.0
    transfer_s_per_token: float = 1e-6
    transfer_latency_s: float = 0.0

    @classmethod
    def from_stats(cls, prefill_stats, decode_stats, **overrides) -> MeasuredCostModel:
        """From a prefill instance's and a decode instance's `EngineStats` after some
        traffic: device seconds per computed prompt token there, device seconds per step
        here (no batch or context term: a crude, honest fit of two numbers)."""
        per_token = prefill_stats.device_time_s / max(prefill_stats.num_prefill_tokens, 1)
        per_step = decode_stats.device_time_s / max(decode_stats.num_steps, 1)
        return cls(prefill_s_per_token=per_token, decode_step_s=per_step, **overrides)

    def prefill_seconds(self, num_tokens: int, num_cached: int) -> float:
        new = max(num_tokens - num_cached, 1)
        return self.prefill_overhead_s + self.prefill_s_per_token * new

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        return (
            self.decode_step_s
            + self.decode_s_per_seq * batch
            + self.decode_s_per_context_token * context_tokens
        )

    def transfer_seconds(self, num_tokens: int) -> float:
        return (
            self.transfer_latency_s + self.transfer_s_per_token * num_tokens if num_tokens else 0.0
        )


# ---- decisions -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    """One request's placement: indices into the prefill and decode lists given to `schedule`.
    `fetch_from` (an index into the prefill list, or None): fetch the prefix of
    `fetch_tokens` tokens from that instance's cache before prefilling (it had
    `local_tokens`). `from_pool`: fetch them from the cluster's KV pool instead (then
    `fetch_from` is None). `rejected`: None, or why the request is rejected (then the rest says
    what it would have been)."""

    prefill: int
    decode: int
    ttft: float  # predicted
    tbt: float  # predicted (the rejection mode's load; the predicted one for 'none')
    local_tokens: int
    fetch_from: int | None = None
    fetch_tokens: int = 0
    transfer_s: float = 0.0
    rejected: str | None = None
    from_pool: bool = False

    @property
    def fetches(self) -> bool:
        """Whether the request fetches a prefix (from an instance or the pool) first."""
        return (self.fetch_from is not None or self.from_pool) and (
            self.fetch_tokens > self.local_tokens
        )


@dataclasses.dataclass
class ConductorStats:
    """What the Conductor did in a cluster: requests placed and rejected (by the SLO predicted
    to miss first: TTFT, else TBT), prefix fetches (tokens moved, bytes and modeled or measured
    seconds) and fetches that fell back to recomputing."""

    num_scheduled: int = 0
    num_rejected: int = 0
    num_rejected_ttft: int = 0
    num_rejected_tbt: int = 0
    num_fetches: int = 0
    fetched_tokens: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0
    num_fetches_recomputed: int = 0
    num_pool_fetches: int = 0  # of num_fetches: from the KV pool (the simulator's SimKVPool)
    pool_fetched_tokens: int = 0

    def record(self, decision: Decision) -> None:
        self.num_scheduled += 1
        if decision.rejected is not None:
            self.num_rejected += 1
            if decision.rejected.startswith("predicted TTFT"):
                self.num_rejected_ttft += 1
            else:
                self.num_rejected_tbt += 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Pin:
    decode: int  # the decode instance's instance_id
    start: float  # predicted decode start (absolute time)
    num_tokens: int  # prompt tokens (its context when it starts decoding)


class Conductor:
    """Mooncake's Conductor (the module doc). `schedule(...)` places a request on a prefill and
    a decode instance (or rejects it); `route(...)` is the prefill choice alone (a Router);
    `finished(request_id, num_output_tokens)` is how a cluster tells it that a request left."""

    name = "mooncake"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        *,
        kvcache_balancing_threshold: float = 1.0,
        ttft_slo: float | None = None,
        tbt_slo: float | None = None,
        rejection: str = "none",
        expected_output_tokens: int | None = None,
    ):
        if rejection not in REJECTION_MODES:
            raise ValueError(f"{rejection=} must be one of {REJECTION_MODES}")
        if not kvcache_balancing_threshold >= 0:
            raise ValueError(f"{kvcache_balancing_threshold=} must be >= 0")
        for name, slo in (("ttft_slo", ttft_slo), ("tbt_slo", tbt_slo)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{name}={slo} must be > 0 seconds (or None)")
        if expected_output_tokens is not None and expected_output_tokens < 1:
            raise ValueError(f"{expected_output_tokens=} must be >= 1")
        self.cost_model = cost_model
        self.kvcache_balancing_threshold = kvcache_balancing_threshold
        self.ttft_slo = ttft_slo
        self.tbt_slo = tbt_slo
        self.rejection = rejection
        self.expected_output_tokens = expected_output_tokens
        self._cached: dict[str, int] = {}  # request id -> cached tokens expected at routing
        self._pins: dict[str, _Pin] = {}  # requests pinned to a decode instance, not decoding
        self._num_finished = 0
        self._output_tokens = 0

    # ---- what the clusters call ----------------------------------------------------------------

    @property
    def uniform_output_tokens(self) -> float:
        """The decode length every request is assumed to have (the module doc)."""
        if self.expected_output_tokens is not None:
            return float(self.expected_output_tokens)
        if self._num_finished:
            return self._output_tokens / self._num_finished
        return float(DEFAULT_OUTPUT_TOKENS)

    def finished(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """The request left the cluster (finished, or with None aborted or failed): forget it;
        a finished one's output length feeds the uniform decode length."""
        self._cached.pop(request_id, None)
        self._pins.pop(request_id, None)
        if num_output_tokens is not None:
            self._num_finished += 1
            self._output_tokens += num_output_tokens

    def route(self, request: RouteRequest, instances: Sequence[InstanceLoad], now: float) -> int:
        """The Router interface: Algorithm 1's prefill choice over `instances` (no fetch)."""
        p, _, local, *_ = self._choose_prefill(request, instances)
        self._cached[request.request_id] = local
        return p

    def schedule(
        self,
        request: RouteRequest,
        prefill: Sequence[ConductorLoad],
        decode: Sequence[ConductorLoad],
        now: float,
        pool: KVPoolLoad | None = None,
    ) -> Decision:
        """Algorithm 1 (the module doc): the prefill and decode instance of `request`, a prefix
        fetch if one pays (from a prefill instance, or from `pool`, the cluster's KV pool if it
        has one), or a rejection. A placed request is remembered (its expected cache hit, its
        decode pin) until `finished`."""
        if not prefill or not decode:
            raise ValueError("the Conductor needs prefill and decode instances")
        p, ttft, local, source, cached, transfer_s = self._choose_prefill(request, prefill, pool)
        n = len(request.prompt_token_ids)
        start = now + ttft
        scores = [self._decode_load(v, n, now, ttft) for v in decode]
        k = min(range(len(decode)), key=lambda i: (scores[i][0], scores[i][1], i))
        _, tbt_predicted, tbt_current = scores[k]
        tbt = tbt_current if self.rejection == "current" else tbt_predicted
        decodes = request.sampling_params.max_tokens > 1  # else it ends at its first token
        reason = self._rejection(ttft, tbt if decodes else 0.0)
        decision = Decision(
            prefill=p,
            decode=k,
            ttft=ttft,
            tbt=tbt,
            local_tokens=local,
            fetch_from=None if source is POOL else source,
            fetch_tokens=cached if source is not None else 0,
            from_pool=source is POOL,
            transfer_s=transfer_s,
            rejected=reason,
        )
        if reason is None:
            rid = request.request_id
            self._cached[rid] = cached
            self._pins[rid] = _Pin(_id(decode[k]), start, n)
        return decision

    # ---- Algorithm 1 ---------------------------------------------------------------------------

    def _cost(self) -> CostModel:
        if self.cost_model is None:
            self.cost_model = MeasuredCostModel()
        return self.cost_model

    def _queue_seconds(self, view) -> float:
        cost = self._cost()
        total = 0.0
        for rid, num_tokens, computed in view.queued_prefills():
            total += cost.prefill_seconds(num_tokens, max(computed, self._cached.get(rid, 0)))
        return total

    def _fetches(self, best: int, local: int) -> bool:
        """Algorithm 1's test: fetch `best` tokens to an instance holding `local` of them."""
        ratio = math.inf if local == 0 and best > 0 else best / max(local, 1)
        return best > local and ratio > self.kvcache_balancing_threshold

    def _choose_prefill(self, request, views, pool=None):
        """(index, TTFT, local match, fetch source (an index, POOL) or None, cached tokens,
        transfer seconds)."""
        cost = self._cost()
        prompt = request.prompt_token_ids
        n = len(prompt)
        ns = request.cache_namespace  # an adapter's prefixes are its own (LoRA)
        args = (prompt,) if ns is None else (prompt, ns)  # (a view without adapters: 1 arg)
        local = [v.cached_prefix_tokens(*args) for v in views]
        best = max(local, default=0)
        b = local.index(best) if views else 0
        # (the pool's keys are the base model's: an adapter's request does not fetch from it)
        stored = pool.match_tokens(prompt) if pool is not None and ns is None else 0
        pool_seconds = getattr(cost, "pool_transfer_seconds", cost.transfer_seconds)
        choice = None
        for k, v in enumerate(views):
            queue = self._queue_seconds(v)
            fetch = self._fetches(best, local[k])
            transfer = cost.transfer_seconds(best - local[k]) if fetch else 0.0
            cached = best if fetch else local[k]
            ttft = queue + transfer + cost.prefill_seconds(n, cached)
            option = (k, ttft, local[k], b if fetch else None, cached, transfer)
            if stored > cached and self._fetches(stored, local[k]):  # the pool (module doc)
                t = pool_seconds(stored - local[k])
                pool_ttft = queue + t + cost.prefill_seconds(n, stored)
                if pool_ttft < ttft:
                    option = (k, pool_ttft, local[k], POOL, stored, t)
            if choice is None or option[1] < choice[1]:
                choice = option
        return choice

    def _decode_load(self, view, n: int, now: float, horizon: float):
        """(KV overflow, predicted TBT, current TBT) of `view` taking a request of `n` prompt
        tokens that starts decoding at now + horizon (the module doc)."""
        cost = self._cost()
        length = self.uniform_output_tokens
        current = list(view.decode_requests())
        batch_now = len(current)
        context_now = sum(c for _, c, _ in current)
        tbt_now = max(cost.decode_step_seconds(max(batch_now, 1), context_now), 1e-9)
        steps = horizon / tbt_now  # decode steps until this request starts
        batch, context, kv = 1, n, n + length
        for _, ctx, out in current:
            left = max(length - out, 0.0)
            if left > steps:
                batch += 1
                context += ctx + steps
                kv += ctx + left
        here = _id(view)
        decoding = {rid for rid, _, _ in current}
        for rid in [r for r, pin in self._pins.items() if pin.decode == here and r in decoding]:
            del self._pins[rid]  # it decodes there now: counted above
        t = now + horizon
        for pin in self._pins.values():
            if pin.decode != here:
                continue
            done = (t - pin.start) / tbt_now  # tokens it decoded by t
            kv += pin.num_tokens + length
            if 0 <= done < length:
                batch += 1
                context += pin.num_tokens + done
        overflow = kv > view.kv_capacity_tokens
        cap = getattr(view, "max_num_seqs", None) or math.inf
        predicted = _tbt(cost, batch, context, cap)
        current_tbt = _tbt(cost, batch_now + 1, context_now + n, cap)
        return overflow, predicted, current_tbt

    def _rejection(self, ttft: float, tbt: float) -> str | None:
        if self.rejection == "none":
            return None
        if self.ttft_slo is not None and ttft > self.ttft_slo:
            return (
                f"predicted TTFT {ttft:.3f} s > ttft_slo {self.ttft_slo:g} s "
                f"(by {ttft - self.ttft_slo:.3f} s)"
            )
        if self.tbt_slo is not None and tbt > self.tbt_slo:
            load = "current" if self.rejection == "current" else "predicted"
            return (
                f"predicted TBT {1e3 * tbt:.1f} ms ({load} decode load) > tbt_slo "
                f"{1e3 * self.tbt_slo:g} ms (by {1e3 * (tbt - self.tbt_slo):.1f} ms)"
            )
        return None


def _tbt(cost, batch: int, context: float, cap: float) -> float:
    """The time between a request's tokens with `batch` requests of `context` tokens in all on
    an instance that decodes at most `cap` at a time: the step of min(batch, cap) of them, and
    one token every batch / cap steps beyond the cap."""
    if batch <= cap:
        return cost.decode_step_seconds(batch, int(context))
    share = cap / batch
    return cost.decode_step_seconds(int(cap), int(context * share)) / share


def _id(view) -> int:
    return getattr(view, "instance_id", view.index)

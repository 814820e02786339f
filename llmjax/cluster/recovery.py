"""How a `Cluster` loses no request (`FailureRecovery`, a part of `Cluster`): the cluster's copy
of each request (`Record`, enough to recompute it anywhere), and an instance that dies (`kill`)
has its requests recomputed elsewhere from the prompt and the tokens so far, or failed with the
reason when no instance of the kind is left."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from llmjax.cluster.core import ENTRY_ROLES, ended_output
from llmjax.cluster.routing import RouteRequest
from llmjax.engine.request import MigratedRequest, RequestMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Record:
    """The cluster's copy of one request: enough to recompute it anywhere."""

    route: RouteRequest
    prompt: str | None
    seed: int
    instance: int  # where it runs now (the decode side while it is being moved)
    tokens: list[int] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics | None = None
    source: int | None = None  # while moving: the prefill instance that still holds it


class FailureRecovery:
    """The failure handling of a `Cluster` (its `instances`, `alive`, `roles`, `_records`,
    `_outstanding`, `_loads`, `_errors`, `router`, `decode_router`, `transfer_stats`, `clock`,
    `_alive_with`, `_choose`, `_left`)."""

    def kill(self, i: int, reason: str | None = None) -> None:
        """Instance `i` is gone (a test's failure injection, or an actor that died): stop
        using it and recompute its requests elsewhere (the module doc)."""
        if not self.alive[i]:
            return
        self.alive[i] = False
        reason = reason or f"instance {i} died"
        with contextlib.suppress(Exception):  # already gone
            self.instances[i].shutdown()
        for rid, rec in list(self._records.items()):
            if rec.source == i:  # moving away from i: the pull fails and the decode side copes
                rec.source = None
                continue
            if rec.instance != i:
                continue
            self._outstanding[i] -= 1
            self._recover(rid, rec, reason)

    def _recover(self, rid: str, rec: Record, reason: str) -> None:
        if rec.source is not None and self.alive[rec.source]:
            self.instances[rec.source].release(rid)  # its pull died with the decode side
            rec.source = None
        roles = ("decode", "colocated") if rec.tokens else ENTRY_ROLES
        while True:
            live = self._alive_with(roles)
            if not live:
                self._fail(rid, f"{reason}, and no live {' or '.join(roles)} instance is left")
                return
            j = self._choose(self.decode_router if rec.tokens else self.router, rec.route, live)
            try:
                self._resubmit(rid, rec, j)
                break
            except Exception as e:  # that one is gone too
                self.kill(j, reason=f"instance {j} failed: {e!r}")
        rec.instance = j
        self._outstanding[j] += 1
        self.transfer_stats.num_recomputed += 1
        logger.warning("request %s: %s; recomputing it on instance %d", rid, reason, j)

    def _resubmit(self, rid: str, rec: Record, j: int) -> None:
        metrics = rec.metrics or RequestMetrics(rec.route.arrival_time)
        m = MigratedRequest(
            request_id=rid,
            prompt_token_ids=list(rec.route.prompt_token_ids),
            output_token_ids=list(rec.tokens),
            sampling_params=rec.route.sampling_params,
            seed=rec.seed,
            num_kv_tokens=0,
            metrics=metrics,
            prompt=rec.prompt,
            hints=rec.route.hints,
            lora_request=rec.route.lora_request,
        )
        self.instances[j].recompute_request(m)
        self._loads[j] = self.instances[j].load()

    def _fail(self, rid: str, error: str) -> None:
        self._left(rid)
        rec = self._records.pop(rid)
        now = self.clock.now()
        self._errors.append(
            ended_output(
                rec.route, rec.prompt, error, now, token_ids=rec.tokens, metrics=rec.metrics
            )
        )
        self.transfer_stats.num_failed_requests += 1

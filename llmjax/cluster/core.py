"""The cluster's policies, once: where an arriving request goes (a router, or the Conductor's
(prefill, decode) placement with its prefix fetch or rejection), which decode instance a parked
request moves to and when (DistServe's pull rule: migration.py), and who hears that a request
left. Both clusters hold a `ClusterCore` and differ only in how their instances run and how a
transfer completes:

  llmjax/cluster/cluster.py   real instances (LocalInstance, Ray actors), stepped in turn on the
                              wall clock; KV moved by a transport; failed instances recovered
  llmjax/sim/cluster.py       simulated engines on virtual clocks, a discrete-event loop; KV
                              moves take their modeled time

    core = ClusterCore(roles, router, decode_router="least_outstanding")
    placement = core.place(route, views, now)           # Placement(prefill, decode, fetch...)
    core.commit(placement, route)                       # the decision counted, the pin kept
    core.left(request_id, num_output_tokens)            # the router hears (the Conductor)

`views(indices)` gives the instances as the routers read them (`InstanceLoad`, and the
Conductor's `ConductorLoad`): each cluster's own view of its instances at the routing time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from llmjax.cluster.conductor import ConductorStats, Decision
from llmjax.cluster.migration import checked_choice, choose
from llmjax.cluster.router import make_router
from llmjax.cluster.routing import Router, RouteRequest
from llmjax.engine.request import RequestMetrics, RequestOutput

ENTRY_ROLES = ("colocated", "prefill")  # the roles that take arrivals


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a request goes (cluster instance indices): its entry instance `prefill`, the decode
    instance it is pinned to (`decode`: the Conductor's; None: any may pull it), the prefix to
    have cached there first (`fetch_tokens`, of which `missing_tokens` are not: from prefill
    instance `fetch_from`, or the KV pool when `from_pool`), or why it is rejected. `decision`:
    the Conductor's, as it gave it."""

    prefill: int
    decode: int | None = None
    fetch_from: int | None = None
    from_pool: bool = False
    fetch_tokens: int = 0
    missing_tokens: int = 0
    rejected: str | None = None
    decision: Decision | None = None

    @property
    def fetches(self) -> bool:
        return self.missing_tokens > 0


def ended_output(
    route: RouteRequest,
    prompt: str | None,
    error: str,
    now: float,
    finish_reason: str = "error",
    token_ids=(),
    metrics: RequestMetrics | None = None,
) -> RequestOutput:
    """The last output of a request the cluster itself ends (rejected by the Conductor, failed
    with no instance left to run it) at `now`, with the tokens it had and the reason."""
    metrics = metrics or RequestMetrics(route.arrival_time)
    metrics.finished_time = now
    return RequestOutput(
        request_id=route.request_id,
        prompt=prompt,
        prompt_token_ids=list(route.prompt_token_ids),
        token_ids=list(token_ids),
        text="",
        finished=True,
        finish_reason=finish_reason,
        metrics=metrics,
        error=error,
    )


def as_router(router: Router | str) -> Router:
    """A router of ROUTERS by name, or the given one; ValueError if it cannot route."""
    r = make_router(router) if isinstance(router, str) else router
    if not callable(getattr(r, "route", None)):
        raise ValueError(f"router {router!r} has no route(request, instances, now)")
    return r


def check_roles(roles: Sequence[str]) -> None:
    """ValueError unless some instance takes arrivals and prefill and decode come together."""
    roles = tuple(roles)
    if not any(r in ENTRY_ROLES for r in roles):
        raise ValueError(f"no instance takes arrivals (roles {roles}): add a prefill one")
    if ("prefill" in roles) != ("decode" in roles):
        raise ValueError(f"prefill instances need a decode instance and vice versa (roles {roles})")


def check_loras(roles: Sequence[str], loras: Sequence) -> None:
    """ValueError unless every instance serves LoRA adapters (its `EngineConfig.lora`) or none
    does: a request under an adapter may be moved, fetch a prefix or be recomputed anywhere."""
    served = [i for i, c in enumerate(loras) if c is not None]
    if served and len(served) != len(loras):
        missing = [f"{i} ({roles[i]})" for i in range(len(loras)) if i not in served]
        raise ValueError(
            f"instances {served} serve LoRA adapters but {', '.join(missing)} do not: every "
            "instance needs EngineConfig.lora (a request under an adapter may move to, or be "
            "recomputed on, any of them)"
        )


class ClusterCore:
    """The routing and migration policies of one cluster (the module doc)."""

    def __init__(
        self,
        roles: Sequence[str],
        router: Router | str = "round_robin",
        decode_router: Router | str = "least_outstanding",
        waiting_page_fraction: float = 0.05,
        loras: Sequence | None = None,
    ):
        check_roles(roles)
        if loras is not None:  # each instance's LoRAConfig or None
            check_loras(roles, loras)
        if not 0 < waiting_page_fraction <= 1:
            raise ValueError(f"{waiting_page_fraction=} must be in (0, 1]")
        self.roles = tuple(roles)
        self.router = as_router(router)
        self.decode_router = as_router(decode_router)
        self.waiting_page_fraction = waiting_page_fraction
        self.entry = [i for i, r in enumerate(self.roles) if r in ENTRY_ROLES]
        self.decode = [i for i, r in enumerate(self.roles) if r == "decode"]
        self.conductor_stats = ConductorStats()
        self.pins: dict[str, int] = {}  # request id -> the decode instance the Conductor chose

    @property
    def conducts(self) -> bool:
        """Whether arrivals get the Conductor's (prefill, decode) placement: a router with
        `schedule` over prefill and decode instances."""
        return bool(self.decode) and getattr(self.router, "schedule", None) is not None

    def place(
        self,
        route: RouteRequest,
        views: Callable[[list[int]], list],
        now: float,
        *,
        alive: Callable[[int], bool] = lambda i: True,
        can_pin: Callable[[int, RouteRequest], bool] | None = None,
        pool=None,
    ) -> Placement:
        """Where `route` goes, as of `now`, among the instances `alive`: its upstream choice
        (`route.instance`, an index into the entry instances) if that one is alive; else the
        Conductor's placement (`can_pin(j, route)`: whether decode instance j could ever hold
        it, else it is left unpinned; `pool`: the KV pool it may fetch from); else the router's
        pick among the live entry instances. RuntimeError if none is alive."""
        entry = [i for i in self.entry if alive(i)]
        if not entry:
            raise RuntimeError("no live instance takes arrivals (all prefill instances died)")
        if route.instance is not None and alive(self.entry[route.instance]):
            return Placement(self.entry[route.instance])
        if not self.conducts:
            return Placement(entry[choose(self.router, route, views(entry), now)])
        prefill = [i for i in entry if self.roles[i] == "prefill"]
        decode = [j for j in self.decode if alive(j)]
        if not prefill or not decode:
            raise RuntimeError(f"no live prefill or decode instance (roles {self.roles})")
        kwargs = {} if pool is None else {"pool": pool}
        d = self.router.schedule(route, views(prefill), views(decode), now, **kwargs)
        rid = route.request_id
        p = prefill[checked_choice(self.router, d.prefill, len(prefill), rid)]
        j = decode[checked_choice(self.router, d.decode, len(decode), rid)]
        if d.rejected is not None:
            return Placement(p, j, rejected=d.rejected, decision=d)
        pin = j if can_pin is None or can_pin(j, route) else None
        pooled = d.from_pool and pool is not None
        if not ((d.fetch_from is not None or pooled) and d.fetch_tokens > d.local_tokens):
            return Placement(p, pin, decision=d)
        source = (
            None
            if pooled
            else prefill[checked_choice(self.router, d.fetch_from, len(prefill), rid)]
        )
        return Placement(
            p,
            pin,
            fetch_from=source,
            from_pool=pooled,
            fetch_tokens=d.fetch_tokens,
            missing_tokens=d.fetch_tokens - d.local_tokens,
            decision=d,
        )

    def commit(self, placement: Placement, route: RouteRequest) -> None:
        """The placement took effect: the Conductor's decision counted, the pin kept; a
        rejected request has left."""
        if placement.decision is not None:
            self.conductor_stats.record(placement.decision)
        if placement.rejected is not None:
            self.left(route.request_id)
        elif placement.decode is not None:
            self.pins[route.request_id] = placement.decode

    def left(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """`request_id` left the cluster (finished with that many tokens; None: aborted,
        failed or rejected): its pin dropped, and a router that wants to know (the
        Conductor's `finished`) is told."""
        self.pins.pop(request_id, None)
        finished = getattr(self.router, "finished", None)
        if finished is not None:
            finished(request_id, num_output_tokens)

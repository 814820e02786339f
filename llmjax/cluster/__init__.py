"""A router / global scheduler over engine instances (issue 21).

`router.py`: `RouteRequest`, the `InstanceLoad` and `Router` protocols, and the routers by name
(`ROUTERS`, `make_router`): `round_robin`, `least_outstanding`, `power_of_two`, `cache_aware`
(sglang-router's). `llmjax.sim.SimCluster` runs them over simulated engines. Nothing here
imports jax.
"""

from llmjax.cluster.router import (
    ROUTERS,
    CacheAware,
    InstanceLoad,
    LeastOutstanding,
    PowerOfTwo,
    PrefixTrie,
    RoundRobin,
    Router,
    RouteRequest,
    make_router,
)

__all__ = [
    "ROUTERS",
    "CacheAware",
    "InstanceLoad",
    "LeastOutstanding",
    "PowerOfTwo",
    "PrefixTrie",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "make_router",
]

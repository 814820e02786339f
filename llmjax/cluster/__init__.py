"""Many engine instances: routers, prefill/decode disaggregation with KV page transfer
(DistServe), Mooncake's Conductor, launchers (issue 21; docs/cluster.md). One core, two drivers:
`Cluster` here runs real instances, `llmjax.sim.SimCluster` simulated ones and a discrete-event
loop, under the same policies. Importing this package imports no jax.

    core.py           ClusterCore: where an arrival goes (the router, an upstream placement, or
                      the Conductor's placement with its fetch, pin or rejection); who hears
                      that a request left; ended_output
    migration.py      DistServe's pull rule over the parked requests (ParkedQueue), shared
    routing.py        RouteRequest and the InstanceLoad and Router protocols
    router.py         the routers by name (ROUTERS, make_router): round_robin, random,
                      least_outstanding, power_of_two, cache_aware (sglang-router's), mooncake
    conductor.py      Mooncake's Conductor, with its cost models (SimCostModel, MeasuredCostModel)
    cluster.py        Cluster: instances behind a router, stepped in turn (duck-types as one
                      engine for llmjax.bench.replay), with pulls.py (DistServe's pull-based
                      migration), recovery.py (dead instances and failed transfers lose no
                      request) and views.py (LoadView: what a router sees of an instance)
    instance.py       LocalInstance: one engine with a role and the calls a Cluster makes on it
    transfer.py       the KV transport protocol and `local`; transfer_server.py the transfer
                      server's; transports.py them by name (make_transport)
    launch.py         launch, InstanceSpec: the `local` launcher on sub-meshes; ray_launcher.py
                      Ray actors
    stats.py          TransferStats; serving_view.py: a cluster as the server drives one engine
"""

from llmjax.cluster.cluster import Cluster
from llmjax.cluster.conductor import (
    Conductor,
    ConductorStats,
    Decision,
    MeasuredCostModel,
    SimCostModel,
)
from llmjax.cluster.instance import LocalInstance
from llmjax.cluster.launch import LAUNCHERS, InstanceSpec, launch
from llmjax.cluster.router import (
    ROUTERS,
    CacheAware,
    InstanceLoad,
    LeastOutstanding,
    PowerOfTwo,
    PrefixTrie,
    RandomRouter,
    RoundRobin,
    Router,
    RouteRequest,
    make_router,
)
from llmjax.cluster.stats import TransferStats
from llmjax.cluster.transfer import LocalTransport, Offer, TransferError
from llmjax.cluster.transports import TRANSPORTS

__all__ = [
    "LAUNCHERS",
    "ROUTERS",
    "TRANSPORTS",
    "CacheAware",
    "Cluster",
    "Conductor",
    "ConductorStats",
    "Decision",
    "InstanceLoad",
    "InstanceSpec",
    "LeastOutstanding",
    "LocalInstance",
    "LocalTransport",
    "MeasuredCostModel",
    "Offer",
    "PowerOfTwo",
    "PrefixTrie",
    "RandomRouter",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "SimCostModel",
    "TransferError",
    "TransferStats",
    "launch",
    "make_router",
]

"""A simulated device: the engine's own scheduler, block manager and prefix cache on a virtual
clock, with the step's duration from a cost model instead of a device (issue 20; ALGORITHMS.md
§12 Vidur, §7.2 DistServe's latency model).

    llm = LLM("mistral-7b-instruct-v0.2", device="sim", sim=SimConfig(hardware="a100-80gb"))
    config = EngineConfig(model=..., device="sim", sim=SimConfig(cost_model="roofline", ...))
    engine = LLMEngine(config, params=None, num_pages=None)   # no JAX; starts in milliseconds

`cost.py`: the step's features (`StepFeatures.from_step`, from the same `StepInput` the real
runner gets) and the fitted cost models; `hardware.py`: named accelerators with sourced peaks and
efficiencies; `roofline.py`: the analytic cost model, with tp and pp; `runner.py`: `SimRunner`,
the drop-in for `ModelRunner`, and `SimConfig`; `cluster.py`: `SimCluster`, many simulated
instances on one timeline behind a router (llmjax/cluster/router.py: `round_robin`,
`least_outstanding`, `power_of_two`, `cache_aware`), which `llmjax.bench.replay` drives as one
engine, with the real cluster's policies (llmjax/cluster/core.py, migration.py) and
`pulls.py`, its migration, and `fetches.py`, the Conductor's prefix fetches and the KV pool's
hook; `views.py`:
what a router sees of a simulated instance; `transfers.py`: how long KV takes to move (the
simulated transports); `kvpool.py`: Mooncake Store's DRAM pool. Nothing here imports jax.
"""

from llmjax.sim.cluster import ROUTERS, SimCluster, make_router
from llmjax.sim.cost import LinearCostModel, RecordedCostModel, StepFeatures
from llmjax.sim.hardware import HARDWARE, Hardware, get_hardware
from llmjax.sim.roofline import RooflineCostModel
from llmjax.sim.runner import SimConfig, SimRunner, sim_num_pages

__all__ = [
    "HARDWARE",
    "ROUTERS",
    "Hardware",
    "LinearCostModel",
    "RecordedCostModel",
    "RooflineCostModel",
    "SimCluster",
    "SimConfig",
    "SimRunner",
    "StepFeatures",
    "get_hardware",
    "make_router",
    "sim_num_pages",
]

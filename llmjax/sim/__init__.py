"""A simulated device: the engine's own scheduler, block manager and prefix cache on a virtual
clock, with the step's duration from a cost model instead of a device (issue 20; ALGORITHMS.md
§12 Vidur, §7.2 DistServe's latency model).

    config = EngineConfig(model=..., device="sim", sim=SimConfig(cost_model=LinearCostModel(...)))
    engine = LLMEngine(config, params=None, num_pages=...)   # no JAX; starts in milliseconds

`cost.py`: the step's features (`StepFeatures.from_step`, from the same `StepInput` the real
runner gets) and the cost models; `runner.py`: `SimRunner`, the drop-in for `ModelRunner`.
Nothing here imports jax.
"""

from llmjax.sim.cost import LinearCostModel, RecordedCostModel, StepFeatures
from llmjax.sim.runner import SimConfig, SimRunner

__all__ = ["LinearCostModel", "RecordedCostModel", "SimConfig", "SimRunner", "StepFeatures"]

"""`SimRunner`: the engine's device replaced by a cost model on a virtual clock.

It takes the same `run(step, sampling)` calls as `llmjax.engine.runner.ModelRunner`, with the
same packed `StepInput`, advances the engine's `VirtualClock` by the modeled duration of the
step and returns a next token per sequence row. The tokens are a deterministic function of the
sequence's last token and its position (never an EOS id), so a replayed prompt gets the same
continuation and prefix caching over generated text behaves as on hardware. KV memory is the
engine's real page layout: size `num_pages` with `kv_page_bytes` from a memory budget.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from llmjax.config import EngineConfig, ModelConfig
from llmjax.engine.clock import VirtualClock
from llmjax.sim.cost import StepFeatures

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_page_bytes(model: ModelConfig, page_size: int, dtype: str) -> int:
    """Bytes of one KV page over every layer (K and V), as llmjax.model.kv_cache lays them out."""
    return (
        2
        * model.num_layers
        * page_size
        * model.num_kv_heads
        * model.head_dim
        * (DTYPE_BYTES[dtype])
    )


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """`EngineConfig.sim` when `EngineConfig.device == 'sim'`: the cost model (an object with
    `step_seconds(StepFeatures) -> float`, e.g. `llmjax.sim.cost.LinearCostModel`)."""

    cost_model: object

    def __post_init__(self):
        if not callable(getattr(self.cost_model, "step_seconds", None)):
            raise ValueError(f"cost_model {self.cost_model!r} has no step_seconds(features)")


class SimRunner:
    """Drop-in for ModelRunner (one device, no pipeline): see the module doc."""

    pipelined = False
    ragged_page_tables = True  # the modeled kernels read only kv_lens of each page table

    def __init__(self, config: EngineConfig, num_pages: int, clock: VirtualClock):
        del num_pages  # ModelRunner's signature; the engine's block manager models the pages
        if not isinstance(clock, VirtualClock):
            raise ValueError(f"a simulated device advances a VirtualClock, not {clock!r}")
        if config.parallel.num_devices > 1 or config.sparse_kv.enabled:
            raise ValueError(
                "the simulated device models one device without sparse_kv for now "
                f"(tp={config.parallel.tp}, pp={config.parallel.pp}, "
                f"sparse_kv={config.sparse_kv.mode!r})"
            )
        self.config = config
        self.clock = clock
        self.cost_model = config.sim.cost_model  # EngineConfig checked that device='sim' has one
        self.num_compiles = 0  # nothing compiles
        self.num_steps = 0
        self.last_features: StepFeatures | None = None
        self.last_seconds = 0.0
        # the ids a step may emit: the vocabulary without the EOS ids (a hash picks one)
        self._ids = np.setdiff1d(np.arange(config.model.vocab_size), config.model.eos_token_ids)

    def run(self, step, sampling) -> np.ndarray:
        """Advance the clock by the step's modeled seconds; the next id of every row [S]."""
        del sampling
        self.last_features = StepFeatures.from_step(step)
        self.last_seconds = float(self.cost_model.step_seconds(self.last_features))
        self.clock.advance(self.last_seconds)
        self.num_steps += 1
        logits_rows = np.asarray(step.logits_indices, np.int64)
        last = np.asarray(step.token_ids, np.int64)[logits_rows]
        pos = np.asarray(step.positions, np.int64)[logits_rows]
        h = (last * 0x9E3779B1 + (pos + 1) * 0x85EBCA77) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        return self._ids[h % len(self._ids)].astype(np.int32)

    def precompile(self, shapes, progress=None) -> None:
        for _ in shapes:
            if progress is not None:
                progress()

    def compile_ahead(self, shapes) -> None:
        pass

    @staticmethod
    def annotate(name: str, **metadata):
        return contextlib.nullcontext()

    @staticmethod
    def annotate_step(step_num: int):
        return contextlib.nullcontext()

"""`SimRunner`: the engine's device replaced by a cost model on a virtual clock.

It takes the same calls as `llmjax.engine.runner.ModelRunner` (`run(step, sampling)` on one
device; `tick(step, sampling, tag)` with pp > 1), with the same packed `StepInput`, advances the
engine's `VirtualClock` by the modeled duration and returns a next token per sequence row. The
tokens are a deterministic function of the sequence's last token and its position (never an EOS
id), so a replayed prompt gets the same continuation and prefix caching over generated text
behaves as on hardware; a request ends at its `max_tokens` (a workload's output length).

With pp > 1 the pipeline runs as llmjax's does on hardware (llmjax/parallel/pipeline.py): one
tick moves every micro-batch in flight one stage on, all stages at once, so a tick lasts as long
as its slowest stage (plus the host's overhead); the time other stages wait is the bubble
(each tick's `last_stage_seconds` go to `EngineStats.pipeline_time_bubble_fraction`). KV
memory is the engine's real page layout: `sim_num_pages` sizes the cache from the hardware's
memory, as `LLM` does on a device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np

from llmjax.config import EngineConfig
from llmjax.engine.batch import fill_pending
from llmjax.engine.clock import VirtualClock
from llmjax.lora.peft import LoRAWeights
from llmjax.sim.cost import LinearCostModel, StepFeatures
from llmjax.sim.hardware import Hardware, get_hardware
from llmjax.sim.roofline import (
    RooflineCostModel,
    kv_page_bytes_per_device,
    weight_bytes_per_device,
)

COST_MODELS = ("roofline", "fitted")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """`EngineConfig.sim` when `EngineConfig.device == 'sim'`.

    cost_model: 'roofline' (llmjax/sim/roofline.py: the model's shape on `hardware`, with the
        engine's tp and pp), 'fitted' (`LinearCostModel.from_profile(profile)`: a profile of the
        real engine from scripts/profile_step.py, on the machine and parallelism it ran with), or
        any object with `step_seconds(StepFeatures) -> float` (and, optionally,
        `stage_seconds(features) -> [seconds per stage]` for pp > 1).
    hardware: a `Hardware` or a name of llmjax.sim.hardware.HARDWARE, or a profile JSON with a
        measured roofline (this CPU); for 'roofline' and for sizing the KV cache.
    profile: the profile JSON of 'fitted'.
    memory_utilization: the fraction of each device's memory for weights and KV pages
        (vLLM's gpu_memory_utilization; Sarathi-Serve runs with 0.8 on its evaluation).
    padded: 'roofline' charges the step's padded bucket shape, as llmjax's jitted steps run
        (False: the real tokens, as an unpadded GPU engine runs; see llmjax/sim/roofline.py).
    expert_skew: a mixture of experts' routing skew for 'roofline' (0: uniform; s > 0: expert
        popularity ~ rank ** -s, `llmjax.sim.roofline.expert_inclusion`).
    """

    cost_model: object = "roofline"
    hardware: object = "a100-80gb"
    profile: str | None = None
    memory_utilization: float = 0.9
    padded: bool = False
    expert_skew: float = 0.0

    def __post_init__(self):
        if isinstance(self.cost_model, str):
            if self.cost_model not in COST_MODELS:
                raise ValueError(
                    f"unknown cost_model {self.cost_model!r}; choose one of {COST_MODELS} or "
                    "pass an object with step_seconds(features)"
                )
            if self.cost_model == "fitted" and not self.profile:
                raise ValueError(
                    "cost_model='fitted' needs profile= (a JSON of scripts/profile_step.py)"
                )
        elif not callable(getattr(self.cost_model, "step_seconds", None)):
            raise ValueError(f"cost_model {self.cost_model!r} has no step_seconds(features)")
        object.__setattr__(self, "hardware", get_hardware(self.hardware))
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"{self.memory_utilization=} must be in (0, 1]")


def make_cost_model(config: EngineConfig):
    """The cost model object that `config.sim` names, for `config`'s model and parallelism."""
    sim = config.sim
    if sim.cost_model == "roofline":
        p = config.parallel
        return RooflineCostModel(
            config.model,
            sim.hardware,
            config.dtype,
            p.tp,
            p.pp,
            sim.padded,
            ep=p.ep,
            expert_skew=sim.expert_skew,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            **_lora_costs(config),
        )
    if sim.cost_model == "fitted":
        return LinearCostModel.from_profile(sim.profile)
    return sim.cost_model


def _lora_costs(config: EngineConfig) -> dict:
    """The roofline's LoRA fields for `config.lora` (none without adapters)."""
    lora = config.lora
    if lora is None:
        return {}
    return dict(
        lora_columns=lora.max_loras * lora.max_lora_rank,
        lora_targets=lora.targets_for(config.model.is_moe),
        lora_rank=lora.max_lora_rank if lora.grouped(config.parallel.tp) else 0,
    )


def sim_num_pages(config: EngineConfig, hardware: Hardware | None = None) -> int:
    """KV pages that fit beside the weights in `memory_utilization` of each device's memory
    (every device holds its stage's layers and its tp share of heads of every page; in the
    hybrid KV layout a page holds `KVGroups.num_slots` layers, `EngineConfig.kv_groups`)."""
    sim, p = config.sim, config.parallel
    hw = get_hardware(hardware or sim.hardware)
    free = hw.memory_bytes * sim.memory_utilization - weight_bytes_per_device(
        config.model, config.dtype, p.tp, p.pp
    )
    groups = config.kv_groups
    page = kv_page_bytes_per_device(
        config.model,
        config.cache.page_size,
        config.dtype,
        p.tp,
        p.pp,
        config.cache.kv_cache_dtype,
        groups.slots_per_device(config.model.num_layers, p.pp) if groups.hybrid else None,
    )
    pages = int(free // page)
    if pages < 2:
        raise ValueError(
            f"{config.model.name or 'the model'} in {config.dtype} at tp={p.tp} pp={p.pp} leaves "
            f"{max(free, 0) / 2**30:.1f} GiB of {hw.name}'s {hw.memory_bytes / 2**30:.0f} GiB "
            "for KV pages: use more devices (tp, pp) or another hardware"
        )
    return pages


@dataclasses.dataclass
class _Launched:
    tag: object
    next_ids: np.ndarray
    seconds: float


class SimRunner:
    """Drop-in for ModelRunner: see the module doc."""

    ragged_page_tables = True  # the modeled kernels read only kv_lens of each page table

    def __init__(self, config: EngineConfig, num_pages: int, clock: VirtualClock):
        del num_pages  # ModelRunner's signature; the engine's block manager models the pages
        if not isinstance(clock, VirtualClock):
            raise ValueError(f"a simulated device advances a VirtualClock, not {clock!r}")
        if config.sparse_kv.enabled:
            raise ValueError(
                f"the simulated device does not model sparse_kv={config.sparse_kv.mode!r} yet"
            )
        self.config = config
        self.clock = clock
        self.cost_model = make_cost_model(config)
        self.pp = config.parallel.pp
        self.pipelined = self.pp > 1
        self.num_compiles = 0  # nothing compiles
        self.num_steps = 0
        self.last_features: StepFeatures | None = None
        self.last_seconds = 0.0
        self.overlapped = False  # set by the engine: async scheduling hides the host overhead
        self._last_ids = None  # the last launched step's ids (async scheduling's pending tokens)
        # pp > 1: the micro-batches in flight, stage 0 first: (tag, step, stage seconds)
        self._slots: collections.deque = collections.deque()
        self.last_stage_seconds: list[float] | None = None  # the last tick's, per stage
        # the ids a step may emit: the vocabulary without the EOS ids (a hash picks one)
        self._ids = np.setdiff1d(np.arange(config.model.vocab_size), config.model.eos_token_ids)
        # LoRA adapters (EngineConfig.lora): the slots' targets; loading one costs its bytes
        # over the host link (`RooflineCostModel.lora_slot_seconds`) on the clock
        self.lora_targets = (
            () if config.lora is None else config.lora.targets_for(config.model.is_moe)
        )
        self.num_lora_writes = 0

    # -- one device ------------------------------------------------------------------------------

    def run(self, step, sampling) -> np.ndarray:
        """Advance the clock by the step's modeled seconds; the next id of every row [S]."""
        return self.collect(self.launch(step, sampling))[1]

    def _next_ids(self, step) -> np.ndarray:
        logits_rows = np.asarray(step.logits_indices, np.int64)
        last = np.asarray(step.token_ids, np.int64)[logits_rows]
        pos = np.asarray(step.positions, np.int64)[logits_rows]
        h = (last * 0x9E3779B1 + (pos + 1) * 0x85EBCA77) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        return self._ids[h % len(self._ids)].astype(np.int32)

    # -- a pipeline ------------------------------------------------------------------------------

    def _stage_seconds(self, features: StepFeatures) -> list[float]:
        stages = getattr(self.cost_model, "stage_seconds", None)
        if stages is not None:
            return [float(s) for s in stages(features)]
        return [float(self.cost_model.step_seconds(features)) / self.pp] * self.pp

    @property
    def num_in_flight(self) -> int:
        return sum(s is not None for s in self._slots)

    def tick(self, step, sampling, tag=None):
        """pp > 1: one pipeline tick, as ModelRunner.tick: the micro-batch (`step`; None for none)
        enters stage 0, every other one moves a stage on; returns (exited, tokens), exited =
        (tag, next ids) of the micro-batch leaving the last stage or None, tokens = each stage's
        token count this tick. The clock advances by the slowest stage + the host overhead."""
        del sampling
        entry = None
        if step is not None:
            features = StepFeatures.from_step(step)
            entry = (tag, step, self._stage_seconds(features))
            self.last_features = features
        self._slots.appendleft(entry)
        while len(self._slots) < self.pp:
            self._slots.append(None)
        busy = [0.0 if s is None else s[2][i] for i, s in enumerate(self._slots)]
        tick = max(busy)
        overhead = float(getattr(self.cost_model, "tick_overhead_s", 0.0))
        self.last_seconds = tick + overhead
        self.clock.advance(self.last_seconds)
        self.last_stage_seconds = busy
        self.num_steps += 1
        tokens = [0 if s is None else int(np.asarray(s[1].cu_q_lens)[-1]) for s in self._slots]
        exiting = self._slots.pop()
        if exiting is None:
            return None, tokens
        return (exiting[0], self._next_ids(exiting[1])), tokens

    # -- the engine's launch / collect ------------------------------------------------------------

    def launch(self, step, sampling, tag=None):
        """As ModelRunner.launch: one step (pp > 1: one tick, done at once, the clock advanced
        by it). A step's modeled seconds are its cost model's (`step_seconds`: the device's
        time plus the host's overhead); with `overlapped` (async scheduling) the host's work
        hides behind the device's, so a step costs max(device, host overhead) instead of their
        sum. The clock advances when the step is collected."""
        if self.pipelined:
            exited, self.last_stage_tokens = self.tick(step, None, tag)
            return exited
        if sampling is not None:  # pending tokens: the last step's ids, as the device fills them
            step = fill_pending(step, sampling.token_rows, self._last_ids)
        self.last_features = StepFeatures.from_step(step)
        seconds = float(self.cost_model.step_seconds(self.last_features))
        host = float(getattr(self.cost_model, "host_overhead_s", 0.0))
        if self.overlapped and host:
            seconds = max(seconds - host, host)
        self.num_steps += 1
        self._last_ids = self._next_ids(step)
        return _Launched(tag, self._last_ids, seconds)

    def collect(self, launched):
        """(tag, next ids) of a launched step, the clock advanced to its end; None for a tick
        that no micro-batch left."""
        if not isinstance(launched, _Launched):  # a tick's (already timed) result
            return launched
        self.last_seconds = launched.seconds
        self.clock.advance(launched.seconds)
        return launched.tag, launched.next_ids

    # -- LoRA adapters (ModelRunner's write_lora_slot; no weights: shapes only) ---------------

    def load_lora(self, path: str, model, max_lora_rank: int, targets) -> LoRAWeights:
        """A simulated adapter: no file is read; it takes the slot's whole rank on every
        target (the bytes ModelRunner moves, padded to max_lora_rank)."""
        return LoRAWeights(path, max_lora_rank, tuple(targets), {})

    def write_lora_slot(self, slot: int, adapter: LoRAWeights) -> None:
        """The adapter's copy into a device slot, on the clock (the roofline's host link)."""
        seconds = getattr(self.cost_model, "lora_slot_seconds", None)
        if seconds is not None:
            self.clock.advance(float(seconds(self.config.lora.max_lora_rank)))
        self.num_lora_writes += 1

    # -- what ModelRunner also offers -----------------------------------------------------------

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

"""Weights that change while the engine serves (issue 43: the rollout engine of an RL loop).

    engine.update_weights(params)       the next steps run `params`: weight version + 1
    engine.pause_generation(mode)       'abort' | 'wait' | 'keep' (vLLM's modes)
    engine.resume_generation()
    engine.sleep(level)                 1: the KV pages freed; 2: the weights too
    engine.wake_up()

**Update.** `update_weights` takes weights as `LLMEngine(config, params)` does (`LLM.update_
weights` converts a trainer's pytree or HF-named arrays to that first) and hands them to the
runner, which places them as it placed its first ones and checks every leaf against them
(shape, dtype, packed format; resharded to the same shardings), so the compiled step runs them
without a recompile. The step in flight (async scheduling) lands first; every running request
then goes back to the front of the waiting queue with its tokens (its KV, computed under the old
weights, is dropped, not offered to the prefix cache) and recomputes under the new ones. The
prefix cache is emptied and its page keys get a new salt (`weight_salt`: the engine's salt mixed
with the version), so nothing cached before the update (device pages, or blocks in the KV tiers
below, which stay where they are under their old keys) is served after it. Each `RequestOutput`
says which version produced its last token (`weight_version`).

**Pause.** 'abort' aborts every live request now (their final outputs come back); 'wait' admits
nothing new while the requests already running finish; 'keep' freezes them all where they are
(no step runs) so an update recomputes their KV and `resume_generation` carries on. In every
mode requests added while paused wait, and run after `resume_generation`.

**Sleep.** Level 1 deletes the KV pages on the devices (the prefix cache emptied); level 2 the
weights too (the LoRA slots stay). Running requests go back to the waiting queue first, as for an
update. `wake_up` allocates the pages again (the same shapes and shardings); after level 2 the
engine serves again once `update_weights` gave it weights. Both return the bytes freed or
taken, and the devices' `bytes_in_use` where the platform reports it.

Engines with requests parked or arriving in disaggregated serving (roles 'prefill' / 'decode'
with requests between instances), sparse KV, or pp > 1 with micro-batches in flight refuse an
update or sleep with the reason (drain them: pause with 'wait' first).
"""

from __future__ import annotations

import hashlib
import logging

from llmjax.engine.request import Request, RequestOutput
from llmjax.engine.step import Step, StepFeature

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


def weight_salt(salt: bytes | None, version: int) -> bytes | None:
    """The page-key salt of weight version `version` (version 0: the engine's own salt)."""
    if salt is None or version == 0:
        return salt
    return hashlib.blake2b(
        version.to_bytes(8, "little"), key=salt, person=b"llmjax-weights"
    ).digest()


def device_bytes_in_use(devices) -> int | None:
    """The devices' allocated bytes (`Device.memory_stats`), or None where the platform does
    not report them (XLA:CPU)."""
    if not devices:
        return None
    total = 0
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_in_use" not in stats:
            return None
        total += int(stats["bytes_in_use"])
    return total


class WeightVersions(StepFeature):
    """Hook `update`: each request that got a token records the weight version that made it
    (`RequestOutput.weight_version`)."""

    def __init__(self, engine):
        self.engine = engine

    def update(self, step: Step) -> None:
        for req in step.sampled:
            req.weight_version = self.engine.weight_version


class EngineWeights:
    """`LLMEngine`'s side of weight updates, pause and sleep (the module doc), mixed into it.
    Reads the engine's scheduler, block manager, runner, KV tiers, overlap and roles."""

    def _init_weights(self) -> None:
        self.weight_version = 0
        self.paused: str | None = None  # one of PAUSE_MODES while paused
        self.sleep_level = 0  # 0: awake
        self._base_salt = getattr(self.block_manager.prefix_cache, "salt", None)
        self._held_outputs: list[RequestOutput] = []  # landed while pausing / updating
        self._started: set[str] = set()  # 'wait': the requests running when it paused

    # ---- update ------------------------------------------------------------------------------

    def update_weights(self, params) -> int:
        """Run `params` (as `LLMEngine(config, params)` takes them) from the next step on;
        returns the new weight version. Running requests recompute their KV under them; the
        prefix cache (and the KV tiers' keys) starts over (the module doc). Raises ValueError
        naming a weight whose shape or dtype differs (nothing changes then)."""
        self._check_no_moving("update_weights")
        self._land_in_flight()
        self._recompute_running()
        self.runner.update_params(params)
        self.weight_version += 1
        self._new_cache_epoch()
        logger.info("weights updated: version %d", self.weight_version)
        return self.weight_version

    def _check_no_moving(self, what: str) -> None:
        if self.parked or self._receiving:
            raise ValueError(
                f"{what}: {len(self.parked)} parked and {len(self._receiving)} arriving requests "
                "hold KV computed under these weights between instances; drain them first "
                "(pause_generation('wait') on the cluster)"
            )
        if self.runner.pipelined and self.runner.num_in_flight:
            raise ValueError(f"{what}: pp micro-batches are in flight; step until they land")

    def _land_in_flight(self) -> None:
        """Collect and update the step in flight (async scheduling); its outputs come with the
        next `step()`."""
        prev = self._overlap.in_flight
        if prev is None:
            return
        self._overlap.in_flight = None
        landed = self._land([prev])
        self._held_outputs += self._emit(Step(None, []), landed)

    def _recompute_running(self) -> None:
        """Every running request to the front of the waiting queue, its KV dropped (not offered
        to the prefix cache): it recomputes prompt + output so far."""
        for req in reversed(list(self.scheduler.running)):  # (the in-flight step has landed)
            self.scheduler.requeue(req, offer_cache=False)

    def _new_cache_epoch(self) -> None:
        """Empty the prefix cache and salt its page keys with the weight version."""
        if self._base_salt is not None:
            salt = weight_salt(self._base_salt, self.weight_version)
            self.block_manager.prefix_cache.salt = salt
        self._empty_prefix_cache()

    def _empty_prefix_cache(self) -> None:
        """`reset_prefix_cache` with nothing running (so nothing stays), and the KV tiers'
        per-request page keys dropped (computed with the cache's old salt)."""
        if self.kv_tiers is not None:
            self.kv_tiers.forget_all()
        if not self.reset_prefix_cache():  # (the tiers' blocks on their way down flushed)
            raise RuntimeError("the prefix cache kept locked pages with no request running")

    # ---- pause -------------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Pause (the module doc). Returns the outputs that end now: with 'abort', every live
        request's last output (finish_reason 'abort'); the step in flight's, if one was."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose one of {PAUSE_MODES}")
        self._land_in_flight()
        out, self._held_outputs = self._held_outputs, []
        if mode == "abort":
            live = [r for r in self._live_requests() if not r.status.is_done]
            self.abort_all()
            out += [self._output(r) for r in live]
        self.paused = mode
        started = self._started = {r.request_id for r in self.scheduler.running}
        # 'wait': what runs now finishes (preempted, it is admitted again); nothing else starts
        self.scheduler.held = (
            (lambda r: r.request_id not in started) if mode == "wait" else (lambda r: True)
        )
        return out

    def resume_generation(self) -> None:
        """Carry on from where `pause_generation` stopped (requests added meanwhile run now)."""
        self.paused = None
        self.scheduler.held = None
        self._started = set()

    @property
    def is_paused(self) -> bool:
        return self.paused is not None

    @property
    def frozen(self) -> bool:
        """Whether `step()` runs nothing: paused with 'keep' or 'abort', or asleep, or without
        weights (sleep level 2 until `update_weights`)."""
        released = getattr(self.runner, "weights_released", False)  # (the simulator's: never)
        return self.paused in ("keep", "abort") or self.sleep_level > 0 or released

    @property
    def can_step(self) -> bool:
        """Whether a `step()` now would make progress (a paused or sleeping engine's requests
        wait for a command: the server's engine thread blocks instead of spinning)."""
        if self._held_outputs or self._rejected:
            return True
        if self.frozen:
            return False
        if self.paused == "wait":  # until what ran at the pause has finished (even if preempted)
            sched = self.scheduler
            started = any(r.request_id in self._started for r in sched.waiting)
            return bool(sched.running) or self._overlap.in_flight is not None or started
        return True

    def _live_requests(self) -> list[Request]:
        s = self.scheduler
        return [
            *s.running,
            *s.waiting,
            *self.parked.values(),
            *(r for r, _ in self._receiving.values()),
        ]

    # ---- sleep -------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> dict:
        """Free the KV pages (level 1) and the weights too (level 2) on the devices; running
        requests wait to recompute. Returns {'kv_bytes', 'weight_bytes', 'bytes_in_use_before',
        'bytes_in_use_after'} (the last two None where the platform does not report them)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: 1 (KV pages) or 2 (KV pages and weights)")
        if self.sleep_level:
            raise ValueError(f"the engine sleeps already (level {self.sleep_level})")
        self._check_no_moving("sleep")
        devices = self._devices()
        before = device_bytes_in_use(devices)
        self._land_in_flight()
        self._recompute_running()
        self._empty_prefix_cache()  # the pages' contents go
        kv = self.runner.release_kv()
        weights = self.runner.release_params() if level == 2 else 0
        self.sleep_level = level
        freed = dict(kv_bytes=kv, weight_bytes=weights, bytes_in_use_before=before,
                     bytes_in_use_after=device_bytes_in_use(devices))  # fmt: skip
        logger.info("asleep (level %d): %s", level, freed)
        return freed

    def wake_up(self) -> dict:
        """Allocate the KV pages again; serving resumes (after level 2, once `update_weights`
        gave weights). Returns {'bytes_in_use_before', 'bytes_in_use_after'}."""
        if not self.sleep_level:
            raise ValueError("the engine is awake")
        devices = self._devices()
        before = device_bytes_in_use(devices)
        self.runner.restore_kv()
        self.sleep_level = 0
        return dict(bytes_in_use_before=before, bytes_in_use_after=device_bytes_in_use(devices))

    def _devices(self) -> list:
        return list(getattr(self.runner, "devices", ()))  # (a fake runner: none)

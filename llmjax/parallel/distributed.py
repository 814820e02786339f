"""Multi-host runs: start-up, host <-> global arrays, and the lockstep check.

Every process runs the same engine on the same inputs (its scheduler, block manager and prefix
cache are deterministic functions of the requests and the sampled tokens, which every process
reads back in full), so their decisions stay in lockstep without messages; the jitted step is one
SPMD program over all processes' devices. `ParallelConfig(check_lockstep=True)` verifies that:
after every step the processes compare a digest of the sampled tokens.

Launch (one command per process; scripts/generate.py and scripts/benchmark.py take the flags):
    python scripts/generate.py --tp 2 --coordinator_address 127.0.0.1:1234 \\
        --num_processes 2 --process_id 0   # and --process_id 1 in a second shell
"""

from __future__ import annotations

import hashlib
import logging

import jax
import numpy as np

logger = logging.getLogger(__name__)


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` for `num_processes` > 1 (before anything touches a device).
    On CPUs the cross-process collectives use gloo."""
    if num_processes <= 1:
        return
    if not coordinator_address:
        raise ValueError("a multi-process run needs --coordinator_address host:port")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"{process_id=} must be in [0, {num_processes=})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    logger.info(
        "process %d of %d: %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated global array -> numpy, from this process's own copy (no communication)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def leader_clock() -> float:
    """Process 0's time.perf_counter(), the same value in every process (a collective: all
    processes must call it together). Real-time benchmark replay reads it, so every process sees
    a request arrive at the same step."""
    import time

    from jax.experimental import multihost_utils

    now = np.array([time.perf_counter()], np.float64)
    return float(np.asarray(multihost_utils.broadcast_one_to_all(now))[0])


def digest(token_ids: np.ndarray) -> int:
    return int.from_bytes(hashlib.sha256(np.ascontiguousarray(token_ids).tobytes()).digest()[:4])


def check_lockstep(token_ids: np.ndarray, step: int) -> None:
    """Raise if any process sampled different tokens in this step (all processes must call)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = digest(token_ids)
    everyone = np.asarray(multihost_utils.process_allgather(np.array([mine], np.uint32)))
    if not (everyone == mine).all():
        raise RuntimeError(
            f"step {step}: processes sampled different tokens (digests {everyone.ravel().tolist()}"
            f"; process {jax.process_index()} has {mine}): their schedulers are out of lockstep"
        )

"""The one clock that request metrics read (arrival, first scheduled, each token, finish).

The real engine reads `WallClock` (`time.perf_counter` seconds). A simulated engine reads a
`VirtualClock` that its device model advances by each step's modeled duration, so TTFT, TBT,
scheduling delay and SLO checks come out in simulated seconds through the same code. What the
engine measures of its own host work (`EngineStats`' host and step seconds) stays wall time:
the host's real cost is what a simulation should still show.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (only differences mean anything)."""
        ...


class WallClock:
    """`time.perf_counter()`: CLOCK_MONOTONIC seconds, comparable across processes on Linux."""

    def now(self) -> float:
        return time.perf_counter()

    def __repr__(self) -> str:
        return "WallClock()"


class VirtualClock:
    """Simulated seconds that move only when told: `advance(dt)` by a step's modeled time, or
    `advance_to(t)` to the next event (never backwards)."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:  # also refuses NaN
            raise ValueError(f"a clock cannot go back or by NaN: advance({seconds})")
        self._now += seconds
        return self._now

    def advance_to(self, t: float) -> float:
        if t != t:
            raise ValueError("advance_to(nan)")
        self._now = max(self._now, float(t))
        return self._now

    def __repr__(self) -> str:
        return f"VirtualClock(now={self._now})"


WALL_CLOCK = WallClock()

"""What a cluster counts of its KV transfers (`TransferStats`), the same for the real cluster
(cluster.py: measured) and the simulated one (llmjax/sim/cluster.py: modeled). The Conductor's
counts are conductor.py's `ConductorStats`."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class TransferStats:
    """KV transfers between instances: count, bytes moved (bucket padding included), seconds
    from the pull's start to the pages' scatter (sum and per transfer), failures (transfers that
    failed or timed out), requests recomputed after a failure or an instance death, requests
    failed."""

    num_transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    transfer_seconds: list[float] = dataclasses.field(default_factory=list)
    num_failures: int = 0
    num_recomputed: int = 0
    num_failed_requests: int = 0

    def record(self, nbytes: int, seconds: float) -> None:
        """One transfer done: `nbytes` moved in `seconds` (measured, or the modeled time)."""
        self.num_transfers += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.transfer_seconds.append(seconds)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        times = d.pop("transfer_seconds")
        d["mean_transfer_s"] = float(np.mean(times)) if times else 0.0
        d["p99_transfer_s"] = float(np.percentile(times, 99)) if times else 0.0
        d["bandwidth_gb_s"] = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return d

"""A cluster as the server's engine thread drives one engine (`Cluster.serving_view()`,
llmjax/serve/): the same calls, summed stats, and the queue and page counts the server reads."""

from __future__ import annotations

import dataclasses

from llmjax.cluster.core import ENTRY_ROLES
from llmjax.engine.request import RequestOutput


class ServingView:
    """The cluster as the server's engine thread drives an `LLMEngine` (llmjax/serve/): the
    same calls, `stats` as one `EngineStats` summed over the instances (updated in place, so a
    reader's counters carry on), and `scheduler` / `block_manager` with the counts the server
    reads (`len(scheduler.waiting)`, `len(scheduler.running)`, `block_manager.num_pages`)."""

    def __init__(self, cluster):  # a cluster.Cluster
        from llmjax.engine.stats import EngineStats

        self.cluster = cluster
        self.config = cluster.config
        self.tokenizer = cluster.tokenizer
        self._stats = EngineStats(num_pages=0)

    def add_request(self, *args, **kwargs) -> str:
        return self.cluster.add_request(*args, **kwargs)

    def step(self) -> list[RequestOutput]:
        return self.cluster.step()

    def abort_request(self, request_id: str) -> bool:
        return self.cluster.abort_request(request_id)

    def abort_all(self) -> list[str]:
        return self.cluster.abort_all()

    def has_unfinished_requests(self) -> bool:
        return self.cluster.has_unfinished_requests()

    def validate_request(self, prompt_token_ids, sampling_params) -> None:
        """What an entry instance would reject (`LLMEngine.validate_request`)."""
        i = self.cluster._alive_with(ENTRY_ROLES)
        if i:
            self.cluster.instances[i[0]].validate_request(prompt_token_ids, sampling_params)

    @property
    def stats(self):
        total = self.cluster.total_stats
        for f in dataclasses.fields(total):
            setattr(self._stats, f.name, getattr(total, f.name))
        return self._stats

    def reset_stats(self) -> None:
        from llmjax.engine.stats import EngineStats

        self.cluster.reset_stats()
        self._stats = EngineStats(num_pages=0)

    def reset_prefix_cache(self) -> bool:
        return self.cluster.reset_prefix_cache()

    # LoRA adapters: served by every instance (`Cluster.add_lora`)

    @property
    def lora(self):
        return self.cluster.lora

    def add_lora(self, lora_request) -> bool:
        return self.cluster.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.cluster.remove_lora(lora_int_id)

    def list_loras(self) -> dict:
        return self.cluster.list_loras()

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Each running and each waiting request's adapter, over the live instances (their
        last load reports)."""
        loads = [ld for i, ld in enumerate(self.cluster._loads) if self.cluster.alive[i]]
        return (
            tuple(n for ld in loads for n in ld.running_loras),
            tuple(n for ld in loads for n in ld.waiting_loras),
        )

    @property
    def scheduler(self):
        loads = [ld for i, ld in enumerate(self.cluster._loads) if self.cluster.alive[i]]
        return _Queues(
            range(sum(ld.num_waiting for ld in loads)),
            range(sum(ld.num_running + ld.num_receiving for ld in loads)),
        )

    @property
    def block_manager(self):
        return _Pages(sum(ld.num_usable_pages + 1 for ld in self.cluster._loads))

    @property
    def num_compiles(self) -> int:
        return self.cluster.num_compiles


@dataclasses.dataclass(frozen=True)
class _Queues:
    waiting: range
    running: range


@dataclasses.dataclass(frozen=True)
class _Pages:
    num_pages: int

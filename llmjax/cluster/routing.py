"""What a router reads and returns, apart from any router (router.py, conductor.py): the request
being routed (`RouteRequest`), an instance as routers see it (`InstanceLoad`: the real cluster's
views and the simulator's `InstanceView` implement it) and the `Router` protocol.

Nothing here imports jax (or the engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from llmjax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmjax.lora import LoRARequest


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """A request being routed: its cluster-wide id, prompt, arrival time (seconds on the
    simulated timeline) and sampling params; `hints` (a program's `ProgramHints`, passed to the
    engine) and `instance` (an entry instance chosen upstream, by a program's scheduler: the
    router is not asked); `lora_request`: the LoRA adapter it runs under (its prefix-cache
    namespace: a prefix cached under another adapter, or none, is not its)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    arrival_time: float
    sampling_params: SamplingParams
    hints: object = None
    instance: int | None = None
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)

    @property
    def cache_namespace(self) -> bytes | None:
        """What keys its cached prefixes apart (`Request.cache_namespace`): its adapter's."""
        return None if self.lora_request is None else self.lora_request.cache_namespace


class InstanceLoad(Protocol):
    """What a router may read of instance `index` as of the routing time (the simulator's
    `InstanceView` documents exactly when each count changes)."""

    @property
    def index(self) -> int: ...  # its position in the instances list

    @property
    def num_outstanding(self) -> int: ...  # routed here and not finished (nor aborted)

    @property
    def num_waiting(self) -> int: ...  # queued, not admitted

    @property
    def num_running(self) -> int: ...  # admitted (holding KV pages)

    @property
    def num_free_pages(self) -> int: ...  # KV pages on the free list

    @property
    def num_available_pages(self) -> int: ...  # free + prefix-cache pages no request holds

    def cached_prefix_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the instance's prefix cache holds now."""
        ...


class Router(Protocol):
    """Picks the instance of each arriving request: the index into `instances` (all of them,
    in index order, as of `now`, the routing time)."""

    name: str

    def route(
        self, request: RouteRequest, instances: Sequence[InstanceLoad], now: float
    ) -> int: ...

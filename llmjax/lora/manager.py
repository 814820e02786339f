"""`LoRAManager`: the engine's adapters: registered by id, their weights in a host cache (LRU,
`max_cpu_loras`), and which adapter each of the `max_loras` device slots holds (LRU)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from llmjax.config import LoRAConfig, ModelConfig
from llmjax.lora.peft import LoRAError, LoRAWeights, load_peft_adapter
from llmjax.lora.request import LoRARequest


class LoRAManager:
    """Adapters by `lora_int_id`.

    `add` registers an adapter and reads it into the host cache (so a bad adapter is refused
    when its first request arrives, not when it runs); `slots_for` gives a step's adapters a
    device slot each, writing the missing ones (`write_slot(slot, weights)`, the runner's) into
    the least recently used slots that no adapter of this step holds. An adapter evicted from
    the host cache is read again from its directory when a slot needs it. `remove` forgets one
    (the server's unload).

    Invariants (`check_invariants`): the host cache holds at most `max_cpu_loras` registered
    adapters; each slot holds at most one registered adapter and no adapter is in two slots."""

    def __init__(
        self,
        config: LoRAConfig,
        model: ModelConfig,
        targets: tuple[str, ...],
        write_slot: Callable[[int, LoRAWeights], None],
        loader: Callable[..., LoRAWeights] = load_peft_adapter,
    ):
        self.config = config
        self.model = model
        self.targets = targets
        self.write_slot = write_slot
        self.loader = loader
        self.adapters: dict[int, LoRARequest] = {}
        self.host: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> adapter id
        self._slot_order: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(config.max_loras)
        )  # least recently used first
        self.num_slot_loads = 0
        self.num_host_loads = 0

    def add(self, lora: LoRARequest) -> None:
        """Register `lora` (reading it if it is new). Raises LoRAError for an adapter that
        cannot be served, or for an id already naming another adapter."""
        known = self.adapters.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                raise LoRAError(
                    f"lora_int_id {lora.lora_int_id} names adapter {known.lora_name!r} "
                    f"({known.lora_path}); {lora.lora_name!r} ({lora.lora_path}) needs another"
                )
            self._host_weights(lora.lora_int_id)
            return
        weights = self._load(lora)
        self.adapters[lora.lora_int_id] = lora
        self._cache(lora.lora_int_id, weights)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is freed); False if it was not registered."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        for s, held in enumerate(self.slots):
            if held == lora_int_id:
                self.slots[s] = None
                self._slot_order.move_to_end(s, last=False)  # free slots are taken first
        return True

    def by_name(self, lora_name: str) -> LoRARequest | None:
        return next((a for a in self.adapters.values() if a.lora_name == lora_name), None)

    def slot_of(self, lora_int_id: int) -> int | None:
        return next((s for s, held in enumerate(self.slots) if held == lora_int_id), None)

    def slots_for(self, lora_int_ids: Iterable[int]) -> dict[int, int]:
        """Each adapter of a step -> its device slot, loading those without one. At most
        `max_loras` distinct adapters (the scheduler's rule)."""
        wanted = list(dict.fromkeys(lora_int_ids))
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"{len(wanted)} adapters in one step, {len(self.slots)} slots")
        for lora_id in wanted:  # this step's adapters are the host cache's last to go
            if lora_id in self.host:
                self.host.move_to_end(lora_id)
        out = {}
        for lora_id in wanted:
            slot = self.slot_of(lora_id)
            if slot is not None:
                out[lora_id] = slot
                self._slot_order.move_to_end(slot)
        for lora_id in wanted:
            if lora_id in out:
                continue
            if lora_id not in self.adapters:
                raise KeyError(f"adapter {lora_id} is not registered (LoRAManager.add)")
            held = set(out.values())
            slot = next(s for s in self._slot_order if s not in held)
            self.write_slot(slot, self._host_weights(lora_id))
            self.slots[slot] = lora_id
            self._slot_order.move_to_end(slot)
            self.num_slot_loads += 1
            out[lora_id] = slot
        return out

    def _load(self, lora: LoRARequest) -> LoRAWeights:
        self.num_host_loads += 1
        return self.loader(lora.lora_path, self.model, self.config.max_lora_rank, self.targets)

    def _host_weights(self, lora_id: int) -> LoRAWeights:
        weights = self.host.get(lora_id)
        if weights is None:
            weights = self._load(self.adapters[lora_id])
            self._cache(lora_id, weights)
        self.host.move_to_end(lora_id)
        return weights

    def _cache(self, lora_id: int, weights: LoRAWeights) -> None:
        self.host[lora_id] = weights
        self.host.move_to_end(lora_id)
        while len(self.host) > self.config.num_cpu_loras:
            self.host.popitem(last=False)

    def check_invariants(self) -> None:
        assert len(self.host) <= self.config.num_cpu_loras, (len(self.host), self.config)
        assert set(self.host) <= set(self.adapters), (set(self.host), set(self.adapters))
        held = [a for a in self.slots if a is not None]
        assert len(held) == len(set(held)), self.slots
        assert set(held) <= set(self.adapters), (held, set(self.adapters))
        assert sorted(self._slot_order) == list(range(len(self.slots)))

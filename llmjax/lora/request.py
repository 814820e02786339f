"""`LoRARequest`: the adapter a request runs under (vLLM's class and field names)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (what clients call it: the server's `model` field),
    `lora_int_id` (a positive integer naming it in the engine: requests with the same id share
    its slot and its cached prefixes), `lora_path` (a PEFT directory: adapter_config.json +
    adapter_model.safetensors). One id names one adapter for the engine's lifetime: reusing an
    id with another name or path is an error (`llmjax.lora.LoRAManager.register`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @functools.cached_property
    def cache_namespace(self) -> bytes:
        """What keys the prefix cache's pages of this adapter apart from every other adapter's
        and the base model's (llmjax/engine/radix_cache.py): a digest of name and path."""
        text = f"{self.lora_name}\0{self.lora_path}".encode()
        return hashlib.blake2b(text, digest_size=16, person=b"llmjax-lora").digest()

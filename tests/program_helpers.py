"""Shared by the program tests: a tokenizer for the tiny model's 256-id vocabulary, engines."""

from __future__ import annotations

import functools


class ByteTokenizer:
    """Characters <-> ids for a vocabulary of 256: U+0100 + id decodes id, so encode(decode(ids))
    == ids; other characters encode to 3 + (code point mod 253) (ids 0-2 are pad, BOS, EOS)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) - 0x100 if 0x100 <= ord(c) < 0x200 else 3 + ord(c) % 253 for c in text]
        return ([1] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x100 + i) for i in ids if i > 2 or not skip_special_tokens)


@functools.cache
def tiny_llm():
    """The tiny model's random weights, loaded once per process (engines: `with_options`)."""
    from llmjax import LLM

    return LLM(
        "tiny",
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
        num_pages=256,
        compilation_cache_dir="",
    )


def sim_engine(num_pages: int = 512, model=None, **scheduler):
    """A simulated engine (no jax; the tiny model unless `model`, a ModelConfig): deterministic
    tokens, a virtual clock."""
    from configs.tiny import TINY
    from llmjax.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmjax.engine.engine import LLMEngine
    from llmjax.sim import SimConfig

    cfg = EngineConfig(
        model=model or TINY,
        cache=CacheConfig(page_size=4, num_pages=num_pages),
        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, **scheduler}),
        max_model_len=256 if model is None else 2048,
        device="sim",
        sim=SimConfig(),
    )
    return LLMEngine(cfg, None, num_pages)

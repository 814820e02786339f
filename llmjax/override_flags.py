"""`--override PATH=VALUE` (repeatable) for scripts/generate.py and scripts/benchmark.py: set any
EngineConfig field by dotted path, e.g. `--override scheduler.lpm_max_queue_len=64
--override cache.watermark=0.02 --override sparse_kv.alpha=5`, applied after the other flags
(`llmjax.config.apply_overrides`; values parsed by the field's type, 'none' for None, commas for
tuples). The fields the loaded weights fix (model, dtype, parallel.tp/pp/pad_heads) are refused."""

from __future__ import annotations

from absl import flags


def define_flags() -> None:
    flags.DEFINE_multi_string(
        "override",
        [],
        "PATH=VALUE: set an EngineConfig field by dotted path (e.g. scheduler.lpm_max_queue_len=64,"
        " cache.memory_fraction=0.3); repeatable; applied after the other flags.",
    )


def parse(items: list[str]) -> dict[str, str]:
    """['a.b=1', 'c=x'] -> {'a.b': '1', 'c': 'x'}; a malformed item raises naming it."""
    out = {}
    for item in items:
        path, eq, value = item.partition("=")
        if not eq or not path.strip():
            raise ValueError(f"--override {item!r}: want PATH=VALUE, e.g. scheduler.max_num_seqs=8")
        out[path.strip()] = value.strip()
    return out


def llm_kwargs(values) -> dict:
    """The LLM(...) keyword arguments the flag sets."""
    return {"overrides": parse(values.override)} if values.override else {}

"""Changing a config by dotted path (`apply_overrides`, the scripts' `--override` and
`--config.PATH=VALUE` flags), command-line strings parsed by each field's type."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from llmjax.config.engine import EngineConfig

# Fields an override may not change: the loaded weights were read and placed for them.
FIXED_BY_WEIGHTS = (
    "model",
    "dtype",
    "quantization",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.pad_heads",
    "device",
    "sim",
)


def apply_overrides(config, overrides: Mapping[str, Any]):
    """`config` (a frozen config dataclass) with nested fields replaced by dotted path, each level
    re-validated. A string value is parsed by the field's type (what command-line flags give:
    ints, floats, booleans as true/false, 'none', comma-separated tuples); other values are used
    as they are. Paths in FIXED_BY_WEIGHTS are refused (EngineConfig).

        apply_overrides(engine_config, {"scheduler.lpm_max_queue_len": "64",
                                        "cache.watermark": 0.02})
    """
    for path, value in overrides.items():
        if isinstance(config, EngineConfig) and any(
            path == f or path.startswith(f + ".") for f in FIXED_BY_WEIGHTS
        ):
            raise ValueError(f"{path!r} is fixed by the loaded weights; it cannot be overridden")
        config = _replace_path(config, path.split("."), value, path)
    return config


def read_override(cls: type, path: str, value):
    """An override's value as the field at dotted `path` of the config dataclass `cls` holds it
    (a string parsed by the field's type, as `apply_overrides` does; other values unchanged)."""
    hint = cls
    for name in path.split("."):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise ValueError(f"{path!r}: {getattr(hint, '__name__', hint)} has no fields")
        hints = typing.get_type_hints(hint)
        if name not in hints:
            raise ValueError(f"{path!r}: {hint.__name__} has no field {name!r}")
        hint = hints[name]
    if not isinstance(value, str):
        return value
    try:
        return _parse_value(value, hint)
    except ValueError as e:
        raise ValueError(f"{path!r}: cannot read {value!r} as {hint}: {e}") from None


def _replace_path(obj, names: list[str], value, path: str):
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"{path!r}: {type(obj).__name__} has no fields")
    fields = {f.name for f in dataclasses.fields(obj)}
    name = names[0]
    if name not in fields:
        raise ValueError(
            f"{path!r}: {type(obj).__name__} has no field {name!r}; fields: {sorted(fields)}"
        )
    if len(names) > 1:
        value = _replace_path(getattr(obj, name), names[1:], value, path)
    elif isinstance(value, str):
        hint = typing.get_type_hints(type(obj))[name]
        try:
            value = _parse_value(value, hint)
        except ValueError as e:
            raise ValueError(f"{path!r}: cannot read {value!r} as {hint}: {e}") from None
    return dataclasses.replace(obj, **{name: value})


def _parse_value(text: str, hint):
    """A command-line string -> a value of type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() == "none" and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _parse_value(text, arg)
                except ValueError:
                    continue
        raise ValueError("no member of the union accepts it")
    if origin is Literal:
        if text in args:
            return text
        raise ValueError(f"choose one of {args}")
    if origin is tuple:
        item = args[0] if args else str
        return tuple(_parse_value(x.strip(), item) for x in text.split(",") if x.strip())
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError("want true or false")
    if hint in (int, float, str):
        return hint(text)
    raise ValueError("not settable from a string; pass the value itself")

"""The check every config's `__post_init__` shares: named fields positive (None passes)."""

from __future__ import annotations

from typing import Any


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {name}={value!r}")

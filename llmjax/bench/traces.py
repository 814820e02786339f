"""Trace files: workloads as JSONL, one request per line (the format is in
llmjax/bench/workloads.py's docstring; Mooncake's traces are read by mooncake.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from llmjax.bench.specs import RequestSpec, check_parents

TRACE_KEYS = ("arrival_time", "prompt", "prompt_len", "prompt_token_ids", "output_len", "parent")


def save_trace(path: str, specs: Sequence[RequestSpec], *, with_token_ids: bool = False) -> None:
    """Write `specs` as JSONL: arrival_time, output_len, and prompt and/or prompt_len (plus
    prompt_token_ids if asked, and parent when set). A prefix-sharing workload needs
    with_token_ids=True: by length alone, its shared prefixes would come back as unrelated random
    ids."""
    check_parents(specs)
    with open(path, "w") as f:
        for spec in specs:
            row: dict = {"arrival_time": spec.arrival_time}
            if spec.prompt is not None:
                row["prompt"] = spec.prompt
            if spec.prompt_len is not None:
                row["prompt_len"] = spec.prompt_len
            if with_token_ids and spec.prompt_token_ids is not None:
                row["prompt_token_ids"] = list(spec.prompt_token_ids)
            row["output_len"] = spec.output_len
            if spec.parent is not None:
                row["parent"] = spec.parent
            f.write(json.dumps(row) + "\n")


def load_trace(path: str) -> list[RequestSpec]:
    """Read a JSONL trace; errors name the file, the line and the field. Blank lines are skipped.
    If a line has both `prompt` and `prompt_len`, the text is what runs (the length is kept as
    information). `parent` is the 0-based index of an earlier request (blank lines not counted)."""
    specs = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                specs.append(_parse_trace_line(line, f"{path}:{lineno}", index=len(specs)))
    if not specs:
        raise ValueError(f"{path}: the trace has no requests")
    return specs


def read_json_object(line: str, where: str) -> dict:
    """One JSONL line as a dict; errors name `where` (file:line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}): {line.strip()[:80]!r}") from e
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _parse_trace_line(line: str, where: str, index: int) -> RequestSpec:
    row = read_json_object(line, where)
    unknown = sorted(set(row) - set(TRACE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {list(TRACE_KEYS)}")

    def number(key, kind, minimum, required=True):
        value = row.get(key)
        if value is None:
            if required:
                raise ValueError(f"{where}: missing {key!r}")
            return None
        ok_type = isinstance(value, int | float) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not ok_type or not value >= minimum:
            want = "a number" if kind is float else "an integer"
            raise ValueError(f"{where}: {key}={value!r} must be {want} >= {minimum}")
        return kind(value)

    prompt = row.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt={prompt!r} must be a non-empty string")
    ids = row.get("prompt_token_ids")
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids)
    ):
        raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids >= 0")
    prompt_len = number("prompt_len", int, 1, required=False)
    if prompt is None and prompt_len is None and ids is None:
        raise ValueError(f"{where}: needs 'prompt', 'prompt_len' or 'prompt_token_ids'")
    if ids is not None and prompt_len is not None and prompt_len != len(ids):
        raise ValueError(f"{where}: prompt_len={prompt_len} but prompt_token_ids has {len(ids)}")
    parent = row.get("parent")
    if parent is not None and (type(parent) is not int or not 0 <= parent < index):
        allowed = f"an integer in [0, {index})" if index else "none: this is the first request"
        raise ValueError(
            f"{where}: parent={parent!r} must be the 0-based index of an earlier request "
            f"({allowed})"
        )
    return RequestSpec(
        arrival_time=number("arrival_time", float, 0),
        output_len=number("output_len", int, 1),
        prompt_len=prompt_len,
        prompt_token_ids=tuple(ids) if ids is not None else None,
        prompt=prompt,
        parent=parent,
    )

"""Mooncake's released request traces (FAST'25; `../shared/data/mooncake/`, its README gives the
fields) as `RequestSpec`s with real prefix sharing.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`: the
prompt's 512-token blocks as prefix-chained hash ids (equal ids at the same position mean equal
prefixes). Replay turns every hash id into a fixed run of token ids (seeded by the id), so two
requests that share leading hash ids share those tokens, and a prefix cache reuses them exactly as
Mooncake's did; a partial last block uses only its first tokens.

`block_tokens` scales the trace to a small model: each hash block becomes `block_tokens` tokens
(512: the trace's own lengths; 16: 1/32 of them, keeping the sharing structure), the prompt
`ceil(input_length * block_tokens / 512)` tokens. `output_scale` scales output lengths, and
`time_scale` the arrival times (0.5: twice the rate). Requests longer than `max_model_len` are
clipped as the synthetic workloads are (output first kept under the context, then the prompt cut).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

from llmjax.bench.specs import MIN_RANDOM_TOKEN_ID, RequestSpec, clip_to_context
from llmjax.bench.traces import read_json_object

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the released traces


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The token ids that stand for one hash block (the same for the same id and seed)."""
    rng = np.random.default_rng([seed, 3, hash_id])
    return rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, block_tokens).tolist()


def load_mooncake_trace(
    path: str,
    *,
    vocab_size: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    output_scale: float = 1.0,
    time_scale: float = 1.0,
    max_model_len: int | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    sample_fraction: float | None = None,
    sample_seed: int = 0,
) -> list[RequestSpec]:
    """The first `num_requests` (None: all) requests of a Mooncake trace, arriving at their
    timestamps (relative to the first, times `time_scale`); errors name the line and field.
    `sample_fraction`: only the requests of that share of the trace's conversations
    (`sample_conversations`), every turn of each, so the sample keeps the trace's sharing."""
    if block_tokens < 1 or not output_scale > 0 or not time_scale >= 0:
        raise ValueError(f"need {block_tokens=} >= 1, {output_scale=} > 0, {time_scale=} >= 0")
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"{vocab_size=} must be > {MIN_RANDOM_TOKEN_ID}")
    blocks: dict[int, list[int]] = {}
    specs: list[RequestSpec] = []
    start = None
    keep = None
    if sample_fraction is not None:
        keep = set(sample_conversations(path, sample_fraction, sample_seed))
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if keep is not None and lineno not in keep:
                continue
            if num_requests is not None and len(specs) >= num_requests:
                break
            if not line.strip():
                continue
            t, n_in, n_out, hash_ids = _parse(line, f"{path}:{lineno}")
            start = t if start is None else start
            n = max(1, math.ceil(n_in * block_tokens / MOONCAKE_BLOCK_TOKENS))
            ids: list[int] = []
            for h in hash_ids:
                if len(ids) >= n:
                    break
                if h not in blocks:
                    blocks[h] = block_token_ids(h, block_tokens, vocab_size, seed)
                ids += blocks[h]
            if len(ids) < n:
                raise ValueError(
                    f"{path}:{lineno}: {len(hash_ids)} hash_ids cover fewer than input_length="
                    f"{n_in} tokens (blocks of {MOONCAKE_BLOCK_TOKENS})"
                )
            out_len = max(1, round(n_out * output_scale))
            n, out_len = clip_to_context(n, out_len, max_model_len)
            specs.append(
                RequestSpec(
                    arrival_time=(t - start) / 1000.0 * time_scale,
                    output_len=out_len,
                    prompt_token_ids=tuple(ids[:n]),
                )
            )
    if not specs:
        raise ValueError(f"{path}: the trace has no requests")
    return specs


def conversation_of(hash_ids: Sequence[int], shared_first: bool, lineno: int):
    """A request's conversation: its first hash block, or its second where every request of
    the trace begins with the same block (conversation's shared system prompt); a request of
    that one block only is its own."""
    if not shared_first:
        return hash_ids[0] if hash_ids else ("line", lineno)
    return hash_ids[1] if len(hash_ids) > 1 else ("line", lineno)


def sample_conversations(path: str, fraction: float, seed: int = 0) -> list[int]:
    """The line numbers (from 1) of the requests of a `fraction` of the trace's conversations
    (`conversation_of`), each conversation in or out with that probability (seeded), every
    turn of those kept: a sample with the whole trace's prefix sharing at a fraction of its
    rate."""
    if not 0 < fraction <= 1:
        raise ValueError(f"{fraction=} must be in (0, 1]")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append((lineno, _parse(line, f"{path}:{lineno}")[3]))
    firsts = {ids[0] for _, ids in rows if ids}
    shared = len(firsts) == 1 and len(rows) > 1
    rng = np.random.default_rng([seed, 7])
    chosen: dict = {}
    out = []
    for lineno, ids in rows:
        key = conversation_of(ids, shared, lineno)
        if key not in chosen:
            chosen[key] = bool(rng.random() < fraction)
        if chosen[key]:
            out.append(lineno)
    return out


def is_mooncake_trace(path: str) -> bool:
    """Whether the file's first request line has Mooncake's fields (else: llmjax's trace)."""
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(row, dict) and "hash_ids" in row
    return False


def _parse(line: str, where: str) -> tuple[float, int, int, list[int]]:
    row = read_json_object(line, where)
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise ValueError(f"{where}: missing {key!r}")
    t, n_in, n_out, hash_ids = (
        row[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")
    )
    if isinstance(t, bool) or not isinstance(t, int | float) or t < 0:
        raise ValueError(f"{where}: timestamp={t!r} must be a number of ms >= 0")
    for key, value in (("input_length", n_in), ("output_length", n_out)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be an integer >= 1")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    return float(t), n_in, n_out, hash_ids

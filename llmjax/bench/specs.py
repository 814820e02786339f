"""A workload's requests (llmjax/bench/workloads.py): `RequestSpec`, and what every workload
generator shares.

    RequestSpec, check_parents   one request: lengths or a prompt, an arrival, maybe a parent
    lognormal_lengths            lengths with a published median and P90
    arrival_times, streams       Poisson arrivals; the seeded length and arrival streams
    clip_to_context              prompt + output cut to fit max_model_len
    with_poisson_arrivals        preparing specs to run: re-timed arrivals,
    with_token_ids               and token ids for prompts given by text or length
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

Z90 = 1.2815515655446004  # the standard normal's 90th percentile
MIN_RANDOM_TOKEN_ID = 100  # random prompts avoid the low ids where special tokens live
DEFAULT_SCALE = 1 / 16


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. The prompt is `prompt_token_ids`, else `prompt` (text, tokenized
    when run), else `prompt_len` random token ids.

    A dependent request has `parent`: the index of an EARLIER spec of the same list (checked by
    `check_parents`). It continues its parent's conversation: it is added once the parent has
    finished, `arrival_time` seconds after the parent's finish, and the prompt that runs is the
    parent's whole prompt + the tokens the parent generated + this spec's own prompt (so
    prompt_token_ids / prompt / prompt_len describe only the new part, e.g. the next user message).
    Chains nest: a parent may itself be dependent.
    """

    arrival_time: float  # seconds from the start of the run (dependent: after the parent finishes)
    output_len: int  # tokens to generate (ignore_eos, so exactly this many)
    prompt_len: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    parent: int | None = None  # index of an earlier spec whose conversation this one continues

    def __post_init__(self):
        if self.prompt_token_ids is not None:
            ids = tuple(int(t) for t in self.prompt_token_ids)
            object.__setattr__(self, "prompt_token_ids", ids)
            if self.prompt_len is None:
                object.__setattr__(self, "prompt_len", len(ids))
            elif self.prompt_len != len(ids):
                raise ValueError(f"{self.prompt_len=} != len(prompt_token_ids)={len(ids)}")
        if self.prompt_len is None and self.prompt is None:
            raise ValueError("a RequestSpec needs prompt_token_ids, prompt or prompt_len")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise ValueError(f"{self.prompt_len=} must be >= 1")
        if self.output_len < 1:
            raise ValueError(f"{self.output_len=} must be >= 1")
        if not self.arrival_time >= 0:
            raise ValueError(f"{self.arrival_time=} must be >= 0 seconds")
        if self.parent is not None and (
            isinstance(self.parent, bool) or not isinstance(self.parent, int) or self.parent < 0
        ):
            raise ValueError(f"{self.parent=} must be the index (an int >= 0) of an earlier spec")


def check_parents(specs: Sequence[RequestSpec]) -> None:
    """Raise ValueError unless every spec's `parent` is the index of an earlier spec."""
    for i, spec in enumerate(specs):
        if spec.parent is not None and not spec.parent < i:
            raise ValueError(
                f"request {i}: parent={spec.parent} must be the index of an earlier request "
                f"(0 <= parent < {i})"
            )


# ------------------------------------------------------------------------------------------------
# Length distributions and arrivals.


def lognormal_lengths(median: float, p90: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` lengths from the lognormal with this median and 90th percentile (float, unclipped)."""
    if not 0 < median < p90:
        raise ValueError(f"need 0 < {median=} < {p90=}")
    sigma = math.log(p90 / median) / Z90
    return rng.lognormal(math.log(median), sigma, n)


def arrival_times(n: int, qps: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `qps` (first at t=0), or all at t=0 if qps is inf. [n] seconds."""
    if math.isinf(qps):
        return np.zeros(n)
    if not qps > 0:
        raise ValueError(f"{qps=} must be > 0 (or inf for all at once)")
    gaps = rng.exponential(1.0 / qps, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:n]


def streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (lengths, arrivals) streams: the lengths do not depend on the QPS."""
    return np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])


def clip_to_context(prompt_len: int, output_len: int, max_model_len: int | None):
    """(prompt_len, output_len) cut to fit max_model_len together: the output first (at most
    max_model_len - 1), then the prompt."""
    if max_model_len is None:
        return prompt_len, output_len
    if max_model_len < 2:
        raise ValueError(f"{max_model_len=} must be >= 2")
    output_len = min(output_len, max_model_len - 1)
    return min(prompt_len, max_model_len - output_len), output_len


# ------------------------------------------------------------------------------------------------
# Preparing specs to run.


def with_poisson_arrivals(specs: Sequence[RequestSpec], qps: float, seed: int = 0):
    """The same requests, re-timed as Poisson arrivals at `qps` (e.g. a length-only trace). Only
    independent requests are re-timed (in list order); dependent ones keep their delay after their
    parent."""
    roots = [i for i, s in enumerate(specs) if s.parent is None]
    arrivals = dict(zip(roots, arrival_times(len(roots), qps, streams(seed)[1]), strict=True))
    return [
        dataclasses.replace(s, arrival_time=float(arrivals[i])) if i in arrivals else s
        for i, s in enumerate(specs)
    ]


def with_token_ids(
    specs: Sequence[RequestSpec], vocab_size: int, *, tokenizer=None, seed: int = 0
) -> list[RequestSpec]:
    """Every spec with `prompt_token_ids` set: text prompts are tokenized with `tokenizer`
    (anything with `.encode(str) -> list[int]`), length-only ones get seeded random ids in
    [100, vocab_size) (request i's ids depend only on seed and i). For a dependent spec these are
    its own ids, which run after its parent's prompt and output. Checks `check_parents`."""
    check_parents(specs)
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"{vocab_size=} must be > {MIN_RANDOM_TOKEN_ID} for random prompts")
    out = []
    for i, spec in enumerate(specs):
        if spec.prompt_token_ids is not None:
            out.append(spec)
            continue
        if spec.prompt is not None:
            if tokenizer is None:
                raise ValueError(f"request {i} has a text prompt but there is no tokenizer")
            ids = tokenizer.encode(spec.prompt)
        else:
            rng = np.random.default_rng([seed, 2, i])
            ids = rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, spec.prompt_len).tolist()
        out.append(dataclasses.replace(spec, prompt_token_ids=tuple(ids), prompt_len=len(ids)))
    return out

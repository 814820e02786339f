"""Workloads: what requests arrive when, with how many prompt and output tokens.

A workload is a list of `RequestSpec`s: lengths (or a prompt) plus an arrival time in seconds from
the start of the run. Lengths and arrivals are drawn from separate seeded streams, so the same
`seed` gives the same requests at every QPS (what a capacity search needs).

Generators (ALGORITHMS.md §3.4 for the length statistics):
  sharegpt   chat: lognormal lengths fitted to ShareGPT4's median and P90 (prompt 1730 / 5696,
             output 415 / 834 tokens), filtered like the source trace to <= 8192 tokens in all.
  arxiv      summarization: arXiv-summarization's (prompt 2730 / 3702, output 167 / 372), <= 4096.
  long_prompt_interference
             decode-heavy short requests at t=0, then long prompts arriving while they decode:
             whole-prompt policies (prefill_first) stall every decode, stall-free ones (sarathi)
             do not.
  fixed      every request the same lengths (throughput at batch N, with qps=inf).
For these, lengths are multiplied by `scale` (default 1/16, so a CPU serves them: ShareGPT medians
become ~108 prompt and ~26 output tokens) and clipped so prompt + output <= max_model_len.

Prefix-sharing generators (ALGORITHMS.md §8, SGLang's RadixAttention workloads) give explicit,
seeded token ids, so `vocab_size` must be the served model's (default 49152, SmolLM2's); their
lengths are set by their own arguments and NOT scaled (`scale` is accepted and ignored):
  shared_system_prompt
             one system prompt, then a different question per request.
  few_shot   MMLU-style k-shot: a few tasks, each with its own fixed examples; a request is its
             task's examples + a new question; tasks interleave in arrival order.
  multi_turn_chat
             sessions whose turn k+1 is turn k's prompt + the tokens the model generated for it +
             a new user message: dependent requests (`RequestSpec.parent`).
Random lengths there are lognormal with the given median and P90 = `p90_ratio` x median
(`p90_ratio=1` makes them exact).

Arrivals: Poisson at `qps` requests/s (seeded exponential gaps, first at t=0), or all at t=0 when
`qps` is inf. A dependent request (`parent` set) instead arrives `arrival_time` seconds after its
parent finishes (see `RequestSpec` and `replay`).

Trace files are JSONL, one request per line:
    {"arrival_time": 0.0, "prompt": "Tell me a story", "output_len": 64}
    {"arrival_time": 0.5, "prompt_len": 812, "output_len": 128}
    {"arrival_time": 2.0, "prompt_len": 40, "output_len": 64, "parent": 1}
(`prompt_token_ids` may replace `prompt`/`prompt_len`; `parent` is the 0-based index of an earlier
request of the file.) Requests given by length get seeded random token ids in [100, vocab_size)
when they are run (`with_token_ids`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence

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


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Published token-length statistics of a trace; `max_total_len` is its length filter."""

    prompt_median: float
    prompt_p90: float
    output_median: float
    output_p90: float
    max_total_len: int


SHAREGPT = LengthStats(1730, 5696, 415, 834, max_total_len=8192)
ARXIV = LengthStats(2730, 3702, 167, 372, max_total_len=4096)


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


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
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


def _specs(prompt_lens, output_lens, arrivals, max_model_len) -> list[RequestSpec]:
    specs = []
    for p, o, t in zip(prompt_lens, output_lens, arrivals, strict=True):
        p, o = clip_to_context(int(p), int(o), max_model_len)
        specs.append(RequestSpec(arrival_time=float(t), prompt_len=p, output_len=o))
    return specs


def from_length_stats(
    stats: LengthStats,
    num_requests: int,
    *,
    qps: float = math.inf,
    scale: float = DEFAULT_SCALE,
    max_model_len: int | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """Lognormal prompt and output lengths matching `stats`, filtered like the source trace
    (prompt + output <= max_total_len, by shortening the prompt), then scaled and clipped."""
    if not scale > 0:
        raise ValueError(f"{scale=} must be > 0")
    length_rng, arrival_rng = _streams(seed)
    prompt = lognormal_lengths(stats.prompt_median, stats.prompt_p90, num_requests, length_rng)
    output = lognormal_lengths(stats.output_median, stats.output_p90, num_requests, length_rng)
    output = np.clip(np.rint(output), 1, stats.max_total_len - 1)
    prompt = np.clip(np.rint(prompt), 1, stats.max_total_len - output)
    prompt = np.maximum(np.rint(prompt * scale), 1)
    output = np.maximum(np.rint(output * scale), 1)
    return _specs(prompt, output, arrival_times(num_requests, qps, arrival_rng), max_model_len)


def sharegpt(num_requests: int, **kwargs) -> list[RequestSpec]:
    """Chat-shaped requests (ShareGPT4 statistics); see `from_length_stats` for the options."""
    return from_length_stats(SHAREGPT, num_requests, **kwargs)


def arxiv(num_requests: int, **kwargs) -> list[RequestSpec]:
    """Summarization-shaped requests (arXiv-summarization statistics)."""
    return from_length_stats(ARXIV, num_requests, **kwargs)


def fixed(
    num_requests: int,
    *,
    prompt_len: int = 128,
    output_len: int = 64,
    qps: float = math.inf,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """`num_requests` identical-length requests (all at t=0 by default: throughput at batch N)."""
    del scale
    _, arrival_rng = _streams(seed)
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    return _specs([prompt_len] * num_requests, [output_len] * num_requests, arrivals, max_model_len)


def long_prompt_interference(
    num_requests: int,
    *,
    qps: float = math.inf,
    long_fraction: float = 0.25,
    decode_prompt_len: int = 32,
    decode_output_len: int = 128,
    long_prompt_len: int | None = None,
    long_output_len: int = 8,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """Decode-heavy short requests, all at t=0, then long prompts arriving while they decode.

    round(num_requests * long_fraction) long prompts (default length 2048, or max_model_len minus
    their output if less) arrive as a Poisson process at `qps` starting one gap after t=0 (all at
    t=0, after the short ones, if qps is inf). Under a whole-prompt policy each long prompt is a
    prefill-only step that stalls every running decode, so the decodes' P99 TBT grows to a whole
    prefill; a stall-free policy cuts the prompt into token-budget chunks beside the decodes.
    Pick qps so the long prompts arrive within the decodes' lifetime (decode_output_len steps),
    each separately: num_long / qps below that lifetime.
    """
    del scale
    num_long = max(1, round(num_requests * long_fraction)) if num_requests > 1 else 0
    num_decode = num_requests - num_long
    if long_prompt_len is None:
        long_prompt_len = min(2048, max_model_len - long_output_len) if max_model_len else 2048
    _, arrival_rng = _streams(seed)
    if math.isinf(qps):
        long_arrivals = np.zeros(num_long)
    else:
        long_arrivals = arrival_times(num_long + 1, qps, arrival_rng)[1:]
    prompt = [decode_prompt_len] * num_decode + [long_prompt_len] * num_long
    output = [decode_output_len] * num_decode + [long_output_len] * num_long
    arrivals = np.concatenate([np.zeros(num_decode), long_arrivals])
    return _specs(prompt, output, arrivals, max_model_len)


# ------------------------------------------------------------------------------------------------
# Prefix-sharing workloads (ALGORITHMS.md §8): explicit, seeded token ids.

DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's; pass the served model's `model_config.vocab_size`
DEFAULT_P90_RATIO = 2.0  # P90 / median of the prefix-sharing workloads' random lengths


def _token_rng(seed: int) -> np.random.Generator:
    """The token-id stream of the prefix-sharing workloads (apart from lengths and arrivals)."""
    return np.random.default_rng([seed, 3])


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"{vocab_size=} must be > {MIN_RANDOM_TOKEN_ID} for random prompts")


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(MIN_RANDOM_TOKEN_ID, vocab_size, int(n)).tolist()


def _varied_lengths(
    name: str, median: float, p90_ratio: float, n: int, rng: np.random.Generator
) -> list[int]:
    """`n` integer lengths >= 1: lognormal with this median and P90 = p90_ratio x median, or all
    round(median) when p90_ratio is 1 (drawing nothing)."""
    if not median >= 1:
        raise ValueError(f"{name}={median} must be >= 1")
    if not p90_ratio >= 1:
        raise ValueError(f"{p90_ratio=} must be >= 1 (1 = every length exactly the median)")
    if p90_ratio == 1:
        return [round(median)] * n
    lengths = lognormal_lengths(median, median * p90_ratio, n, rng)
    return np.maximum(np.rint(lengths), 1).astype(int).tolist()


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not value >= 1:
            raise ValueError(f"{name}={value} must be >= 1")


def shared_system_prompt(
    num_requests: int,
    *,
    system_prompt_len: int = 1024,
    question_len: float = 64,
    output_len: int = 32,
    qps: float = math.inf,
    p90_ratio: float = DEFAULT_P90_RATIO,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """Every prompt is the same `system_prompt_len` random token ids followed by the request's own
    question (random ids; lognormal length, median `question_len`); exactly `output_len` tokens
    out. A prefix cache computes the system prompt once instead of once per request.

    Questions are independent random ids, so two may share their first tokens by chance (a
    1/(vocab_size - 100) event per token, never a whole KV page in practice). max_model_len:
    output_len is cut to max_model_len - 2, then the system prompt (for every request alike, so it
    stays shared) to leave one question token, then each question to the room left.
    """
    del scale
    _check_vocab(vocab_size)
    _check_positive(system_prompt_len=system_prompt_len, output_len=output_len)
    length_rng, arrival_rng = _streams(seed)
    questions = _varied_lengths("question_len", question_len, p90_ratio, num_requests, length_rng)
    token_rng = _token_rng(seed)  # ids drawn at full length, then cut: cuts change no other id
    system = _random_ids(token_rng, system_prompt_len, vocab_size)
    question_ids = [_random_ids(token_rng, q, vocab_size) for q in questions]
    if max_model_len is not None:
        if max_model_len < 3:
            raise ValueError(
                f"{max_model_len=} must be >= 3 (a system, a question, an output token)"
            )
        output_len = min(output_len, max_model_len - 2)
        system = system[: max_model_len - output_len - 1]
        question_ids = [q[: max_model_len - output_len - len(system)] for q in question_ids]
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    return [
        RequestSpec(float(t), output_len, prompt_token_ids=tuple(system + q))
        for q, t in zip(question_ids, arrivals, strict=True)
    ]


def few_shot(
    num_requests: int,
    *,
    num_tasks: int = 4,
    num_shots: int = 5,
    shot_len: float = 96,
    question_len: float = 48,
    output_len: int = 16,
    header_len: int = 0,
    qps: float = math.inf,
    p90_ratio: float = DEFAULT_P90_RATIO,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """MMLU-style k-shot prompts: `num_tasks` tasks, each with its own `num_shots` fixed examples
    (random ids; lognormal lengths, median `shot_len`). A request's prompt is `header_len` random
    ids common to ALL tasks (default none), its task's examples concatenated, then a new question
    (median `question_len`); exactly `output_len` tokens out.

    Tasks share nothing but the header: their first example tokens are distinct, so prompts of
    different tasks differ exactly at position header_len, and prompts of one task share header +
    its examples (and, by chance, a question's first tokens). Requests take the tasks in rounds:
    each consecutive block of num_tasks requests has every task once, in a seeded random order, so
    tasks interleave in arrival order (FCFS alternates prefixes, longest-prefix-match groups them).
    max_model_len: output_len is cut to max_model_len - 2, each task's header + examples to leave
    one question token (a prefix cut, so prompts of a task still share it), then each question.
    """
    del scale
    _check_vocab(vocab_size)
    _check_positive(num_tasks=num_tasks, num_shots=num_shots, output_len=output_len)
    if header_len < 0:
        raise ValueError(f"{header_len=} must be >= 0")
    if num_tasks > vocab_size - MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"{num_tasks=} needs distinct first tokens: at most {vocab_size=} - 100")
    length_rng, arrival_rng = _streams(seed)
    shots = _varied_lengths("shot_len", shot_len, p90_ratio, num_tasks * num_shots, length_rng)
    questions = _varied_lengths("question_len", question_len, p90_ratio, num_requests, length_rng)
    rounds = -(-num_requests // num_tasks)
    tasks = np.concatenate([length_rng.permutation(num_tasks) for _ in range(rounds)])
    token_rng = _token_rng(seed)
    header = _random_ids(token_rng, header_len, vocab_size)
    firsts = token_rng.choice(vocab_size - MIN_RANDOM_TOKEN_ID, num_tasks, replace=False)
    prefixes = []
    for k in range(num_tasks):
        examples = [
            _random_ids(token_rng, n, vocab_size) for n in shots[k * num_shots :][:num_shots]
        ]
        examples[0][0] = MIN_RANDOM_TOKEN_ID + int(firsts[k])
        prefixes.append(header + [t for example in examples for t in example])
    question_ids = [_random_ids(token_rng, q, vocab_size) for q in questions]
    if max_model_len is not None:
        if max_model_len < 3:
            raise ValueError(f"{max_model_len=} must be >= 3 (an example, a question, an output)")
        output_len = min(output_len, max_model_len - 2)
        prefixes = [p[: max_model_len - output_len - 1] for p in prefixes]
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    specs = []
    for task, q, t in zip(tasks[:num_requests], question_ids, arrivals, strict=True):
        prefix = prefixes[task]
        if max_model_len is not None:
            q = q[: max_model_len - output_len - len(prefix)]
        specs.append(RequestSpec(float(t), output_len, prompt_token_ids=tuple(prefix + q)))
    return specs


def multi_turn_chat(
    num_requests: int,
    *,
    num_turns: int = 4,
    first_prompt_len: float = 256,
    user_turn_len: float = 64,
    output_len: int = 32,
    think_time: float = 1.0,
    qps: float = math.inf,
    p90_ratio: float = DEFAULT_P90_RATIO,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_model_len: int | None = None,
    seed: int = 0,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """Chat sessions of `num_turns` turns, exactly `num_requests` requests in all, listed session
    by session (a session's turns are consecutive): ceil(num_requests / num_turns) sessions, the
    last one shorter when num_turns does not divide num_requests.

    Turn 1 is a fresh prompt (random ids; lognormal length, median `first_prompt_len`). Turn k+1 is
    a dependent request (`parent` = turn k): its prompt runs as turn k's prompt + the `output_len`
    tokens the model generated for turn k + a new user message (median `user_turn_len`), so a
    prefix cache holding turn k's prompt and output computes only the new message. Every turn
    makes exactly `output_len` tokens.

    Arrivals: sessions start as Poisson arrivals at `qps` sessions/s (all at t=0 if inf); turn k+1
    arrives a think time after turn k finishes: exponential with mean `think_time` seconds (seeded;
    0 = at once).

    max_model_len: turn k runs a prompt of first + (k - 1) x (output_len + a user message) tokens,
    then output_len more, all known up front (outputs are exactly output_len). output_len is cut to
    max_model_len - 1 and the first prompt to leave room for it; a user message is cut to the room
    left, and a session with no room for a next message ends early (fewer turns), more sessions
    then making up num_requests. Every turn then fits: prompt + output <= max_model_len.
    """
    del scale
    _check_vocab(vocab_size)
    _check_positive(num_turns=num_turns, output_len=output_len)
    if not think_time >= 0:
        raise ValueError(f"{think_time=} must be >= 0 seconds")
    if max_model_len is not None:
        if max_model_len < 2:
            raise ValueError(f"{max_model_len=} must be >= 2")
        output_len = min(output_len, max_model_len - 1)
    length_rng, arrival_rng = _streams(seed)
    token_rng = _token_rng(seed)
    sessions: list[list[list[int]]] = []  # per session, per turn: its own (new) prompt ids
    num_left = num_requests
    while num_left > 0:
        first = _varied_lengths("first_prompt_len", first_prompt_len, p90_ratio, 1, length_rng)
        users = _varied_lengths(
            "user_turn_len", user_turn_len, p90_ratio, num_turns - 1, length_rng
        )
        turns = [_random_ids(token_rng, first[0], vocab_size)]
        messages = [_random_ids(token_rng, n, vocab_size) for n in users]
        if max_model_len is not None:
            turns[0] = turns[0][: max_model_len - output_len]
        context = len(turns[0]) + output_len  # tokens once the last turn so far has finished
        for message in messages[: num_left - 1]:
            if max_model_len is not None:
                room = max_model_len - context - output_len
                if room < 1:
                    break
                message = message[:room]
            turns.append(message)
            context += len(message) + output_len
        sessions.append(turns)
        num_left -= len(turns)
    starts = arrival_times(len(sessions), qps, arrival_rng)
    think_rng = np.random.default_rng([seed, 4])
    specs: list[RequestSpec] = []
    for start, turns in zip(starts, sessions, strict=True):
        specs.append(RequestSpec(float(start), output_len, prompt_token_ids=tuple(turns[0])))
        for message in turns[1:]:
            think = float(think_rng.exponential(think_time)) if think_time > 0 else 0.0
            parent = len(specs) - 1
            specs.append(
                RequestSpec(think, output_len, prompt_token_ids=tuple(message), parent=parent)
            )
    return specs


def long_context(
    num_requests: int,
    *,
    prompt_len: int = 2048,
    output_len: int = 128,
    qps: float = math.inf,
    max_model_len: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer=None,
    scale: float | None = None,  # accepted for a uniform signature; lengths are not scaled
) -> list[RequestSpec]:
    """Long real-text prompts with long generations (InfiniGen's setting, ALGORITHMS.md §11.5:
    1920-token prompts, 128 generated): request i's prompt is a `prompt_len`-token window of the
    bundled public-domain text (llmjax/bench/data/), starting at a seeded offset, tokenized with
    `tokenizer` (its bytes folded into the vocabulary without one). Real text, because sparse
    attention's selection and accuracy mean little on random tokens."""
    del scale
    from llmjax.bench.texts import public_domain_text

    _check_positive(prompt_len=prompt_len, output_len=output_len)
    text = public_domain_text()
    ids = (
        tokenizer.encode(text) if tokenizer is not None else [b % vocab_size for b in text.encode()]
    )
    if max_model_len is not None and prompt_len + output_len > max_model_len:
        prompt_len = max(1, max_model_len - output_len)
    if len(ids) < prompt_len:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {prompt_len=}")
    rng = np.random.default_rng([seed, 3])
    starts = rng.integers(0, len(ids) - prompt_len + 1, num_requests)
    _, arrival_rng = _streams(seed)
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    return [
        RequestSpec(
            arrival_time=float(t),
            output_len=output_len,
            prompt_token_ids=tuple(ids[s : s + prompt_len]),
        )
        for s, t in zip(starts, arrivals, strict=True)
    ]


WORKLOADS: dict[str, Callable[..., list[RequestSpec]]] = {
    "long_context": long_context,
    "sharegpt": sharegpt,
    "arxiv": arxiv,
    "long_prompt_interference": long_prompt_interference,
    "fixed": fixed,
    "shared_system_prompt": shared_system_prompt,
    "few_shot": few_shot,
    "multi_turn_chat": multi_turn_chat,
}


def make_workload(name: str, num_requests: int, **kwargs) -> list[RequestSpec]:
    """A synthetic workload by name (`WORKLOADS`); kwargs go to its generator."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"{num_requests=} must be >= 1")
    return WORKLOADS[name](num_requests, **kwargs)


# ------------------------------------------------------------------------------------------------
# Preparing specs to run.


def with_poisson_arrivals(specs: Sequence[RequestSpec], qps: float, seed: int = 0):
    """The same requests, re-timed as Poisson arrivals at `qps` (e.g. a length-only trace). Only
    independent requests are re-timed (in list order); dependent ones keep their delay after their
    parent."""
    roots = [i for i, s in enumerate(specs) if s.parent is None]
    arrivals = dict(zip(roots, arrival_times(len(roots), qps, _streams(seed)[1]), strict=True))
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


# ------------------------------------------------------------------------------------------------
# Trace files (JSONL).

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

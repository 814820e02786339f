"""Workloads with explicit, seeded token ids (the list is in llmjax/bench/workloads.py): the
prefix-sharing ones (ALGORITHMS.md §8, SGLang's RadixAttention workloads: a shared system prompt,
few-shot tasks, multi-turn chat) and long_context (windows of a bundled public-domain text,
InfiniGen's setting). Their lengths are their own arguments, not scaled.
"""

from __future__ import annotations

import math

import numpy as np

from llmjax.bench.specs import (
    MIN_RANDOM_TOKEN_ID,
    RequestSpec,
    arrival_times,
    lognormal_lengths,
    streams,
)

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
    length_rng, arrival_rng = streams(seed)
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
    length_rng, arrival_rng = streams(seed)
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
    length_rng, arrival_rng = streams(seed)
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
    bundled public-domain text (llmjax/data/), starting at a seeded offset, tokenized with
    `tokenizer` (its bytes folded into the vocabulary without one). Real text, because sparse
    attention's selection and accuracy mean little on random tokens."""
    del scale
    from llmjax.data.texts import public_domain_text

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
    _, arrival_rng = streams(seed)
    arrivals = arrival_times(num_requests, qps, arrival_rng)
    return [
        RequestSpec(
            arrival_time=float(t),
            output_len=output_len,
            prompt_token_ids=tuple(ids[s : s + prompt_len]),
        )
        for s, t in zip(starts, arrivals, strict=True)
    ]

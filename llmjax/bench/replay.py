"""Drive an `LLMEngine` with a workload, in real time or all at once.

The replayer adds each request once its arrival time has passed, stamped with that intended
arrival (so time spent waiting for the engine's current step counts as queueing, as in a server),
steps the engine while anything is unfinished, and sleeps only when the engine is idle and the next
arrival is in the future. Every request decodes greedily for exactly `output_len` tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from llmjax.bench.workloads import RequestSpec, with_token_ids
from llmjax.engine.request import RequestOutput
from llmjax.sampling_params import SamplingParams


def replay(
    engine, specs: Sequence[RequestSpec], *, realtime: bool = True, seed: int = 0
) -> list[RequestOutput]:
    """Run `specs` through `engine` (an `LLMEngine` with no unfinished requests); returns one
    finished `RequestOutput` per spec, in the order of `specs`.

    realtime: add request i at start + specs[i].arrival_time (time.perf_counter seconds, passed to
        `add_request` as its arrival time); False adds all at once, arriving at the start.
    seed: for the random token ids of length-only specs (`with_token_ids`).
    """
    if engine.has_unfinished_requests():
        raise ValueError("replay needs an idle engine: it has unfinished requests")
    specs = with_token_ids(
        specs, engine.config.model.vocab_size, tokenizer=engine.tokenizer, seed=seed
    )
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_time)  # stable for ties
    request_ids: list[str | None] = [None] * len(specs)
    finished: dict[str, RequestOutput] = {}
    next_i = 0
    start = time.perf_counter()
    while next_i < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while next_i < len(order) and (
            not realtime or start + specs[order[next_i]].arrival_time <= now
        ):
            i = order[next_i]
            spec = specs[i]
            request_ids[i] = engine.add_request(
                list(spec.prompt_token_ids),
                SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                prompt=spec.prompt,
                arrival_time=start + spec.arrival_time if realtime else start,
            )
            next_i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        elif next_i < len(order):
            time.sleep(max(0.0, start + specs[order[next_i]].arrival_time - time.perf_counter()))
    return [finished[rid] for rid in request_ids]


def warm_up(engine, specs: Sequence[RequestSpec], *, max_output_len: int = 64, seed: int = 0):
    """Compile the step shapes a run of `specs` will need, before measuring: replay them all at
    once with staggered short outputs (request i makes min(output_len, 1 + i % max_output_len)
    tokens), so prefill shapes and a falling number of concurrent decodes are both visited.
    Shapes that only real-time arrivals produce may still compile later; compare
    `engine.num_compiles` before and after a measured run."""
    staggered = [
        dataclasses.replace(
            s, arrival_time=0.0, output_len=min(s.output_len, 1 + i % max_output_len)
        )
        for i, s in enumerate(specs)
    ]
    return replay(engine, staggered, realtime=False, seed=seed)

"""The time of one decode-only engine step, measured on a live engine (no jax here: the engine's
own counters split each step into host and device time).

    ref = measure_decode_step(llm.engine, num_requests=8, num_steps=8)
    tbt_slo = 5 * (ref["host_ms_per_step"] + ref["device_ms_per_step"]) / 1e3  # Sarathi-Serve's

Sarathi-Serve sets its strict TBT SLO at about 5x a decode-only iteration of the hardware at hand
(ALGORITHMS.md §3); `scripts/benchmark.py --tbt_slo_factor` and the scheduler notebook do this.
"""

from __future__ import annotations

import time

import numpy as np

from llmjax.sampling_params import SamplingParams

DECODE_SLACK = 32  # extra max_tokens, so every request still decodes through the timed steps


def measure_decode_step(
    engine, num_requests: int, num_steps: int, *, prompt_len: int = 16, seed: int = 0
) -> dict:
    """Median host, device and wall time per step with `num_requests` decodes running (all
    prefilled first, from random prompts of `prompt_len` tokens); steps that compiled (e.g. when
    the page-table bucket grows) are skipped. The engine must allow that many running requests
    and tokens per step; its requests are aborted afterwards (their pages freed, their prefixes
    left in the cache)."""
    # Chunked prefill starts requests a few steps apart: the slack keeps all of them decoding
    # through the timed steps.
    params = SamplingParams(max_tokens=num_steps + DECODE_SLACK, ignore_eos=True)
    rng = np.random.default_rng(seed)
    vocab = engine.config.model.vocab_size
    ids = [
        engine.add_request(rng.integers(min(100, vocab - 1), vocab, prompt_len).tolist(), params)
        for _ in range(num_requests)
    ]
    started: set[str] = set()
    while len(started) < num_requests:  # prefill until every request has its first token
        started.update(o.request_id for o in engine.step() if o.token_ids)
    stats = engine.stats
    rows = []  # (host s, device s, wall s, decodes) per clean step
    skipped = 0
    for _ in range(num_steps + DECODE_SLACK // 2):
        if len(rows) == num_steps:
            break
        before = (stats.host_time_s, stats.device_time_s, stats.num_decode_tokens)
        compiles = engine.num_compiles
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        if engine.num_compiles != compiles:
            skipped += 1
            continue
        rows.append(
            (
                stats.host_time_s - before[0],
                stats.device_time_s - before[1],
                wall,
                stats.num_decode_tokens - before[2],
            )
        )
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    if not rows:
        raise RuntimeError(f"every one of {skipped} decode steps compiled; raise the step count")
    host, device, wall, decodes = (float(np.median(c)) for c in zip(*rows, strict=True))
    return {
        "num_running": num_requests,
        "decodes_per_step": decodes,
        "num_steps": len(rows),
        "num_compiling_steps_skipped": skipped,
        "host_ms_per_step": 1e3 * host,
        "device_ms_per_step": 1e3 * device,
        "wall_ms_per_step": 1e3 * wall,
        "host_fraction": host / max(host + device, 1e-12),
    }

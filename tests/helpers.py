"""Shared test helpers: build step inputs by hand, run the model without the engine."""

from __future__ import annotations

import functools

import numpy as np

from llmjax.model.step_input import StepInput


def make_step(
    seqs: list[tuple[list[int], int, list[int]]],
    page_size: int,
    *,
    num_tokens: int | None = None,
    max_pages: int | None = None,
    all_logits: bool = False,
) -> StepInput:
    """seqs: (new token ids, start position, page table) per sequence -> a padded StepInput.

    Logits rows: every new token if all_logits, else the last new token of each sequence.
    """
    T = num_tokens or sum(len(t) for t, _, _ in seqs)
    P = max_pages or max(len(p) for _, _, p in seqs)
    S = len(seqs)
    token_ids, positions, slots, logits_rows = [], [], [], []
    cu, kv_lens = [0], []
    pages = np.zeros((S, P), np.int32)
    for i, (ids, start, table) in enumerate(seqs):
        pos = np.arange(start, start + len(ids))
        token_ids += list(ids)
        positions += list(pos)
        slots += [table[p // page_size] * page_size + p % page_size for p in pos]
        rows = range(cu[-1], cu[-1] + len(ids))
        logits_rows += list(rows) if all_logits else [rows[-1]]
        cu.append(cu[-1] + len(ids))
        kv_lens.append(start + len(ids))
        pages[i, : len(table)] = table
    pad = T - len(token_ids)
    return StepInput(
        token_ids=np.array(token_ids + [0] * pad, np.int32),
        positions=np.array(positions + [0] * pad, np.int32),
        slot_mapping=np.array(slots + [0] * pad, np.int32),
        cu_q_lens=np.array(cu, np.int32),
        kv_lens=np.array(kv_lens, np.int32),
        page_indices=pages,
        num_seqs=np.array([S], np.int32),
        logits_indices=np.array(logits_rows, np.int32),
    )


def full_logits(params, config, token_ids, *, page_size=4, num_pages=None, dtype=np.float32):
    """Logits [len, V] of one sequence run as a single prefill, pages in shuffled order (the
    layers scanned or unrolled as `params` are laid out)."""
    import jax.numpy as jnp

    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.params import layers_stacked

    n = len(token_ids)
    need = -(-n // page_size)
    num_pages = num_pages or need + 3
    table = list(np.random.default_rng(0).permutation(np.arange(1, num_pages))[:need])
    kv = allocate_kv_pages(
        config, num_pages, page_size, jnp.dtype(dtype), stacked=layers_stacked(params)
    )
    step = make_step([(list(token_ids), 0, table)], page_size, all_logits=True)
    logits, _ = forward(params, kv, step, config)
    return np.asarray(logits)


_BENCHMARK_SCRIPT = None


def run_benchmark_script(args: list[str]) -> None:
    """scripts/benchmark.py's main with these flags, in this process (the script is loaded as a
    module once per process, since absl refuses to define its flags twice; they are parsed for
    each call and reset afterwards)."""
    import importlib.util
    import os

    global _BENCHMARK_SCRIPT
    if _BENCHMARK_SCRIPT is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(
            "benchmark_script", os.path.join(root, "scripts", "benchmark.py")
        )
        _BENCHMARK_SCRIPT = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_BENCHMARK_SCRIPT)
    bench = _BENCHMARK_SCRIPT
    bench.FLAGS(["benchmark.py", *args])
    try:
        bench.main([])
    finally:
        bench.FLAGS.unparse_flags()


@functools.cache
def tiny_llm(max_model_len: int = 96):
    """The tiny model's random weights on a small engine (4-token pages, a 32-token budget, 8
    sequences), loaded once per process and length; tests build their engines over it with
    `LLM.with_options`."""
    from llmjax import LLM

    return LLM(
        "tiny",
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=max_model_len,
        compilation_cache_dir="",
    )

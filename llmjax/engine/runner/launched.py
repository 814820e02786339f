"""What a launched step is (`Launched`) and the all-greedy sampling inputs that precompiling and
padding use."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from llmjax.engine.batch import SamplingInput


@dataclasses.dataclass
class Launched:
    """A dispatched step (`ModelRunner.launch`): device arrays that `collect` waits for."""

    tag: object  # handed back by collect (the engine's scheduled batch)
    next_ids: jax.Array | None  # [S]; None: a pipeline tick that no micro-batch left
    logprobs: tuple | None = None  # the sampler's (top ids, top logprobs, sampled, rank)
    prompt_logprobs: tuple | None = None  # (target logprob, rank, top ids, top logprobs) [T]
    spec: tuple | None = None  # (tokens, accepted, (processed ids, plain rows) or None)
    sparse_stats: object = None  # sparse_kv's SparseStats


def greedy_sampling(S: int) -> SamplingInput:
    zeros = np.zeros(S, np.float32)
    return SamplingInput(
        zeros,
        zeros.astype(np.int32),
        zeros + 1,
        zeros.astype(np.uint32),
        zeros.astype(np.int32),
        all_greedy=True,
    )

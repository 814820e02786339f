"""What a precision costs in quality: perplexity on held-out text and greedy agreement.

Both are teacher-forced over the model step itself (`llmjax.model.llama.forward`, one prefill
of each whole sequence with every position's logits), so they measure the weights and the
matmul forms, not sampling or scheduling:

- `perplexity`: exp(mean NLL of each next token) over windows of a text's tokens.
- `greedy_agreement`: on the reference precision's own greedy continuations, the share of
  continuation positions where another precision's argmax is the same token (teacher-forced, so
  one early difference does not make every later position disagree; as
  llmjax/sparse/evaluate.py measures sparse attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import ModelConfig
from llmjax.model.attention import AttentionFn, reference_attention
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.llama import forward
from llmjax.model.params import layers_stacked
from llmjax.model.step_input import contiguous_prefill


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"))
def _scores(params, kv, step, targets, config: ModelConfig, attention_fn: AttentionFn):
    logits, _ = forward(params, kv, step, config, attention_fn=attention_fn)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return nll, jnp.argmax(logits, axis=-1)


def teacher_forced(
    params,
    config: ModelConfig,
    sequences,
    page_size: int = 16,
    kv_cache_dtype: str = "auto",
    attention_fn: AttentionFn = reference_attention,
):
    """[B, n] token ids -> (nll [B, n-1] of each next token, argmax [B, n-1]) from one prefill
    of each row (a row at a time: the logits of every position of a 49k vocabulary are big),
    over a KV cache of `kv_cache_dtype` (CacheConfig's: every position attends over the stored,
    possibly quantized, keys and values), attending with `attention_fn` (the jnp reference, or
    a kernel's: `make_attention_fn`)."""
    sequences = np.asarray(sequences, np.int32)
    n = sequences.shape[1]
    dtype = params["final_norm"].dtype
    nll, argmax = [], []
    for row in sequences:
        step, _ = contiguous_prefill(row[None], n, page_size)
        step = step._replace(logits_indices=np.arange(n - 1, dtype=np.int32))
        kv = allocate_kv_pages(
            config,
            2 + -(-n // page_size),
            page_size,
            dtype,
            stacked=layers_stacked(params),
            kv_cache_dtype=kv_cache_dtype,
        )
        nl, am = _scores(params, kv, step, jnp.asarray(row[1:]), config, attention_fn)
        nll.append(np.asarray(nl))
        argmax.append(np.asarray(am))
    return np.stack(nll), np.stack(argmax)


def text_windows(token_ids, window: int, num_windows: int) -> np.ndarray:
    """The first `num_windows` non-overlapping windows of `window` tokens -> [B, window]."""
    token_ids = np.asarray(token_ids, np.int32)
    have = len(token_ids) // window
    if have < num_windows:
        raise ValueError(f"the text has {have} windows of {window} tokens, {num_windows} wanted")
    return token_ids[: num_windows * window].reshape(num_windows, window)


def perplexity(params, config: ModelConfig, windows, kv_cache_dtype: str = "auto") -> float:
    nll, _ = teacher_forced(params, config, windows, kv_cache_dtype=kv_cache_dtype)
    return float(np.exp(nll.astype(np.float64).mean()))


def greedy_agreement(params, config: ModelConfig, sequences, prompt_len: int) -> float:
    """`sequences` [B, n]: prompts of `prompt_len` tokens + the reference's greedy continuation.
    -> the share of continuation tokens this model's argmax reproduces."""
    _, argmax = teacher_forced(params, config, sequences)
    predicted = argmax[:, prompt_len - 1 :]  # argmax at position t predicts token t + 1
    return float((predicted == np.asarray(sequences)[:, prompt_len:]).mean())

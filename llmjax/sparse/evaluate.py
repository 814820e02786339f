"""Accuracy of sparse KV fetching against full attention (InfiniGen's evaluation, ALGORITHMS.md
§11.5): perplexity on held-out text and greedy-token agreement, with the bytes each setting
fetches.

`teacher_forced` runs B equal-length token sequences through `sparse_forward` the way a server
would: one prefill of the first `prefix_len` tokens (full attention, as InfiniGen's prefill),
then one decode step per remaining token, fed the *given* next token (teacher forcing), so every
scored position attends through the sparse path with the history it would have when decoding.
It returns each scored position's negative log-likelihood of the next given token, the argmax
(the greedy token), and the KV rows fetched.

- Perplexity: exp(mean NLL) over held-out text.
- Greedy agreement: feed the full-attention model's own greedy continuation; the share of
  positions where the sparse setting's greedy token is the same (teacher-forced, so one early
  difference does not make every later position disagree).
- Free-running agreement: each setting generates greedily on its own (`greedy_continuations`
  with `sparse`); how many tokens equal full attention's before the first that differs
  (`agreed_prefix`).
- `decode` is the loop under both, greedy or teacher-forced, keeping each step's logits if
  asked (scripts/sparse_divergence.py's KL against full attention).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from llmjax.config import ModelConfig, SparseKVConfig
from llmjax.model.step_input import StepInput, contiguous_prefill
from llmjax.sparse import infinigen


@dataclasses.dataclass
class TeacherForced:
    nll: np.ndarray  # [B, n] -log p(next given token) at each scored position
    argmax: np.ndarray  # [B, n] the greedy token at each scored position
    rows: np.ndarray  # [B, n] KV rows (token x kv head, K and V) fetched, all layers
    sparse_steps: int

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


def greedy_agreement(run: TeacherForced, reference: TeacherForced) -> float:
    """The share of scored positions whose greedy token equals `reference`'s (runs over the same
    sequences; the last position has no next given token and is left out)."""
    return float((run.argmax[:, :-1] == reference.argmax[:, :-1]).mean())


def fetched_fraction(run: TeacherForced, reference: TeacherForced) -> float:
    """KV rows `run` fetched over the decode steps relative to `reference` (full attention); the
    prefill step's row, full for every setting, is left out."""
    return float(run.rows[:, 1:].sum() / reference.rows[:, 1:].sum())


def _steps(sequences: np.ndarray, prefix_len: int, page_size: int):
    """The prefill step, then one decode step per position: StepInputs for B sequences, each
    on its own run of pages (1 + b * pages_per_seq ...)."""
    B, n = sequences.shape
    prefill, tables = contiguous_prefill(sequences, prefix_len, page_size)

    def slots(b, pos):
        return tables[b, pos // page_size] * page_size + pos % page_size

    yield prefill
    for t in range(prefix_len, n - 1):
        yield StepInput(
            token_ids=sequences[:, t].astype(np.int32),
            positions=np.full(B, t, np.int32),
            slot_mapping=np.array([slots(b, t) for b in range(B)], np.int32),
            cu_q_lens=np.arange(B + 1, dtype=np.int32),
            kv_lens=np.full(B, t + 1, np.int32),
            page_indices=tables,
            num_seqs=np.array([B], np.int32),
            logits_indices=np.arange(B, dtype=np.int32),
        )


@functools.cache
def _step_fn(config: ModelConfig, sparse: SparseKVConfig, host: bool):
    """The jitted sparse step for one setting, built once (so the runs of one setting on other
    sequences of the same shape reuse its executable)."""
    return jax.jit(
        functools.partial(infinigen.sparse_forward, config=config, sparse=sparse, host=host),
        donate_argnums=(1, 2),
    )


def _setup(params, config: ModelConfig, sparse: SparseKVConfig, skew, B: int, n: int, G: int):
    """The jitted step of `sparse` and a fresh pool for B sequences of n tokens on pages of G
    -> (step_fn, pool, partial keys or bounds, speculation weights)."""
    dtype = params["final_norm"].dtype  # the activations' (weights may be packed)
    num_pages = 1 + B * -(-n // G)
    kind = infinigen.pool_memory_kind(sparse.pool_memory)
    pool = infinigen.allocate_pool(config, num_pages, G, dtype, kind)
    partial = infinigen.allocate_partial_keys(config, sparse, num_pages, G, dtype)
    weights = [None] * config.num_layers
    if sparse.mode == "infinigen":
        weights = infinigen.speculation_weights(*skew, config, sparse)
    return _step_fn(config, sparse, kind is not None), pool, partial, weights


def clear_compiled() -> None:
    """Drop every setting's compiled steps (a long grid of settings otherwise runs out of
    executable memory: LLVM's section mappings)."""
    _step_fn.cache_clear()
    jax.clear_caches()


@jax.jit
def _score(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return nll, jnp.argmax(logits, axis=-1)


def teacher_forced(
    params,
    config: ModelConfig,
    sparse: SparseKVConfig,
    skew,
    sequences,
    prefix_len: int,
    page_size: int = 16,
) -> TeacherForced:
    """Score positions prefix_len - 1 .. n - 2 of every sequence ([B, n] token ids) under
    `sparse` ('offload' is exact full attention). `skew`: (A, energy) for 'infinigen'."""
    sequences = np.asarray(sequences)
    B, n = sequences.shape
    if not 0 < prefix_len < n:
        raise ValueError(f"{prefix_len=} must be in (0, {n}) for sequences of {n} tokens")
    step_fn, pool, partial, weights = _setup(params, config, sparse, skew, B, n, page_size)
    score = _score
    nll, argmax, rows = [], [], []
    sparse_steps = 0
    row_per_token = config.num_kv_heads  # rows per cached token and layer
    for i, step in enumerate(_steps(sequences, prefix_len, page_size)):
        logits, pool, partial, stats = step_fn(params, pool, partial, weights, step)
        t = prefix_len - 1 + i  # the position whose next token these logits predict
        nl, am = score(logits, jnp.asarray(sequences[:, t + 1]))
        nll.append(np.asarray(nl))
        argmax.append(np.asarray(am))
        is_sparse = bool(stats.sparse)
        sparse_steps += is_sparse
        dense_layers = sparse.num_dense_layers if is_sparse else config.num_layers
        fetched = dense_layers * row_per_token * (t + 1) + np.asarray(stats.rows)[:B]
        rows.append(fetched)
    return TeacherForced(
        nll=np.stack(nll, axis=1),
        argmax=np.stack(argmax, axis=1),
        rows=np.stack(rows, axis=1),
        sparse_steps=sparse_steps,
    )


def decode(
    params,
    config: ModelConfig,
    prompts,
    num_tokens: int,
    page_size: int = 16,
    sparse: SparseKVConfig | None = None,
    skew=None,
    forced=None,
    keep_logits: bool = False,
):
    """Decode `num_tokens` after each prompt ([B, n] token ids) -> (tokens [B, num_tokens], the
    next-token logits [B, num_tokens, V] float32 if `keep_logits`, else None): one prefill, then
    one decode step per token, each fed back as a server would: greedily, or `forced` ([B,
    num_tokens]: teacher forcing, the logits then scored against it). Under full attention by
    default, else under `sparse` (`skew`: (A, energy) for 'infinigen')."""
    prompts = np.asarray(prompts)
    B, n = prompts.shape
    seqs = np.concatenate([prompts, np.zeros((B, num_tokens), prompts.dtype)], axis=1)
    if forced is not None:
        seqs[:, n:] = forced
    if sparse is None:
        sparse = SparseKVConfig(mode="offload", pool_memory="device")
    step_fn, pool, partial, weights = _setup(
        params, config, sparse, skew, B, seqs.shape[1], page_size
    )
    steps = _steps(seqs, n, page_size)
    tokens, logits_out = np.zeros((B, num_tokens), prompts.dtype), []
    for i in range(num_tokens):
        step = next(steps)
        if i > 0:  # the decode step feeds the token chosen (or forced) last
            step = step._replace(token_ids=seqs[:, n - 1 + i].astype(np.int32))
        logits, pool, partial, _ = step_fn(params, pool, partial, weights, step)
        tokens[:, i] = np.asarray(jnp.argmax(logits, axis=-1))[:B]
        if keep_logits:
            logits_out.append(np.asarray(logits[:B], np.float32))
        if forced is None:
            seqs[:, n + i] = tokens[:, i]
    return tokens, np.stack(logits_out, axis=1) if keep_logits else None


def greedy_continuations(
    params,
    config: ModelConfig,
    prompts,
    num_tokens: int,
    page_size: int = 16,
    sparse: SparseKVConfig | None = None,
    skew=None,
):
    """The greedy continuation of each prompt ([B, n] token ids) -> [B, n + num_tokens]: under
    full attention by default (the sequences on which greedy agreement is measured), or
    free-running under `sparse` (`skew`: (A, energy) for 'infinigen'), each token fed back as
    a server would."""
    prompts = np.asarray(prompts)
    tokens, _ = decode(params, config, prompts, num_tokens, page_size, sparse, skew)
    return np.concatenate([prompts, tokens], axis=1)


def agreed_prefix(run: np.ndarray, reference: np.ndarray, prompt_len: int) -> np.ndarray:
    """Free-running agreement: per sequence, how many generated tokens of `run` ([B, n]) equal
    `reference`'s before the first that differs (all of them if none does)."""
    a, b = np.asarray(run)[:, prompt_len:], np.asarray(reference)[:, prompt_len:]
    same = a == b
    return np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))

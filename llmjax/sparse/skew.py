"""InfiniGen's offline attention skewing (ALGORITHMS.md §11.1; `gen_llama_skewing_matrix.py`).

For each layer and kv head, one calibration prefill gives the post-RoPE queries Q_h and keys
K_h of that head. From their SVDs

    _, S_q, V_q^T = svd(Q_h);  _, S_k, _ = svd(K_h)
    s = S_q * S_k;  ind = argsort(s)          (ascending)
    A_h[:, ind[j]] = V_q[:, j]                 (A_h: V_q with its columns permuted)

A_h is orthogonal, so (Q A)(K A)^T = Q K^T: attention is unchanged, but the energy of Q A (and,
when K's dominant directions follow Q's, of K A) sits in a few columns, the ones the speculation
keeps (`partial_weight_ratio` of them). With RoPE the rotation depends on the position, so A
cannot be folded into W_q / W_k (as InfiniGen does for OPT): for Llama-family models it is applied
to q and k after RoPE, on the prediction path only.

GQA (our choice; InfiniGen's models are multi-head): one A per *kv head*, from the SVD of the
queries of all its query heads stacked ([Q * n, H]) and of its keys [n, H], because the partial
key cache holds skewed keys, and a key is shared by its group. With one query per kv head this is
exactly InfiniGen's per-head matrix. The partial key cache then holds `partial_weight_ratio` of
the key cache, as in the paper.

Besides A, calibration records each skewed column's energy sum_t |Q A|[t, col] over the group's
queries ([L, K, H]): the speculation keeps the top `partial_weight_ratio * H` columns (InfiniGen's
`partial_weight_index_generation`; fixed offline, as its accuracy code does, so chunked prefill
and shared prefix pages see one index).

Layout: A [L, K, H, H] float32 (layer, kv head, in, out), energy [L, K, H]. `save_skew` /
`load_skew` keep them in one .npz file (with the calibration's token count) beside a checkpoint.
"""

from __future__ import annotations

import os

import numpy as np

from llmjax.config import ModelConfig

SKEW_FILE = "infinigen_skew.npz"


def skewing_matrix(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [m, H], k [n, H] (one head's post-RoPE queries and keys, n >= H; m may stack a GQA
    group's queries) -> A [H, H], orthogonal."""
    n, H = k.shape
    if n < H or q.shape[1] != H:
        raise ValueError(
            f"skewing needs as many calibration tokens as the head dim, and q and k alike: "
            f"{q.shape=} {k.shape=}"
        )
    s_q, v_q = _right_singular(np.asarray(q, np.float64))
    s_k, _ = _right_singular(np.asarray(k, np.float64))
    ind = np.argsort(s_q * s_k, kind="stable")
    A = np.empty((H, H))
    A[:, ind] = v_q  # A[:, ind[j]] = V_q[:, j]
    return A


def _right_singular(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, H] -> (singular values descending [H], right singular vectors as columns [H, H]),
    from the eigendecomposition of the H x H Gram matrix (an SVD of the tall x took 0.2-0.5 s
    per head on a 2-core CPU; this is ~10x less). Columns' signs are arbitrary, as in an SVD."""
    w, v = np.linalg.eigh(x.T @ x)
    order = np.argsort(w, kind="stable")[::-1]
    return np.sqrt(np.clip(w[order], 0, None)), v[:, order]


def skewing_matrices(queries, keys, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer post-RoPE queries [n, N, H] and keys [n, K, H] -> (A [L, K, H, H], energy
    [L, K, H]) float32: per kv head, the skew of its group's stacked queries and its keys, and
    sum_t |Q A| per skewed column."""
    K, H = config.num_kv_heads, config.head_dim
    Q = config.num_heads // K
    L = len(queries)
    skew, energy = np.empty((L, K, H, H), np.float32), np.empty((L, K, H), np.float32)
    for layer, (q, k) in enumerate(zip(queries, keys, strict=True)):
        q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
        n = q.shape[0]
        for g in range(K):
            q_group = q[:, g * Q : (g + 1) * Q].transpose(1, 0, 2).reshape(Q * n, H)
            A = skewing_matrix(q_group, k[:, g])
            skew[layer, g] = A
            energy[layer, g] = np.abs(q_group.astype(np.float64) @ A).sum(axis=0)
    return skew, energy


def partial_columns(energy: np.ndarray, partial_weight_ratio: float) -> np.ndarray:
    """energy [L, K, H] -> the kept skewed columns [L, K, c], c = max(1, round(ratio * H)),
    most energetic first (InfiniGen: 26 of 128 dims at 0.2)."""
    H = energy.shape[-1]
    c = max(1, min(H, round(partial_weight_ratio * H)))
    return np.argsort(-energy, axis=-1, kind="stable")[..., :c].astype(np.int32)


def collect_qk(params, config: ModelConfig, token_ids, page_size: int = 16):
    """Run one prefill of `token_ids` (jitted, with the jnp reference attention) and return the
    post-RoPE queries [n, N, H] and keys [n, K, H] of every layer, as numpy arrays."""
    import jax

    from llmjax.model.attention import reference_attention
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.params import unstack_layers
    from llmjax.model.step_input import contiguous_prefill

    params = unstack_layers(params)  # the unrolled loop: each layer's q, k recorded
    n = len(token_ids)
    step, _ = contiguous_prefill([list(token_ids)], n, page_size)  # pages 1.. (0: the sink)
    pages = -(-n // page_size)

    def run(params, kv, step):
        queries, keys = [], []

        def recording(q, k_pages, v_pages, step, *, new_kv=None, **kw):
            queries.append(q.astype(np.float32))
            keys.append(new_kv[0].astype(np.float32))
            return reference_attention(q, k_pages, v_pages, step, **kw)

        forward(params, kv, step, config, recording)
        return queries, keys

    dtype = params["final_norm"].dtype  # the activations' (weights may be packed)
    kv = allocate_kv_pages(config, pages + 1, page_size, dtype)
    queries, keys = jax.jit(run)(params, kv, step)
    return [np.asarray(q) for q in queries], [np.asarray(k) for k in keys]


def calibrate(params, config: ModelConfig, token_ids) -> tuple[np.ndarray, np.ndarray]:
    """(A [L, K, H, H], energy [L, K, H]) from one calibration prefill of `token_ids` (>=
    head_dim tokens; InfiniGen used the first 2048 tokens of a PG-19 book)."""
    if len(token_ids) < config.head_dim:
        raise ValueError(
            f"calibration needs at least head_dim={config.head_dim} tokens, got {len(token_ids)}"
        )
    return skewing_matrices(*collect_qk(params, config, token_ids), config)


def calibration_tokens(tokenizer, vocab_size: int, n: int) -> list[int]:
    """The first `n` tokens of the bundled public-domain text (llmjax/data/), tokenized;
    without a tokenizer (dummy weights), its bytes folded into the vocabulary."""
    from llmjax.data.texts import text_token_ids

    ids = text_token_ids(tokenizer, vocab_size)
    if len(ids) < n:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {n=}")
    return ids[:n]


def calibrate_on_text(params, config: ModelConfig, tokenizer, n: int = 2048):
    """`calibrate` on the first `n` tokens of the bundled public-domain text (InfiniGen: 2048
    tokens of PG-19's first book)."""
    return calibrate(params, config, calibration_tokens(tokenizer, config.vocab_size, n))


def save_skew(
    directory: str, skew: np.ndarray, energy: np.ndarray, num_calibration_tokens: int
) -> str:
    """Write A and the column energies beside a checkpoint: <directory>/infinigen_skew.npz.
    Returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SKEW_FILE)
    np.savez(path, skew=skew, energy=energy, num_calibration_tokens=num_calibration_tokens)
    return path


def load_skew(directory: str, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Read (A, energy) for `config` from <directory>/infinigen_skew.npz, checking shapes."""
    path = os.path.join(directory, SKEW_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: calibrate first (llmjax.sparse.skew.calibrate + save_skew)"
        )
    try:
        with np.load(path) as f:
            skew, energy = f["skew"], f["energy"]
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(f"{path} is not a skew file written by save_skew: {e}") from e
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    if skew.shape != (L, K, H, H) or energy.shape != (L, K, H):
        raise ValueError(
            f"{path}: skew {skew.shape} / energy {energy.shape}, expected {(L, K, H, H)} / "
            f"{(L, K, H)} for this model"
        )
    return skew, energy

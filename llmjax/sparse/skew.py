"""InfiniGen's offline attention skewing (ALGORITHMS.md §11.1; `gen_llama_skewing_matrix.py`).

For each layer and query head, one calibration prefill gives the post-RoPE queries Q_h and keys
K_h [n, H] (for GQA, K_h is the head's kv head). From their SVDs

    _, S_q, V_q^T = svd(Q_h);  _, S_k, _ = svd(K_h)
    s = S_q * S_k;  ind = argsort(s)          (ascending)
    A_h[:, ind[j]] = V_q[:, j]                 (A_h: V_q with its columns permuted)

A_h is orthogonal, so (Q A)(K A)^T = Q K^T: attention is unchanged, but the energy of Q A (and,
when K's dominant directions follow Q's, of K A) sits in a few columns, the ones the speculation
keeps (`partial_weight_ratio` of them). With RoPE the rotation depends on the position, so A
cannot be folded into W_q / W_k (as InfiniGen does for OPT): for Llama-family models it is applied
to q and k after RoPE, on the prediction path only.

Layout: A [L, N, H, H] float32 (layer, query head, in, out). `save_skew` / `load_skew` keep it in
one .npz file (with the calibration's token count) beside a checkpoint.
"""

from __future__ import annotations

import os

import numpy as np

from llmjax.config import ModelConfig

SKEW_FILE = "infinigen_skew.npz"


def skewing_matrix(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q, k [n, H] (one head's post-RoPE queries and keys, n >= H) -> A [H, H], orthogonal."""
    n, H = q.shape
    if n < H or k.shape != q.shape:
        raise ValueError(
            f"skewing needs as many calibration tokens as the head dim, and q and k alike: "
            f"{q.shape=} {k.shape=}"
        )
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    _, s_q, vt_q = np.linalg.svd(q64, full_matrices=False)  # vt_q [H, H], rows = V_q columns
    s_k = np.linalg.svd(k64, compute_uv=False)
    ind = np.argsort(s_q * s_k, kind="stable")
    A = np.empty((H, H))
    A[:, ind] = vt_q.T  # A[:, ind[j]] = V_q[:, j]
    return A


def skewing_matrices(queries, keys, config: ModelConfig) -> np.ndarray:
    """Per-layer post-RoPE queries [n, N, H] and keys [n, K, H] -> A [L, N, H, H] float32."""
    Q = config.num_heads // config.num_kv_heads
    out = np.empty((len(queries), config.num_heads, config.head_dim, config.head_dim), np.float32)
    for layer, (q, k) in enumerate(zip(queries, keys, strict=True)):
        q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
        for h in range(config.num_heads):
            out[layer, h] = skewing_matrix(q[:, h], k[:, h // Q])
    return out


def collect_qk(params, config: ModelConfig, token_ids, page_size: int = 16):
    """Run one prefill of `token_ids` (eagerly, with the jnp reference attention) and return the
    post-RoPE queries [n, N, H] and keys [n, K, H] of every layer, as numpy arrays."""
    from llmjax.model.attention import reference_attention
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.step_input import StepInput

    n = len(token_ids)
    pages = -(-n // page_size)
    step = StepInput(
        token_ids=np.asarray(token_ids, np.int32),
        positions=np.arange(n, dtype=np.int32),
        slot_mapping=np.arange(page_size, page_size + n, dtype=np.int32),  # pages 1.. (0: sink)
        cu_q_lens=np.array([0, n], np.int32),
        kv_lens=np.array([n], np.int32),
        page_indices=np.arange(1, 1 + pages, dtype=np.int32)[None],
        num_seqs=np.array([1], np.int32),
        logits_indices=np.array([n - 1], np.int32),
    )
    queries, keys = [], []

    def recording(q, k_pages, v_pages, step, *, sm_scale, sliding_window=None, new_kv=None):
        queries.append(np.asarray(q, np.float32))
        keys.append(np.asarray(new_kv[0], np.float32))
        return reference_attention(
            q, k_pages, v_pages, step, sm_scale=sm_scale, sliding_window=sliding_window
        )

    dtype = np.asarray(params["embed"]).dtype
    kv = allocate_kv_pages(config, pages + 1, page_size, dtype)
    forward(params, kv, step, config, recording)
    return queries, keys


def calibrate(params, config: ModelConfig, token_ids) -> np.ndarray:
    """A [L, N, H, H] from one calibration prefill of `token_ids` (>= head_dim tokens; InfiniGen
    used the first 2048 tokens of a PG-19 book)."""
    if len(token_ids) < config.head_dim:
        raise ValueError(
            f"calibration needs at least head_dim={config.head_dim} tokens, got {len(token_ids)}"
        )
    return skewing_matrices(*collect_qk(params, config, token_ids), config)


def save_skew(directory: str, skew: np.ndarray, num_calibration_tokens: int) -> str:
    """Write A beside a checkpoint: <directory>/infinigen_skew.npz. Returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SKEW_FILE)
    np.savez(path, skew=skew, num_calibration_tokens=num_calibration_tokens)
    return path


def load_skew(directory: str, config: ModelConfig) -> np.ndarray:
    """Read A for `config` from <directory>/infinigen_skew.npz, checking its shape."""
    path = os.path.join(directory, SKEW_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: calibrate first (llmjax.sparse.skew.calibrate + save_skew)"
        )
    with np.load(path) as f:
        skew = f["skew"]
    want = (config.num_layers, config.num_heads, config.head_dim, config.head_dim)
    if skew.shape != want:
        raise ValueError(f"{path}: skew has shape {skew.shape}, expected {want} for this model")
    return skew

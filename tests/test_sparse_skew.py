"""InfiniGen's offline skewing (llmjax/sparse/skew.py): the matrix is orthogonal, leaves QK^T
unchanged, is V_q with columns permuted as InfiniGen's code does, concentrates the query's energy
in few columns; calibration on the tiny model and the file beside a checkpoint."""

import jax
import numpy as np
import pytest

import configs
from llmjax.model.params import init_params
from llmjax.sparse.skew import (
    calibrate,
    collect_qk,
    load_skew,
    save_skew,
    skewing_matrices,
    skewing_matrix,
)


def _anisotropic(rng, n, H, decay=0.7):
    """Rows with energy decaying over a random orthogonal basis (as real queries have)."""
    basis, _ = np.linalg.qr(rng.standard_normal((H, H)))
    return (rng.standard_normal((n, H)) * decay ** np.arange(H)) @ basis.T


def _best_columns_energy(x, k):
    energy = (x**2).sum(axis=0)
    return np.sort(energy)[::-1][:k].sum() / energy.sum()


@pytest.mark.parametrize("n, H", [(64, 16), (200, 64), (16, 16)])
def test_orthogonal_and_attention_logits_unchanged(n, H):
    rng = np.random.default_rng(n + H)
    q, k = _anisotropic(rng, n, H), _anisotropic(rng, n, H, decay=0.8)
    A = skewing_matrix(q, k)
    np.testing.assert_allclose(A @ A.T, np.eye(H), atol=1e-12)
    np.testing.assert_allclose((q @ A) @ (k @ A).T, q @ k.T, atol=1e-9)


def test_columns_are_v_q_permuted_by_the_product_of_singular_values():
    rng = np.random.default_rng(0)
    q, k = _anisotropic(rng, 80, 8), _anisotropic(rng, 80, 8, decay=0.9)
    _, s_q, vt_q = np.linalg.svd(q, full_matrices=False)
    s_k = np.linalg.svd(k, compute_uv=False)
    ind = np.argsort(s_q * s_k)
    A = skewing_matrix(q, k)
    for j in range(8):
        np.testing.assert_allclose(A[:, ind[j]], vt_q[j], atol=1e-12)


def test_skewed_queries_hold_more_energy_in_their_best_columns():
    """InfiniGen keeps partial_weight_ratio = 0.2 of the columns: after skewing they carry most
    of the query's energy (Eckart-Young: never less than before)."""
    rng = np.random.default_rng(1)
    H, keep = 64, 13
    q, k = _anisotropic(rng, 256, H), _anisotropic(rng, 256, H)
    A = skewing_matrix(q, k)
    before, after = _best_columns_energy(q, keep), _best_columns_energy(q @ A, keep)
    assert after >= before
    assert after > 0.95 and before < 0.6, (before, after)


def test_errors():
    with pytest.raises(ValueError, match="as many calibration tokens as the head dim"):
        skewing_matrix(np.ones((8, 16)), np.ones((8, 16)))
    params = init_params(configs.TINY, jax.random.key(0))
    with pytest.raises(ValueError, match="at least head_dim=16 tokens"):
        calibrate(params, configs.TINY, list(range(3, 10)))


def test_calibrate_tiny_model_and_store_it_beside_the_checkpoint(tmp_path):
    config = configs.TINY  # 4 query heads over 2 kv heads, head dim 16
    params = init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(3, 256, 40).tolist()
    skew = calibrate(params, config, tokens)
    assert skew.shape == (2, 4, 16, 16) and skew.dtype == np.float32
    queries, keys = collect_qk(params, config, tokens)
    assert queries[0].shape == (40, 4, 16) and keys[0].shape == (40, 2, 16)
    np.testing.assert_array_equal(skew, skewing_matrices(queries, keys, config))
    for layer in range(2):
        for h in range(4):
            A = skew[layer, h].astype(np.float64)
            q, k = queries[layer][:, h], keys[layer][:, h // 2]  # GQA: its kv head
            np.testing.assert_allclose(A @ A.T, np.eye(16), atol=1e-5)
            np.testing.assert_allclose((q @ A) @ (k @ A).T, q @ k.T, rtol=1e-4, atol=1e-4)
    save_skew(str(tmp_path), skew, len(tokens))
    np.testing.assert_array_equal(load_skew(str(tmp_path), config), skew)
    with pytest.raises(ValueError, match=r"expected \(5, 4, 16, 16\)"):
        load_skew(str(tmp_path), configs.TINY_DEEP)
    with pytest.raises(FileNotFoundError, match="calibrate first"):
        load_skew(str(tmp_path / "elsewhere"), config)

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
    calibration_tokens,
    collect_qk,
    load_skew,
    partial_columns,
    save_skew,
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
    for j in range(8):  # singular vectors are defined up to their sign
        np.testing.assert_allclose(abs(A[:, ind[j]] @ vt_q[j]), 1.0, atol=1e-9)


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
    skew, energy = calibrate(params, config, tokens)
    assert skew.shape == (2, 2, 16, 16) and skew.dtype == np.float32
    assert energy.shape == (2, 2, 16)
    queries, keys = collect_qk(params, config, tokens)
    assert queries[0].shape == (40, 4, 16) and keys[0].shape == (40, 2, 16)
    for layer in range(2):
        for g in range(2):  # per kv head, from its group's stacked queries (GQA)
            A = skew[layer, g].astype(np.float64)
            q = queries[layer][:, 2 * g : 2 * g + 2].reshape(-1, 16)
            k = keys[layer][:, g]
            np.testing.assert_allclose(A @ A.T, np.eye(16), atol=1e-5)
            np.testing.assert_allclose((q @ A) @ (k @ A).T, q @ k.T, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(energy[layer, g], np.abs(q @ A).sum(0), rtol=1e-4)
    # the kept columns are the most energetic ones, 0.2 * 16 -> 3 of them
    cols = partial_columns(energy, 0.2)
    assert cols.shape == (2, 2, 3)
    for layer in range(2):
        for g in range(2):
            e = energy[layer, g]
            assert set(cols[layer, g]) == set(np.argsort(-e)[:3])
    save_skew(str(tmp_path), skew, energy, len(tokens))
    loaded = load_skew(str(tmp_path), config)
    np.testing.assert_array_equal(loaded[0], skew)
    np.testing.assert_array_equal(loaded[1], energy)
    with pytest.raises(ValueError, match=r"expected \(5, 2, 16, 16\)"):
        load_skew(str(tmp_path), configs.TINY_DEEP)
    with pytest.raises(FileNotFoundError, match="calibrate first"):
        load_skew(str(tmp_path / "elsewhere"), config)
    (tmp_path / "bad").mkdir()
    np.savez(tmp_path / "bad" / "infinigen_skew.npz", other=np.zeros(3))
    with pytest.raises(ValueError, match="not a skew file"):
        load_skew(str(tmp_path / "bad"), config)


def test_calibration_text_is_the_bundled_public_domain_book():
    from llmjax.data.texts import public_domain_text

    ids = calibration_tokens(None, 256, 100)
    assert len(ids) == 100 and max(ids) < 256
    assert bytes(ids[:20]).decode() == public_domain_text()[:20]
    with pytest.raises(ValueError, match="fewer than"):
        calibration_tokens(None, 256, 10**7)

"""llmjax/viz/sparse.py: the energy helpers against the skew of llmjax/sparse/skew.py, the traced
prefill against collect_qk, the speculation's math (with the true query it reproduces the true
logits) and selection (the engine's), the accuracy summary, and what each plot draws."""

import jax
import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

import configs  # noqa: E402
from llmjax.config import SparseKVConfig  # noqa: E402
from llmjax.model.params import abstract_params  # noqa: E402
from llmjax.sparse.evaluate import TeacherForced  # noqa: E402
from llmjax.sparse.skew import collect_qk, skewing_matrices, skewing_matrix  # noqa: E402
from llmjax.viz import sparse as viz  # noqa: E402

CFG = configs.TINY  # 2 layers, 4 query heads over 2 kv heads, head dim 16


def low_rank_qk(seed=0, n=200, H=16, rank=3):
    """Queries and keys living mostly in one shared rank-3 subspace, in a random basis."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(H, H)))[0]
    scales = np.r_[np.full(rank, 5.0), np.full(H - rank, 0.1)]
    q = (rng.normal(size=(n, H)) * scales) @ basis.T
    k = (rng.normal(size=(n, H)) * scales) @ basis.T
    return q, k


def test_energy_helpers_and_the_skew():
    q, k = low_rank_qk()
    A = skewing_matrix(q, k)
    e = viz.column_energy(q)
    assert e.shape == (16,) and e.sum() == pytest.approx(1.0)
    cum = viz.cumulative_energy(q)
    assert np.all(np.diff(cum) >= -1e-12) and cum[-1] == pytest.approx(1.0)
    np.testing.assert_allclose(viz.singular_values(q @ A), viz.singular_values(q), atol=1e-9)
    assert viz.singular_values(q)[0] == 1.0
    # the skew puts the shared subspace into 3 columns, of Q and of K
    assert viz.cumulative_energy(q @ A)[2] > 0.99 > viz.cumulative_energy(q)[2]
    assert viz.cumulative_energy(k @ A)[2] > 0.99 > viz.cumulative_energy(k)[2]


def test_group_queries_and_kept_energy_follow_skewing_matrices():
    rng = np.random.default_rng(1)
    L, n, N, K, H = 2, 40, 4, 2, 16
    queries = [rng.normal(size=(n, N, H)) for _ in range(L)]
    keys = [rng.normal(size=(n, K, H)) for _ in range(L)]
    q0, k0 = low_rank_qk(n=n)
    keys[1][:, 1] = k0  # one low-rank head
    for h in (2, 3):
        queries[1][:, h] = q0
    cfg = CFG.replace(num_layers=L, num_heads=N, num_kv_heads=K, hidden_size=N * H)
    skew, energy = skewing_matrices(queries, keys, cfg)
    for layer in range(L):
        for g in range(K):
            grouped = viz.group_queries(queries[layer], g, K)
            assert grouped.shape == (2 * n, H)
            np.testing.assert_allclose(
                np.abs(grouped @ skew[layer, g]).sum(axis=0), energy[layer, g], rtol=1e-4
            )
    kept = viz.kept_energy(queries, keys, skew, energy, 0.2, K)
    assert set(kept) == {"q_before", "q_after", "k_before", "k_after"}
    assert all(v.shape == (L, K) for v in kept.values())
    assert kept["q_after"][1, 1] > 0.95 and kept["k_after"][1, 1] > 0.95
    assert kept["q_before"][1, 1] < 0.8


def test_skew_plots_draw_the_curves():
    q, k = low_rank_qk(2)
    A = skewing_matrix(q, k)
    ax = viz.plot_skew_energy(q, k, A, 0.2)
    lines = {line.get_label(): line for line in ax.lines}
    np.testing.assert_allclose(lines["Q before"].get_ydata(), viz.cumulative_energy(q))
    np.testing.assert_allclose(lines["K skewed"].get_ydata(), viz.cumulative_energy(k @ A))
    assert lines["3 kept columns"].get_xdata()[0] == 3
    ax = viz.plot_singular_values(q, k)
    np.testing.assert_allclose(ax.lines[1].get_ydata(), viz.singular_values(k))
    fig = viz.plot_column_magnitudes(q, A, num_tokens=50)
    images = [a.get_images()[0].get_array() for a in fig.axes]
    assert images[0].shape == (50, 16)
    np.testing.assert_allclose(np.sort(images[1][0]), np.sort(np.abs(q @ A)[0]))
    kept = {
        name: np.random.default_rng(3).uniform(size=(4, 2))
        for name in ("q_before", "q_after", "k_before", "k_after")
    }
    ax = viz.plot_kept_energy(kept)
    np.testing.assert_allclose(ax.lines[0].get_ydata(), kept["q_after"].mean(axis=1))
    plt.close("all")


@pytest.fixture(scope="module")
def traced():
    # random weights from numpy (init_params takes seconds of op-by-op dispatch); norms near 1
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (
            (1.0 + 0.1 * rng.normal(size=s.shape))
            if len(s.shape) == 1
            else 0.3 * rng.normal(size=s.shape)
        ),
        abstract_params(CFG),
    )
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    tokens = np.random.default_rng(0).integers(3, 256, 24).tolist()
    return params, tokens, viz.trace_prefill(params, CFG, tokens, page_size=8)


def test_trace_prefill_matches_collect_qk(traced):
    params, tokens, trace = traced
    queries, keys = collect_qk(params, CFG, tokens, page_size=8)
    assert len(trace.attn_inputs) == CFG.num_layers
    assert trace.attn_inputs[0].shape == (24, CFG.hidden_size)
    for layer in range(CFG.num_layers):
        np.testing.assert_allclose(trace.queries[layer], queries[layer], atol=1e-5)
        np.testing.assert_allclose(trace.keys[layer], keys[layer], atol=1e-5)


def test_speculation_math_and_selection(traced):
    params, _, trace = traced
    skew, energy = skewing_matrices(trace.queries, trace.keys, CFG)
    layer, position = 1, 23
    everything = SparseKVConfig(
        mode="infinigen", alpha=1e9, max_num_kv=None, partial_weight_ratio=1.0
    )
    # With the layer's own attention input and every column kept, the speculated logits are
    # the true ones (the skew is orthogonal): the speculation's query and keys are right.
    exact = viz.PrefillTrace(list(trace.attn_inputs), trace.queries, trace.keys)
    exact.attn_inputs[layer - 1] = trace.attn_inputs[layer]
    spec = viz.speculation(exact, params, CFG, skew, energy, everything, layer, position, 8)
    K = CFG.num_kv_heads
    true_max = spec.true_logits.reshape(K, -1, position + 1).max(axis=1)
    np.testing.assert_allclose(spec.predicted_logits, true_max, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(spec.true_probs.sum(axis=1), 1.0, rtol=1e-6)
    assert spec.selected.all()  # alpha huge, no cap: everything
    np.testing.assert_allclose(viz.attention_recall(spec.true_probs, spec.selected), 1.0, 1e-6)
    # InfiniGen's setting: sinks, recent and own row always; the rest capped
    sparse = SparseKVConfig(mode="infinigen", alpha=2.0, max_num_kv=5, num_recent_tokens=4)
    spec = viz.speculation(trace, params, CFG, skew, energy, sparse, layer, position, 8)
    assert spec.selected[:, [0, 20, 21, 22, 23]].all()
    assert (spec.selected.sum(axis=1) <= 1 + 4 + 5).all()
    recall = viz.attention_recall(spec.true_probs, spec.selected)
    assert recall.shape == (CFG.num_heads,) and (recall > 0).all() and (recall < 1).all()
    # no skew: identity matrices, the raw columns' energies (the ablation)
    eye, raw = viz.unskewed(trace.queries, K)
    assert eye.shape == skew.shape and raw.shape == energy.shape
    np.testing.assert_allclose(raw[1, 0], np.abs(viz.group_queries(trace.queries[1], 0, K)).sum(0))
    plain = viz.speculation(exact, params, CFG, eye, raw, everything, layer, position, 8)
    np.testing.assert_allclose(plain.predicted_logits, true_max, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="layer 0"):
        viz.speculation(trace, params, CFG, skew, energy, sparse, 0, position, 8)


def test_speculation_plots():
    rng = np.random.default_rng(4)
    N, K, C = 4, 2, 30
    logits = rng.normal(size=(N, C))
    selected = rng.uniform(size=(K, C)) < 0.3
    spec = viz.Speculation(
        3, C - 1, logits, viz._softmax(logits), rng.normal(size=(K, C)), selected
    )
    fig = viz.plot_attention_maps(spec, tokens=[f"t{i}" for i in range(C)])
    images = [a.get_images()[0].get_array() for a in fig.axes]
    np.testing.assert_allclose(images[0], spec.true_probs.reshape(K, 2, C).max(axis=1))
    np.testing.assert_allclose(images[1].sum(axis=1), 1.0, rtol=1e-6)  # speculated softmax
    np.testing.assert_array_equal(images[2], selected.astype(float))
    top = viz.top_tokens(spec, [f"t{i}" for i in range(C)], 2)
    assert top[0][0] == int(np.argmax(spec.true_probs.max(axis=0)))
    assert f"'{top[0][1]}'@{top[0][0]}" in fig.axes[0].get_title(loc="left")
    # quality: a perfect speculation correlates 1; a selection of everything recalls 1
    perfect = viz.Speculation(
        3,
        C - 1,
        logits,
        viz._softmax(logits),
        logits.reshape(K, 2, C).max(axis=1),
        np.ones((K, C), bool),
    )
    quality = viz.speculation_quality(perfect, num_sink_tokens=1, num_recent_tokens=4)
    np.testing.assert_allclose(quality["correlation"], 1.0)
    np.testing.assert_allclose(quality["candidate_recall"], 1.0)
    quality = viz.speculation_quality(spec, num_sink_tokens=1, num_recent_tokens=4)
    cand = np.zeros(C, bool)
    cand[1 : C - 4] = True  # not the sink (0), not the recent window (C-4 .. C-1)
    head = spec.true_probs[2, cand]
    expected = (head * selected[1, cand]).sum() / head.sum()  # query head 2 -> kv head 1
    assert quality["candidate_recall"][2] == pytest.approx(expected)
    assert quality["correlation"].shape == (K,)
    ax = viz.plot_speculation_scatter(spec, kv_head=1)
    fetched, other = ax.collections[1].get_offsets(), ax.collections[0].get_offsets()
    assert len(fetched) == selected[1].sum() and len(other) == C - selected[1].sum()
    np.testing.assert_allclose(fetched[:, 1], spec.predicted_logits[1][selected[1]])
    recall = {"skewed": rng.uniform(size=(3, N)), "not skewed": rng.uniform(size=(3, N))}
    ax = viz.plot_by_layer([2, 3, 4], recall, "recall", [0.2, 0.3, 0.25])
    lines = {line.get_label(): line for line in ax.lines}
    np.testing.assert_allclose(lines["not skewed"].get_ydata(), recall["not skewed"].mean(axis=1))
    np.testing.assert_allclose(lines["rows fetched"].get_ydata(), [0.2, 0.3, 0.25])
    assert len(ax.collections) == 2  # the bands
    plt.close("all")


def _run(rows, argmax, nll):
    return TeacherForced(
        nll=np.asarray(nll, float), argmax=np.asarray(argmax), rows=np.asarray(rows), sparse_steps=3
    )


def test_accuracy_rows_and_plots():
    full_p = _run([[100, 10, 10, 10]], [[1, 2, 3, 4]], [[1.0, 1.0, 1.0, 1.0]])
    full_g = _run([[100, 10, 10, 10]], [[5, 6, 7, 8]], [[0.5] * 4])
    rows = [
        viz.accuracy_row("full", SparseKVConfig(mode="offload"), full_p, full_g, full_p, full_g)
    ]
    assert rows[0]["fetched_fraction"] == 1.0 and rows[0]["greedy_agreement"] == 1.0
    for granularity in ("token", "page"):
        for alpha, fetched, agree in (
            (1.0, [2, 2, 2], [5, 0, 0, 9]),
            (5.0, [5, 5, 5], [5, 6, 0, 0]),
        ):
            sparse = SparseKVConfig(mode="infinigen", alpha=alpha, granularity=granularity)
            p = _run([[100, *fetched]], [[1, 2, 3, 4]], [[1.0, 2.0, 1.0, 1.0]])
            g = _run([[100, *fetched]], [agree], [[0.5] * 4])
            rows.append(viz.accuracy_row(f"{granularity} {alpha}", sparse, p, g, full_p, full_g))
    both = _run([[1, 2], [3, 4], [5, 6]], [[1, 1], [2, 2], [3, 3]], [[0.0] * 2] * 3)
    text, cont = viz.split_run(both, 1)
    assert text.rows.tolist() == [[1, 2]] and cont.argmax.tolist() == [[2, 2], [3, 3]]
    assert cont.sparse_steps == 3
    r = rows[1]
    assert r["fetched_fraction"] == pytest.approx(0.2)
    assert r["greedy_agreement"] == pytest.approx(1 / 3)  # the last position left out
    assert r["perplexity"] == pytest.approx(np.exp(1.25))
    ax = viz.plot_accuracy_vs_bytes(rows, "perplexity")
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {"full", "tokens", "pages"}
    np.testing.assert_allclose(lines["tokens"].get_xdata(), [0.2, 0.5])
    assert lines["full"].get_xdata()[0] == 1.0
    assert sum("α=" in t.get_text() for t in ax.texts) == 4
    ax = viz.plot_accuracy_vs_bytes(rows, "greedy_agreement")
    np.testing.assert_allclose(
        {line.get_label(): line for line in ax.lines}["pages"].get_ydata(), [1 / 3, 2 / 3]
    )

    modes = rows[:1]
    for i, (mode, variant) in enumerate(
        [
            ("oracle", {}),
            ("quest", {}),
            ("infinigen", {}),
            ("infinigen", {"page_residual": "page_mid"}),
        ]
    ):
        for fetched in ([2, 2, 2], [4, 4, 4]):
            sparse = SparseKVConfig(mode=mode, **variant)
            p = _run([[100, *fetched]], [[1, 2, 3, 4]], [[1.0 + i, 1.0, 1.0, 1.0]])
            modes.append(viz.accuracy_row(mode, sparse, p, p, full_p, full_g))
    assert modes[-1]["selection"] == "infinigen+mid" and modes[1]["selection"] == "oracle"
    ax = viz.plot_modes_vs_bytes(modes, "perplexity")
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {"full", "oracle (reads every key)", "quest", "infinigen", "infinigen+mid"}
    np.testing.assert_allclose(lines["infinigen+mid"].get_xdata(), [0.2, 0.4])
    np.testing.assert_allclose(lines["quest"].get_ydata(), [np.exp(5 / 4)] * 2)  # nll 2, 1, 1, 1
    assert lines["oracle (reads every key)"].get_linestyle() == "--"

    class Stats:
        def __init__(self, b):
            self.h2d_bytes_per_decode_token = b

    ax = viz.plot_fetch_bytes({"offload": Stats(4 * 2**20), "infinigen": Stats(2**20)})
    assert [b.get_height() for b in ax.patches] == [4.0, 1.0]
    assert "(0.25x)" in ax.texts[1].get_text()
    plt.close("all")

"""InfiniGen's sparse KV fetching (llmjax/sparse/infinigen.py) and the full-offload baseline.

- With `alpha` huge and no cap the selection is every cached token: logits equal full attention
  (the paged reference) to float32 rounding, and greedy outputs equal `sparse_kv='none'`, with
  chunked prefill mixing prompts and decodes, for token and page granularity, the pool in host
  memory (`pinned_host` on the CPU), with the jnp attention and with the Pallas kernel
  (interpreted), which is also checked alone against the jnp attention over fetched rows.
- The selection rules on hand-made scores: sinks and recent tokens always, the rest within alpha
  of the best, the count averaged over kv heads and capped; whole pages at page granularity;
  evicted pages (holes) never attended or selected; on random and repetitive contexts (keys
  repeating up to RoPE) a larger alpha selects a superset at a fixed budget, and with every
  skewed column a filled budget selects the oracle's tokens.
- Engine: bytes moved are counted (full offload = every cached token of every layer), the step
  compiles once per bucket and updates the pool and partial keys in place (no copies in the
  HLO), evictions (capacity < 1) keep serving with invariants intact; the skew is stored beside
  the checkpoint.
- Accuracy tools: teacher-forced scores under offload equal one whole-sequence prefill's; the
  long_context workload is real text; the benchmark compares sparse modes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax import LLM, SamplingParams
from llmjax.config import SparseKVConfig
from llmjax.model.kv_cache import allocate_kv_pages
from llmjax.model.layers import apply_rope, layer_rope, rope_cos_sin
from llmjax.model.llama import forward
from llmjax.model.params import init_params
from llmjax.sparse import infinigen as ig
from llmjax.sparse.skew import calibrate
from tests.helpers import make_step

CFG = configs.TINY_DEEP  # 5 layers: 1 dense + 4 speculated
EVERYTHING = dict(alpha=1e9, max_num_kv=None, num_dense_layers=1)


@pytest.fixture(scope="module")
def model():
    params = init_params(CFG, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(3, 256, 48).tolist()
    return params, calibrate(params, CFG, tokens)


# one jit each for the module (a new partial per call compiled the same steps again)
_SPARSE = jax.jit(
    ig.sparse_forward, static_argnames=("config", "sparse", "host"), donate_argnums=(1, 2)
)
_REF = jax.jit(forward, static_argnames=("config",), donate_argnums=(1,))


def _run_both(params, skew, sparse, steps, page_size, num_pages, host):
    """Each step through sparse_forward and through the paged reference -> logits pairs."""
    mk = "pinned_host" if host else None
    pool = ig.allocate_pool(CFG, num_pages, page_size, jnp.float32, mk)
    partial = ig.allocate_partial_keys(CFG, sparse, num_pages, page_size, jnp.float32)
    weights = ig.speculation_weights(*skew, CFG, sparse)
    kv = allocate_kv_pages(CFG, num_pages, page_size, jnp.float32)
    out = []
    for step in steps:
        logits, pool, partial, stats = _SPARSE(
            params, pool, partial, weights, step, CFG, sparse, host
        )
        ref, kv = _REF(params, kv, step, CFG)
        out.append(
            (
                np.asarray(logits),
                np.asarray(ref),
                bool(stats.sparse),
                jax.tree.map(np.asarray, stats),
            )
        )
    if host:
        assert pool[0][0].sharding.memory_kind == "pinned_host"
    return out


def _steps(rng, page_size):
    """Two sequences on shuffled pages: prefill chunks (one crossing pages), then decodes."""
    pages = rng.permutation(np.arange(1, 25))
    tables = [pages[:12].tolist(), pages[12:].tolist()]
    seqs = [rng.integers(3, 256, 40).tolist() for _ in range(2)]
    steps = [
        make_step(
            [(seqs[0][:9], 0, tables[0]), (seqs[1][:6], 0, tables[1])], page_size, num_tokens=16
        ),
        make_step(
            [(seqs[0][9:14], 9, tables[0]), (seqs[1][6:7], 6, tables[1])], page_size, num_tokens=8
        ),
    ]
    for j in range(3):  # decode-only steps
        a, b = 14 + j, 7 + j
        steps.append(
            make_step(
                [(seqs[0][a : a + 1], a, tables[0]), (seqs[1][b : b + 1], b, tables[1])],
                page_size,
                num_tokens=4,
            )
        )
    return steps


# pool in device memory: greedy_continuations below (exact full logits) and the HLO test
@pytest.mark.parametrize(
    "granularity, host, variant",
    [
        ("token", True, {}),
        ("page", True, {}),
        ("token", True, {"page_residual": "page_mid"}),
        ("token", True, {"query_source": "own_layer", "page_residual": "page_upper"}),
    ],
)
def test_selecting_everything_equals_full_attention(model, granularity, host, variant):
    params, skew = model
    sparse = SparseKVConfig(mode="infinigen", granularity=granularity, **EVERYTHING, **variant)
    out = _run_both(params, skew, sparse, _steps(np.random.default_rng(1), 4), 4, 30, host)
    assert [s for *_, s, _ in out] == [False, False] + [True] * 3  # prefill steps attend fully
    for logits, ref, *_ in out:
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_offload_fetches_everything_and_equals_full_attention(model):
    params, skew = model
    out = _run_both(
        params,
        skew,
        SparseKVConfig(mode="offload"),
        _steps(np.random.default_rng(2), 4),
        4,
        30,
        True,
    )
    for logits, ref, is_sparse, _ in out:
        assert not is_sparse
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "D, K, Q, M, H, dtype, cap",
    [
        (3, 2, 2, 21, 16, "float32", None),
        (2, 1, 4, 40, 64, "float32", 0.7),
        (4, 2, 1, 9, 32, "bfloat16", None),
    ],
)
def test_pallas_kernel_over_the_fetched_rows_equals_jnp(D, K, Q, M, H, dtype, cap):
    """The ragged paged attention kernel (interpreted) attends the fetched rows as one decode
    sequence per (token, kv head): equal to the jnp sparse attention, random validity masks
    (one (token, head) with no valid row: only its own), with and without Gemma 2's logit soft
    cap (0.7: scores of ~1 are capped hard)."""
    rng = np.random.default_rng(D * 100 + M)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((D, K * Q, H)), dt)
    k_rows, v_rows = (jnp.asarray(rng.standard_normal((D, K, M, H)), dt) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.standard_normal((D, K, H)), dt) for _ in range(2))
    valid = rng.random((D, K, M)) < 0.6
    valid[0, 0] = False
    valid = jnp.asarray(valid)
    want = ig.sparse_attention(q, k_rows, v_rows, valid, k_new, v_new, H**-0.5, cap)
    got = ig.sparse_attention_pallas(q, k_rows, v_rows, valid, k_new, v_new, H**-0.5, cap)
    if cap is not None:  # the cap changes the output: the test sees it
        plain = ig.sparse_attention(q, k_rows, v_rows, valid, k_new, v_new, H**-0.5)
        assert float(jnp.abs(plain - want).max()) > 1e-2
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )


# ---- the selection rule on hand-made scores -----------------------------------------------


def _spec_inputs(scores_by_pos, kv_len, page_size=4, K=1, Q=1):
    """A one-token step at position kv_len - 1 whose speculated logit for key position j is
    scores_by_pos[j] (partial keys one-hot, partial query = 1)."""
    c = 1
    P = -(-kv_len // page_size)
    table = np.arange(1, P + 1)
    partial = np.zeros((P + 1, page_size, K, c), np.float32)
    for j, sc in enumerate(scores_by_pos):
        partial[table[j // page_size], j % page_size, :, 0] = sc
    step = make_step([([5], kv_len - 1, table.tolist())], page_size)
    q_next = np.ones((1, K * Q, 1), np.float32)
    a_part = np.ones((K, 1, c), np.float32)
    return q_next, jnp.asarray(partial), jnp.asarray(a_part), step


def _select(scores, sparse, **kw):
    q, partial, a, step = _spec_inputs(scores, len(scores), **kw)
    pos, valid = ig.speculate(
        jnp.asarray(q), partial, a, step, jnp.zeros(1, jnp.int32), sparse, sm_scale=1.0
    )
    return set(np.asarray(pos)[0, 0][np.asarray(valid)[0, 0]].tolist())


def test_selection_keeps_sinks_recent_and_tokens_within_alpha():
    scores = [0.0] * 20
    scores[5], scores[9], scores[11] = 10.0, 7.0, 4.0  # within 5 of the best: 5 and 9
    sparse = SparseKVConfig(mode="infinigen", alpha=5.0, num_sink_tokens=1, num_recent_tokens=3)
    # position 19 is the token itself (its own row comes from the step): recent = 17, 18
    assert _select(scores, sparse) == {0, 17, 18, 5, 9}
    # the cap keeps the best
    capped = SparseKVConfig(mode="infinigen", alpha=5.0, max_num_kv=1, num_recent_tokens=3)
    assert _select(scores, capped) == {0, 17, 18, 5}
    # alpha large: everything
    assert _select(scores, SparseKVConfig(mode="infinigen", alpha=1e9, num_recent_tokens=3)) == set(
        range(19)
    )


def test_page_granularity_fetches_whole_pages():
    scores = [0.0] * 20
    scores[6] = 10.0  # page 1 (positions 4..7)
    sparse = SparseKVConfig(
        mode="infinigen", alpha=5.0, granularity="page", num_sink_tokens=1, num_recent_tokens=2
    )
    assert _select(scores, sparse) == {0, 18, 4, 5, 6, 7}


def test_count_is_averaged_over_kv_heads():
    """Two kv heads: one has 4 tokens within alpha, the other 2 -> each keeps its best 3."""
    K = 2
    kv_len, page_size = 16, 4
    P = kv_len // page_size
    partial = np.zeros((P + 1, page_size, K, 1), np.float32)
    s0 = np.zeros(kv_len)
    s0[[3, 5, 7, 9]] = [10, 9, 8, 7]
    s1 = np.zeros(kv_len)
    s1[[4, 6]] = [10, 9]
    for j in range(kv_len):
        partial[1 + j // page_size, j % page_size, 0, 0] = s0[j]
        partial[1 + j // page_size, j % page_size, 1, 0] = s1[j]
    step = make_step([([5], kv_len - 1, list(range(1, P + 1)))], page_size)
    sparse = SparseKVConfig(mode="infinigen", alpha=5.0, num_sink_tokens=0, num_recent_tokens=1)
    pos, valid = ig.speculate(
        jnp.ones((1, K, 1)),
        jnp.asarray(partial),
        jnp.ones((K, 1, 1)),
        step,
        jnp.zeros(1, jnp.int32),
        sparse,
        sm_scale=1.0,
    )
    pos, valid = np.asarray(pos)[0], np.asarray(valid)[0]
    assert set(pos[0][valid[0]]) == {3, 5, 7}  # mean count (4 + 2) / 2 = 3
    assert set(pos[1][valid[1]]) == {4, 6} | {int(pos[1][valid[1]][-1])}
    assert valid[1].sum() == 3


@pytest.mark.parametrize("residual", ["none", "page_mid", "page_upper"])
@pytest.mark.parametrize("seed", [0, 1])
def test_speculated_scores_with_page_residuals_match_numpy(residual, seed):
    """The partial keys and the left-out columns' page bounds, written in random chunks on
    shuffled pages (write_partial), give InfiniGen's partial logits plus the page estimate of
    the rest; 'page_upper' is never below a key's true logit (the skew is orthogonal)."""
    rng = np.random.default_rng(seed)
    G, K, Q, H, n = 4, 2, 3, 8, 27
    c = 3
    A = np.stack([np.linalg.qr(rng.standard_normal((H, H)))[0] for _ in range(K)])  # [K, H, H]
    kept = np.stack([rng.permutation(H)[:c] for _ in range(K)])  # [K, c]
    order = np.stack([np.concatenate([kp, np.setdiff1d(np.arange(H), kp)]) for kp in kept])
    w = np.take_along_axis(A, order[:, None, :], axis=-1)  # kept columns first
    if residual == "none":
        w = w[..., :c]
    P = -(-n // G)
    num_pages = P + 3
    table = (rng.permutation(num_pages - 1)[:P] + 1).tolist()
    partial = jnp.zeros((num_pages, G, K, c))
    state = partial if residual == "none" else (partial, jnp.zeros((num_pages, 2, K, H - c)))
    keys = rng.standard_normal((n, K, H)).astype(np.float32)
    done = 0
    while done < n:
        pos = np.arange(done, min(n, done + int(rng.integers(1, 6))))
        slots = np.array([table[p // G] * G + p % G for p in pos], np.int32)
        state = ig.write_partial(state, jnp.asarray(keys[pos]), jnp.asarray(w), slots, G)
        done += len(pos)
    q = rng.standard_normal((1, K * Q, H)).astype(np.float32)
    step = make_step([([5], n - 1, table)], G)
    seq = jnp.zeros(1, jnp.int32)
    got = ig.speculated_scores(jnp.asarray(q), state, jnp.asarray(w), step, seq, residual)
    got = np.asarray(got)[0, :, :n]
    for k in range(K):
        qs = q[0].reshape(K, Q, H)[k] @ A[k]  # [Q, H] skewed
        ks = keys[:, k] @ A[k]  # [n, H]
        rest = np.setdiff1d(np.arange(H), kept[k])
        est = qs[:, kept[k]] @ ks[:, kept[k]].T  # [Q, n]
        if residual != "none":
            for j in range(n):
                page = ks[(j // G) * G : min(n, (j // G + 1) * G)][:, rest]
                lo, hi = page.min(axis=0), page.max(axis=0)
                a, b = qs[:, rest] * lo, qs[:, rest] * hi
                up, down = np.maximum(a, b).sum(-1), np.minimum(a, b).sum(-1)
                est[:, j] += up if residual == "page_upper" else (up + down) / 2
        np.testing.assert_allclose(got[k], est.max(axis=0), rtol=1e-4, atol=1e-4)
        if residual == "page_upper":
            true = (q[0].reshape(K, Q, H)[k] @ keys[:, k].T).max(axis=0)
            assert (got[k] >= true - 1e-4).all()
    # speculate ranks by these scores: SparseKVConfig.page_residual reaches them
    cap = 6
    sparse = SparseKVConfig(
        mode="infinigen", page_residual=residual, alpha=float("inf"), max_num_kv=cap,
        num_sink_tokens=0, num_recent_tokens=1,
    )  # fmt: skip
    pos, valid = ig.speculate(jnp.asarray(q), state, jnp.asarray(w), step, seq, sparse, 1.0)
    for k in range(K):
        chosen = set(np.asarray(pos)[0, k][np.asarray(valid)[0, k]].tolist())
        assert chosen == set(np.argsort(-got[k][: n - 1])[:cap].tolist())


def _keys(context, rng, n, K, H):
    """Post-RoPE keys [n, K, H] of a random context, or of a repetitive one (a block of 5 keys
    repeated, rotated by each position's RoPE: near-ties everywhere, as a context of repeated
    prompts gives)."""
    if context == "random":
        return rng.standard_normal((n, K, H)).astype(np.float32)
    block = rng.standard_normal((5, K, H)).astype(np.float32)
    raw = np.tile(block, (-(-n // 5), 1, 1))[:n]
    cfg = dataclasses.replace(CFG, head_dim=H)
    cos, sin = layer_rope(*rope_cos_sin(jnp.arange(n, dtype=jnp.int32), cfg), 0)
    return np.asarray(apply_rope(jnp.asarray(raw), cos, sin))


@pytest.mark.parametrize("context", ["random", "repetitive"])
@pytest.mark.parametrize(
    "granularity, residual", [("token", "none"), ("token", "page_mid"), ("page", "none")]
)
def test_growing_alpha_selects_supersets(context, granularity, residual):
    """At a fixed budget, a larger alpha keeps a prefix of the same ranking that is at least as
    long: every (token, kv head)'s rows are a superset of the smaller alpha's, up to alpha=inf
    (the budget filled). Several sequences of different lengths, GQA (Q = 3)."""
    rng = np.random.default_rng(7)
    G, K, Q, H, c = 4, 2, 3, 8, 3
    lens = [61, 38, 50]
    A = np.stack([np.linalg.qr(rng.standard_normal((H, H)))[0] for _ in range(K)])
    kept = np.stack([rng.permutation(H)[:c] for _ in range(K)])
    order = np.stack([np.concatenate([kp, np.setdiff1d(np.arange(H), kp)]) for kp in kept])
    w = np.take_along_axis(A, order[:, None, :], axis=-1)
    w = jnp.asarray(w if residual != "none" else w[..., :c])
    num_pages = 1 + sum(-(-n // G) for n in lens)
    perm = (rng.permutation(num_pages - 1) + 1).tolist()
    tables, state = [], jnp.zeros((num_pages, G, K, c))
    if residual != "none":
        state = (state, jnp.zeros((num_pages, 2, K, H - c)))
    for n in lens:
        table, perm = perm[: -(-n // G)], perm[-(-n // G) :]
        tables.append(table)
        slots = np.array([table[p // G] * G + p % G for p in range(n)], np.int32)
        state = ig.write_partial(state, jnp.asarray(_keys(context, rng, n, K, H)), w, slots, G)
    step = make_step([([5], n - 1, t) for n, t in zip(lens, tables, strict=True)], G)
    q = jnp.asarray(rng.standard_normal((len(lens), K * Q, H)).astype(np.float32))
    seq = jnp.arange(len(lens), dtype=jnp.int32)
    previous = None
    for alpha in (0.0, 0.5, 2.0, 5.0, 9.0, 1e9, float("inf")):
        sparse = SparseKVConfig(
            mode="infinigen", alpha=alpha, max_num_kv=12, granularity=granularity,
            page_residual=residual, num_sink_tokens=1, num_recent_tokens=3,
        )  # fmt: skip
        pos, valid = (np.asarray(x) for x in ig.speculate(q, state, w, step, seq, sparse, 0.4))
        chosen = [[set(pos[t, k][valid[t, k]].tolist()) for k in range(K)] for t in range(3)]
        if previous is not None:
            for t, k in np.ndindex(len(lens), K):
                assert previous[t][k] <= chosen[t][k], (alpha, t, k)
        previous = chosen
    # alpha=inf fills the budget: 12 tokens, or 3 whole pages, besides the sink and recent ones
    for t, k in np.ndindex(len(lens), K):
        spec = chosen[t][k] - {0, lens[t] - 2, lens[t] - 3}
        assert len(spec) == 12 if granularity == "token" else len({p // G for p in spec}) == 3


@pytest.mark.parametrize("context", ["random", "repetitive"])
def test_filled_budget_with_every_column_selects_the_oracle_tokens(context):
    """partial_weight_ratio=1.0 (every skewed column: the partial logits are the exact ones, the
    skew being orthogonal) with the budget filled (alpha=inf) selects the oracle's tokens: the
    rule query_source='own_layer' applies in each layer, on random keys and on a repetitive
    context's near-ties (a tie within float rounding may pick either; the chosen logits are
    then the oracle's)."""
    rng = np.random.default_rng(8)
    G, K, Q, H, cap = 4, 2, 2, 8, 10
    lens = [57, 33]
    A = jnp.asarray(np.stack([np.linalg.qr(rng.standard_normal((H, H)))[0] for _ in range(K)]))
    num_pages = 1 + sum(-(-n // G) for n in lens)
    pages = np.zeros((num_pages, G, K, H), np.float32)
    perm = (rng.permutation(num_pages - 1) + 1).tolist()
    tables, partial = [], jnp.zeros((num_pages, G, K, H))
    for n in lens:
        table, perm = perm[: -(-n // G)], perm[-(-n // G) :]
        tables.append(table)
        keys = _keys(context, rng, n, K, H)
        slots = np.array([table[p // G] * G + p % G for p in range(n)], np.int32)
        pages.reshape(-1, K, H)[slots] = keys
        partial = ig.write_partial(partial, jnp.asarray(keys), A, slots, G)
    step = make_step([([5], n - 1, t) for n, t in zip(lens, tables, strict=True)], G)
    q = jnp.asarray(rng.standard_normal((len(lens), K * Q, H)).astype(np.float32))
    seq = jnp.arange(len(lens), dtype=jnp.int32)
    common = dict(max_num_kv=cap, num_sink_tokens=1, num_recent_tokens=3)
    own = SparseKVConfig(
        mode="infinigen", alpha=float("inf"), partial_weight_ratio=1.0,
        query_source="own_layer", **common,
    )  # fmt: skip
    oracle = SparseKVConfig(mode="oracle", **common)
    got = ig.speculate(q, partial, A, step, seq, own, 0.35)
    exact = ig.oracle_scores(q, jnp.asarray(pages), step, seq, host=False) * 0.35
    want = ig.select_rows(exact, None, step, seq, oracle, G, None, alpha=None)
    exact = np.asarray(exact)
    for t, k in np.ndindex(len(lens), K):
        sel = [np.asarray(x)[t, k] for x in got], [np.asarray(x)[t, k] for x in want]
        (gp, gv), (wp, wv) = sel
        a, b = sorted(gp[gv].tolist()), sorted(wp[wv].tolist())
        if a != b:  # only a near-tie at the budget's edge may differ
            np.testing.assert_allclose(
                np.sort(exact[t, k, a]), np.sort(exact[t, k, b]), rtol=0, atol=1e-5
            )
        assert len(a) == len(b) == 1 + 2 + cap


def test_own_layer_query_with_every_column_selects_as_the_oracle(model):
    """query_source='own_layer' with every skewed column kept (the skew is orthogonal, so the
    partial logits are the exact ones) and the budget filled picks what the oracle picks: the
    same logits at a budget that leaves most tokens out. InfiniGen's one-layer-ahead query
    picks otherwise."""
    params, skew = model
    common = dict(max_num_kv=3, num_dense_layers=1, num_recent_tokens=2, num_sink_tokens=1)
    own = SparseKVConfig(
        mode="infinigen", query_source="own_layer", partial_weight_ratio=1.0,
        alpha=float("inf"), **common,
    )  # fmt: skip
    ahead = dataclasses.replace(own, query_source="previous_layer")
    oracle = SparseKVConfig(mode="oracle", **common)
    runs = [
        _run_both(params, skew, s, _steps(np.random.default_rng(5), 4), 4, 30, False)
        for s in (own, oracle, ahead)
    ]
    for (got, *_), (want, *_) in zip(runs[0], runs[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pairs = zip(runs[2], runs[1], strict=True)
    assert any(not np.allclose(a[0], o[0], rtol=1e-5, atol=1e-5) for a, o in pairs)


def test_evicted_pages_are_never_attended_or_selected():
    """A hole (evicted page: table entry 0) is invisible to the dense path and never chosen by
    the speculation, however high its tokens score."""
    rng = np.random.default_rng(6)
    G, K, Q, H = 4, 2, 2, 8
    pages_k = jnp.asarray(rng.standard_normal((6, G, K, H)), jnp.float32)
    pages_v = jnp.asarray(rng.standard_normal((6, G, K, H)), jnp.float32)
    table = [3, 0, 5, 1]  # page index 1 (positions 4..7) evicted
    step = make_step([([7], 14, table)], G)
    q = jnp.asarray(rng.standard_normal((1, K * Q, H)), jnp.float32)
    out = ig.dense_attention(q, pages_k, pages_v, step, False, 0.5, None)
    visible = [p for p in range(15) if not 4 <= p < 8]
    keys = np.stack([np.asarray(pages_k)[table[p // G], p % G] for p in visible])  # [n, K, H]
    vals = np.stack([np.asarray(pages_v)[table[p // G], p % G] for p in visible])
    qg = np.asarray(q)[0].reshape(K, Q, H)
    s = np.einsum("kqh,nkh->kqn", qg, keys) * 0.5
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expect = np.einsum("kqn,nkh->kqh", w, vals).reshape(1, K * Q, H)
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-5)

    scores = [0.0] * 16
    scores[5] = 100.0  # in the hole
    scores[9] = 10.0
    q_next, partial, a_part, one = _spec_inputs(scores, 16)
    one = one._replace(page_indices=np.array([[1, 0, 3, 4]], np.int32))
    sparse = SparseKVConfig(mode="infinigen", alpha=5.0, num_recent_tokens=2)
    pos, valid = ig.speculate(
        jnp.asarray(q_next), partial, a_part, one, jnp.zeros(1, jnp.int32), sparse, sm_scale=1.0
    )
    chosen = set(np.asarray(pos)[0, 0][np.asarray(valid)[0, 0]].tolist())
    assert chosen == {0, 14, 9}


# ---- through the engine --------------------------------------------------------------------


@functools.cache
def _base_llm():
    """The tiny model's random weights, loaded once per process (2 layers: 1 dense + 1
    speculated, fast to compile); each test's engine comes from `LLM.with_options`."""
    return LLM(
        "tiny",
        load_format="dummy",
        page_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        compilation_cache_dir="",
        calibration_tokens=64,
    )


def _llm(sparse, **kw):
    return _base_llm().with_options(sparse_kv=sparse, **kw)


def _prompts(n, seed=0):
    """n prompts of 20 tokens: chunked by the 32-token budget beside decodes in few buckets."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, 20).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def dense_outputs():
    llm = _llm("none")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(3), params)]


def test_engine_selecting_everything_equals_dense(dense_outputs, tmp_path):
    skew_dir = str(tmp_path / "ckpt")
    llm = _llm(SparseKVConfig(mode="infinigen", skew_dir=skew_dir, **EVERYTHING))
    # calibrated at start-up and stored beside the "checkpoint"; the engine uses what is stored
    from llmjax.sparse.skew import load_skew

    tiny = configs.TINY
    stored = ig.speculation_weights(*load_skew(skew_dir, tiny), tiny, llm.config.sparse_kv)
    for a, b in zip(stored[1:], llm.engine.runner.spec_weights[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = llm.generate(_prompts(3), params)
    assert [o.token_ids for o in outs] == dense_outputs
    stats = llm.engine.stats
    assert stats.num_sparse_steps > 0 and stats.h2d_bytes > 0
    compiles = llm.engine.num_compiles
    llm.reset_prefix_cache()  # the same prompts again run the same buckets: no new compile
    llm.generate(_prompts(3), params)
    assert llm.engine.num_compiles == compiles
    # ... nor a second executable for a traced bucket (an uncommitted first input once made
    # the same trace compile again when the committed outputs came back)
    assert llm.engine.runner._sparse_step._cache_size() == compiles


def test_engine_with_pallas_kernels_selecting_everything_equals_dense(dense_outputs, monkeypatch):
    """attention_backend='pallas' (interpreted here), the kernel named (pallas_kernel='tpu'): it
    attends the fetched pages and the fetched rows; with everything selected the outputs are full
    attention's."""
    import kernels_pallas.ragged_paged_attention as rpa

    named, real = [], rpa.ragged_paged_attention

    def recording(*args, implementation=None, **kw):
        named.append(implementation)
        return real(*args, implementation=implementation, **kw)

    monkeypatch.setattr(rpa, "ragged_paged_attention", recording)
    llm = _llm(
        SparseKVConfig(mode="infinigen", **EVERYTHING),
        attention_backend="pallas",
        pallas_kernel="tpu",
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)  # interpreted: keep it short
    outs = llm.generate(_prompts(3)[:1], params)
    assert [o.token_ids for o in outs] == [dense_outputs[0][:3]]
    assert llm.engine.stats.num_sparse_steps > 0
    assert named and set(named) == {"tpu"}  # dense and sparse layers, the kernel asked for


def test_engine_offload_counts_every_cached_token(dense_outputs):
    llm = _llm("offload")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = _prompts(3)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == dense_outputs
    stats = llm.engine.stats
    # every step fetches every cached token's K and V rows of every layer: a decode token of a
    # sequence with n cached tokens costs n rows per kv head and layer
    tiny = configs.TINY
    row = 2 * tiny.head_dim * 4 * tiny.num_kv_heads * tiny.num_layers
    assert stats.h2d_bytes % row == 0 and stats.num_sparse_steps == 0
    assert stats.num_decode_only_tokens > 0
    lens = [len(p) for p in prompts]
    assert row * min(lens) < stats.h2d_bytes_per_decode_token < row * (max(lens) + 10)


def test_engine_evicts_within_capacity_and_keeps_serving():
    """Policies are checked one by one in tests/test_sparse_host_pool.py; here the engine path."""
    sparse = SparseKVConfig(
        mode="infinigen", alpha=3.0, num_dense_layers=1, capacity=0.5, eviction="counter"
    )
    llm = _llm(sparse)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    system = list(range(3, 19))  # 16 shared tokens: 4 prefix-cached pages
    prompts = [system + p + p[::-1] for p in _prompts(4, seed=7)]  # 56 tokens
    llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # the shared prefix enters the cache
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 40 for o in outs)
    engine = llm.engine
    assert engine.stats.num_pool_evictions > 0
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_errors(model):
    with pytest.raises(ValueError, match="unknown sparse_kv mode"):
        SparseKVConfig(mode="streamingllm")
    with pytest.raises(ValueError, match="capacity"):
        SparseKVConfig(mode="infinigen", capacity=1.5)
    with pytest.raises(ValueError, match="num_recent_tokens"):
        SparseKVConfig(mode="infinigen", num_recent_tokens=0)
    with pytest.raises(ValueError, match="num_dense_layers=9 exceeds"):
        _llm(SparseKVConfig(mode="infinigen", num_dense_layers=9))
    with pytest.raises(ValueError, match="only the jnp attention masks"):
        _llm(SparseKVConfig(mode="offload", capacity=0.5), attention_backend="pallas")
    from llmjax.config import EngineConfig
    from llmjax.engine.engine import LLMEngine

    params, _ = model
    config = EngineConfig(
        model=CFG, sparse_kv=SparseKVConfig(mode="infinigen"), compilation_cache_dir=""
    )
    with pytest.raises(ValueError, match="needs the skewing matrices"):
        LLMEngine(config, params, 20)


@pytest.mark.parametrize(
    "mode, variant, kv_cache_dtype",
    [
        ("infinigen", {}, "auto"),
        ("infinigen", {"page_residual": "page_mid"}, "auto"),
        ("infinigen", {"query_source": "own_layer"}, "auto"),
        ("oracle", {}, "auto"),
        ("quest", {}, "auto"),
        ("h2o", {}, "auto"),
        ("infinigen", {}, "int8"),  # a quantized pool: codes and scales [50, 4, K, 1]
        ("quest", {}, "fp8_e4m3"),
    ],
)
@pytest.mark.parametrize("pool_memory", ["pinned_host"])  # "device" gave the same HLO copies
def test_compiled_step_updates_pool_and_partial_keys_in_place(
    pool_memory, mode, variant, kv_cache_dtype
):
    """The step reads layer i+1's pool pages and partial keys (speculation and fetch, during
    layer i) before layer i+1 writes them; XLA must not copy them to do that (it copied both
    every step until the writes were ordered after the reads). Oracle, Quest and H2O read a
    layer's pages (and Quest its bounds) after writing them; no copies either, except H2O's small
    accumulated attention (carried through a condition and a scan: XLA copies it)."""
    from llmjax.engine.batch import pack

    sparse = SparseKVConfig(mode=mode, num_dense_layers=1, pool_memory=pool_memory, **variant)
    prefix_cache = "none" if mode == "h2o" else "radix"
    llm = _llm(sparse, num_pages=50, prefix_cache=prefix_cache, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    batch = engine.scheduler.schedule()
    step, sampling = pack(batch, engine.block_manager.page_tables, 4, engine.buckets)
    hlo = engine.runner.lower(step, sampling).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "[50," in line]
    if mode == "h2o":  # its accumulated attention [pages, G, K] (1/H of the keys) is copied
        acc = f"[50,4,{configs.TINY.num_kv_heads}]"
        copies = [line for line in copies if f"f32{acc}" not in line]
    assert not copies, copies
    if pool_memory == "pinned_host":  # every array of the pool (a quantized one's codes, scales)
        for leaf in jax.tree.leaves(engine.runner.kv_pages[1][0]):
            assert leaf.sharding.memory_kind == "pinned_host"


# ---- accuracy evaluation and the benchmark ------------------------------------------------


def test_teacher_forced_scores_equal_full_logits(model):
    """'offload' is exact full attention: its per-position NLL and greedy tokens equal those
    of one prefill over the whole sequence; a sparse setting runs its decode steps sparse and
    fetches fewer rows (selecting everything equals full attention: tested above)."""
    from llmjax.sparse.evaluate import greedy_continuations, teacher_forced
    from tests.helpers import full_logits

    params, skew = model
    rng = np.random.default_rng(4)
    seqs = rng.integers(3, 256, (2, 24))
    full = teacher_forced(params, CFG, SparseKVConfig(mode="offload"), skew, seqs, 16, page_size=4)
    assert full.nll.shape == (2, 8) and full.sparse_steps == 0
    for b in range(2):
        logits = full_logits(params, CFG, seqs[b].tolist(), page_size=4)
        logp = jax.nn.log_softmax(jnp.asarray(logits[15:23]), axis=-1)
        expect = -np.take_along_axis(np.asarray(logp), seqs[b, 16:24, None], axis=1)[:, 0]
        np.testing.assert_allclose(full.nll[b], expect, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(full.argmax[b], logits[15:23].argmax(-1))
    few = SparseKVConfig(mode="infinigen", alpha=0.0, num_dense_layers=1, num_recent_tokens=2)
    sparse = teacher_forced(params, CFG, few, skew, seqs, 16, page_size=4)
    assert sparse.sparse_steps == 7  # every decode step
    assert (sparse.rows[:, 1:] < full.rows[:, 1:]).all()  # fetched less
    np.testing.assert_allclose(sparse.nll[:, 0], full.nll[:, 0], rtol=1e-5)  # the prefill step
    cont = greedy_continuations(params, CFG, seqs[:, :12], 5, page_size=4)
    assert cont.shape == (2, 17)
    for b in range(2):
        logits = full_logits(params, CFG, cont[b].tolist(), page_size=4)
        np.testing.assert_array_equal(cont[b, 12:], logits[11:16].argmax(-1))


def test_long_context_workload_is_real_text():
    from llmjax.bench.workloads import make_workload
    from llmjax.data.texts import public_domain_text

    specs = make_workload("long_context", 3, prompt_len=50, output_len=7, vocab_size=256)
    assert [s.prompt_len for s in specs] == [50] * 3 and {s.output_len for s in specs} == {7}
    text = public_domain_text().encode()
    for s in specs:
        assert bytes(s.prompt_token_ids) in text
    capped = make_workload("long_context", 1, prompt_len=500, output_len=20, max_model_len=100)
    assert capped[0].prompt_len == 80


def test_benchmark_compares_sparse_modes(tmp_path, capsys):
    import json

    from tests.helpers import run_benchmark_script

    out = str(tmp_path / "bench.json")
    run_benchmark_script(
        [
            "--model=tiny",
            "--load_format=dummy",
            "--policies=sarathi",
            "--workload=long_context",
            "--sparse_kv=offload,infinigen",
            "--config.sparse_kv.num_dense_layers=1",
            "--config.sparse_kv.max_num_kv=8",
            "--config.sparse_kv.num_recent_tokens=4",
            "--num_requests=2",
            "--long_prompt_len=40",
            "--output_len=6",
            "--max_model_len=64",
            "--page_size=4",
            "--warmup=2",
            "--norehearse",
            "--tbt_slo=10",
            f"--json_out={out}",
        ]
    )
    table = capsys.readouterr().out
    assert "KV MiB host->device / decode token" in table and "greedy tokens equal" in table
    doc = json.load(open(out))
    offload, infinigen = doc["variants"]["sarathi/offload"], doc["variants"]["sarathi/infinigen"]
    assert offload["engine"]["sparse_kv"] == "offload"
    # the --config.* flags reached both engines
    for v in (offload, infinigen):
        sparse = v["engine"]["config"]["sparse_kv"]
        assert (sparse["num_dense_layers"], sparse["max_num_kv"], sparse["num_recent_tokens"]) == (
            1,
            8,
            4,
        )
    per_token = [v["engine_stats"]["h2d_bytes_per_decode_token"] for v in (offload, infinigen)]
    assert 0 < per_token[1] < per_token[0]
    assert infinigen["engine_stats"]["num_sparse_steps"] > 0
    assert all(len(ids) == 6 for ids in infinigen["output_token_ids"])

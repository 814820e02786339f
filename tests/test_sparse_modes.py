"""Sparse KV's alternatives to InfiniGen on the same pool, page tables and fetch path
(llmjax/sparse/infinigen.py): the exact top-k `oracle` and `quest`'s page bounds.

- With a budget that keeps everything, each mode's logits equal full attention (the paged
  reference) under chunked prefill and decodes, the pool in host memory, and the engine's greedy
  outputs equal `sparse_kv='none'`.
- The selection rules on random and hand-made inputs: the oracle picks the true top-k per kv
  head (and the best pages at page granularity); Quest's page bound is never below a page's
  true best logit, its metadata is exactly the element-wise min and max of what each page holds
  (reset when a page is reused), and it fetches the pages with the highest bounds.
- A small budget fetches fewer rows than full attention and keeps serving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from llmjax import SamplingParams
from llmjax.config import SparseKVConfig
from llmjax.sparse import infinigen as ig
from tests.helpers import make_step
from tests.test_sparse_infinigen import CFG, _base_llm, _run_both, _steps

EVERYTHING = dict(max_num_kv=None, num_dense_layers=1)
MODES = [("oracle", "token"), ("oracle", "page"), ("quest", "page")]


@pytest.fixture(scope="module")
def params():
    from llmjax.model.params import init_params

    return init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("mode, granularity", MODES)
def test_selecting_everything_equals_full_attention(params, mode, granularity):
    sparse = SparseKVConfig(mode=mode, granularity=granularity, **EVERYTHING)
    skew = (None, None)  # unused: these modes need no calibration
    out = _run_both(params, skew, sparse, _steps(np.random.default_rng(1), 4), 4, 30, True)
    assert [s for *_, s, _ in out] == [False, False] + [True] * 3  # prefill steps attend fully
    for logits, ref, *_ in out:
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def _one_token_step(kv_len, page_size, rng):
    """A one-token decode at position kv_len - 1 on shuffled pages, and its page table."""
    P = -(-kv_len // page_size)
    table = (rng.permutation(P) + 1).tolist()
    return make_step([([5], kv_len - 1, table)], page_size), table


def _selected(positions, valid):
    pos, ok = np.asarray(positions)[0], np.asarray(valid)[0]
    return [set(pos[k][ok[k]].tolist()) for k in range(pos.shape[0])]


@pytest.mark.parametrize("kv_len, cap, K, Q", [(37, 5, 2, 2), (64, 12, 1, 3), (20, 30, 2, 1)])
def test_oracle_picks_the_true_top_k(kv_len, cap, K, Q):
    rng = np.random.default_rng(kv_len)
    G, H = 4, 8
    step, table = _one_token_step(kv_len, G, rng)
    pages = rng.standard_normal((len(table) + 1, G, K, H)).astype(np.float32)
    q = rng.standard_normal((1, K * Q, H)).astype(np.float32)
    sparse = SparseKVConfig(mode="oracle", max_num_kv=cap, num_sink_tokens=1, num_recent_tokens=3)
    seq = jnp.zeros(1, jnp.int32)
    s = ig.oracle_scores(jnp.asarray(q), jnp.asarray(pages), step, seq, host=False)
    got = _selected(*ig.select_rows(s, None, step, seq, sparse, G, None, alpha=None))
    keys = np.stack([pages[table[j // G], j % G] for j in range(kv_len)])  # [C, K, H]
    pos = kv_len - 1
    for k in range(K):
        true = np.einsum("qh,jh->qj", q[0].reshape(K, Q, H)[k], keys[:, k]).max(axis=0)
        always = {0} | {pos - 1, pos - 2}  # the sink and the recent tokens (not itself)
        others = [j for j in range(1, pos - 2)]
        best = sorted(others, key=lambda j: -true[j])[:cap]
        assert got[k] == always | set(best), k


def test_oracle_at_page_granularity_picks_the_pages_with_the_best_token():
    rng = np.random.default_rng(3)
    G, K, H, kv_len = 4, 1, 4, 32
    step, table = _one_token_step(kv_len, G, rng)
    pages = rng.standard_normal((len(table) + 1, G, K, H)).astype(np.float32) * 0.1
    q = np.ones((1, 1, H), np.float32)
    for j, v in [(9, 5.0), (21, 3.0), (13, 1.0)]:  # pages 2, 5, 3 by their best token
        pages[table[j // G], j % G, 0] = v
    sparse = SparseKVConfig(
        mode="oracle", granularity="page", max_num_kv=8, num_sink_tokens=0, num_recent_tokens=1
    )
    seq = jnp.zeros(1, jnp.int32)
    s = ig.oracle_scores(jnp.asarray(q), jnp.asarray(pages), step, seq, host=False)
    (got,) = _selected(*ig.select_rows(s, None, step, seq, sparse, G, None, alpha=None))
    assert got == set(range(8, 12)) | set(range(20, 24))  # 8 // 4 = 2 pages


def _write_in_chunks(bounds, pool, keys, table, G, rng):
    """Write keys [n, K, H] at positions 0..n-1 of a sequence on `table`, in random chunks, to
    both the bounds (quest_update) and a plain pool."""
    n, done = len(keys), 0
    while done < n:
        m = int(rng.integers(1, 7))
        pos = np.arange(done, min(n, done + m))
        slots = np.array([table[p // G] * G + p % G for p in pos], np.int32)
        bounds = ig.quest_update(bounds, jnp.asarray(keys[pos]), jnp.asarray(slots), G)
        pool[slots // G, slots % G] = keys[pos]
        done += len(pos)
    return bounds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quest_bounds_hold_each_pages_min_and_max_and_never_underestimate(seed):
    rng = np.random.default_rng(seed)
    G, K, Q, H, n = 4, 2, 2, 8, 29
    num_pages = 12
    bounds = jnp.zeros((num_pages, 2, K, H), jnp.float32)
    pool = np.zeros((num_pages, G, K, H), np.float32)
    table = (rng.permutation(num_pages - 1)[: -(-n // G)] + 1).tolist()
    # pages first filled with large keys by another sequence, then reused: bounds start afresh
    bounds = _write_in_chunks(bounds, pool, 50 + rng.random((n, K, H)), table, G, rng)
    keys = rng.standard_normal((n, K, H)).astype(np.float32)
    bounds = _write_in_chunks(bounds, pool, keys, table, G, rng)
    b = np.asarray(bounds)
    for p, page in enumerate(table):
        held = keys[p * G : (p + 1) * G]
        np.testing.assert_array_equal(b[page, 0], held.min(axis=0))
        np.testing.assert_array_equal(b[page, 1], held.max(axis=0))
    step = make_step([([5], n, table)], G)
    for _ in range(5):
        q = rng.standard_normal((1, K * Q, H)).astype(np.float32)
        bound = np.asarray(
            ig.quest_page_scores(jnp.asarray(q), bounds, step, jnp.zeros(1, jnp.int32))
        )[0]  # [K, P]
        for p in range(len(table)):
            held = keys[p * G : (p + 1) * G]  # [m, K, H]
            true = np.einsum("kqh,mkh->kqm", q[0].reshape(K, Q, H), held).max(axis=(1, 2))
            assert (bound[:, p] >= true - 1e-5).all()


def test_quest_fetches_the_pages_with_the_highest_bounds():
    rng = np.random.default_rng(5)
    G, K, H, kv_len = 4, 1, 4, 40
    step, table = _one_token_step(kv_len, G, rng)
    bounds = np.zeros((len(table) + 1, 2, K, H), np.float32)
    bounds[:, 0], bounds[:, 1] = -0.1, 0.1
    for page_index, v in [(3, 4.0), (7, 2.0), (1, 3.0), (5, -9.0)]:
        bounds[table[page_index], 1, 0, 0] = v  # max of dim 0: bound = v (+ 0.1 * 3 others)
    q = np.ones((1, 1, H), np.float32)
    sparse = SparseKVConfig(mode="quest", max_num_kv=12, num_sink_tokens=0, num_recent_tokens=1)
    seq = jnp.zeros(1, jnp.int32)
    scores = ig.quest_page_scores(jnp.asarray(q), jnp.asarray(bounds), step, seq)
    (got,) = _selected(*ig.select_rows(None, scores, step, seq, sparse, G, None, alpha=None))
    assert got == set(range(12, 16)) | set(range(4, 8)) | set(range(28, 32))  # pages 3, 1, 7


# ---- the engine ----------------------------------------------------------------------------


def _llm(sparse):
    extra = {"prefix_cache": "none"} if sparse != "none" and sparse.mode == "h2o" else {}
    return _base_llm().with_options(sparse_kv=sparse, **extra)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, PROMPT_LEN).tolist() for _ in range(n)]


# The engine tests' requests: every step bucket compiles per sparse engine, so they take few: the
# prompts fill one step (2 x 16 tokens = the 32-token budget), then decode together to contexts of
# 40 tokens, 5x the small budget's 8 (chunked prefill beside sparse decodes:
# test_sparse_infinigen.py's engine tests).
N, PROMPT_LEN, MAX_TOKENS = 2, 16, 24


@pytest.fixture(scope="module")
def dense_outputs():
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in _llm("none").generate(_prompts(N), params)]


@pytest.fixture(scope="module")
def offload_h2d_bytes():
    """What full fetches (mode 'offload') of the same requests move host -> device."""
    full = _llm(SparseKVConfig(mode="offload"))
    full.generate(_prompts(N), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return full.engine.stats.h2d_bytes


@pytest.mark.parametrize(
    "mode, variant",
    [
        ("oracle", {}),
        ("quest", {}),
        ("h2o", {}),
        ("infinigen", {"page_residual": "page_mid", "query_source": "own_layer", "alpha": 1e9}),
    ],
)
def test_engine_selecting_everything_equals_dense_and_a_budget_fetches_less(
    dense_outputs, offload_h2d_bytes, mode, variant
):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = _llm(SparseKVConfig(mode=mode, **EVERYTHING, **variant))
    assert [o.token_ids for o in llm.generate(_prompts(N), params)] == dense_outputs
    assert llm.engine.stats.num_sparse_steps > 0
    small = _llm(
        SparseKVConfig(
            mode=mode, max_num_kv=8, num_recent_tokens=4, num_dense_layers=1,
            **{k: v for k, v in variant.items() if k != "alpha"},
        )
    )  # fmt: skip
    outs = small.generate(_prompts(N), params)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert small.engine.stats.h2d_bytes < 0.8 * offload_h2d_bytes
    compiles = small.engine.num_compiles
    small.reset_prefix_cache()
    small.generate(_prompts(N), params)
    assert small.engine.num_compiles == compiles


def test_quest_metadata_is_a_fraction_of_the_key_cache():
    sparse = SparseKVConfig(mode="quest", num_dense_layers=1)
    cfg = configs.TINY
    bounds = ig.allocate_partial_keys(cfg, sparse, 10, 16, jnp.float32)
    assert bounds[0] is None and bounds[1].shape == (10, 2, cfg.num_kv_heads, cfg.head_dim)
    assert bounds[1].dtype == jnp.float32  # 2 rows per page of 16: 1/8 of the key cache


# ---- H2O -----------------------------------------------------------------------------------


def _h2o_reference(q, k, v, n0, sparse, scale):
    """H2O in numpy for one sequence: q, k, v [n, K, Q|1, H] for positions 0..n-1, a prefill of
    n0 tokens then one decode per position -> (outputs [n, K, Q, H], acc [n, K], evicted [n, K])."""
    n, K, Q, H = q.shape
    acc = np.zeros((n, K))
    evicted = np.zeros((n, K), bool)
    out = np.zeros((n, K, Q, H))
    cap = n if sparse.max_num_kv is None else sparse.max_num_kv
    for t in range(n):
        for h in range(K):
            if t < n0:
                keys = list(range(t + 1))
            else:
                recent = set(range(max(0, t - sparse.num_recent_tokens + 1), t + 1))
                sinks = {j for j in range(sparse.num_sink_tokens) if j not in recent and j < t}
                cand = [
                    j
                    for j in range(sparse.num_sink_tokens, t - sparse.num_recent_tokens + 1)
                    if not evicted[j, h]
                ]
                keep = sorted(cand, key=lambda j: -acc[j, h])[:cap]
                for j in cand:
                    evicted[j, h] |= j not in keep
                keys = sorted(sinks | recent | set(keep))
            s = np.einsum("qh,jh->qj", q[t, h], k[keys, h, 0]) * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[t, h] = p @ v[keys, h, 0]
            acc[keys, h] += p.sum(axis=0)
    return out, acc, evicted


@pytest.mark.parametrize("cap, n0, n", [(3, 9, 22), (6, 5, 25), (None, 7, 15)])
def test_h2o_matches_a_numpy_h2o(cap, n0, n):
    """A prefill, then decodes: the step functions (as sparse_forward runs them) give the
    outputs, accumulated attention and evictions of a plain H2O."""
    from llmjax.model.attention import token_seq_ids
    from llmjax.sparse import h2o

    rng = np.random.default_rng(n)
    K, Q, H, G = 2, 2, 8, 4
    sparse = SparseKVConfig(mode="h2o", max_num_kv=cap, num_sink_tokens=1, num_recent_tokens=3)
    q = rng.standard_normal((n, K, Q, H)).astype(np.float32)
    k = rng.standard_normal((n, K, 1, H)).astype(np.float32)
    v = rng.standard_normal((n, K, 1, H)).astype(np.float32)
    want, want_acc, want_evicted = _h2o_reference(q, k, v, n0, sparse, H**-0.5)
    P = -(-n // G)
    table = (rng.permutation(P + 2)[:P] + 1).tolist()
    num_pages = P + 3
    kp = jnp.zeros((num_pages, G, K, H))
    vp = jnp.zeros((num_pages, G, K, H))
    acc = jnp.zeros((num_pages, G, K))
    got = []
    for start, stop in [(0, n0)] + [(t, t + 1) for t in range(n0, n)]:
        step = make_step([([5] * (stop - start), start, table)], G, max_pages=P)
        slots = step.slot_mapping[: stop - start]
        kp = kp.reshape(-1, K, H).at[slots].set(k[start:stop, :, 0]).reshape(kp.shape)
        vp = vp.reshape(-1, K, H).at[slots].set(v[start:stop, :, 0]).reshape(vp.shape)
        acc = h2o.reset(acc, jnp.asarray(step.slot_mapping))
        qt = jnp.asarray(q[start:stop].reshape(stop - start, K * Q, H))
        T = len(step.token_ids)
        seq_ids = token_seq_ids(jnp.asarray(step.cu_q_lens), T)
        if start == 0:
            k_all = kp[jnp.asarray(step.page_indices).reshape(-1)]
            v_all = vp[jnp.asarray(step.page_indices).reshape(-1)]
            o, acc = h2o.dense_attention(qt, k_all, v_all, acc, step, seq_ids, H**-0.5, None)
        else:
            positions, valid, acc = h2o.select(acc, step, seq_ids[:1], sparse, None)
            table_row = jnp.asarray(step.page_indices)[0]
            row_slots = jnp.where(valid, table_row[positions // G] * G + positions % G, 0)
            k_rows = kp.reshape(-1, K, H)[row_slots, jnp.arange(K)[None, :, None]]
            v_rows = vp.reshape(-1, K, H)[row_slots, jnp.arange(K)[None, :, None]]
            o, probs = ig.sparse_attention(
                qt, k_rows, v_rows, valid, jnp.asarray(k[start:stop, :, 0]),
                jnp.asarray(v[start:stop, :, 0]), H**-0.5, with_probs=True,
            )  # fmt: skip
            own = jnp.broadcast_to(jnp.asarray(slots)[:, None, None], (1, K, 1))
            acc = h2o.accumulate(
                acc, probs, jnp.concatenate([row_slots, own], -1), jnp.ones(1, bool)
            )
        got.append(np.asarray(o)[: stop - start])
    got = np.concatenate(got).reshape(n, K, Q, H)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    flat = np.asarray(acc).reshape(-1, K)
    slots = np.array([table[j // G] * G + j % G for j in range(n)])
    np.testing.assert_array_equal(np.isneginf(flat[slots]), want_evicted)
    kept = ~want_evicted
    np.testing.assert_allclose(flat[slots][kept], want_acc[kept], rtol=1e-4, atol=1e-5)
    if cap is not None:
        assert want_evicted.any()  # the budget bit: something was evicted


def test_h2o_selecting_everything_equals_full_attention(params):
    sparse = SparseKVConfig(mode="h2o", **EVERYTHING)
    out = _run_both(params, (None, None), sparse, _steps(np.random.default_rng(4), 4), 4, 30, True)
    assert [s for *_, s, _ in out] == [False, False] + [True] * 3
    for logits, ref, *_ in out:
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_h2o_needs_unshared_pages():
    with pytest.raises(ValueError, match="prefix_cache='none'"):
        _base_llm().with_options(sparse_kv=SparseKVConfig(mode="h2o"))


def test_free_running_agreement_counts_tokens_before_the_first_difference(params):
    from llmjax.sparse.evaluate import agreed_prefix, greedy_continuations

    ref = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    run = np.array([[1, 2, 3, 4, 5], [1, 2, 9, 4, 5], [1, 2, 3, 9, 9]])
    assert agreed_prefix(run, ref, 2).tolist() == [3, 0, 1]  # after a 2-token prompt
    prompts = np.random.default_rng(7).integers(3, 256, (2, 20))
    full = greedy_continuations(params, CFG, prompts, 6, page_size=4)
    keep_all = SparseKVConfig(mode="oracle", pool_memory="device", **EVERYTHING)
    free = greedy_continuations(params, CFG, prompts, 6, page_size=4, sparse=keep_all)
    np.testing.assert_array_equal(free, full)
    assert agreed_prefix(free, full, 20).tolist() == [6, 6]


def test_eval_sparse_script_compares_modes_and_infinigen_variants(tmp_path):
    """scripts/eval_sparse.py on the tiny random model: one row per setting with its figures; a
    budget fetches less than full attention; the InfiniGen variants reach the configs."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "eval.json"
    cmd = [
        sys.executable, os.path.join(root, "scripts", "eval_sparse.py"), "--model=tiny",
        "--load_format=dummy", "--num_segments=2", "--context_lens=48", "--score_len=4",
        "--gen_len=3", "--calibration_tokens=64", "--modes=oracle,infinigen", "--budgets=0.25",
        "--num_dense_layers=1", "--num_recent_tokens=4", "--page_residuals=page_mid",
        "--query_sources=previous_layer,own_layer", f"--out={out}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["setting"]: r for r in json.load(open(out))["results"]}
    assert set(rows) == {
        "full",
        "oracle token 25%",
        "infinigen token a=5 r=0.2 mid 25%",
        "infinigen token a=5 r=0.2 own mid 25%",
    }
    assert rows["full"]["fetched_fraction"] == 1.0 and rows["full"]["greedy_agreement"] == 1.0
    own = rows["infinigen token a=5 r=0.2 own mid 25%"]
    assert (own["query_source"], own["page_residual"]) == ("own_layer", "page_mid")
    for name, r in rows.items():
        assert np.isfinite(r["perplexity"]) and 0 <= r["free_running_agreement"] <= 3
        if name != "full":
            assert r["fetched_fraction"] < 1.0, name
        assert name in proc.stdout


def test_sparse_divergence_script_reports_each_setting_per_prompt(tmp_path):
    """scripts/sparse_divergence.py on the tiny random model: per prompt and setting the tokens
    before the first difference, the agreement and KL against full attention; the oracle with a
    budget that keeps everything never differs."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "div.json"
    cmd = [
        sys.executable, os.path.join(root, "scripts", "sparse_divergence.py"), "--model=tiny",
        "--load_format=dummy", "--num_prompts=2", "--context_len=40", "--gen_len=4",
        "--max_num_kv=64", "--calibration_tokens=64", "--num_dense_layers=1",
        "--num_recent_tokens=4", "--settings=oracle,infinigen:alpha=inf", f"--out={out}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(out))["results"]
    assert {(r["setting"], r["prompt"]) for r in rows} == {
        (s, p) for s in ("oracle", "infinigen:alpha=inf") for p in (0, 1)
    }
    for r in rows:
        assert 0 <= r["free"] <= 4 and 0 <= r["agree"] <= 1 and r["kl"] >= -1e-9
        if r["setting"] == "oracle":  # 64 >= every cached token: full attention
            assert r["free"] == 4 and r["agree"] == 1.0 and r["kl"] < 1e-6
    assert "infinigen:alpha=inf" in proc.stdout
    bad = subprocess.run(
        [*cmd[:-2], "--settings=infinigen:alpha", f"--out={out}"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert bad.returncode != 0 and "not field=value" in bad.stderr

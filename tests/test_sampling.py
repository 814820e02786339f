"""SamplingParams validation and the on-device sampler."""

import jax.numpy as jnp
import numpy as np
import pytest

from llmjax import SamplingParams
from llmjax.model.sampler import greedy_ids, sample


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_accepts_one_string_or_a_list():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def _run(logits, temperature, top_k=0, top_p=1.0, seed=0, counter=0, all_greedy=False):
    S = logits.shape[0]
    full = lambda v, dt: jnp.full((S,), v, dt)
    return np.asarray(
        sample(
            jnp.asarray(logits, jnp.float32),
            full(temperature, jnp.float32),
            full(top_k, jnp.int32),
            full(top_p, jnp.float32),
            full(seed, jnp.uint32),
            full(counter, jnp.int32),
            all_greedy=all_greedy,
        )
    )


def _logits(rows=4, vocab=50, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * 2


def test_greedy_is_argmax_with_or_without_the_sort():
    logits = _logits()
    want = logits.argmax(-1)
    np.testing.assert_array_equal(_run(logits, 0.0, all_greedy=True), want)
    np.testing.assert_array_equal(_run(logits, 0.0, all_greedy=False), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_ids_is_jnp_argmax_with_ties_infinities_and_nans(dtype):
    import jax

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(12, 300)).astype(np.float32)
    logits[0, [7, 40, 299]] = logits[0].max() + 1  # a tie: the first wins
    logits[1, :] = -np.inf  # all -inf: position 0
    logits[2, [5, 9]] = np.inf
    logits[3, 11] = np.nan  # a NaN counts as the maximum
    logits[4, [20, 3]] = np.nan
    logits[5, 0] = logits[5].max() + 1
    logits[6, -1] = logits[6].max() + 1
    logits[7] = np.round(logits[7])  # many ties
    x = jnp.asarray(logits, dtype)
    got = jax.jit(greedy_ids)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits()
    want = logits.argmax(-1)
    for seed in range(5):
        np.testing.assert_array_equal(_run(logits, 1.0, top_k=1, seed=seed), want)
        np.testing.assert_array_equal(_run(logits, 1.0, top_p=1e-6, seed=seed), want)


def test_same_seed_same_token_whatever_the_batch():
    logits = _logits(rows=1, vocab=1000)
    alone = _run(logits, 1.0, seed=7, counter=3)[0]
    batched_logits = np.concatenate([_logits(rows=5, vocab=1000, seed=9), logits])
    S = batched_logits.shape[0]
    seeds = jnp.array([1, 2, 3, 4, 5, 7], jnp.uint32)
    counters = jnp.array([0, 1, 2, 3, 4, 3], jnp.int32)
    out = sample(
        jnp.asarray(batched_logits),
        jnp.ones(S),
        jnp.zeros(S, jnp.int32),
        jnp.ones(S),
        seeds,
        counters,
        all_greedy=False,
    )
    assert int(out[-1]) == int(alone)


def test_samples_follow_the_filtered_distribution():
    """Empirical frequencies over many seeds match softmax restricted by top-k and top-p."""
    vocab = 8
    logits = np.log(np.array([[0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01]], np.float32))
    n = 4000
    batch = np.repeat(logits, n, axis=0)
    seeds = jnp.arange(n, dtype=jnp.uint32)

    def frequencies(temperature, top_k, top_p):
        out = sample(
            jnp.asarray(batch),
            jnp.full(n, temperature),
            jnp.full(n, top_k, jnp.int32),
            jnp.full(n, top_p),
            seeds,
            jnp.zeros(n, jnp.int32),
            all_greedy=False,
        )
        return np.bincount(np.asarray(out), minlength=vocab) / n

    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(frequencies(1.0, 0, 1.0), p, atol=0.03)
    top3 = np.where(np.arange(vocab) < 3, p, 0) / p[:3].sum()
    np.testing.assert_allclose(frequencies(1.0, 3, 1.0), top3, atol=0.03)
    # top_p=0.7: 0.3 + 0.25 < 0.7 <= 0.3 + 0.25 + 0.2, so the first three tokens stay.
    np.testing.assert_allclose(frequencies(1.0, 0, 0.7), top3, atol=0.03)
    hot = np.exp(logits[0] / 0.5) / np.exp(logits[0] / 0.5).sum()
    np.testing.assert_allclose(frequencies(0.5, 0, 1.0), hot, atol=0.03)


def test_counter_changes_the_draw():
    logits = _logits(rows=1, vocab=1000)
    draws = {int(_run(logits, 2.0, seed=3, counter=c)[0]) for c in range(20)}
    assert len(draws) > 5


def _keep_reference(scaled, top_k, top_p, min_p):
    """numpy, row by row: min_p, then top-k, then top-p over the renormalized rest, on the row
    sorted descending with ties by token id (a stable sort)."""
    S, V = scaled.shape
    keep = np.zeros((S, V), bool)
    for i in range(S):
        x = scaled[i].astype(np.float64)
        alive = x >= x.max() + np.log(min_p[i]) if min_p[i] > 0 else np.ones(V, bool)
        order = np.argsort(-np.where(alive, x, -np.inf), kind="stable")
        n = int(alive.sum()) if top_k[i] <= 0 else min(int(top_k[i]), int(alive.sum()))
        top = order[:n]
        p = np.exp(x[top] - x[top].max())
        p /= p.sum()
        before = np.cumsum(p) - p
        keep[i, top[(before < top_p[i]) | (np.arange(n) == 0)]] = True
    return keep


@pytest.mark.parametrize("vocab", [50, 1000])
def test_kept_tokens_by_the_cap_or_by_bisection_equal_the_reference(vocab):
    """Top-k / top-p rows whose kept tokens rank within TRUNCATE_CAP (found with lax.top_k) and
    rows that keep more (thresholds found by bisection) keep exactly the reference's tokens, in
    one batch and with min_p, ties and -inf logits among them."""
    import jax

    from llmjax.model.sampler import TRUNCATE_CAP, _keep

    rng = np.random.default_rng(vocab)
    S = 10
    peaked = rng.normal(size=(S, vocab)).astype(np.float32) * np.linspace(0.2, 6, S)[:, None]
    peaked[3, :40] = peaked[3].max()  # ties at the top
    peaked[4, ::3] = -np.inf
    top_k = np.array([0, 5, 0, 0, 2, vocab // 2, 0, TRUNCATE_CAP + 7, 1, 0], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.95, 0.8, 0.9, 0.999, 1.0, 0.3, 1.0], np.float32)
    min_p = np.array([0, 0, 0.05, 0, 0, 0, 0, 0, 0, 0.2], np.float32)
    got = jax.jit(_keep)(peaked, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.asarray(got), _keep_reference(peaked, top_k, top_p, min_p))
    # The flattest rows (top_p 0.999, or top_k above the cap) went past the cap at 1000 tokens:
    assert vocab <= TRUNCATE_CAP or _keep_reference(peaked, top_k, top_p, min_p)[6].sum() > 256


def test_a_row_draws_the_same_token_whether_its_batch_ranks_or_sorts():
    """A row's token depends on its own logits, parameters, seed and counter only: alone, beside
    rows without top-k/top-p (no ranking), beside a top-k row (lax.top_k) and beside a row that
    goes past the cap (bisection), it draws the same tokens."""
    import jax

    jitted_sample = jax.jit(sample, static_argnames="all_greedy")  # one compile per batch size
    vocab = 2000
    rng = np.random.default_rng(5)
    row = (rng.normal(size=(1, vocab)) * 4).astype(np.float32)
    flat = rng.normal(size=(1, vocab)).astype(np.float32) * 0.1

    def draw(others, temps, ks, ps, seed):
        logits = np.concatenate([row, *others])
        S = logits.shape[0]
        out = jitted_sample(
            jnp.asarray(logits),
            jnp.array([0.8, *temps], jnp.float32),
            jnp.array([0, *ks], jnp.int32),
            jnp.array([0.9, *ps], jnp.float32),
            jnp.array([seed] + [99] * (S - 1), jnp.uint32),
            jnp.zeros(S, jnp.int32),
            all_greedy=False,
        )
        return int(out[0])

    for seed in range(6):
        alone = draw([], [], [], [], seed)
        assert draw([flat], [1.0], [0], [1.0], seed) == alone  # nothing to rank
        assert draw([flat], [1.0], [3], [1.0], seed) == alone  # ranked within the cap
        assert draw([flat], [1.0], [0], [0.99], seed) == alone  # past the cap: bisection
        assert draw([flat, flat], [0.0, 1.0], [1, 0], [0.5, 0.999], seed) == alone


def test_samples_follow_the_distribution_over_a_large_vocabulary():
    """Frequencies of tokens drawn by the inverse CDF over 20000 seeds match the filtered
    softmax at a vocabulary past TRUNCATE_CAP: top-k within the cap, top-p that needs the full
    sort, and no filter."""
    vocab, n = 600, 20000
    rng = np.random.default_rng(2)
    logits = np.full((1, vocab), -2.0, np.float32) + rng.normal(size=(1, vocab)) * 0.3
    logits[0, :4] = [3.0, 2.5, 2.0, 1.0]
    batch = np.repeat(logits, n, axis=0)
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()

    def frequencies(top_k, top_p):
        out = sample(
            jnp.asarray(batch),
            jnp.ones(n),
            jnp.full(n, top_k, jnp.int32),
            jnp.full(n, top_p),
            jnp.arange(n, dtype=jnp.uint32),
            jnp.zeros(n, jnp.int32),
            all_greedy=False,
        )
        return np.bincount(np.asarray(out), minlength=vocab) / n

    f = frequencies(0, 1.0)
    np.testing.assert_allclose(f[:4], p[:4], atol=0.015)
    np.testing.assert_allclose(f[4:].sum(), p[4:].sum(), atol=0.015)
    top3 = np.where(np.arange(vocab) < 3, p, 0) / p[:3].sum()
    np.testing.assert_allclose(frequencies(3, 1.0), top3, atol=0.015)
    f = frequencies(0, 0.995)  # keeps most of the tail: past the cap, by bisection
    kept = _keep_reference(logits, np.zeros(1, np.int32), np.array([0.995], np.float32),
                           np.zeros(1, np.float32))[0]  # fmt: skip
    assert kept.sum() > 256 and f[~kept].sum() == 0
    q = np.where(kept, p, 0) / p[kept].sum()
    np.testing.assert_allclose(f[:4], q[:4], atol=0.015)

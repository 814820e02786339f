"""Speculative decoding (issue 24, item 3): prompt lookup against a plain search; the device
verification against numpy (greedy) and against the target distribution (chi-square over fixed
seeds, on synthetic logits and on a 16-token model); greedy outputs identical with and without
it under every policy, with preemption, stops and mixed batches; an oracle proposer accepted
every time; no page kept; bounded compiles; the errors.

(The scheduler's property tests, tests/test_scheduler_properties.py, have a speculative mode:
random workloads, preemption and aborts with a fake model, invariants after every step.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from configs.tiny import TINY
from llmjax import LLM, SamplingParams
from llmjax.config import (
    SCHEDULER_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from llmjax.engine.engine import LLMEngine
from llmjax.engine.speculative import Speculator, ngram_proposals
from llmjax.model.params import init_params
from llmjax.model.sampler import sample, verify_proposals
from tests.helpers import full_logits, tiny_llm

# ---- prompt lookup --------------------------------------------------------------------------


def _plain_lookup(tokens, min_n, max_n, k):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, not the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_ngram_proposals_equal_a_plain_search(tokens, min_n, extra, k):
    got = ngram_proposals(tokens, min_n, min_n + extra, k)
    assert got == _plain_lookup(tokens, min_n, min_n + extra, k)
    assert len(got) <= k


def test_ngram_proposals_take_the_longest_match_and_its_latest_occurrence():
    t = [1, 2, 3, 9, 7, 2, 3, 5, 8, 1, 2, 3]
    assert ngram_proposals(t, 1, 3, 2) == [9, 7]  # "1 2 3" occurs at 0
    assert ngram_proposals(t, 1, 2, 2) == [5, 8]  # "2 3": the latest earlier one, at 5
    assert ngram_proposals([4, 5, 6], 1, 3, 3) == []


# ---- the device verification ------------------------------------------------------------------


def _layout(ks, K):
    """Rows laid out as batch.pack does: sequence i has ks[i] + 1 rows from first_rows[i]."""
    first = np.cumsum([0] + [k + 1 for k in ks[:-1]]).astype(np.int32)
    return first, sum(k + 1 for k in ks)


def _verify(logits, ks, proposals, *sampling):
    """verify_proposals over `logits` rows laid out as `_layout` says (rows past them pad)."""
    K = proposals.shape[1]
    first, _ = _layout(list(ks), K)
    R = logits.shape[0]
    row_seq = np.zeros(R, np.int32)
    row_pos = np.full(R, K + 1, np.int32)
    for i, k in enumerate(ks):
        row_seq[first[i] : first[i] + k + 1] = i
        row_pos[first[i] : first[i] + k + 1] = np.arange(k + 1)
    tokens, accepted = verify_proposals(
        jnp.asarray(logits), None, first, row_seq, row_pos, proposals,
        np.asarray(ks, np.int32), *sampling,
    )  # fmt: skip
    return np.asarray(tokens), np.asarray(accepted)


@pytest.mark.parametrize("V, K, ks", [(16, 3, [3, 0, 2, 1]), (97, 4, [4, 4]), (300, 1, [1, 0, 1])])
def test_greedy_verification_equals_numpy(V, K, ks):
    rng = np.random.default_rng(V)
    first, R = _layout(ks, K)
    logits = rng.normal(size=(R + 3, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    S = len(ks)
    proposals = np.full((S, K), -1, np.int32)
    for i, k in enumerate(ks):  # a random number of proposals right, then a wrong one
        right = rng.integers(0, k + 1)
        for j in range(k):
            t = argmax[first[i] + j]
            proposals[i, j] = t if j < right else (t + 1 + rng.integers(0, V - 1)) % V
    zeros = np.zeros(S, np.float32)
    tokens, accepted = _verify(
        logits, ks, proposals, zeros, zeros.astype(np.int32), zeros + 1,
        np.arange(S, dtype=np.uint32), zeros.astype(np.int32), True,
    )  # fmt: skip
    for i, k in enumerate(ks):
        a = 0
        while a < k and proposals[i, a] == argmax[first[i] + a]:
            a += 1
        assert accepted[i] == a
        assert tokens[i, : a + 1].tolist() == argmax[first[i] : first[i] + a + 1].tolist()


def _probs(logits, temperature, top_k=0):
    x = logits.astype(np.float64) / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


def _chi2_pvalue(counts, probs):
    """Pearson's chi-square p-value of `counts` against `probs`, merging categories whose
    expected count is under 5 (and requiring zero counts where the probability is 0)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small & (probs > 0)], counts[small].sum())
    exp = np.append(expected[~small & (probs > 0)], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return scipy_stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize(
    "case",
    ["likely proposals", "unlikely proposals", "proposal outside top_k", "greedy rows mixed"],
)
def test_sampled_verification_keeps_the_target_distribution(case):
    """Many sequences (seeds) verify the same two proposals over the same rows: the first token
    has the row's distribution, the second (after an acceptance) the next row's, and the first
    proposal is accepted with its probability."""
    V, N, K, temperature, top_k = 8, 20000, 2, 0.8, 0
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    if case == "likely proposals":
        x = [int(np.argmax(rows[0])), int(np.argmax(rows[1]))]
    elif case == "unlikely proposals":
        x = [int(np.argmin(rows[0])), int(np.argsort(rows[1])[1])]
    else:
        x = [int(np.argsort(rows[0])[2]), int(np.argmin(rows[1]))]
        top_k = 3 if case == "proposal outside top_k" else 0
    p0, p1, p2 = (_probs(r, temperature, top_k) for r in rows)
    logits = np.tile(rows, (N, 1))  # sequence i's rows at 3i .. 3i + 2
    proposals = np.tile(np.array(x, np.int32), (N, 1))
    temp = np.full(N, temperature, np.float32)
    if case == "greedy rows mixed":
        temp[::7] = 0.0  # every 7th sequence greedy: argmax, whatever the seed
    counters = np.full(N, 5, np.int32)
    tokens, accepted = _verify(
        logits, [K] * N, proposals, temp, np.full(N, top_k, np.int32),
        np.ones(N, np.float32), np.arange(N, dtype=np.uint32), counters, False,
    )  # fmt: skip
    random = temp > 0
    if case == "greedy rows mixed":
        g = ~random
        a0 = x[0] == np.argmax(rows[0])
        assert (tokens[g, 0] == np.argmax(rows[0])).all() and (accepted[g] >= a0).all()
    tokens, accepted = tokens[random], accepted[random]
    first_tokens = tokens[:, 0]
    assert _chi2_pvalue(np.bincount(first_tokens, minlength=V), p0) > 1e-3
    # a rejection never returns the proposal: token 0 == x0 exactly when it was accepted
    assert ((first_tokens == x[0]) == (accepted >= 1)).all()
    n = len(first_tokens)
    assert abs((accepted >= 1).mean() - p0[x[0]]) <= 4 * np.sqrt(p0[x[0]] * (1 - p0[x[0]]) / n)
    after = accepted >= 1
    if after.sum() > 200:
        second = tokens[after, 1]
        assert _chi2_pvalue(np.bincount(second, minlength=V), p1) > 1e-3
    both = accepted == 2
    if both.sum() > 200:  # the bonus token, sampled from the third row
        assert _chi2_pvalue(np.bincount(tokens[both, 2], minlength=V), p2) > 1e-3


def test_rows_without_proposals_sample_exactly_as_the_plain_sampler():
    V, S, K = 50, 6, 3
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(S, V)).astype(np.float32)
    temperature = np.array([0.0, 0.7, 1.0, 1.3, 0.5, 0.9], np.float32)
    top_k = np.array([0, 5, 0, 10, 0, 3], np.int32)
    top_p = np.array([1.0, 1.0, 0.8, 0.9, 1.0, 1.0], np.float32)
    seeds = rng.integers(0, 2**32, S).astype(np.uint32)
    counters = rng.integers(0, 100, S).astype(np.int32)
    want = sample(jnp.asarray(logits), temperature, top_k, top_p, seeds, counters, False)
    tokens, accepted = _verify(
        logits, [0] * S, np.full((S, K), -1, np.int32), temperature, top_k, top_p, seeds,
        counters, False,
    )  # fmt: skip
    assert tokens[:, 0].tolist() == np.asarray(want).tolist()
    assert not accepted.any()


# ---- the engine ----------------------------------------------------------------------------------


def _llm():
    return tiny_llm(128)


# adaptive=False: every proposal verified (the adaptive choice depends on measured step times)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
# Repetitive prompts (the tiny random model soon repeats itself too), and one that is not.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(10, 40)), [3, 4] * 10, [9, 100, 17, 250, 31]]


def _same_outputs(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_greedy_outputs_are_identical_with_speculation_under_every_policy(policy):
    opts = dict(scheduler_policy=policy)
    if policy in ("prefill_first", "decode_first"):
        opts["max_num_batched_tokens"] = 128
    plain = _llm().with_options(**opts)
    spec = _llm().with_options(speculative_config=NGRAM, **opts)
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=7, ignore_eos=True),  # ends inside a verification's tokens
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=25, ignore_eos=True),
    ]
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    _same_outputs(want, got)
    stats = spec.engine.stats
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens > 0
    assert stats.spec_acceptance_rate < 1  # some were rejected, and rolled back
    assert stats.num_steps < plain.engine.stats.num_steps
    for out in got:
        state = out.metrics.spec_decode
        assert state.num_decode_tokens == len(out.token_ids) - 1  # the first came from prefill
    bm = spec.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_speculation_with_preemption_stops_and_a_prefix_cache_keeps_greedy_outputs():
    # 24 usable pages of 4 tokens for 6 requests of up to 70 tokens: decodes preempt.
    opts = dict(num_pages=25, max_num_seqs=6)
    plain = _llm().with_options(**opts)
    spec = _llm().with_options(speculative_config=NGRAM, **opts)
    prompts = [*PROMPTS, [5, 6, 7, 8] * 3, [3, 4] * 4]
    first = plain.generate(prompts[:1], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_at = first.token_ids[20]  # a token the first request meets mid-run
    params = [
        SamplingParams(max_tokens=40, stop_token_ids=[stop_at], ignore_eos=True),
        *[SamplingParams(max_tokens=40, ignore_eos=True)] * 5,
    ]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    _same_outputs(want, got)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop_at
    assert spec.engine.stats.num_preemptions > 0
    assert spec.engine.stats.num_spec_accepted_tokens > 0
    bm = spec.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


def test_mixed_batches_with_processing_rows_keep_outputs():
    spec = _llm().with_options(speculative_config=NGRAM)
    plain = _llm().with_options()
    params = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),  # one token a step
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, ignore_eos=True, seed=3, temperature=0.8),
    ]
    want = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in want[:3]] == [o.token_ids for o in got[:3]]
    assert got[1].logprobs is not None and len(got[1].logprobs) == 12
    # the sampled request is not token-identical (rejection sampling draws differently) but
    # it is seeded: the same again
    again = _llm().with_options(speculative_config=NGRAM).generate(PROMPTS, params)
    assert again[3].token_ids == got[3].token_ids
    assert spec.engine.stats.num_spec_accepted_tokens > 0
    for out, p in zip(got, params, strict=True):
        state = out.metrics.spec_decode
        if p.logprobs is not None or p.repetition_penalty != 1:
            assert state.num_drafts == 0  # never speculated
        assert state.num_decode_tokens == len(out.token_ids) - 1
    # a step that computes prompt logprobs verifies nothing, and its outputs are unchanged
    params[1] = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    prompts = [PROMPTS[0], list(range(60, 120)), *PROMPTS[2:]]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in want[:3]] == [o.token_ids for o in got[:3]]
    assert got[1].prompt_logprobs == want[1].prompt_logprobs


def test_speculated_sampling_is_batch_invariant():
    params = SamplingParams(max_tokens=24, ignore_eos=True, seed=11, temperature=0.9)
    alone = _llm().with_options(speculative_config=NGRAM).generate(PROMPTS[:1], params)[0]
    others = [SamplingParams(max_tokens=20, ignore_eos=True)] * 3
    mixed = _llm().with_options(speculative_config=NGRAM).generate(PROMPTS, [params, *others])
    assert mixed[0].token_ids == alone.token_ids


class _Oracle(Speculator):
    """Proposes the next tokens of known greedy outputs (a draft equal to the target)."""

    def __init__(self, config, outputs: dict[tuple, list[int]]):
        super().__init__(config)
        self.outputs = outputs

    def propose(self, req, max_k):
        k = min(max_k, self.config.num_speculative_tokens)
        done = len(req.output_token_ids)
        return self.outputs[tuple(req.prompt_token_ids)][done : done + k]


def test_an_oracle_proposer_is_accepted_every_time():
    params = SamplingParams(max_tokens=31, ignore_eos=True)
    want = _llm().generate(PROMPTS, params)
    spec = _llm().with_options(speculative_config=dict(NGRAM, num_speculative_tokens=4))
    outputs = {tuple(p): o.token_ids for p, o in zip(PROMPTS, want, strict=True)}
    oracle = _Oracle(spec.config.speculative, outputs)
    spec.engine.speculator = spec.engine.scheduler.speculator = oracle
    got = spec.generate(PROMPTS, params)
    _same_outputs(want, got)
    stats = spec.engine.stats
    assert stats.spec_acceptance_rate == 1.0
    assert stats.spec_mean_accepted_length == 5.0  # 30 tokens after the first: 6 x (4 + 1)
    for out in got:
        assert out.metrics.spec_decode.tokens_per_decode_step > 4


# ---- the target distribution on a 16-token model ----------------------------------------------

SMALL = TINY.replace(vocab_size=16, name="tiny-v16")


def _small_engine(spec: SpeculativeConfig, params) -> LLMEngine:
    config = EngineConfig(
        model=SMALL,
        cache=CacheConfig(page_size=4, prefix_cache="none"),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256),
        max_model_len=32,
        compilation_cache_dir="",
        speculative=spec,
    )
    return LLMEngine(config, params, num_pages=64 * 4 + 1)


class _ArgmaxOracle(Speculator):
    """Proposes what greedy decoding would: each proposal the reference forward's argmax."""

    def __init__(self, config, weights):
        super().__init__(config)
        self.weights = weights

    @functools.cache  # noqa: B019 (a test's small cache)
    def _greedy(self, tokens: tuple, k: int) -> list[int]:
        seq, out = list(tokens), []
        for _ in range(k):
            out.append(int(np.argmax(full_logits(self.weights, SMALL, seq)[-1])))
            seq.append(out[-1])
        return out

    def propose(self, req, max_k):
        k = min(max_k, self.config.num_speculative_tokens)
        return self._greedy(tuple(req.token_ids_slice(0, req.num_tokens)), k)


def test_speculative_sampling_matches_the_model_distribution():
    """4000 seeded requests, temperature 0.8, the first three tokens of each, with proposals
    that are the greedy continuation (accepted often): each token's distribution given the
    ones before is the reference forward's softmax (chi-square per position, over the
    prefixes drawn most)."""
    weights = init_params(SMALL, jax.random.key(4))
    prompt = [3, 9, 4, 11, 5]
    temperature, N = 0.8, 4000
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)
    engine = _small_engine(cfg, weights)
    engine.speculator = engine.scheduler.speculator = _ArgmaxOracle(cfg, engine.runner.params)
    for i in range(N):
        params = SamplingParams(max_tokens=3, seed=i, temperature=temperature, ignore_eos=True)
        engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == N
    assert engine.stats.num_spec_accepted_tokens > 0.2 * engine.stats.num_spec_draft_tokens
    samples = [tuple(o.token_ids) for o in outs]
    ref_params = engine.runner.params
    for pos in range(3):
        by_prefix: dict[tuple, list[int]] = {}
        for s in samples:
            by_prefix.setdefault(s[:pos], []).append(s[pos])
        tested = 0
        for prefix, nexts in sorted(by_prefix.items(), key=lambda kv: -len(kv[1]))[:3]:
            if len(nexts) < 200:
                break
            logits = full_logits(ref_params, SMALL, prompt + list(prefix))[-1]
            p = _probs(logits, temperature)
            assert _chi2_pvalue(np.bincount(nexts, minlength=16), p) > 1e-3, (pos, prefix)
            tested += 1
        assert tested >= 1


# ---- errors and compiles -------------------------------------------------------------------------


def test_bad_speculative_configs_are_named():
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.coerce({"method": "ngram", "num_lookahead": 3})
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be positive"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    base = EngineConfig(model=TINY, compilation_cache_dir="")
    ngram = SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match="speculative decoding needs pp == 1"):
        base.replace(speculative=ngram, parallel=base.parallel.__class__(pp=2))
    with pytest.raises(ValueError, match="needs sparse_kv='none'"):
        base.replace(speculative=ngram, sparse_kv=base.sparse_kv.__class__(mode="offload"))
    with pytest.raises(TypeError, match="must be a dict"):
        SpeculativeConfig.coerce("ngram")


def test_speculation_compiles_one_more_variant_per_bucket_and_never_again():
    spec = _llm().with_options(speculative_config=NGRAM)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    spec.generate(PROMPTS, params)
    runner = spec.engine.runner
    compiles, sample_compiles = runner.num_compiles, runner.num_sample_compiles
    spec.engine.reset_prefix_cache()  # the same steps again
    spec.generate(PROMPTS, params)
    assert (runner.num_compiles, runner.num_sample_compiles) == (compiles, sample_compiles)
    spec.generate(PROMPTS[::-1], params)  # may meet new buckets, each at most twice
    assert runner.num_compiles <= 2 * len(spec.engine.buckets.shapes())


# ---- the early-exit draft --------------------------------------------------------------------


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_the_first_layers_forward_equals_a_model_cut_to_them(layer_loop):
    """forward(num_layers=d) = the same weights cut to d layers (final norm and head kept), and
    the other layers' KV pages are untouched."""
    from llmjax.model.kv_cache import allocate_kv_pages
    from llmjax.model.llama import forward
    from llmjax.model.params import stack_layers, unstack_layers
    from tests.helpers import make_step

    config = TINY.replace(num_layers=3)
    params = unstack_layers(init_params(config, jax.random.key(7)))
    cut = dict(params, layers=params["layers"][:2])
    stacked = layer_loop == "scan"
    if stacked:
        params, cut = stack_layers(params), stack_layers(cut)
    step = make_step([([5, 9, 3, 7], 0, [1, 2]), ([11, 4], 0, [3])], 4, num_tokens=8)
    kv = allocate_kv_pages(config, 8, 4, jnp.float32, stacked=stacked)
    kv_cut = allocate_kv_pages(config.replace(num_layers=2), 8, 4, jnp.float32, stacked=stacked)
    got, kv_after = forward(params, kv, step, config, num_layers=2)
    want, _ = forward(cut, kv_cut, step, config.replace(num_layers=2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if stacked:  # layer 2's pages are the last third of the stacked cache: still zeros
        assert not np.asarray(kv_after[0][16:]).any() and np.asarray(kv_after[0][:16]).any()
    else:
        assert not np.asarray(kv_after[2][0]).any() and np.asarray(kv_after[1][0]).any()


DRAFT = {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_a_draft_with_every_layer_is_the_target_and_always_accepted(layer_loop):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _llm().with_options(layer_loop=layer_loop)
    full = _llm().with_options(
        layer_loop=layer_loop, speculative_config=dict(DRAFT, num_draft_layers=TINY.num_layers)
    )
    _same_outputs(plain.generate(PROMPTS, params), full.generate(PROMPTS, params))
    assert full.engine.stats.spec_acceptance_rate == 1.0
    assert full.engine.stats.spec_mean_accepted_length > 3


def test_an_early_exit_draft_keeps_greedy_outputs_with_preemption():
    opts = dict(num_pages=25, max_num_seqs=6)
    prompts = [*PROMPTS, [5, 6, 7, 8] * 3, [3, 4] * 4]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _llm().with_options(**opts).generate(prompts, params)
    spec = _llm().with_options(speculative_config=dict(DRAFT, num_draft_layers=1), **opts)
    got = spec.generate(prompts, params)
    _same_outputs(want, got)
    stats = spec.engine.stats
    assert stats.num_preemptions > 0 and stats.num_spec_draft_tokens > 0
    assert 0 < stats.spec_acceptance_rate < 1
    runner = spec.engine.runner
    compiles = (runner.num_compiles, runner.num_sample_compiles, runner.num_draft_compiles)
    spec.engine.reset_prefix_cache()
    spec.generate(prompts, params)
    assert (runner.num_compiles, runner.num_sample_compiles, runner.num_draft_compiles) == compiles
    bm = spec.engine.block_manager
    bm.check_invariants()
    assert bm.num_available_pages == bm.num_usable_pages


# ---- the adaptive choice -----------------------------------------------------------------------


def _selector(seconds: dict[int, float], acceptance: float) -> Speculator:
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    spec.token_bucket = lambda n: 1 << (n - 1).bit_length()  # powers of two, as the engine's
    for T, s in seconds.items():
        spec.cost.observe(T, s)
    spec.cost.acceptance = acceptance
    return spec


class _Req:
    def __init__(self, accepted: int, proposed: int):
        from llmjax.engine.request import RequestMetrics
        from llmjax.engine.speculative import SpecState

        self.metrics = RequestMetrics(0.0)
        self.metrics.spec_decode = SpecState(
            num_draft_tokens=proposed, num_accepted_tokens=accepted
        )


def test_adaptive_selection_weighs_acceptance_against_the_measured_step_cost():
    offers = [(_Req(30, 40), [1, 2, 3, 4]) for _ in range(8)]  # 8 decodes, acceptance ~0.7
    flat = _selector({8: 1.0, 64: 1.0}, 0.7)  # verification rows cost nothing more
    assert flat.select(offers, 8, 8) == [4] * 8
    steep = _selector({8: 1.0, 16: 2.0, 32: 4.0, 64: 8.0}, 0.7)  # cost grows with every row
    assert steep.select(offers, 8, 8) == [0] * 8
    # a cheap next bucket: keep what fits in 16 rows, the likeliest requests first
    bucket = _selector({8: 1.0, 16: 1.05, 32: 2.0, 64: 4.0}, 0.7)
    offers[3] = (_Req(39, 40), [1, 2, 3, 4])  # this one is almost always right
    kept = bucket.select(offers, 8, 8)
    assert 0 < sum(kept) <= 8 and kept[3] == max(kept)
    # poor acceptance: nothing is worth even a cheap bucket
    poor = [(_Req(1, 40), [1, 2, 3, 4]) for _ in range(8)]
    assert _selector({8: 1.0, 16: 1.2, 32: 2.0}, 0.05).select(poor, 8, 8) == [0] * 8
    # one decode at batch 1 on a memory-bound device: speculate
    assert _selector({1: 1.0, 8: 1.1}, 0.5).select(offers[:1], 1, 1) == [4]
    # before two sizes are measured, steps alternate between all and nothing
    fresh = _selector({}, 0.5)
    assert [fresh.select(offers, 8, 8) for _ in range(2)] == [[4] * 8, [0] * 8]
    fresh.cost.observe(8, 1.0)
    assert not fresh.cost.fitted
    fresh.config = fresh.config.__class__(method="ngram", adaptive=False)
    assert fresh.select(offers, 8, 8) == [4] * 8


def test_speculation_with_tensor_parallelism_equals_one_device():
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _llm().generate(PROMPTS, params)
    for config in (NGRAM, dict(DRAFT, num_draft_layers=1)):
        sharded = LLM(
            "tiny",
            load_format="dummy",
            tp=2,
            page_size=4,
            max_num_batched_tokens=32,
            max_num_seqs=8,
            max_model_len=128,
            compilation_cache_dir="",
            speculative_config=config,
        )
        _same_outputs(want, sharded.generate(PROMPTS, params))
        assert sharded.engine.stats.num_spec_accepted_tokens > 0


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=50),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_the_incremental_ngram_index_equals_the_plain_search(tokens, min_n, extra, k, steps):
    """As a request's tokens grow a few at a time (a verification appends several), every
    lookup equals the plain search over all of them."""
    from llmjax.engine.speculative import NgramIndex

    class _Growing:
        def __init__(self, ids):
            self.ids = ids

        @property
        def num_tokens(self):
            return len(self.ids)

        def token_ids_slice(self, a, b):
            return self.ids[a:b]

    index = NgramIndex(min_n, min_n + extra)
    n = 1
    for grow in [0, *steps]:
        n = min(len(tokens), n + grow)
        req = _Growing(tokens[:n])
        assert index.propose(req, k) == _plain_lookup(tokens[:n], min_n, min_n + extra, k)

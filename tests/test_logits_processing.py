"""Logits processing and logprobs (issue 24, item 1): vLLM's penalties, logit_bias, min_tokens
and min_p against a plain numpy implementation of their definitions on random logits and token
histories; logprobs against the log-softmax of the reference forward; greedy decoding with
penalties against a numpy decode loop over the tiny model; batch invariance under every policy;
the errors; bounded compilation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny import TINY
from llmjax import LLM, SamplingParams
from llmjax.model.sampler import process_logits, sample_processed
from tests.helpers import full_logits, tiny_llm

# ---- the definitions, in numpy (vLLM's apply_penalties, logit_bias, min_p) --------------------


def numpy_process(logits, bias, prompt, output, presence, frequency, repetition):
    """One row: logit_bias added, then the repetition penalty on tokens of the prompt or the
    output (divide if > 0, else multiply), frequency x count and presence x (count > 0)."""
    x = logits.astype(np.float64).copy()
    for token, value in bias:
        x[token] += value
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)[: x.size]
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    rep = np.where(seen, repetition, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    return x - frequency * counts - presence * (counts > 0)


def _device_rows(rows, V, B=8, L=32):
    """rows: [(logits, bias, prompt, output, presence, frequency, repetition)] -> the arrays."""
    S = len(rows)
    a = dict(
        logits=np.stack([r[0] for r in rows]).astype(np.float32),
        bias_ids=np.full((S, B), -1, np.int32),
        bias_values=np.zeros((S, B), np.float32),
        history_ids=np.full((S, L), -1, np.int32),
        history_is_output=np.zeros((S, L), bool),
        presence=np.zeros(S, np.float32),
        frequency=np.zeros(S, np.float32),
        repetition=np.ones(S, np.float32),
    )
    for i, (_, bias, prompt, output, pres, freq, rep) in enumerate(rows):
        for k, (t, v) in enumerate(bias):
            a["bias_ids"][i, k], a["bias_values"][i, k] = t, v
        hist = list(prompt) + list(output)
        a["history_ids"][i, : len(hist)] = hist
        a["history_is_output"][i, len(prompt) : len(hist)] = True
        a["presence"][i], a["frequency"][i], a["repetition"][i] = pres, freq, rep
    return a


@pytest.mark.parametrize("V, S", [(16, 1), (97, 3), (512, 5)])
def test_processing_equals_the_numpy_definitions(V, S):
    rng = np.random.default_rng(V + S)
    rows = []
    for _ in range(S):
        logits = rng.normal(0, 3, V)
        logits[rng.integers(0, V, 3)] = 0.0  # exact zeros: neither divided nor multiplied
        prompt = rng.integers(0, V, rng.integers(0, 10)).tolist()
        output = rng.integers(0, V, rng.integers(0, 20)).tolist()  # repeats: counts > 1
        tokens, values = rng.integers(0, V, 4), rng.normal(0, 5, 4)
        bias = [(int(t), float(v)) for t, v in zip(tokens, values, strict=True)]
        bias.append((bias[0][0], 1.5))  # the same token twice: both add
        pen = (rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.5, 2.0))
        rows.append((logits, bias, prompt, output, *pen))
    a = _device_rows(rows, V)
    got = np.asarray(process_logits(**{k: jnp.asarray(v) for k, v in a.items()}))
    want = np.stack([numpy_process(*r) for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_neutral_rows_are_untouched():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, 64)).astype(np.float32)
    a = _device_rows([(row, [], [1, 2], [3, 3], 0.0, 0.0, 1.0) for row in logits], 64)
    got = np.asarray(process_logits(**{k: jnp.asarray(v) for k, v in a.items()}))
    np.testing.assert_array_equal(got, logits)


def _processed(logits, temperature, min_p, seeds, counters, num_logprobs=0):
    S, V = logits.shape
    a = _device_rows([(row, [], [], [], 0.0, 0.0, 1.0) for row in logits], V)
    return sample_processed(
        jnp.asarray(logits),
        jnp.asarray(temperature, jnp.float32),
        jnp.zeros(S, jnp.int32),
        jnp.ones(S, jnp.float32),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(counters, jnp.int32),
        jnp.asarray(min_p, jnp.float32),
        *(jnp.asarray(a[k]) for k in ("bias_ids", "bias_values", "history_ids")),
        jnp.asarray(a["history_is_output"]),
        *(jnp.asarray(a[k]) for k in ("presence", "frequency", "repetition")),
        num_logprobs=num_logprobs,
    )


def test_min_p_keeps_exactly_the_tokens_above_the_fraction_of_the_top():
    rng = np.random.default_rng(1)
    V, n = 12, 4000
    row = rng.normal(0, 1.5, V).astype(np.float32)
    temperature, min_p = 0.7, 0.3
    probs = np.exp(row / temperature - np.max(row / temperature))
    probs /= probs.sum()
    allowed = probs >= min_p * probs.max()
    assert 1 < allowed.sum() < V
    logits = np.repeat(row[None], n, 0)
    ids, _ = _processed(
        logits, np.full(n, temperature), np.full(n, min_p), np.arange(n), np.zeros(n)
    )
    seen = np.bincount(np.asarray(ids), minlength=V)
    assert set(np.flatnonzero(seen)) == set(np.flatnonzero(allowed))
    # The kept tokens in their renormalized proportions (chi-square, loose).
    p = np.where(allowed, probs, 0) / probs[allowed].sum()
    expected = p[allowed] * n
    chi2 = ((seen[allowed] - expected) ** 2 / expected).sum()
    assert chi2 < 40, chi2


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (3, 50)).astype(np.float32)
    ids, (top_ids, top_values, chosen, rank) = _processed(
        logits, np.zeros(3), np.zeros(3), np.zeros(3), np.zeros(3), num_logprobs=5
    )
    x = logits.astype(np.float64)
    want = x - x.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    order = np.argsort(-logits, axis=-1)
    np.testing.assert_array_equal(np.asarray(top_ids), order[:, :5])
    np.testing.assert_allclose(top_values, np.take_along_axis(want, order[:, :5], -1), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), order[:, 0])  # greedy
    np.testing.assert_allclose(chosen, np.asarray(want).max(-1), atol=1e-5)
    assert np.asarray(rank).tolist() == [1, 1, 1]


# ---- through the engine -----------------------------------------------------------------------


def _llm():
    return tiny_llm(96)


def _reference_decode(prompt, params: SamplingParams, n: int, proposed: list[int]):
    """Greedy decoding with the processing in numpy over the reference forward: the tokens and
    each step's raw log-softmax. The forward runs once, over prompt + `proposed` (the engine's
    tokens): the model is causal, so while the reference's tokens equal the proposed ones its
    logits at each step are that pass's; it stops at the first token that differs (returned, so
    the comparison fails there)."""
    llm = _llm()
    weights = llm.engine.runner.params
    raws = full_logits(weights, TINY, list(prompt) + list(proposed[: n - 1]))
    out, logps = [], []
    for step in range(n):
        raw = raws[len(prompt) - 1 + step].astype(np.float64)
        bias = list(params.logit_bias)
        if len(out) < params.min_tokens:
            bias += [(t, -np.inf) for t in params.stop_token_ids]
        x = numpy_process(
            raw, bias, prompt, out, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty,
        )  # fmt: skip
        token = int(np.argmax(x))
        logps.append(raw - raw.max() - np.log(np.exp(raw - raw.max()).sum()))
        out.append(token)
        if token != proposed[step]:
            break
    return out, logps


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 40, 41, 40], list(range(100, 137)), [7, 7, 7]]


def _params(i: int) -> SamplingParams:
    kinds = [
        dict(repetition_penalty=1.8, logprobs=3),
        dict(frequency_penalty=1.5, presence_penalty=-0.5, logprobs=0),
        dict(logit_bias={17: 3.0, 23: -4.0}, repetition_penalty=0.7),
        dict(presence_penalty=2.0, min_tokens=4, stop_token_ids=[9, 11]),
    ]
    return SamplingParams(max_tokens=8, ignore_eos=True, **kinds[i % len(kinds)])


def test_greedy_with_processing_equals_the_numpy_decode_loop_and_logprobs_the_forward():
    outs = _llm().generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    plain = _llm().generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    changed = [a.token_ids != b.token_ids for a, b in zip(outs, plain, strict=True)]
    assert sum(changed) >= 2, changed  # the processing matters on these prompts
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        params = _params(i)
        want, logps = _reference_decode(prompt, params, 8, out.token_ids)
        assert out.token_ids == want, i
        if params.logprobs is not None:
            assert len(out.logprobs) == 8
            for token, entry, ref in zip(out.token_ids, out.logprobs, logps, strict=True):
                assert token in entry
                top = np.argsort(-ref)[: params.logprobs]
                assert set(entry) == set(top.tolist()) | {token}
                for t, lp in entry.items():
                    assert lp.logprob == pytest.approx(ref[t], abs=2e-4)
                    assert lp.rank == 1 + int((ref > ref[t] + 1e-6).sum())
            total = sum(lp[t] for t, lp in zip(out.token_ids, logps, strict=True))
            assert out.cumulative_logprob == pytest.approx(total, abs=2e-3)
        else:
            assert out.logprobs is None and out.cumulative_logprob is None


@pytest.mark.parametrize(
    "policy, overlap",
    [(p, False) for p in ("sarathi", "prefill_first", "decode_first", "splitfuse")]
    + [("sarathi", True), ("splitfuse", True)],  # async scheduling (penalized rows land first)
)
def test_processed_requests_do_not_depend_on_the_batch(policy, overlap):
    chunked = policy in ("sarathi", "splitfuse")
    llm = _llm().with_options(
        scheduler_policy=policy,
        max_num_batched_tokens=32 if chunked else 96,
        async_scheduling=overlap,
    )
    prompts = PROMPTS * 2
    params = [_params(i) for i in range(len(PROMPTS))]
    params += [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=3)] * 4
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for a, b in zip(alone, together, strict=True):
        if a.logprobs is not None:
            assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]


def test_compiles_stay_bounded():
    llm = _llm().with_options()
    runner = llm.engine.runner
    for _ in range(2):
        llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
        before = runner.num_sample_compiles
    llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert runner.num_sample_compiles == before


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_what_an_engine_cannot_do_is_rejected_and_the_rest_served():
    from llmjax.sim import SimConfig

    sim = LLM("llama2-7b", device="sim", sim=SimConfig())
    out = sim.generate([[5] * 10], SamplingParams(max_tokens=4, logprobs=2))[0]
    assert out.finish_reason == "error" and "logprobs" in out.error
    out = sim.generate([[5] * 10], SamplingParams(max_tokens=4, repetition_penalty=1.2))[0]
    assert out.finish_reason == "length"  # accepted: a simulated token is a stand-in
    llm = _llm()
    big = SamplingParams(
        logit_bias={t: 1.0 for t in range(500)}, min_tokens=1, stop_token_ids=list(range(600))
    )
    outs = llm.generate([[5] * 4, [6] * 4], [big, SamplingParams(max_tokens=3)])
    assert outs[0].finish_reason == "error" and "bias slots" in outs[0].error
    assert len(outs[1].token_ids) == 3


def _log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("overlap", [False, True])  # async: consecutive chunks in flight
def test_prompt_logprobs_equal_the_forward_across_chunks_the_cache_and_preemption(overlap):
    llm = _llm().with_options(max_num_batched_tokens=16, num_pages=40, async_scheduling=overlap)
    long = list(range(10, 60))  # 50 tokens: 4 chunks of 16
    ref = _log_softmax(full_logits(llm.engine.runner.params, TINY, long))
    llm.generate([long], SamplingParams(max_tokens=2))  # cached now
    busy = [SamplingParams(max_tokens=40, ignore_eos=True)] * 3  # small cache: preemptions
    outs = llm.generate(
        [long, *[[k] * 30 for k in (3, 4, 5)]],
        [SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=1), *busy],
    )
    out = outs[0]
    assert out.num_cached_tokens == 0  # every prompt token computed for its logits
    assert llm.engine.stats.num_preemptions > 0
    entries = out.prompt_logprobs
    assert len(entries) == len(long) and entries[0] is None
    for i in range(1, len(long)):
        row = ref[i - 1]
        top = set(np.argsort(-row)[:2].tolist())
        assert set(entries[i]) == top | {long[i]}
        assert entries[i][long[i]].logprob == pytest.approx(row[long[i]], abs=2e-4)
        assert entries[i][long[i]].rank == 1 + int((row > row[long[i]] + 1e-6).sum())
    # The output is what the same request without prompt logprobs generates.
    plain = llm.generate([long], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == plain.token_ids and out.prompt_logprobs is not None
    assert plain.prompt_logprobs is None

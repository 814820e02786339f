"""Token buckets (llmjax/engine/batch.py `token_buckets`) and the padding a step pays for them
(`EngineStats.num_padded_tokens`), on the simulated device: no JAX, milliseconds."""

from __future__ import annotations

import pytest

from configs.tiny import TINY
from llmjax.config import EngineConfig, SchedulerConfig
from llmjax.engine.batch import TOKEN_ALIGN, Buckets, token_buckets
from llmjax.engine.engine import LLMEngine
from llmjax.sampling_params import SamplingParams
from llmjax.sim import LinearCostModel, SimConfig


def test_token_buckets_are_powers_of_two_and_aligned_steps_between():
    assert token_buckets(512, 1) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(512, 4) == (
        *(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112),
        *(128, 160, 192, 224, 256, 320, 384, 448, 512),
    )
    assert token_buckets(1, 4) == (1,)
    assert token_buckets(100, 2) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    for hi in (1, 7, 100, 512, 3000):
        for k in (1, 2, 3, 4, 8):
            b = token_buckets(hi, k)
            assert list(b) == sorted(set(b)) and b[-1] == hi and b[0] == 1
            pow2 = {1 << i for i in range(hi.bit_length()) if 1 << i < hi}
            assert pow2 <= set(b)  # the coarser buckets stay
            assert all(v in pow2 or v % TOKEN_ALIGN == 0 for v in b[:-1])
            # the padding of any count is at most one step of its octave
            for n in range(1, hi + 1):
                T = next(v for v in b if v >= n)
                step = -(-n // (k * TOKEN_ALIGN)) * TOKEN_ALIGN
                assert T - n < step or n == T, (hi, k, n, T)
    with pytest.raises(ValueError, match="per_octave"):
        token_buckets(512, 0)
    with pytest.raises(ValueError, match="token_buckets_per_octave"):
        EngineConfig(model=TINY, token_buckets_per_octave=0)


def test_shapes_use_the_finer_buckets():
    b = Buckets.create(512, 16, 64, ragged_pages=True, per_octave=4)
    assert b.shape_for(144, 16, 9) == (160, 16, 64)  # 16 decodes + a 128-token chunk
    assert b.shape_for(17, 16, 2) == (24, 16, 64)
    assert Buckets.create(512, 16, 64, ragged_pages=True).shape_for(144, 16, 9)[0] == 256
    assert {T for T, _, _ in b.shapes()} == set(b.token_buckets)


@pytest.mark.parametrize("per_octave", [1, 4])
def test_engine_counts_the_padded_tokens_of_every_step(per_octave):
    """num_padded_tokens is the sum of the steps' token buckets; the finer buckets pay less."""
    config = EngineConfig(
        model=TINY,
        device="sim",
        sim=SimConfig(LinearCostModel((0.01, 0.001))),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        token_buckets_per_octave=per_octave,
    )
    engine = LLMEngine(config, params=None, num_pages=128)
    buckets = token_buckets(64, per_octave)
    want_padded, prompts = 0, [[3 + i] * (9 + 7 * i) for i in range(6)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), f"r{i}")
    while engine.has_unfinished_requests():
        before = engine.stats.num_batched_tokens
        engine.step()
        n = engine.stats.num_batched_tokens - before
        want_padded += next(T for T in buckets if n <= T) if n else 0
    st = engine.stats
    assert st.num_batched_tokens == sum(map(len, prompts)) + 6 * 4
    assert st.num_padded_tokens == want_padded > st.num_batched_tokens
    assert st.padding_fraction == pytest.approx(1 - st.num_batched_tokens / want_padded)
    assert st.as_dict()["padded_tokens_per_step"] == pytest.approx(want_padded / st.num_steps)

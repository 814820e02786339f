"""The server's request features (issue 24): n, logprobs / top_logprobs in both wire formats,
echo with the prompt's logprobs, the penalties, min_p, min_tokens and logit_bias, prompt_logprobs,
streamed and not, each equal to the same request offline. SmolLM2's tokenizer over a random
2-layer body; a real uvicorn server on 127.0.0.1 at a free port; every call has a timeout."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmjax import LLM, SamplingParams
from llmjax.serve import Server

TIMEOUT = 60.0
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        "smollm2-tiny",
        load_format="dummy",
        tokenizer=smollm2_path,
        max_model_len=128,
        num_pages=160,
        max_num_seqs=16,
        max_num_batched_tokens=128,
    )


def _post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path, body) -> list[dict]:
    events = []
    with httpx.stream(
        "POST", server.url + path, json=body | {"stream": True}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_n_and_logprobs_in_completions_equal_offline(llm):
    params = SamplingParams(
        n=2, seed=11, temperature=0.9, max_tokens=6, logprobs=3, ignore_eos=True,
        frequency_penalty=0.5, min_p=0.05,
    )  # fmt: skip
    offline = llm.generate(PROMPTS, params)
    body = {
        "prompt": PROMPTS, "n": 2, "seed": 11, "temperature": 0.9, "max_tokens": 6,
        "logprobs": 3, "ignore_eos": True, "frequency_penalty": 0.5, "min_p": 0.05,
    }  # fmt: skip
    with Server(llm) as server:
        answer = _post(server, "/v1/completions", body)
        events = _stream(server, "/v1/completions", body)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert answer["usage"]["completion_tokens"] == 4 * 6
    for i, out in enumerate(offline):
        for sample in out.outputs:
            c = choices[2 * i + sample.index]
            assert c["text"] == sample.text
            lp = c["logprobs"]
            assert len(lp["tokens"]) == 6 == len(lp["token_logprobs"])
            want = [e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True)]
            assert lp["token_logprobs"] == pytest.approx(want, abs=1e-5)
            assert all(len(top) in (3, 4) for top in lp["top_logprobs"])
            offsets = lp["text_offset"]
            assert offsets[0] == 0 and all(
                b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"], strict=False)
            )
    # Streamed: per choice index, the pieces join to the same text and logprobs.
    texts, token_lps = {}, {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["logprobs"]:
                token_lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    assert texts == {c["index"]: c["text"] for c in choices}
    assert token_lps == {
        c["index"]: pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-6) for c in choices
    }


def test_echo_gives_the_prompt_and_its_logprobs_first(llm):
    with Server(llm) as server:
        answer = _post(
            server,
            "/v1/completions",
            {"prompt": PROMPTS[0], "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0},
        )
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    offline = llm.generate([prompt_ids], SamplingParams(max_tokens=3, prompt_logprobs=1))[0]
    c = answer["choices"][0]
    assert c["text"] == PROMPTS[0] + offline.text
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e[t].logprob for t, e in zip(prompt_ids[1:], offline.prompt_logprobs[1:], strict=True)]
    assert lp["token_logprobs"][1 : len(prompt_ids)] == pytest.approx(want, abs=1e-5)


def test_chat_logprobs_top_logprobs_and_the_openai_client(llm):
    messages = [{"role": "user", "content": "Say something."}]
    with Server(llm) as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )
        r = client.chat.completions.create(
            model=server.model_name, messages=messages, max_tokens=5, temperature=0,
            logprobs=True, top_logprobs=2, n=2, presence_penalty=1.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_tokens": 5},
        )  # fmt: skip
        raw = _post(
            server, "/v1/chat/completions",
            {"messages": messages, "max_tokens": 3, "prompt_logprobs": 1, "temperature": 0},
        )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(
        n=2, max_tokens=5, logprobs=2, presence_penalty=1.0, ignore_eos=True,
        repetition_penalty=1.3, min_tokens=5,
    )  # fmt: skip
    offline = llm.generate([text], params)[0]
    for c in r.choices:
        sample = offline.outputs[c.index]
        assert c.message.content == sample.text
        content = c.logprobs.content
        assert len(content) == 5
        for item, token, entry in zip(content, sample.token_ids, sample.logprobs, strict=True):
            assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-5)
            assert len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    assert raw["prompt_logprobs"][0][0] is None and len(raw["prompt_logprobs"][0]) > 3


def test_response_format_and_structured_outputs(llm):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},  # a random model pads with spaces
    }
    messages = [{"role": "user", "content": "JSON please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    chat, completions = "/v1/chat/completions", "/v1/completions"
    as_object = {"type": "json_object"}
    choice = {"choice": ["up", "down"], "disable_any_whitespace": True}
    with Server(llm) as server:
        a = _post(server, chat, {"messages": messages, "max_tokens": 60, "response_format": fmt})
        b = _post(
            server, chat, {"messages": messages, "max_tokens": 9, "response_format": as_object}
        )
        c = _post(
            server, completions, {"prompt": "pick", "max_tokens": 8, "structured_outputs": choice}
        )
    jsonschema.validate(json.loads(a["choices"][0]["message"]["content"]), schema)
    assert a["choices"][0]["finish_reason"] == "stop"
    assert b["choices"][0]["message"]["content"].startswith("{")  # an object, cut at 9 tokens
    assert c["choices"][0]["text"] in ("up", "down")

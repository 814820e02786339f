"""The OpenAI-compatible server (llmjax/serve/): a real uvicorn server on 127.0.0.1 at a free port,
driven by the official `openai` client and raw HTTP (httpx). SmolLM2's tokenizer over a random
2-layer body for most tests (the real SmolLM2 in test_serve_smollm2.py). Every server stops at
the end of its `with` block; every client call has a timeout."""

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmjax import LLM, SamplingParams
from llmjax.serve import Server

MAX_MODEL_LEN = 160
TIMEOUT = 60.0
PROMPTS = ["The capital of France is", "Once upon a time, in a land"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        "smollm2-tiny",
        load_format="dummy",
        tokenizer=smollm2_path,
        max_model_len=MAX_MODEL_LEN,
        num_pages=200,
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )


@pytest.fixture(scope="module")
def llm_one(llm):
    """One request runs at a time, so others wait: for the queueing tests. Its step shapes are
    compiled first, so that a test's timings are the model's, not the compiler's (on a cold
    machine a first step can outlast a client's patience)."""
    one = llm.with_options(max_num_seqs=1, num_pages=40)
    one.generate(PROMPTS, SamplingParams(max_tokens=3))
    one.reset_prefix_cache()
    return one


def _client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT, **kwargs
    )


def _metrics(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from GET /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _sse(lines) -> list[dict]:
    """The JSON events of a server-sent event stream, checking its framing and [DONE] end."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "an event after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: ") :]))
    assert done, "the stream did not end with [DONE]"
    return events


def test_completions_and_chat_equal_offline_greedy(llm):
    params = SamplingParams(max_tokens=8)
    want = llm.generate(PROMPTS, params)
    want_chat = llm.chat(MESSAGES, params)[0]
    with Server(llm) as server:
        client = _client(server)
        name = server.model_name
        got = client.completions.create(model=name, prompt=PROMPTS, max_tokens=8, temperature=0)
        choices = sorted(got.choices, key=lambda c: c.index)
        assert [c.text for c in choices] == [o.text for o in want]
        assert [c.finish_reason for c in choices] == [o.finish_reason for o in want]
        assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
        assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        # token ids as the prompt
        ids = client.completions.create(
            model=name, prompt=want[0].prompt_token_ids, max_tokens=8, temperature=0
        )
        assert ids.choices[0].text == want[0].text

        for include_usage in (True, False):
            chunks = list(
                client.completions.create(
                    model=name,
                    prompt=PROMPTS,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": include_usage},
                )
            )
            texts = ["", ""]
            for chunk in chunks:
                for c in chunk.choices:
                    texts[c.index] += c.text
            assert texts == [o.text for o in want]
            usage = [c.usage for c in chunks if c.usage is not None]
            assert len(usage) == include_usage
            if include_usage:
                assert chunks[-1].choices == [] and chunks[-1].usage == got.usage

        chat = client.chat.completions.create(
            model=name, messages=MESSAGES, max_completion_tokens=8, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == want_chat.text
        assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
        stream = list(
            client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
        )
        assert stream[0].choices[0].delta.role == "assistant"  # with the first token
        assert all(c.choices[0].delta.role is None for c in stream[1:])
        assert "".join(c.choices[0].delta.content or "" for c in stream) == want_chat.text
        assert stream[-1].choices[0].finish_reason == want_chat.finish_reason
        assert all(c.usage is None for c in stream)


def test_content_parts_stop_strings_and_seeds(llm):
    """Message content as text parts, stop strings cut the text (streamed pieces join to it),
    and a seeded sampled request is reproducible."""
    with Server(llm) as server:
        client = _client(server)
        name = server.model_name
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        plain = [{"role": "user", "content": "Hi"}]
        a, b = (
            client.chat.completions.create(model=name, messages=m, max_tokens=6, temperature=0)
            for m in (parts, plain)
        )
        assert a.choices[0].message.content == b.choices[0].message.content
        full = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
        text = full.choices[0].text
        stop = text[3:5]
        assert stop.strip(), f"pick a visible stop string from {text!r}"
        cut = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].model_extra["stop_reason"] == stop
        pieces = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], stream=True
        )
        assert "".join(c.choices[0].text for c in pieces) == cut.choices[0].text
        seeded = [
            client.completions.create(
                model=name, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, seed=7
            )
            .choices[0]
            .text
            for _ in range(2)
        ]
        assert seeded[0] == seeded[1]


def _post(server, path, body, headers=None, timeout=TIMEOUT) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def _error(response: httpx.Response, status: int, param=None, match: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param, error
    assert match in error["message"], error
    return error


def test_errors_have_vllms_shape_and_name_the_field(llm):
    too_long = list(range(10, 10 + MAX_MODEL_LEN))
    with Server(llm) as server:
        c = "/v1/completions"
        e = _error(_post(server, c, b'{"prompt": "x",'), 400, None, "malformed JSON")
        assert e["type"] == "BadRequestError"
        _error(_post(server, c, b'["a list"]'), 400)
        _error(_post(server, c, {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
        _error(_post(server, c, {"prompt": "x", "temperature": -1}), 400, "temperature")
        _error(_post(server, c, {"prompt": 5}), 400, "prompt")
        _error(_post(server, c, {"max_tokens": 3}), 400, "prompt", "Field required")
        _error(_post(server, c, {"prompt": []}), 400, "prompt", "must not be empty")
        _error(_post(server, c, {"prompt": too_long}), 400, "prompt", "maximum context length")
        _error(_post(server, c, {"prompt": "x", "max_tokens": 10**4}), 400, "max_tokens")
        _error(_post(server, c, {"prompt": [1, 10**6]}), 400, "prompt", "outside the vocabulary")
        _error(_post(server, c, {"prompt": "x", "model": "gpt-5"}), 404, "model", "gpt-5")
        _error(_post(server, c, {"prompt": "x", "stop": [""]}), 400, "stop", "non-empty")
        _error(_post(server, c, {"prompt": "x", "stream_options": {}}), 400, "stream")
        for field, value in [
            ("suffix", "!"),
            ("best_of", 3),
        ]:
            _error(_post(server, c, {"prompt": "x", field: value}), 400, field, "not implemented")
        for field, value, words in [
            ("n", 0, "n must be"),
            ("logprobs", 21, "logprobs must be"),
            ("presence_penalty", 2.5, "presence_penalty must be"),
            ("logit_bias", {"x": 1.0}, "token ids"),
            ("logit_bias", {"5": 500}, "logit_bias maps"),
            ("min_tokens", 99, "min_tokens must be"),
            ("response_format", {"type": "xml"}, "type must be"),
            ("response_format", {"type": "json_schema"}, "json_schema.schema"),
            (
                "response_format",
                {"type": "json_schema", "json_schema": {"schema": {"type": 3}}},
                "json",
            ),
            ("structured_outputs", {"regex": "a(b"}, "invalid structured_outputs.regex"),
            ("structured_outputs", {"regex": "a", "choice": ["b"]}, "exactly one"),
        ]:
            body = {"prompt": "x", "max_tokens": 4, field: value}
            _error(_post(server, c, body), 400, field, words)
        chat = "/v1/chat/completions"
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        _error(
            _post(server, chat, {"messages": [{"role": "user", "content": [image]}]}),
            400,
            "messages",
        )
        _error(_post(server, chat, {"messages": []}), 400, "messages")
        long_chat = {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}
        _error(_post(server, chat, long_chat), 400, "messages", "maximum context length")
        _error(_post(server, chat, {"messages": MESSAGES, "tools": [{"a": 1}]}), 400, "tools")
        no_logprobs = {"messages": MESSAGES, "top_logprobs": 2}
        _error(_post(server, chat, no_logprobs), 400, "top_logprobs", "needs logprobs")
        missing = httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            _client(server).completions.create(model=server.model_name, prompt="x", max_tokens=0)
        # the engine kept serving
        ok = _post(server, c, {"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key_guards_v1_only(llm):
    with Server(llm, api_key="secret") as server:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}):
            e = _error(_post(server, "/v1/completions", body, headers=headers), 401)
            assert e["type"] == "AuthenticationError"
        models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT)
        assert models.status_code == 401
        ok = _post(server, "/v1/completions", body, headers={"authorization": "Bearer secret"})
        assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            _client(server).models.list()
        listed = _client(server, default_headers={"authorization": "Bearer secret"}).models.list()
        assert [m.id for m in listed.data] == [server.model_name]
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(server.url + path, timeout=TIMEOUT).status_code == 200


def test_models_version_tokenize_detokenize(llm):
    tok = llm.get_tokenizer()
    with Server(llm, served_model_name="tiny-chat") as server:
        models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()
        assert models["data"][0]["id"] == "tiny-chat"
        assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
        assert httpx.get(server.url + "/version", timeout=TIMEOUT).json()["version"]
        got = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()
        assert got["tokens"] == tok.encode(PROMPTS[0]) and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == MAX_MODEL_LEN
        chat = _post(server, "/tokenize", {"messages": MESSAGES}).json()
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(text)
        back = _post(server, "/detokenize", {"tokens": got["tokens"]}).json()
        assert back["prompt"] == tok.decode(got["tokens"])
        _error(_post(server, "/detokenize", {"tokens": [10**7]}), 400, "tokens")
        _error(_post(server, "/tokenize", {"prompt": "a", "model": "other"}), 404, "model")
        # the served name is the model clients must send
        _error(
            _post(server, "/v1/completions", {"prompt": "x", "model": "smollm2-tiny"}), 404, "model"
        )


def _slow_steps(monkeypatch, engine, seconds: float) -> None:
    """Each engine step takes `seconds` longer, so a request outlives its client's patience."""
    step = engine.step

    def slow():
        out = step()
        time.sleep(seconds)
        return out

    monkeypatch.setattr(engine, "step", slow)


def test_aborted_stream_frees_its_pages_and_counts_as_aborted(llm, monkeypatch):
    _slow_steps(monkeypatch, llm.engine, 0.01)
    with Server(llm) as server:
        before = _metrics(server)
        body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT
        ) as response:
            lines = response.iter_lines()
            got = [next(line for line in lines if line) for _ in range(2)]  # two chunks
        assert all(line.startswith("data: {") for line in got)

        def aborted():
            m = _metrics(server)
            key = ("llmjax:request_success_total", (("finished_reason", "abort"),))
            return m[("llmjax:num_requests_running", ())] == 0 and m[key] == before[key] + 1

        _wait_for(aborted, "the aborted stream to show in /metrics")
        assert llm.engine.block_manager.num_used_pages == 0
        assert not llm.engine.has_unfinished_requests()


def test_disconnect_while_queued_or_waiting_for_a_whole_response(llm_one, monkeypatch):
    """With one request running, a second waits; its client leaves (a stream, before any token)
    and so does the running one's (a non-streaming call): both are aborted, nothing is left."""
    _slow_steps(monkeypatch, llm_one.engine, 0.02)  # 140 steps: ~3 s, past the client's 1.5 s
    with Server(llm_one) as server:
        body = {"prompt": PROMPTS[1], "max_tokens": 140, "ignore_eos": True}
        # The prompt's first steps compiled beforehand: on a cold compilation cache they took
        # longer than the client's 1.5 s, which then left before its request was seen running.
        assert _post(server, "/v1/completions", {**body, "max_tokens": 2}).status_code == 200
        length = ("llmjax:request_success_total", (("finished_reason", "length"),))
        finished_by_length = _metrics(server)[length]  # the warm-up's one
        raised = []

        def impatient():
            try:
                _post(server, "/v1/completions", body, timeout=1.5)
            except httpx.ReadTimeout as e:
                raised.append(e)

        running = threading.Thread(target=impatient, daemon=True)
        running.start()
        _wait_for(lambda: _metrics(server)[("llmjax:num_requests_running", ())] == 1, "running")
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=0.5
        ) as response:
            _wait_for(lambda: _metrics(server)[("llmjax:num_requests_waiting", ())] == 1, "queue")
            assert response.status_code == 200
        running.join(TIMEOUT)
        assert raised, "the non-streaming call finished before its client gave up"

        def both_aborted():
            m = _metrics(server)
            gone = m[("llmjax:num_requests_running", ())] + m[("llmjax:num_requests_waiting", ())]
            return (
                gone == 0
                and m[("llmjax:request_success_total", (("finished_reason", "abort"),))] == 2
            )

        _wait_for(both_aborted, "both requests to be aborted")
        assert llm_one.engine.block_manager.num_used_pages == 0
        assert _metrics(server)[length] == finished_by_length  # neither ran to its length


def test_flood_past_max_num_queued_gets_503_and_the_admitted_complete(llm_one):
    n, max_tokens = 10, 60

    async def flood(url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True}
            return await asyncio.gather(
                *[client.post("/v1/completions", json=body) for _ in range(n)]
            )

    with Server(llm_one, max_num_queued=2) as server:
        responses = asyncio.run(flood(server.url))
        ok = [r for r in responses if r.status_code == 200]
        busy = [r for r in responses if r.status_code == 503]
        assert len(ok) + len(busy) == n and ok and busy
        for r in busy:
            _error(r, 503, match="max_num_queued")
            assert r.headers["retry-after"] == "1"
        assert all(r.json()["usage"]["completion_tokens"] == max_tokens for r in ok)
        m = _metrics(server)
        assert m[("llmjax:request_success_total", (("finished_reason", "length"),))] == len(ok)
        assert m[("llmjax:num_requests_waiting", ())] == 0


def test_64_concurrent_streams_equal_offline_greedy(llm):
    """Served with async scheduling (the engine thread schedules a step while the last runs),
    the streams equal the synchronous engine's offline outputs."""
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    prompts = [rng.integers(3, vocab, int(rng.integers(2, 48))).tolist() for _ in range(64)]
    max_tokens = [int(rng.integers(2, 12)) for _ in range(64)]
    want = llm.generate(
        prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    )

    async def one(client, prompt, m):
        body = {
            "prompt": prompt,
            "max_tokens": m,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = _sse([line async for line in response.aiter_lines()])
        text = "".join(c["text"] for e in events for c in e["choices"])
        return text, events[-1]["usage"]["completion_tokens"]

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            return await asyncio.gather(
                *[one(client, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
            )

    overlapped = llm.with_options(async_scheduling=True)
    assert overlapped.engine.async_scheduling
    with Server(overlapped) as server:
        got = asyncio.run(run(server.url))
        assert [g[0] for g in got] == [o.text for o in want]
        assert [g[1] for g in got] == max_tokens
        m = _metrics(server)
        assert m[("llmjax:generation_tokens_total", ())] == sum(max_tokens)
        assert m[("llmjax:request_success_total", (("finished_reason", "length"),))] == 64


def test_health_turns_503_when_the_engine_thread_fails(llm):
    broken = llm.with_options(num_pages=24)  # its own engine: nothing else reuses its state

    def fail():
        raise RuntimeError("injected failure")

    broken.engine.step = fail
    with Server(broken) as server:
        assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            events = _sse(list(r.iter_lines()))
        assert events[-1]["error"]["code"] == 500
        assert "injected failure" in events[-1]["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=TIMEOUT)
        _error(health, 503, match="injected failure")
        _error(_post(server, "/v1/completions", {"prompt": "x"}), 503, match="injected failure")


def completion_token_ids(server, body) -> tuple[list[list[int]], list[list[int]]]:
    """POST /v1/completions with token-id prompts, whole and streamed: each choice's token ids
    (index order), both ways."""
    got = _post(server, "/v1/completions", body).json()
    ids = [c["token_ids"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        events = _sse(list(r.iter_lines()))
    streamed = [[] for _ in ids]
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] += c["token_ids"]
    return ids, streamed


def test_a_model_without_tokenizer_serves_token_ids():
    bare = LLM("tiny", load_format="dummy", max_model_len=64, num_pages=32)
    assert bare.tokenizer is None
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = bare.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    with Server(bare) as server:
        body = {"prompt": prompts, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        ids, streamed = completion_token_ids(server, body)
        assert ids == [o.token_ids for o in want]
        assert streamed == ids
        _error(_post(server, "/v1/completions", {"prompt": "text"}), 400, "prompt", "tokenizer")
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        _error(_post(server, "/v1/chat/completions", chat), 400, "messages", "tokenizer")

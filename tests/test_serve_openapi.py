"""The server's OpenAPI schema (/openapi.json) says what the server answers: schemathesis fuzzes a
real server from it with every check (as `schemathesis run --checks all` does: statuses, media
types, bodies and headers as documented, schema-invalid requests refused, the API key enforced,
405 with Allow), and plain requests check that each route documents the statuses, bodies and media
types it really answers. The server: a uvicorn server on 127.0.0.1 (llmjax.serve.Server, as in
test_serve.py), SmolLM2's tokenizer over a random 2-layer body with a short context, so that
generations stay short and large max_tokens are 400s at once."""

import httpx
import jsonschema
import pytest
import schemathesis
from schemathesis.engine import Status, StopReason, events, from_schema

from llmjax import LLM
from llmjax.serve import Server
from llmjax.serve.weight_routes import PATHS as WEIGHT_PATHS

# SmolLM2's chat template takes 29 tokens of it: a chat generates 3 at most.
MAX_MODEL_LEN = 32
TIMEOUT = 60.0
KEY = "secret"
GENERATION = ("/v1/completions", "/v1/chat/completions")
VALID_OR_400 = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]
ROUTES = {  # path -> method
    "/v1/completions": "post",
    "/v1/chat/completions": "post",
    "/v1/programs": "post",
    "/v1/programs/{session_id}": "delete",
    "/v1/models": "get",
    "/health": "get",
    "/version": "get",
    "/metrics": "get",
    "/tokenize": "post",
    "/detokenize": "post",
    "/v1/load_lora_adapter": "post",
    "/v1/unload_lora_adapter": "post",
    "/pause": "post",
    "/resume": "post",
    "/is_paused": "get",
    "/sleep": "post",
    "/wake_up": "post",
    "/is_sleeping": "get",
    "/update_weights_from_disk": "post",
    "/weight_version": "get",
}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        "smollm2-tiny",
        load_format="dummy",
        tokenizer=smollm2_path,
        max_model_len=MAX_MODEL_LEN,
        num_pages=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )


def _fuzz(server: Server, *, max_examples: int, phases: list[str], headers=None) -> dict:
    """One pass of schemathesis' engine over the server's schema with every check, a fixed seed
    and at most `max_examples` generated cases per operation and phase: {operation: cases}.
    Fails with every failure and error found."""
    options = {
        "seed": 1,
        "checks": {"enabled": True, "max_response_time": 20},
        "phases": {
            name: {"enabled": name in phases}
            for name in ("examples", "coverage", "fuzzing", "stateful")
        },
        "generation": {"max-examples": max_examples, "database": "none"},
        "cache": {"enabled": False},  # no replays of earlier runs' failures, no .schemathesis/
        "output": {"sanitization": {"enabled": False}},
        "operations": [
            {
                # A schema-valid request can still be refused with a 400: a prompt whose tokens
                # with max_tokens do not fit max_model_len, a chat template, grammar or program
                # that does not compile. JSON Schema cannot say these (the schema says them in
                # words): schemathesis' default statuses and 400. Every other check holds for
                # these routes too.
                "include-path": [*GENERATION, "/v1/programs"],
                "include-method": "POST",
                "checks": {"positive_data_acceptance": {"expected-statuses": VALID_OR_400}},
            },
            {
                # A session outlives its POST only with keep_session: true (the stateful phase
                # takes POST /v1/programs' session_id for a resource DELETE can always find).
                "include-path": "/v1/programs/{session_id}",
                "checks": {"ensure_resource_availability": {"enabled": False}},
            },
        ],
    }
    if headers:
        options["headers"] = headers
    config = schemathesis.Config.from_dict(options)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)

    @schema.hook
    def map_body(context, body):
        """At most 2 samples per prompt: the server takes up to 128 (OpenAI's maximum), and a
        fuzzer's n=128 runs them all. Values the server refuses stay as they are."""
        n = body.get("n") if isinstance(body, dict) else None
        if context.operation.path in GENERATION and type(n) is int and n > 2:
            body = {**body, "n": 2}
        return body

    cases, problems, stop = {}, [], None
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            label = event.recorder.label
            cases[label] = cases.get(label, 0) + len(event.recorder.cases)
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        failure = check.failure_info.failure
                        problems.append(
                            f"{label}: {check.name}: {failure.title}: {failure.message}\n"
                            f"{check.failure_info.code_sample}"
                        )
        elif isinstance(event, events.NonFatalError):
            problems.append(f"{event.label}: error: {event.info}")
        elif isinstance(event, events.FatalError):
            problems.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            stop = event.stop_reason
    assert not problems, "\n\n".join(dict.fromkeys(problems))
    assert stop == StopReason.COMPLETED, stop
    return cases


@pytest.mark.timeout(90)  # one pass: ~30 s here, ~40 s with a cold compilation cache
def test_schemathesis_finds_nothing(llm):
    with Server(llm) as server:
        cases = _fuzz(
            server, max_examples=10, phases=["examples", "coverage", "fuzzing", "stateful"]
        )
    for path, method in ROUTES.items():
        assert cases.get(f"{method.upper()} {path}"), (path, cases)
    assert sum(cases.values()) >= 500, cases
    with Server(llm, api_key=KEY) as server:  # the API key's scheme: 401 without it
        cases = _fuzz(
            server,
            max_examples=3,
            phases=["fuzzing"],
            headers={"Authorization": f"Bearer {KEY}"},
        )
    for path, method in ROUTES.items():
        assert cases.get(f"{method.upper()} {path}"), (path, cases)


# ------------------------------------------------------------------------------------------------
# The statuses the server answers are the ones documented, with the documented bodies.


def _client(server: Server, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=TIMEOUT, **kwargs)


def _check(schema: dict, response, path: str, method: str = "post") -> None:
    """`response` is documented for the route: its status, media type and body."""
    documented = schema["paths"][path][method]["responses"]
    status = str(response.status_code)
    assert status in documented, (path, status, list(documented))
    content = documented[status].get("content")
    if not content:  # nothing documented: nothing sent
        assert response.content == b"" and "content-type" not in response.headers
        return
    media_type = response.headers["content-type"].split(";")[0]
    assert media_type in content, (path, media_type, list(content))
    if media_type == "application/json":
        body_schema = {"components": schema["components"], **content[media_type]["schema"]}
        jsonschema.validate(response.json(), body_schema)


def test_routes_document_the_statuses_they_answer(llm):
    with Server(llm) as server:
        client = _client(server)
        schema = client.get("/openapi.json").json()
        assert sorted((p, m) for p, ops in schema["paths"].items() for m in ops) == sorted(
            ROUTES.items()
        )
        for path, operations in schema["paths"].items():  # validation errors are 400s
            for operation in operations.values():
                assert "422" not in operation["responses"], path
                assert "security" not in operation, path
        assert "HTTPValidationError" not in schema["components"]["schemas"]
        assert "securitySchemes" not in schema["components"]

        c, chat = "/v1/completions", "/v1/chat/completions"
        _check(schema, client.post(c, json={"prompt": "Hi", "max_tokens": 2}), c)
        _check(schema, client.post(c, json={"prompt": "Hi", "temperature": -1}), c)
        _check(schema, client.post(c, content=b'{"prompt": "x",'), c)  # malformed JSON
        _check(schema, client.post(c, json={"prompt": "Hi", "model": "other"}), c)
        long = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}  # the documented maximum + 1
        assert client.post(c, json=long).status_code == 400
        assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"][
            "anyOf"
        ][0]["maximum"] == (MAX_MODEL_LEN - 1)
        stream = client.post(c, json={"prompt": "Hi", "max_tokens": 2, "stream": True})
        _check(schema, stream, c)
        assert stream.text.endswith("data: [DONE]\n\n")
        messages = [{"role": "user", "content": "Hi"}]
        _check(schema, client.post(chat, json={"messages": messages, "max_tokens": 1}), chat)
        _check(schema, client.post(chat, json={"messages": []}), chat)
        _check(schema, client.post(chat, json={"messages": messages, "n": True}), chat)
        too_many = client.post(c, json={"prompt": "Hi", "max_tokens": 1, "n": 129})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert (
            schema["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"]
            == 128
        )

        p = "/v1/programs"
        _check(schema, client.post(p, json={}), p)
        _check(schema, client.post(p, json={"get": [{"variables": ["x"]}]}), p)
        _check(schema, client.post(p, json={"session_id": "s-gone"}), p)
        _check(schema, client.delete(p + "/s-gone"), p + "/{session_id}", "delete")
        kept = client.post(p, json={"keep_session": True}).json()["session_id"]
        _check(schema, client.delete(f"{p}/{kept}"), p + "/{session_id}", "delete")

        for path in ("/tokenize", "/detokenize"):
            _check(schema, client.post(path, json={}), path)
            other = {"model": "other", "tokens": [], "prompt": ""}
            _check(schema, client.post(path, json=other), path)
        _check(schema, client.post("/tokenize", json={"prompt": "Hi"}), "/tokenize")
        _check(schema, client.post("/tokenize", json={"messages": messages}), "/tokenize")
        _check(schema, client.post("/detokenize", json={"tokens": [10**7]}), "/detokenize")
        _check(schema, client.post("/detokenize", json={"tokens": [42, 43.0]}), "/detokenize")

        for path in ("/v1/models", "/version", "/health", "/metrics"):
            _check(schema, client.get(path), path, "get")
        metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
            "text/plain"
        ]
        health = client.get("/health")
        assert health.status_code == 200 and health.content == b""
        not_allowed = client.request("TRACE", "/health")
        assert not_allowed.status_code == 405 and "GET" in not_allowed.headers["allow"]
        assert not_allowed.json()["error"]["code"] == 405

    with Server(llm, max_num_queued=0) as server:  # every request would wait: 503
        client = _client(server)
        busy = client.post(c, json={"prompt": "Hi", "max_tokens": 2})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        _check(schema, busy, c)
        assert "Retry-After" in schema["paths"][c]["post"]["responses"]["503"]["headers"]

    with Server(llm, api_key=KEY) as server:
        client = _client(server)
        keyed = client.get("/openapi.json").json()
        assert keyed["components"]["securitySchemes"]["APIKey"]["scheme"] == "bearer"
        for path, operations in keyed["paths"].items():
            for operation in operations.values():
                guarded = path.startswith("/v1") or path in WEIGHT_PATHS  # (weight_routes.py)
                assert ("401" in operation["responses"]) == guarded, path
                assert (operation.get("security") == [{"APIKey": []}]) == guarded, path
        _check(keyed, client.post(c, json={"prompt": "Hi", "max_tokens": 2}), c)
        _check(keyed, client.get("/v1/models"), "/v1/models", "get")
        _check(keyed, client.get("/health"), "/health", "get")
        authorized = _client(server, headers={"Authorization": f"Bearer {KEY}"})
        _check(keyed, authorized.get("/v1/models"), "/v1/models", "get")

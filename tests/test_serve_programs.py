"""Programs over HTTP (llmjax/serve/programs.py, llmjax/program/remote.py): a real uvicorn server
on 127.0.0.1 at a free port, driven by `Program(url)` and raw httpx. The tiny model's random
weights with tests/program_helpers.py's ByteTokenizer; a server per test over one module-wide
engine (another one runs the same programs in-process). Every client call has a timeout."""

import re
import threading
import time

import httpx
import pytest

from llmjax import SamplingParams
from llmjax.program import Program, ProgramError, ProgramExecutor, SemanticFunction
from llmjax.program.reference import run_sequential
from llmjax.serve import Server
from tests.program_helpers import ByteTokenizer, tiny_llm

TIMEOUT = 60.0
SUMMARIZE = SemanticFunction(
    "summarize",
    "Summarize: {{chunk}}\nSummary:{{summary}}",
    {"summary": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)},
)
MERGE = SemanticFunction(
    "merge",
    "A: {{a}}\nB: {{b}}\nC: {{c}}\nAll:{{merged}}",
    {"merged": SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)},
)
# Four of these run ~200 decode steps: long enough to act on while they run.
RAMBLE = SemanticFunction(
    "ramble",
    "Go on about {{topic}}:{{text}}",
    {"text": SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)},
)
CHUNKS = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]


@pytest.fixture(scope="module")
def llms():
    """(served, local): two engines over the tiny model's weights, with ByteTokenizer."""
    base = tiny_llm()
    pair = base.with_options(), base.with_options()
    for llm in pair:
        llm.tokenizer = llm.engine.tokenizer = ByteTokenizer()
    return pair


def _map_reduce(backend, **kwargs) -> tuple[dict[str, str], Program]:
    """Map, reduce (one get), then a follow-up call reading the reduce's output (a later get:
    on a server, a second POST in the session). {variable id: text}, and the program."""
    with Program(backend, **kwargs) as p:
        parts = [SUMMARIZE(chunk=c) for c in CHUNKS]
        merged = MERGE(*parts)
        merged.get("latency")
        p.get(parts, "throughput")
        SUMMARIZE(chunk=merged).get()
        values = {vid: v.get() for vid, v in p.vars.items()}
    return values, p


def _post(server, body, timeout=TIMEOUT, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/v1/programs", json=body, timeout=timeout, **kwargs)


def _error(response: httpx.Response, status: int, param=None, match: str = "") -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    assert match in error["message"], error
    return error["message"]


def _sessions(server):
    return server.async_engine.engine.sessions  # the ProgramEngine view's


def _call(cid, fn, inputs, outputs) -> dict:
    return {"id": cid, "function": fn, "inputs": inputs, "outputs": outputs}


def _ramble_body(n: int = 4, **extra) -> dict:
    return {
        "functions": [RAMBLE.to_dict()],
        "variables": [{"id": f"t{i}", "content": f"topic {i}"} for i in range(n)],
        "calls": [
            _call(f"c{i}", "ramble", {"topic": f"t{i}"}, {"text": f"o{i}"}) for i in range(n)
        ],
        "get": [{"variables": [f"o{i}" for i in range(n)], "criteria": "throughput"}],
        **extra,
    }


def _wait_for(server, predicate, what: str, timeout: float = 30.0):
    """Poll `predicate()` on the engine thread (between steps) until it holds."""
    deadline = time.monotonic() + timeout
    while not server.call(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _running(server):
    ex = _sessions(server).executor
    return lambda: any(t.state == "running" for a in ex.apps.values() for t in a.tasks.values())


def _in_thread(fn) -> tuple[threading.Thread, list]:
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def _all_pages_free(llm):
    bm = llm.engine.block_manager
    return lambda: (
        not llm.engine.has_unfinished_requests() and bm.num_available_pages == bm.num_usable_pages
    )


def test_map_reduce_over_http_equals_in_process_and_the_reference(llms):
    served, local = llms
    with Server(served) as server:
        remote, program = _map_reduce(server.url, model=server.model_name)
        assert server.call(lambda: len(_sessions(server).sessions)) == 0  # closed on exit
    in_process, _ = _map_reduce(ProgramExecutor(local))
    assert remote == in_process
    reference = run_sequential(local, program.functions, program.constants, program.calls)
    assert {vid: text for vid, (text, _) in reference.items()} == remote
    assert all(text for text in remote.values())


def test_json_session_usage_and_a_completion_while_a_program_runs(llms):
    served, local = llms
    want = local.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))[0].text
    with Server(served) as server:
        body = {
            "model": server.model_name,
            "functions": [SUMMARIZE.to_dict()],
            "variables": [{"id": "v0", "content": CHUNKS[0]}],
            "calls": [_call("c0", "summarize", {"chunk": "v0"}, {"summary": "v1"})],
            "get": [{"variables": ["v1"], "criteria": "latency"}],
            "keep_session": True,
        }
        first = _post(server, body).json()
        assert first["object"] == "program" and first["errors"] == {}
        assert set(first["values"]) == {"v1"}
        assert first["usage"]["completion_tokens"] == 6
        assert first["usage"]["prompt_tokens"] > len(CHUNKS[0])
        sid = first["session_id"]
        follow = {  # reads v1, computed by the first request; the session then closes
            "session_id": sid,
            "calls": [_call("c1", "summarize", {"chunk": "v1"}, {"summary": "v2"})],
            "get": [{"variables": ["v1", "v2"]}],
        }
        second = _post(server, follow).json()
        assert second["session_id"] == sid and second["values"]["v1"] == first["values"]["v1"]
        assert second["usage"]["completion_tokens"] == 6  # v2's task only
        _error(_post(server, follow), 404, "session_id", sid)
        with Program(local):  # the same two calls in-process
            v1 = SUMMARIZE(chunk=CHUNKS[0])
            v2 = SUMMARIZE(chunk=v1)
            assert [v1.get(), v2.get()] == [second["values"]["v1"], second["values"]["v2"]]

        # A plain completion is served while a program's tasks run.
        thread, result = _in_thread(lambda: _post(server, _ramble_body()))
        _wait_for(server, _running(server), "the program's tasks to run")
        got = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0},
            timeout=TIMEOUT,
        )
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
        assert thread.is_alive(), "the program finished before the completion: make it longer"
        thread.join(TIMEOUT)
        answer = result[0].json()
        assert result[0].status_code == 200 and answer["errors"] == {}
        assert set(answer["values"]) == {f"o{i}" for i in range(4)}
        assert answer["usage"]["completion_tokens"] == 4 * 200
        metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        assert 'llmjax:program_tasks_total{model_name="tiny",state="done"} 6.0' in metrics
        assert 'llmjax:program_calls_total{model_name="tiny"} 6.0' in metrics


def test_submission_errors_name_the_field_and_change_nothing(llms):
    served, _ = llms
    fn = SUMMARIZE.to_dict()
    const = [{"id": "v0", "content": "text"}]
    ok_call = _call("c0", "summarize", {"chunk": "v0"}, {"summary": "v1"})
    bad_template = {**fn, "name": "bad", "template": "Tell {{who}}:{{summary}}", "inputs": ["whom"]}
    cases = [
        (
            {"functions": [bad_template]},
            "functions",
            "semantic function 'bad', placeholder {{whom}}",
        ),
        (
            {"calls": [_call("c0", "summarize", {"chunk": "v9"}, {"summary": "v1"})]},
            "calls",
            "input {{chunk}} names an unknown variable 'v9'",
        ),
        ({"calls": [{**ok_call, "function": "nope"}]}, "calls", "unknown semantic function 'nope'"),
        (
            {
                "calls": [
                    _call("c0", "summarize", {"chunk": "v2"}, {"summary": "v1"}),
                    _call("c1", "summarize", {"chunk": "v1"}, {"summary": "v2"}),
                ]
            },
            "calls",
            "a cycle",
        ),
        ({"calls": [{"id": "c0"}]}, "calls", "calls[0]: missing field 'function'"),
        ({"get": [{"variables": ["v1"], "criteria": "soon"}]}, "get", "criteria must be one of"),
        ({"get": [{"variables": ["v7"]}]}, "get", "unknown variable 'v7'"),
        ({"variables": [*const, *const]}, "variables", "'v0' is given twice"),
    ]
    with Server(served) as server:
        for change, param, match in cases:
            body = {"functions": [fn], "variables": const, "calls": [ok_call], **change}
            _error(_post(server, body), 400, param, match)
        assert server.call(lambda: len(_sessions(server).sessions)) == 0  # none left open
        # In an open session a refused submission changes nothing: resending the good one works.
        sid = _post(server, {"keep_session": True}).json()["session_id"]
        bad = {"session_id": sid, "functions": [fn], "variables": const, "calls": [ok_call]}
        bad_get = {**bad, "get": [{"variables": ["v7"]}], "keep_session": True}
        _error(_post(server, bad_get), 400, "get")
        good = _post(server, {**bad, "get": [{"variables": ["v1"]}]})
        assert good.status_code == 200 and set(good.json()["values"]) == {"v1"}
        _error(_post(server, {"session_id": "nope"}), 404, "session_id", "no open program")
        _error(httpx.delete(server.url + "/v1/programs/nope", timeout=TIMEOUT), 404, "session_id")
        _error(_post(server, {"model": "gpt-4"}), 404, "model")
        # The client: a 400 is a ValueError (a chat function, but the tokenizer has no template)
        chat = SemanticFunction(
            "chat", "{{q}}{{a}}", {"a": SamplingParams(max_tokens=2)}, chat=True
        )
        with Program(server.url) as p, pytest.raises(ValueError, match="no chat template"):
            chat(q="hi").get()
        assert p.closed


def test_delete_mid_run_aborts_the_calls_and_frees_every_page(llms):
    served, _ = llms
    with Server(served) as server:
        sid = _post(server, {"keep_session": True}).json()["session_id"]
        thread, result = _in_thread(lambda: _post(server, _ramble_body(session_id=sid)))
        _wait_for(server, _running(server), "the program's tasks to run")
        deleted = httpx.delete(f"{server.url}/v1/programs/{sid}", timeout=TIMEOUT)
        assert deleted.status_code == 200 and deleted.json()["session_id"] == sid
        assert deleted.json()["cancelled"] >= 1
        thread.join(TIMEOUT)
        answer = result[0].json()  # the waiting request answers with the cancellation
        assert answer["values"] == {} and set(answer["errors"]) == {f"o{i}" for i in range(4)}
        assert all("was cancelled" in e["message"] for e in answer["errors"].values())
        assert server.call(_all_pages_free(served))
        _error(_post(server, {"session_id": sid}), 404, "session_id")
        metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
        assert 'llmjax:program_tasks_total{model_name="tiny",state="cancelled"} 4.0' in metrics

        # A client that disconnects while waiting cancels its session the same way (32 x 200
        # tokens: several waves of decodes, far longer than the client waits, even when warm).
        with pytest.raises(httpx.ReadTimeout):
            _post(server, _ramble_body(32, keep_session=True), timeout=0.2)
        cancelled = server.metrics.program_tasks["cancelled"]
        _wait_for(server, lambda: cancelled._value.get() == 36, "its tasks to be cancelled", 10)
        assert server.call(lambda: not _sessions(server).sessions)  # kept, yet closed
        assert server.call(_all_pages_free(served))


def test_a_failed_call_fails_its_dependents_naming_the_input(llms):
    served, _ = llms
    too_long = "x" * 300  # max_model_len is 256
    with Server(served) as server:
        body = {
            "functions": [SUMMARIZE.to_dict()],
            "variables": [{"id": "v0", "content": too_long}],
            "calls": [
                _call("c0", "summarize", {"chunk": "v0"}, {"summary": "v1"}),
                _call("c1", "summarize", {"chunk": "v1"}, {"summary": "v2"}),
            ],
            "get": [{"variables": ["v2"]}, {"variables": ["v1"], "criteria": "throughput"}],
        }
        answer = _post(server, body).json()
        assert answer["values"] == {}
        v1, v2 = answer["errors"]["v1"], answer["errors"]["v2"]
        assert (v1["function"], v1["placeholder"]) == ("summarize", "summary")
        assert "max_model_len=256" in v1["message"]
        assert (v2["function"], v2["placeholder"]) == ("summarize", "chunk")
        assert "input {{chunk}}" in v2["message"] and "max_model_len=256" in v2["message"]
        with Program(server.url):  # the client raises it as a ProgramError
            out = SUMMARIZE(chunk=SUMMARIZE(chunk=too_long))
            with pytest.raises(ProgramError, match=re.escape("input {{chunk}}")) as e:
                out.get()
            assert (e.value.function, e.value.placeholder) == ("summarize", "chunk")
            assert SUMMARIZE(chunk="short").get()  # the program goes on
        assert server.call(_all_pages_free(served))


def test_api_key_idle_expiry_and_no_programs_without_a_tokenizer(llms):
    _, local = llms
    with Server(local, api_key="k", program_idle_s=0.2) as server:
        _error(_post(server, {}), 401)
        auth = {"Authorization": "Bearer k"}
        sid = _post(server, {"keep_session": True}, headers=auth).json()["session_id"]
        time.sleep(0.5)
        _error(_post(server, {"session_id": sid}, headers=auth), 404, "session_id", "idle")
        with Program(server.url, api_key="k"):
            assert SUMMARIZE(chunk="hi").get()
    with Server(tiny_llm()) as server:  # token ids only
        _error(_post(server, {}), 501, None, "tokenizer")


@pytest.mark.slow
def test_smollm2_chat_program_over_http_equals_in_process(smollm2_path):
    """The real SmolLM2: a chat function (the model's chat template frames the pieces) feeding
    a plain one, over HTTP and in-process, equal and readable."""
    from llmjax import LLM

    llm = LLM("smollm2-135m-instruct", max_model_len=256, compilation_cache_dir="")
    answer = SemanticFunction(
        "answer",
        "In one sentence: what is {{thing}}?{{reply}}",
        {"reply": SamplingParams(max_tokens=24)},
        chat=True,
        system="You are a concise assistant.",
    )
    title = SemanticFunction(
        "title",
        "Text: {{text}}\nA three-word title for the text:{{title}}",
        {"title": SamplingParams(max_tokens=8, stop=["\n"])},
    )

    def run(backend) -> list[str]:
        with Program(backend) as p:
            replies = [answer(thing=t) for t in ("the Moon", "Paris")]
            titles = [title(text=r) for r in replies]
            return p.get(replies + titles, "latency")

    in_process = run(llm)
    with Server(llm) as server:
        remote = run(server.url)
    assert remote == in_process
    assert "moon" in in_process[0].lower() and "paris" in in_process[1].lower(), in_process

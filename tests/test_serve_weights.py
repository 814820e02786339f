"""The rollout engine's routes over HTTP (issue 43; llmjax/serve/weight_routes.py): /pause in
each mode, /update_weights_from_disk, /resume, /sleep and /wake_up, behind the flag and the API
key. The tiny model (token-id prompts); a real uvicorn server on 127.0.0.1, every call with a
timeout."""

from __future__ import annotations

import threading
import time

import httpx
import jax
import pytest

import configs
from llmjax import LLM, SamplingParams
from llmjax.checkpoint.hf import save_hf
from llmjax.model.params import init_params
from llmjax.serve import Server
from tests.test_serve import TIMEOUT, _error, _post

OPTS = dict(load_format="dummy", page_size=4, max_model_len=64, num_pages=64,
            compilation_cache_dir="")  # fmt: skip
KEY = {"authorization": "Bearer k"}
PROMPT = [5, 6, 7, 8, 9, 10, 11]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def _ids(server) -> list[int]:
    r = _post(server, "/v1/completions", BODY, KEY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _until(server, condition) -> None:
    """Poll `condition()` on the engine thread until it holds."""
    deadline = time.monotonic() + TIMEOUT
    while not server.call(condition):
        assert time.monotonic() < deadline, "the engine never got there"


def test_pause_update_from_disk_resume_and_sleep(tmp_path):
    params = init_params(configs.get_preset("tiny"), jax.random.key(9))
    path = str(save_hf(tmp_path / "new", configs.get_preset("tiny"), params))
    want = (
        LLM(path, **{k: v for k, v in OPTS.items() if k != "load_format"})
        .generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        .token_ids
    )
    llm = LLM("tiny", **OPTS)
    with Server(llm, api_key="k", enable_weight_updates=True) as s:
        old = _ids(s)
        assert old != want
        _error(_post(s, "/pause", {"mode": "keep"}), 401, None, "API key")
        _error(_post(s, "/pause", {"mode": "later"}, KEY), 400, "mode", "choose one of")
        # 'abort': a request held by a pause ('keep') ends with finish_reason 'abort' (the
        # engine tests abort running ones: here nothing races the request's own end)
        assert _post(s, "/pause", {"mode": "keep"}, KEY).json()["num_aborted"] == 0
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(r=_post(s, "/v1/completions", BODY, KEY)), daemon=True
        )
        thread.start()
        _until(s, lambda: bool(llm.engine.scheduler.waiting))
        r = _post(s, "/pause", {"mode": "abort"}, KEY)
        assert r.status_code == 200 and r.json()["num_aborted"] == 1, r.text
        thread.join(TIMEOUT)
        choice = result["r"].json()["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["token_ids"] == []
        assert httpx.get(s.url + "/is_paused", headers=KEY, timeout=TIMEOUT).json()["is_paused"]
        # a request sent while paused waits, and runs under the weights given meanwhile
        thread = threading.Thread(
            target=lambda: result.update(r=_post(s, "/v1/completions", BODY, KEY)), daemon=True
        )
        thread.start()
        r = _post(s, "/update_weights_from_disk", {"model_path": path}, KEY)
        assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
        bad = _post(s, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")}, KEY)
        _error(bad, 400, "model_path", "nope")
        assert thread.is_alive()  # still waiting: paused
        assert _post(s, "/resume", {}, KEY).status_code == 200
        thread.join(TIMEOUT)
        assert result["r"].json()["choices"][0]["token_ids"] == want
        # sleep frees the KV pages; a request waits for wake_up; the outputs are the same
        r = _post(s, "/sleep", {"level": 1}, KEY)
        assert r.status_code == 200 and r.json()["kv_bytes"] > 0, r.text
        asleep = httpx.get(s.url + "/is_sleeping", headers=KEY, timeout=TIMEOUT).json()
        assert asleep == {"is_sleeping": True, "level": 1}
        assert _post(s, "/wake_up", {}, KEY).status_code == 200
        assert _ids(s) == want
        version = httpx.get(s.url + "/weight_version", headers=KEY, timeout=TIMEOUT).json()
        assert version == {"weight_version": 1}


def test_the_routes_are_off_unless_asked():
    with Server(LLM("tiny", **OPTS)) as s:
        for path in ("/pause", "/resume", "/sleep", "/wake_up"):
            _error(_post(s, path, {}), 400, None, "--enable_weight_updates")
        r = _post(s, "/update_weights_from_disk", {"model_path": "/x"})
        _error(r, 400, None, "--enable_weight_updates")


@pytest.mark.parametrize("mode", ["wait"])
def test_pause_wait_answers_after_the_running_requests_finish(mode):
    llm = LLM("tiny", **OPTS)
    with Server(llm, enable_weight_updates=True) as s:
        result = {}
        long = {**BODY, "max_tokens": 40}
        thread = threading.Thread(
            target=lambda: result.update(r=_post(s, "/v1/completions", long)), daemon=True
        )
        thread.start()
        _until(s, lambda: bool(llm.engine.scheduler.running))
        r = _post(s, "/pause", {"mode": mode})
        assert r.status_code == 200, r.text
        thread.join(TIMEOUT)
        choice = result["r"].json()["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 40
        assert _post(s, "/resume", {}).status_code == 200

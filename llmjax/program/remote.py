"""The client of an llmjax server's /v1/programs (docs/programs.md, "Over HTTP"): what
`Program("http://host:port", model=...)` runs on.

    with Program("http://127.0.0.1:8000") as p:      # RemoteBackend under the hood
        parts = [summarize(chunk=c) for c in chunks]
        print(merge(*parts).get())                    # one POST: the whole DAG, one answer

Each `get` is one POST with the calls recorded since the last one and the variables asked for;
the server runs the DAG (dependent calls never come back here) and answers when they are done.
The first POST opens the server's session (the server names it); later ones continue it, so
they may read variables computed before. `cancel` and `close` DELETE the session.
"""

from __future__ import annotations

import itertools
import threading

from llmjax.program.graph import ProgramError


class RemoteBackend:
    """A program service behind `url` (an llmjax server): the interface of `LocalBackend`
    (llmjax/program/frontend.py). `model`: the served model's name (None: the server's);
    `api_key`: sent as `Authorization: Bearer`; `timeout`: seconds a request may take (a
    `get` waits for its variables)."""

    def __init__(self, url: str, model: str | None = None, api_key=None, timeout: float = 600):
        import httpx

        self.url, self.model = url.rstrip("/"), model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._session: dict[str, str | None] = {}  # local id -> the server's session id
        self._cancelled: set[str] = set()

    def open(self) -> str:
        """A local id for a new program; the server opens its session on the first `run`."""
        app_id = f"remote-{next(self._ids)}"
        self._session[app_id] = None
        return app_id

    def run(self, app_id, functions, constants, calls, var_ids, criteria, submitted) -> dict:
        """One POST: submit (then `submitted()` once the server took it), compute `var_ids`
        under `criteria`; {var id: (content, error)}. Raises ValueError for a submission the
        server refused (400) and RuntimeError for other failures."""
        if app_id in self._cancelled:
            error = ProgramError(f"program {app_id!r} was cancelled")
            return {v: (None, error) for v in var_ids}
        body = {
            "model": self.model,
            "session_id": self._session[app_id],
            "functions": [f.to_dict() for f in functions],
            "variables": [{"id": k, "content": v} for k, v in constants.items()],
            "calls": [c.to_dict() for c in calls],
            "get": [{"variables": list(var_ids), "criteria": criteria}] if var_ids else [],
            "keep_session": True,
        }
        response = self._request("POST", "/v1/programs", json=body)
        if response.status_code != 200:
            message = _message(response)
            if response.status_code == 400:  # the server refused the submission: nothing ran
                raise ValueError(message)
            if response.status_code >= 500:  # it may have taken the calls: never resend them
                submitted()
            raise RuntimeError(
                f"POST {self.url}/v1/programs answered {response.status_code}: {message}"
            )
        answer = response.json()
        submitted()
        with self._lock:
            self._session[app_id] = answer["session_id"]
            cancel = app_id in self._cancelled  # cancelled while this request ran
        if cancel:
            self._delete(answer["session_id"])
        results = {vid: (text, None) for vid, text in answer["values"].items()}
        for vid, e in answer["errors"].items():
            error = ProgramError(e["message"], e.get("function"), e.get("placeholder"))
            results[vid] = (None, error)
        missing = [v for v in var_ids if v not in results]
        if missing:
            raise RuntimeError(f"the server's answer has no value or error for {missing}")
        return results

    def cancel(self, app_id: str) -> None:
        """Abort what the program runs on the server and close its session; its pending
        variables fail, and later `get`s fail at once."""
        with self._lock:
            self._cancelled.add(app_id)
            session_id = self._session.get(app_id)
        if session_id is not None:
            self._delete(session_id)

    def close(self, app_id: str) -> None:
        """Close the program's session (idempotent)."""
        with self._lock:
            session_id = self._session.pop(app_id, None)
            cancelled = app_id in self._cancelled
            self._cancelled.discard(app_id)
        if session_id is not None and not cancelled:
            self._delete(session_id)

    def _delete(self, session_id: str) -> None:
        response = self._request("DELETE", f"/v1/programs/{session_id}")
        if response.status_code not in (200, 404):  # 404: closed already (or expired)
            raise RuntimeError(
                f"DELETE {self.url}/v1/programs/{session_id} answered {response.status_code}: "
                f"{_message(response)}"
            )

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        try:
            return self._client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{method} {self.url}{path} failed: {type(e).__name__}: {e}") from e


def _message(response) -> str:
    """The server's error message (its JSON error body), or the response's text."""
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:500]

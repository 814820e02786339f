"""The serving front door: an OpenAI-compatible HTTP server over one engine.

  async_engine.py  `AsyncEngine`: the engine thread that owns every JAX call, and the streams
                   that hand its outputs to the asyncio loop (merged per request).
  protocol.py      the request bodies (pydantic), with the fields llmjax does not implement yet,
                   and the response bodies the OpenAPI schema documents.
  app.py           the FastAPI routes: completions, chat, models, health, metrics, tokenize;
                   the OpenAPI schema (/openapi.json) of what each answers.
  programs.py      /v1/programs: semantic-variable programs on a `ProgramExecutor` that the
                   engine thread drives around the engine (sessions, waiters, expiry).
  metrics.py       `ServingMetrics`: Prometheus metrics with vLLM's names and buckets.
  server.py        `serve` (blocking, scripts/serve.py) and `Server` (a background thread).

Needs the `serve` extra (FastAPI, uvicorn, pydantic, prometheus-client): `pip install
'llmjax[serve]'`.
"""

from llmjax.serve.server import Server, make_app, serve

__all__ = ["Server", "make_app", "serve"]

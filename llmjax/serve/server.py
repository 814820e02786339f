"""Run the OpenAI-compatible server for an `LLM`: `serve(...)` blocks (scripts/serve.py);
`Server` runs the same app under uvicorn in a background thread of this process and stops when
asked (tests, notebooks, benchmarks):

    with Server(llm, port=0) as server:        # port 0: a free port on 127.0.0.1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        client.completions.create(model=server.model_name, prompt="Hi", max_tokens=8)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import uvicorn

from llmjax.serve.app import ServerConfig, build_app
from llmjax.serve.async_engine import AsyncEngine
from llmjax.serve.metrics import ServingMetrics
from llmjax.serve.programs import ProgramRoutes, ProgramSessions

logger = logging.getLogger(__name__)

# On shutdown, open connections get this long to finish before they are closed (and their
# requests aborted with the engine thread).
GRACEFUL_SHUTDOWN_S = 5


def make_app(
    llm,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_num_queued: int | None = None,
    metrics_prefix: str = "llmjax:",
    program_idle_s: float = 600.0,
    program_config=None,
    lora_modules=(),
    enable_lora_runtime_updates: bool = False,
    enable_weight_updates: bool = False,
):
    """(FastAPI app, AsyncEngine, ServingMetrics) serving `llm`'s engine, or a
    `llmjax.cluster.Cluster`'s instances behind its router. The app's lifespan starts the engine
    thread; from then on nothing else may drive `llm.engine` (or the cluster).

    With a tokenizer it also serves semantic-variable programs (/v1/programs): its engine
    thread drives a `ProgramExecutor` (under `program_config`, a ProgramConfig) around the
    engine (or the cluster, whose entry instances Parrot's scheduler places tasks on);
    sessions kept open close after `program_idle_s` idle seconds.

    `lora_modules`: (name, path) pairs (or a dict) of LoRA adapters served by name (the
    request's `model`), read now (an LLM built with enable_lora=True; a bad one raises
    LoRAError); `enable_lora_runtime_updates` opens /v1/load_lora_adapter and
    /v1/unload_lora_adapter. `enable_weight_updates` opens /pause, /resume, /sleep, /wake_up and
    /update_weights_from_disk (llmjax/serve/weight_routes.py: a trainer in another process)."""
    name = served_model_name or llm.model_name
    engine = llm.serving_view() if hasattr(llm, "serving_view") else llm.engine
    modules = list(dict(lora_modules).items())
    if modules or enable_lora_runtime_updates:
        if getattr(engine, "lora", None) is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        from llmjax.lora import LoRARequest

        for i, (lora_name, path) in enumerate(modules):
            engine.add_lora(LoRARequest(lora_name, i + 1, path))
    metrics = ServingMetrics(
        name, engine.config, engine.block_manager.num_pages, metrics_prefix, stats=engine.stats
    )
    config = ServerConfig(
        name,
        llm.model_name,
        api_key,
        max_num_queued,
        program_idle_s,
        enable_lora_runtime_updates,
        enable_weight_updates,
    )
    sessions, unsupported = None, ""
    if llm.tokenizer is None:
        unsupported = "/v1/programs needs the model's tokenizer; this server's model has none"
    else:
        target = None
        if hasattr(llm, "serving_view"):  # a Cluster: tasks placed on its entry instances
            from llmjax.program.targets import ClusterTarget

            target = ClusterTarget(llm)
        sessions = ProgramSessions(engine, program_config, metrics, config.program_idle_s, target)
        engine = sessions.engine_view
    async_engine = AsyncEngine(engine, metrics, max_num_queued)
    routes = ProgramRoutes(async_engine, sessions) if sessions is not None else None
    app = build_app(async_engine, llm.tokenizer, config, metrics, routes, unsupported, llm)
    return app, async_engine, metrics


def serve(llm, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **options):
    """Serve `llm` until interrupted (Ctrl-C). `options`: make_app's."""
    app, _, _ = make_app(llm, **options)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


class Server:
    """The server for `llm` under uvicorn in a daemon thread; `start()` returns once it accepts
    connections, `stop()` (or leaving the `with` block) shuts it down and stops the engine
    thread (unfinished requests are aborted). `url` is http://host:port."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0, log_level="warning", **options):
        self.app, self.async_engine, self.metrics = make_app(llm, **options)
        self.model_name = options.get("served_model_name") or llm.model_name
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> Server:
        self._thread = threading.Thread(target=self._server.run, name="llmjax-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("serving %s on %s", self.model_name, self.url)
        return self

    def call(self, fn, timeout: float = 60.0):
        """`fn()` on the engine thread between two steps (where the engine may be inspected
        while it serves); returns its result."""
        ae = self.async_engine
        return asyncio.run_coroutine_threadsafe(ae.call(fn), ae._loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

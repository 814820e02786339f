"""The rollout engine's control routes for a trainer in another process (issue 43), with vLLM's
and SGLang's names, open only with `--enable_weight_updates` (and behind the API key, as /v1/*):

    POST /pause                     {"mode": "abort" | "wait" | "keep"}   (or ?mode=)
    POST /resume
    GET  /is_paused                 {"is_paused": bool, "mode": ...}      (read-only: always open)
    POST /sleep                     {"level": 1 | 2}                      (or ?level=)
    POST /wake_up
    GET  /is_sleeping               {"is_sleeping": bool, "level": ...}   (read-only: always open)
    POST /update_weights_from_disk  {"model_path": ..., "load_format": "auto"} (SGLang's)
    GET  /weight_version            {"weight_version": n}                 (read-only: always open)

Each runs on the engine thread between two steps (`AsyncEngine.call`); 'abort' ends every
stream with finish_reason 'abort', 'wait' answers once the running requests finished. The
engine calls are `LLMEngine`'s (llmjax/engine/weights.py); loading a checkpoint and converting
it is `LLM.update_weights`' (the `llm` the server was made from).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from llmjax.engine.weights import PAUSE_MODES

PATHS = (
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/update_weights_from_disk",
    "/weight_version",
)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str = "auto"


class SuccessResponse(BaseModel):
    success: bool


class PauseResponse(SuccessResponse):
    mode: str
    num_aborted: int  # requests 'abort' ended


class IsPausedResponse(BaseModel):
    is_paused: bool
    mode: str | None


class SleepResponse(SuccessResponse):
    level: int
    kv_bytes: int  # KV pages freed
    weight_bytes: int  # weights freed (level 2)
    bytes_in_use_before: int | None  # the devices' (None: not reported, XLA:CPU)
    bytes_in_use_after: int | None


class WakeUpResponse(SuccessResponse):
    bytes_in_use_before: int | None
    bytes_in_use_after: int | None


class IsSleepingResponse(BaseModel):
    is_sleeping: bool
    level: int


class UpdateWeightsResponse(SuccessResponse):
    message: str
    weight_version: int


class WeightVersionResponse(BaseModel):
    weight_version: int


def load_checkpoint(model_path: str, load_format: str = "auto"):
    """The weights of a checkpoint (an HF or orbax directory, a .gguf file) as llmjax's pytree,
    in float32 on the host: what `LLM.update_weights` takes."""
    if load_format != "auto":
        raise ValueError(f"load_format={load_format!r}: only 'auto' reads checkpoints here")
    from llmjax.loading import load

    _, params, _ = load(model_path, "float32", "auto", None)
    return params


def add_weight_routes(app: FastAPI, async_engine, llm, config, api_error, errors) -> None:
    """The routes above on `app`, driving `async_engine` (and `llm.update_weights` for a
    checkpoint on disk); `api_error(status, message, param)` makes the server's error,
    `errors(*statuses)` documents them."""

    def ok(model, what: str) -> dict:
        return {200: {"model": model, "description": what}} | errors(400, 503)

    engine = async_engine.engine

    def check_open() -> None:
        if not hasattr(engine, "pause_generation"):
            raise api_error(400, "a cluster's instances take no weight updates yet", None)
        if not config.enable_weight_updates:
            raise api_error(
                400,
                "pausing, sleeping and updating weights is off: start the server with "
                "--enable_weight_updates",
                None,
            )

    async def on_engine(fn, param=None):
        from llmjax.serve.async_engine import EngineDeadError

        try:
            return await async_engine.call(fn)
        except (ValueError, RuntimeError) as e:
            raise api_error(400, str(e), param) from None
        except EngineDeadError as e:
            raise api_error(503, f"the engine is not serving: {e}", None) from None

    @app.post("/pause", responses=ok(PauseResponse, "Paused"))
    async def pause(body: PauseRequest | None = None, mode: str | None = None):
        check_open()
        mode = mode or (body.mode if body is not None else "abort")
        if mode not in PAUSE_MODES:
            raise api_error(400, f"mode {mode!r}: choose one of {list(PAUSE_MODES)}", "mode")

        def run():
            outs = engine.pause_generation(mode)
            async_engine.deliver(outs)  # 'abort': every stream ends now
            return len([o for o in outs if o.finish_reason == "abort"])

        aborted = await on_engine(run, "mode")
        if mode == "wait":  # answer once what was running has finished
            while await on_engine(lambda: engine.paused == "wait" and engine.can_step):
                await asyncio.sleep(0.005)
        return {"success": True, "mode": mode, "num_aborted": aborted}

    @app.post("/resume", responses=ok(SuccessResponse, "Resumed"))
    async def resume():
        check_open()
        await on_engine(engine.resume_generation)
        return {"success": True}

    @app.get("/is_paused", responses=ok(IsPausedResponse, "Whether paused"))
    async def is_paused():  # (read-only: open without the flag)
        return {"is_paused": engine.is_paused, "mode": engine.paused}

    @app.post("/sleep", responses=ok(SleepResponse, "Asleep: the bytes freed"))
    async def sleep(body: SleepRequest | None = None, level: int | None = None):
        check_open()
        level = level if level is not None else (body.level if body is not None else 1)
        freed = await on_engine(lambda: engine.sleep(level), "level")
        return {"success": True, "level": level, **freed}

    @app.post("/wake_up", responses=ok(WakeUpResponse, "Awake"))
    async def wake_up():
        check_open()
        taken = await on_engine(engine.wake_up)
        return {"success": True, **taken}

    @app.get("/is_sleeping", responses=ok(IsSleepingResponse, "Whether asleep"))
    async def is_sleeping():
        return {"is_sleeping": bool(engine.sleep_level), "level": engine.sleep_level}

    @app.post(
        "/update_weights_from_disk", responses=ok(UpdateWeightsResponse, "The new weights serve")
    )
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        check_open()
        if not hasattr(llm, "update_weights"):
            raise api_error(400, "this server's engine takes no weight updates", None)
        try:  # read on a worker thread: the engine keeps serving meanwhile
            params = await asyncio.to_thread(load_checkpoint, body.model_path, body.load_format)
        except (OSError, ValueError) as e:
            raise api_error(400, f"cannot read {body.model_path!r}: {e}", "model_path") from None
        version = await on_engine(lambda: llm.update_weights(params), "model_path")
        return {
            "success": True,
            "message": f"weights updated from {body.model_path}",
            "weight_version": version,
        }

    @app.get(
        "/weight_version",
        responses={200: {"model": WeightVersionResponse, "description": "The weight version"}},
    )
    async def weight_version():
        return {"weight_version": engine.weight_version}

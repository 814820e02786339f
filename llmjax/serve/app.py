"""The OpenAI-compatible HTTP front door (FastAPI), with vLLM's wire conventions:

    POST /v1/completions        prompt: a string, a list of strings, token ids, or lists of them
    POST /v1/chat/completions   messages rendered with the model's chat template
    POST /v1/programs           semantic-variable programs (llmjax/serve/programs.py)
    DELETE /v1/programs/{id}    cancel and close a program's session
    GET  /v1/models   GET /health   GET /metrics   GET /version
    POST /tokenize    POST /detokenize

Streaming is server-sent events (`data: {json}\\n\\n`, ending `data: [DONE]\\n\\n`); a chat stream's
role arrives with its first token; `stream_options.include_usage` adds a usage chunk with empty
choices. Errors have vLLM's shape `{"error": {"message", "type", "param", "code"}}`: 400 for bad
parameters, malformed JSON, wrong types and prompts that cannot fit (`param` names the field; never
FastAPI's 422), 404 for an unknown model, 401 for a wrong or missing key when an api key is set (on
/v1/*), 503 with Retry-After when more than `max_num_queued` requests wait (decided before anything
is streamed), 405 with Allow for a method a route does not take, and an error event inside a
stream that fails after it started. A client that disconnects aborts its requests before the
engine's next step.

The OpenAPI schema (/openapi.json) says exactly this: each route's statuses with the error body's
model (`ErrorResponse`), the success bodies (llmjax/serve/protocol.py) and the streams' events,
/metrics as Prometheus text, /health's empty 200, the API key as a bearer security scheme on /v1/*,
and the bounds that depend on the model (token ids below its vocabulary size, max_tokens below
max_model_len). tests/test_serve_openapi.py fuzzes the server from it with schemathesis.

Every JAX call happens on the engine thread (`AsyncEngine`); handlers tokenize, check, queue and
format. Timestamps come from the engine's own request metrics; the request's arrival is stamped
when its handler starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import llmjax
from llmjax.engine.engine import InvalidRequest
from llmjax.engine.request import RequestOutput
from llmjax.lora import LoRARequest
from llmjax.sampling_params import SamplingParams
from llmjax.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    OutputStream,
)
from llmjax.serve.logprobs import chat_logprobs, completion_logprobs
from llmjax.serve.metrics import CONTENT_TYPE
from llmjax.serve.protocol import (
    CONTEXT_MAX,
    VOCAB_MAX,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    OpenAIModel,
    ProgramClosed,
    ProgramRequest,
    ProgramResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from llmjax.serve.weight_routes import PATHS as WEIGHT_PATHS
from llmjax.serve.weight_routes import add_weight_routes
from llmjax.tokenizer import TextStream

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 for a full queue asks the client to wait
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
REQUEST_FIELDS = {"top_logprobs", "logit_bias", "response_format", "structured_outputs"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """served_model_name: the `model` clients send (and /v1/models lists). model_path: where the
    weights came from (`root` in /v1/models). api_key: if set, /v1/* need `Authorization: Bearer
    <key>`. max_num_queued: at most this many requests wait for the engine (None: unbounded).
    program_idle_s: a program session kept open (`keep_session`) is closed after this many
    seconds without a request. enable_lora_runtime_updates: /v1/load_lora_adapter and
    /v1/unload_lora_adapter change the adapters served (else they answer 400; vLLM gates them
    by VLLM_ALLOW_RUNTIME_LORA_UPDATING). enable_weight_updates: /pause, /resume, /sleep,
    /wake_up and /update_weights_from_disk drive the engine for a trainer (else they answer 400;
    llmjax/serve/weight_routes.py); with an api_key they need it too."""

    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_num_queued: int | None = None
    program_idle_s: float = 600.0
    enable_lora_runtime_updates: bool = False
    enable_weight_updates: bool = False

    def __post_init__(self):
        if not self.program_idle_s > 0:
            raise ValueError(f"program_idle_s={self.program_idle_s} must be > 0")


def _keyed(path: str) -> bool:
    """Whether a route needs the API key (when the server has one)."""
    return path.startswith("/v1") or path in WEIGHT_PATHS


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "InternalServerError")


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None, kind: str = "") -> dict:
    kind = kind or ERROR_TYPES.get(status, "InternalServerError")
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(error_body(e.status, e.message, e.param, e.kind), e.status, headers)


def build_app(
    async_engine: AsyncEngine,
    tokenizer,
    config: ServerConfig,
    metrics=None,
    programs=None,
    programs_unsupported: str = "this server does not run programs",
    llm=None,
) -> FastAPI:
    """The FastAPI app over a started-on-startup `AsyncEngine` (its lifespan starts and stops the
    engine thread). `metrics`: the `ServingMetrics` /metrics exposes. `programs`: the
    `ProgramRoutes` (llmjax/serve/programs.py) behind /v1/programs, or None (the routes answer
    501 with `programs_unsupported`). `llm`: the LLM whose `update_weights` reads a checkpoint
    for /update_weights_from_disk (llmjax/serve/weight_routes.py)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        expiry = asyncio.ensure_future(programs.expire_forever()) if programs else None
        try:
            yield
        finally:
            if expiry is not None:
                expiry.cancel()
            async_engine.stop()

    app = FastAPI(title="llmjax", version=llmjax.__version__, lifespan=lifespan)
    handler = _Handlers(async_engine, tokenizer, config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return error_response(_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # e.headers: a 405's Allow (the methods the route takes)
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("error serving %s", request.url.path)
        return JSONResponse(error_body(500, f"{type(e).__name__}: {e}"), 500)

    if config.api_key:
        expected = f"Bearer {config.api_key}".encode()

        @app.middleware("http")
        async def _authenticate(request: Request, call_next):
            if request.method != "OPTIONS" and _keyed(request.url.path):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    message = "invalid or missing API key (Authorization: Bearer <key>)"
                    return JSONResponse(error_body(401, message), 401)
            return await call_next(request)

    @app.post(
        "/v1/completions",
        responses=_generation_responses(CompletionResponse, CompletionChunk)
        | _errors(400, 404, 503),
    )
    async def completions(body: CompletionRequest, request: Request):
        return await handler.completions(body, request)

    @app.post(
        "/v1/chat/completions",
        responses=_generation_responses(ChatCompletionResponse, ChatCompletionChunk)
        | _errors(400, 404, 503),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handler.chat(body, request)

    @app.post(
        "/v1/programs",
        responses={200: {"model": ProgramResponse, "description": "The variables asked for"}}
        | _errors(400, 404, 501, 503),
    )
    async def run_program(body: ProgramRequest, request: Request):
        handler._check_model(body.model)
        if programs is None:
            raise APIError(501, programs_unsupported)
        return await programs.post(body, request)

    @app.delete(
        "/v1/programs/{session_id}",
        responses={200: {"model": ProgramClosed, "description": "Cancelled and closed"}}
        | _errors(404, 501, 503),
    )
    async def close_program(session_id: str):
        if programs is None:
            raise APIError(501, programs_unsupported)
        return await programs.delete(session_id)

    @app.get("/v1/models", responses={200: {"model": ModelList, "description": "The model"}})
    async def models():
        return handler.models()

    @app.get(
        "/health",
        response_class=Response,  # no body: no content type (vLLM's)
        responses={
            200: {"description": "The engine thread is running (an empty body)"},
            503: {"model": ErrorResponse, "description": "The engine thread stopped"},
        },
    )
    async def health():
        if async_engine.is_running:
            return Response(status_code=200)
        return JSONResponse(error_body(503, async_engine.error or "the engine is not running"), 503)

    @app.get("/version", responses={200: {"model": VersionResponse, "description": "llmjax's"}})
    async def version():
        return {"version": llmjax.__version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus' text exposition format"}},
    )
    async def prometheus_metrics():
        body = metrics.exposition() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.post(
        "/tokenize",
        responses={200: {"model": TokenizeResponse, "description": "The token ids"}}
        | _errors(400, 404),
    )
    async def tokenize(body: TokenizeRequest):
        return handler.tokenize(body)

    @app.post(
        "/detokenize",
        responses={200: {"model": DetokenizeResponse, "description": "The text"}}
        | _errors(400, 404),
    )
    async def detokenize(body: DetokenizeRequest):
        return handler.detokenize(body)

    add_weight_routes(app, async_engine, llm, config, APIError, _errors)

    @app.post(
        "/v1/load_lora_adapter",
        responses={200: {"description": "Success: the adapter is served", "content": TEXT}}
        | _errors(400, 503),
    )
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return await handler.load_lora(body)

    @app.post(
        "/v1/unload_lora_adapter",
        responses={200: {"description": "Success: it is no longer served", "content": TEXT}}
        | _errors(400, 404, 503),
    )
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await handler.unload_lora(body)

    limits = {
        VOCAB_MAX: handler.llm_engine.config.model.vocab_size - 1,
        CONTEXT_MAX: handler.max_model_len - 1,
    }

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _openapi_schema(app, config, limits)
        return app.openapi_schema

    app.openapi = openapi
    return app


# ------------------------------------------------------------------------------------------------
# The OpenAPI schema: what each route answers.

ERROR_DESCRIPTIONS = {
    400: "Bad parameters, malformed JSON, wrong types, or a prompt that cannot fit (param names "
    "the field)",
    401: "A wrong or missing API key (Authorization: Bearer <key>)",
    404: "An unknown model (or program session)",
    501: "This server does not run programs",
    503: "Too many requests wait (max_num_queued), or the engine stopped",
}
REF = "#/components/schemas/"
TEXT = {"text/plain": {"schema": {"type": "string"}}}  # a plain-text body (vLLM's LoRA routes)


def _errors(*statuses: int) -> dict[int, dict]:
    """Route responses: vLLM's error body for each status (a 503 asks to retry later)."""
    out = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        if status == 503:
            retry = {"description": "seconds to wait", "schema": {"type": "integer"}}
            out[status]["headers"] = {"Retry-After": {**retry, "required": True}}
    return out


def _generation_responses(body: type, chunk: type) -> dict[int, dict]:
    """A generation route's 200: the JSON body, or with `stream: true` server-sent events, each
    a `chunk` (or an error body if the stream fails after it started), then [DONE]."""
    data = {
        "type": "string",
        "oneOf": [
            {"const": "[DONE]"},
            {
                "contentMediaType": "application/json",
                "contentSchema": {
                    "anyOf": [{"$ref": REF + chunk.__name__}, {"$ref": REF + "ErrorResponse"}]
                },
            },
        ],
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {
        200: {
            "model": body,
            "description": "The completion; with stream: true, server-sent events",
            "content": {"text/event-stream": {"itemSchema": event}},
        }
    }


def _openapi_schema(app: FastAPI, config: ServerConfig, limits: dict[str, int]) -> dict:
    """FastAPI's schema of `app`, made to say what the server answers: no 422 (validation
    errors are 400s), the streams' chunk models, the model's bounds (`limits`: placeholder ->
    maximum), and with an API key a bearer scheme and 401 on /v1/*."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for model in (CompletionChunk, ChatCompletionChunk, ErrorResponse):
        model_schema = model.model_json_schema(ref_template=REF + "{model}", mode="serialization")
        for name, definition in model_schema.pop("$defs", {}).items():
            models.setdefault(name, definition)
        models.setdefault(model.__name__, model_schema)
    models.pop("HTTPValidationError", None)
    models.pop("ValidationError", None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if config.api_key and _keyed(path):  # as the middleware decides
                operation["security"] = [{"APIKey": []}]
                operation["responses"]["401"] = {
                    "description": ERROR_DESCRIPTIONS[401],
                    "content": {"application/json": {"schema": {"$ref": REF + "ErrorResponse"}}},
                }
    if config.api_key:
        components["securitySchemes"] = {
            "APIKey": {"type": "http", "scheme": "bearer", "description": "the server's api key"}
        }
    _fill_limits(schema, limits)
    return schema


def _fill_limits(node, limits: dict[str, int]) -> None:
    """Replace each placeholder key (protocol.VOCAB_MAX, CONTEXT_MAX) with `maximum`."""
    if isinstance(node, dict):
        for key, value in limits.items():
            if node.pop(key, None):
                node["maximum"] = value
        for child in node.values():
            _fill_limits(child, limits)
    elif isinstance(node, list):
        for child in node:
            _fill_limits(child, limits)


def _validation_error(e: RequestValidationError) -> APIError:
    """pydantic's errors -> one 400 naming the first field (loc after 'body')."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
    parts = []
    for err in errors[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return APIError(400, "invalid request: " + "; ".join(parts), loc[0] if loc else None)


# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Call:
    """One completions or chat call, checked and ready to queue."""

    kind: str  # "completion" or "chat"
    response_id: str
    prompts: list[list[int]]
    texts: list[str | None]
    params: list  # SamplingParams per prompt
    stream: bool
    include_usage: bool
    continuous_usage: bool
    arrival_time: float
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    lora: LoRARequest | None = None  # the adapter the `model` field named

    def model_name(self, base: str) -> str:
        """The `model` the response names: the adapter's, or the base model's."""
        return base if self.lora is None else self.lora.lora_name


class _Handlers:
    def __init__(self, async_engine: AsyncEngine, tokenizer, config: ServerConfig):
        self.engine = async_engine
        self.llm_engine = async_engine.engine
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = self.llm_engine.config.max_model_len
        self.created = int(time.time())
        # the LoRA adapters served, by name (registered before the engine thread started; then
        # changed only through the engine thread, by load_lora / unload_lora)
        lora_list = getattr(self.llm_engine, "list_loras", dict)
        self.loras: dict[str, LoRARequest] = {a.lora_name: a for a in lora_list().values()}

    # ---- checks shared by both endpoints

    def _check_common(self, body: OpenAIModel) -> LoRARequest | None:
        """The request's adapter (None: the base model), after the checks both endpoints
        share."""
        lora = self._check_model(body.model)
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(400, unsupported[1], unsupported[0])
        if body.unknown_fields():
            logger.warning("ignored unknown request fields %s", body.unknown_fields())
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream")
        if body.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need the model's tokenizer", "stop")
        return lora

    def _tokenizer(self, param: str):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param)
        return self.tokenizer

    def _sampling(self, body, prompt: list[int], requested: int | None, prompt_param: str):
        n, limit = len(prompt), self.max_model_len
        max_tokens = requested if requested is not None else limit - n
        if n + max(max_tokens, 1) > limit:
            param = prompt_param if n >= limit else "max_tokens"
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the {prompt_param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                param,
            )
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            field = str(e).split(" ", 1)[0].rstrip(":.").split(".")[0]
            if field == "logprobs" and isinstance(body, ChatCompletionRequest):
                field = "top_logprobs"
            raise APIError(
                400, str(e), field if field in SAMPLING_FIELDS | REQUEST_FIELDS else None
            ) from None
        try:
            self.llm_engine.validate_request(prompt, params)
        except InvalidRequest as e:
            param = prompt_param if e.param == "prompt" else e.param
            if param == "structured_outputs" and body.structured_outputs is None:
                param = "response_format"
            raise APIError(400, str(e), param) from None
        return params

    def _call(
        self, kind: str, body, prompts, texts, requested, prompt_param, arrival, lora
    ) -> _Call:
        params = [self._sampling(body, p, requested, prompt_param) for p in prompts]
        options = body.stream_options
        return _Call(
            kind=kind,
            response_id=f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
            prompts=prompts,
            texts=texts,
            params=params,
            stream=body.stream,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
            arrival_time=arrival,
            echo=bool(getattr(body, "echo", False)),
            lora=lora,
        )

    # ---- endpoints

    async def completions(self, body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        lora = self._check_common(body)
        prompts, texts = [], []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(self._tokenizer("prompt").encode(p))
                texts.append(p)
            else:
                prompts.append(list(p))
                texts.append(None)
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        call = self._call(
            "completion", body, prompts, texts, body.max_tokens, "prompt", arrival, lora
        )
        return await self._serve(call, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        lora = self._check_common(body)
        tok = self._tokenizer("messages")
        messages = [m.as_template_message() for m in body.messages]
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt
            )
        except Exception as e:  # a template that refuses these messages (roles, order)
            raise APIError(400, f"the chat template failed: {e}", "messages") from None
        requested = body.requested_max_tokens
        call = self._call(
            "chat", body, [tok.encode(text)], [text], requested, "messages", arrival, lora
        )
        return await self._serve(call, request)

    def models(self) -> dict:
        card = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llmjax",
            "root": self.config.model_path or self.config.served_model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "vocab_size": self.llm_engine.config.model.vocab_size,  # llmjax's: for load tests
        }
        adapters = [  # vLLM's cards of LoRA adapters: the base model is their parent
            card | {"id": name, "root": lora.lora_path, "parent": self.config.served_model_name}
            for name, lora in self.loras.items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    async def load_lora(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        self._check_runtime_updates()
        name = body.lora_name
        if name in self.loras or name == self.config.served_model_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora_id = max((a.lora_int_id for a in self.loras.values()), default=0) + 1
        lora = LoRARequest(name, lora_id, body.lora_path)
        try:
            await self.engine.call(lambda: self.llm_engine.add_lora(lora))
        except ValueError as e:  # LoRAError too: the adapter cannot be served
            raise APIError(400, str(e), "lora_path") from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not serving: {e}") from None
        self.loras[name] = lora
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        self._check_runtime_updates()
        name = body.lora_name
        lora = self.loras.get(name)
        if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        try:
            await self.engine.call(lambda: self.llm_engine.remove_lora(lora.lora_int_id))
        except ValueError as e:  # requests still use it
            raise APIError(400, str(e), "lora_name") from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not serving: {e}") from None
        del self.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _check_runtime_updates(self) -> None:
        if not self.config.enable_lora_runtime_updates:
            raise APIError(
                400,
                "loading and unloading LoRA adapters at run time is off: start the server with "
                "--enable_lora_runtime_updates",
            )

    def tokenize(self, body: TokenizeRequest) -> dict:
        self._check_model(body.model)
        tok = self._tokenizer("prompt")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            try:
                text = tok.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt
                )
            except Exception as e:  # as chat's: a template that refuses these messages
                raise APIError(400, f"the chat template failed: {e}", "messages") from None
            tokens = tok.encode(text, add_special_tokens=body.add_special_tokens)
        else:
            tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        vocab = self.llm_engine.config.model.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(
                400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens"
            )
        return {"prompt": self._tokenizer("tokens").decode(body.tokens)}

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for an unknown model."""
        if model is None or model == self.config.served_model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return lora

    # ---- queueing and answering

    async def _serve(self, call: _Call, request: Request):
        try:
            stream = self.engine.add_requests(
                list(zip(call.prompts, call.params, strict=True)),
                request_id=call.response_id,
                arrival_time=call.arrival_time,
                prompts=call.texts if call.kind == "completion" else None,
                final_only=not call.stream,
                lora_request=call.lora,
            )
        except EngineOverloadedError as e:
            raise APIError(503, str(e)) from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not serving: {e}") from None
        if call.stream:
            return _EventStream(self._sse(call, stream), lambda: self.engine.close(stream))
        try:
            outputs = await _collect_or_disconnect(stream, request)
        finally:
            self.engine.close(stream)
        if outputs is None:  # the client went away: its requests are aborted
            return Response(status_code=499)
        return self._response(call, outputs)

    def _response(self, call: _Call, outputs: dict[str, RequestOutput]) -> JSONResponse:
        ordered = [outputs[f"{call.response_id}-{i}"] for i in range(len(call.prompts))]
        failed = next((o for o in ordered if o.error), None)
        if failed is not None:
            raise APIError(400, failed.error, "prompt" if call.kind == "completion" else "messages")
        choices = []
        for i, out in enumerate(ordered):
            params = call.params[i]
            for sample in out.outputs:
                choice = {"index": i * params.n + sample.index}
                text = sample.text
                if call.echo:
                    text = self._prompt_text(call, i) + text
                if call.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                if self.tokenizer is None:  # no text to give: the token ids (vLLM's token_ids)
                    choice["token_ids"] = sample.token_ids
                choice |= {
                    "logprobs": self._logprobs(call, i, out, sample.token_ids, sample.logprobs),
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
                choices.append(choice)
        body = {
            "id": call.response_id,
            "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": call.model_name(self.config.served_model_name),
            "choices": choices,
            "usage": _usage(ordered),
        }
        if any(p.prompt_logprobs is not None for p in call.params):  # vLLM's extension
            body["prompt_logprobs"] = [_prompt_logprobs_json(o.prompt_logprobs) for o in ordered]
        return JSONResponse(body)

    def _prompt_text(self, call: _Call, i: int) -> str:
        text = call.texts[i]
        if text is None:
            text = self.tokenizer.decode(call.prompts[i]) if self.tokenizer is not None else ""
        return text

    def _logprobs(
        self, call: _Call, i: int, out, token_ids, entries, offset: int = 0, first: bool = True
    ):
        """A choice's `logprobs` in the endpoint's format (None unless asked for); with echo,
        the prompt's tokens lead the `first` chunk. `offset`: characters before these tokens
        (completions' text_offset)."""
        params = call.params[i]
        if params.logprobs is None or entries is None:
            return None
        token_ids, entries = list(token_ids), list(entries)[: len(token_ids)]
        if call.kind == "chat":
            return chat_logprobs(self.tokenizer, token_ids, entries, params.logprobs)
        if call.echo and first and out.prompt_logprobs is not None:  # the prompt's first
            token_ids = call.prompts[i] + token_ids
            entries = list(out.prompt_logprobs) + entries
        return completion_logprobs(self.tokenizer, token_ids, entries, offset)

    async def _sse(self, call: _Call, stream: OutputStream):
        """The events of one call: a chunk per sample with new text (or a finish), the usage
        chunk if asked for, [DONE]; an error event if the engine stops first."""
        kind = "chat.completion.chunk" if call.kind == "chat" else "text_completion"
        head = {
            "id": call.response_id,
            "object": kind,
            "created": int(time.time()),
            "model": call.model_name(self.config.served_model_name),
        }
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        pieces: dict[tuple[str, int], TextStream | None] = {}
        sent: dict[tuple[str, int], int] = {}  # token ids streamed per sample
        offsets: dict[tuple[str, int], int] = {}  # their logprobs' characters (text_offset)
        latest: dict[str, RequestOutput] = {}
        try:
            async for outputs in stream:
                for out in outputs:
                    latest[out.request_id] = out
                    if out.error:
                        raise EngineDeadError(out.error)
                    i = index[out.request_id]
                    params = call.params[i]
                    for sample in out.outputs:
                        key = (out.request_id, sample.index)
                        first = key not in sent
                        if first:
                            pieces[key] = (
                                TextStream(self.tokenizer, params.stop) if self.tokenizer else None
                            )
                        piece, done = pieces[key], sample.finish_reason is not None
                        before = sent.get(key, 0)
                        new_ids = sample.token_ids[before:]
                        sent[key] = len(sample.token_ids)
                        text = piece.update(sample.token_ids, done, sample.text) if piece else ""
                        if call.echo and first:
                            text = self._prompt_text(call, i) + text
                        if not (text or done or (first and call.kind == "chat") or not piece):
                            continue
                        if not new_ids and not done and not first and piece is None:
                            continue
                        choice = {"index": i * params.n + sample.index}
                        if call.kind == "chat":  # the role comes with the first token
                            role = {"role": "assistant"} if first else {}
                            choice["delta"] = role | {"content": text}
                        else:
                            choice["text"] = text
                        if piece is None:  # no tokenizer: the new token ids instead of text
                            choice["token_ids"] = new_ids
                        entries = None if sample.logprobs is None else sample.logprobs[before:]
                        logprobs = None
                        if new_ids or (call.echo and first):
                            logprobs = self._logprobs(
                                call, i, out, new_ids, entries, offsets.get(key, 0), first
                            )
                        if logprobs is not None and "tokens" in logprobs:
                            offsets[key] = offsets.get(key, 0) + sum(map(len, logprobs["tokens"]))
                        choice |= {
                            "logprobs": logprobs,
                            "finish_reason": sample.finish_reason if done else None,
                            "stop_reason": sample.stop_reason if done else None,
                        }
                        chunk = head | {"choices": [choice]}
                        if call.continuous_usage:
                            chunk["usage"] = _usage(latest.values())
                        yield _event(chunk)
            if call.include_usage:
                yield _event(head | {"choices": [], "usage": _usage(latest.values())})
        except EngineDeadError as e:
            yield _event(error_body(500, str(e), kind="InternalServerError"))
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A server-sent event stream that calls `on_close` however it ends: finished, failed, or
    cancelled because the client disconnected (even before its first event)."""

    def __init__(self, events, on_close):
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _prompt_logprobs_json(entries) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, None or {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": max(lp.logprob, -9999.0),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in e.items()
        }
        for e in entries
    ]


def _usage(outputs) -> dict:
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


async def _collect_or_disconnect(
    stream: OutputStream, request: Request
) -> dict[str, RequestOutput] | None:
    """Every request's final output, or None if the client disconnects first."""

    async def collect():
        final = {}
        async for outputs in stream:
            final |= {o.request_id: o for o in outputs}
        return final

    try:
        return await _or_disconnect(collect(), request)
    except EngineDeadError as e:
        raise APIError(503, f"the engine stopped: {e}") from None


async def _or_disconnect(awaitable, request: Request):
    """What `awaitable` gives (or raises), or None if the client disconnects first (the
    awaitable is then cancelled)."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if result in done:
        return result.result()
    result.cancel()
    return None

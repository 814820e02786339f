"""The wire models of the OpenAI-compatible API (pydantic): the request bodies, with vLLM's
extras that llmjax implements (`top_k`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `seed`, `max_completion_tokens`), and the response bodies, which
document the server's OpenAPI schema (the handlers build them as dicts; the error body is built
from `ErrorResponse`).

Fields that OpenAI or vLLM define and llmjax does not implement yet are declared with their
defaults, so a request that sets one to anything else is answered 400 naming it
(`unsupported()`), never silently ignored. Other unknown fields are ignored with a warning in the
server's log, as vLLM does.

Pydantic validates types and the bounds given with `Field(ge=..)`; the bounds given with
`_checked(..)` are only documented, since the handler checks them itself (answering 400 with its
own message that names the field, as vLLM's). `VOCAB_MAX` and `CONTEXT_MAX` mark bounds that
depend on the served model: the app's schema replaces them with the model's (app.py).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from llmjax.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

# Schema placeholders for bounds that depend on the served model (filled in by the app).
MAX_N = 128  # samples per request (`n`), as OpenAI bounds it
VOCAB_MAX = "x-llmjax-vocab-max"  # maximum: the vocabulary's last token id
CONTEXT_MAX = "x-llmjax-context-max"  # maximum: max_model_len - 1 (a prompt has >= 1 token)


def _checked(**schema: Any) -> Any:
    """JSON Schema keywords for a bound the handler checks (not pydantic): documented only."""
    return Field(json_schema_extra=schema)


def _unsupported(*allowed: Any) -> Any:
    """The schema of a field llmjax does not implement: only its `allowed` values."""
    return WithJsonSchema(
        {"enum": list(allowed), "description": "not implemented by llmjax yet: leave it out"}
    )


def _integral(value: Any) -> Any:
    """An integral JSON number (5.0) as an int: JSON Schema's integers (strict mode refuses
    floats; booleans and strings stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
TokenIds = list[Annotated[Int, Field(ge=0)]]
# Token ids the server checks against the model's vocabulary (the prompt's, /detokenize's).
VocabTokenIds = list[Annotated[Int, Field(ge=0), _checked(**{VOCAB_MAX: True})]]
NonEmptyString = Annotated[str, _checked(minLength=1)]
Logprobs = Annotated[Int, _checked(minimum=0, maximum=MAX_LOGPROBS)]


class _Request(BaseModel):
    """A request body, or a part of one: JSON's types as the schema says (no "1" for 1, no 0 for
    false: a client that sends them learns it at once, as from the schema)."""

    model_config = ConfigDict(strict=True)


class OpenAIModel(_Request):
    model_config = ConfigDict(extra="allow")
    # field -> its default (or a tuple of the values that mean "off"): others are refused
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value llmjax does not implement."""
        for name, default in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in (default if isinstance(default, tuple) else (default,)):
                return name, (
                    f"{name}={value!r} is not implemented by llmjax yet; leave it out (or at "
                    f"{default[0] if isinstance(default, tuple) else default!r})"
                )
        return None


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(OpenAIModel):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[Int, Field(ge=-1)] = 0  # vLLM: -1 or 0 disables
    seed: Annotated[Int, Field(ge=0, lt=2**32)] | None = None
    stop: NonEmptyString | list[NonEmptyString] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    # OpenAI's maximum: a server bounds the sequences one request may start (the library's
    # SamplingParams does not)
    n: Annotated[Int, _checked(minimum=1, maximum=MAX_N)] = 1
    presence_penalty: Annotated[float, _checked(minimum=-2, maximum=2)] = 0.0
    frequency_penalty: Annotated[float, _checked(minimum=-2, maximum=2)] = 0.0
    repetition_penalty: Annotated[float, _checked(exclusiveMinimum=0)] = 1.0
    min_tokens: Annotated[Int, _checked(minimum=0)] = Field(0, description="at most max_tokens")
    min_p: Annotated[float, _checked(minimum=0, maximum=1)] = 0.0
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, _checked(minimum=-100, maximum=100)]],
            _checked(maxProperties=MAX_LOGIT_BIAS),
        ]
        | None
    ) = Field(None, description="{token id (a decimal string): bias}")
    prompt_logprobs: Logprobs | None = None
    # OpenAI's: text, json_object, json_schema (with json_schema.schema, a JSON schema)
    response_format: (
        Annotated[
            dict[str, Any],
            _checked(
                properties={"type": {"enum": ["text", "json_object", "json_schema"]}},
            ),
        ]
        | None
    ) = None
    # vLLM's: exactly one of json, regex, choice, grammar, json_object
    structured_outputs: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {}

    def structured(self) -> StructuredOutputsParams | None:
        """`structured_outputs` or `response_format` as StructuredOutputsParams (ValueError
        naming the field)."""
        fmt = self.response_format
        if self.structured_outputs is not None:
            if fmt is not None and fmt.get("type", "text") != "text":
                raise ValueError("response_format: give it or structured_outputs, not both")
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format: json_schema needs json_schema.schema, an object")
            return StructuredOutputsParams(json=schema)
        raise ValueError(
            f"response_format: type must be text, json_object or json_schema, got {kind!r}"
        )

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = self.stop if self.stop is not None else ()
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N} (OpenAI's maximum), got n={self.n}")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            stop=stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            logit_bias=bias,
            logprobs=self.requested_logprobs,
            prompt_logprobs=self.requested_prompt_logprobs,
            structured_outputs=self.structured(),
        )

    @property
    def requested_logprobs(self) -> int | None:
        return None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_Sampling):
    prompt: (
        str
        | Annotated[list[str], _checked(minItems=1)]
        | Annotated[VocabTokenIds, _checked(minItems=1)]
        | Annotated[list[Annotated[VocabTokenIds, _checked(minItems=1)]], _checked(minItems=1)]
    ) = Field(description="a text, texts, token ids, or lists of them: one choice each")
    max_tokens: Annotated[Int, Field(ge=1), _checked(**{CONTEXT_MAX: True})] | None = Field(
        16, description="prompt tokens + max_tokens must fit max_model_len (null: fill it)"
    )
    best_of: Annotated[Int | None, _unsupported(None, 1)] = None
    echo: bool = False
    logprobs: Logprobs | None = None
    suffix: Annotated[str | None, _unsupported(None)] = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_Sampling.UNSUPPORTED,
        "best_of": (None, 1),
        "suffix": None,
    }

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's logprobs too (OpenAI's legacy completions). A
        negative prompt_logprobs is kept, so that it is refused as without echo."""
        if self.echo and self.logprobs is not None and (self.prompt_logprobs or 0) >= 0:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template

    role: str
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: content a string (text parts joined with
        newlines, as vLLM does)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = Field(
        None, description="deprecated: max_completion_tokens, if given, wins"
    )
    max_completion_tokens: Annotated[Int, Field(ge=1), _checked(**{CONTEXT_MAX: True})] | None = (
        Field(None, description="prompt tokens + this must fit max_model_len (null: fill it)")
    )
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(None, description="needs logprobs: true")
    tools: Annotated[
        list[dict[str, Any]] | None,
        WithJsonSchema(
            {
                "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                "description": "not implemented by llmjax yet: leave it out",
            }
        ),
    ] = None
    tool_choice: Annotated[str | dict[str, Any] | None, _unsupported(None, "none")] = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_Sampling.UNSUPPORTED,
        "tools": (None, []),
        "tool_choice": (None, "none"),
    }

    @property
    def requested_logprobs(self) -> int | None:
        """logprobs: true, with top_logprobs (0-20) alternatives per token."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(OpenAIModel):
    """Exactly one of `prompt` (a text) and `messages` (rendered with the chat template)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter body: a PEFT directory served as model `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: VocabTokenIds


class ProgramVariable(_Request):
    id: str
    content: str


class ProgramGet(_Request):
    variables: list[str]
    criteria: str = "latency"  # checked by the handler (a 400 naming `get`)


class ProgramRequest(OpenAIModel):
    """POST /v1/programs (docs/programs.md): semantic functions (`SemanticFunction.to_dict()`),
    constant variables, calls (`CallSpec.to_dict()`) and the variables to compute, for a new
    session (`session_id` null) or an open one."""

    model: str | None = None
    session_id: str | None = None
    functions: list[dict[str, Any]] = []
    variables: list[ProgramVariable] = []
    calls: list[dict[str, Any]] = []
    get: list[ProgramGet] = []
    keep_session: bool = False


# ------------------------------------------------------------------------------------------------
# Responses. The handlers build these bodies as dicts; the models document them (the OpenAPI
# schema) and `ErrorResponse` builds the error body.


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="BadRequestError, AuthenticationError, NotFoundError, ...")
    param: str | None = Field(description="the request field at fault, if one is")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """vLLM's error body (a stream that fails after it started sends one as its last event)."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: per token its text, logprob, top alternatives, text offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatContentLogprob(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatContentLogprob]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt, per prompt token, null or {token id: PromptLogprob}
PromptLogprobs = list[list[dict[str, PromptLogprob] | None] | None]


class _Choice(BaseModel):
    index: int = Field(description="prompt index x n + sample index")
    token_ids: list[int] | None = Field(
        None, description="only from a server whose model has no tokenizer (no text)"
    )
    finish_reason: str | None = Field(description="stop, length, abort, error; null mid-stream")
    stop_reason: int | str | None = Field(description="the stop token id or string that ended it")


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="only if asked for")


class CompletionChunk(BaseModel):
    """One event of a completions stream (`choices` empty in the usage chunk)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="with stream_options' usage options")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="only if asked for")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="with the first token")
    content: str


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(BaseModel):
    """One event of a chat stream (`choices` empty in the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options' usage options")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ProgramVariableError(BaseModel):
    message: str
    function: str | None
    placeholder: str | None


class ProgramUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ProgramResponse(BaseModel):
    object: Literal["program"]
    session_id: str
    values: dict[str, str] = Field(description="{variable id: its text}")
    errors: dict[str, ProgramVariableError] = Field(description="{variable id: why it failed}")
    usage: ProgramUsage


class ProgramClosed(BaseModel):
    session_id: str
    cancelled: int = Field(description="requests aborted")

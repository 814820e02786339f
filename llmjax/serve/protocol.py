"""The request bodies of the OpenAI-compatible API (pydantic), with vLLM's extras that llmjax
implements (`top_k`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `seed`,
`max_completion_tokens`).

Fields that OpenAI or vLLM define and llmjax does not implement yet are declared with their
defaults, so a request that sets one to anything else is answered 400 naming it
(`unsupported()`), never silently ignored. Other unknown fields are ignored with a warning in the
server's log, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmjax.sampling_params import SamplingParams, StructuredOutputsParams

TokenIds = list[Annotated[int, Field(ge=0)]]


class OpenAIModel(BaseModel):
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


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(OpenAIModel):
    """What completions and chat completions share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM: -1 or 0 disables
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar

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
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

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
        """echo with logprobs: the prompt's logprobs too (OpenAI's legacy completions)."""
        if self.echo and self.logprobs is not None:
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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
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
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

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
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


class ProgramVariable(BaseModel):
    id: str
    content: str


class ProgramGet(BaseModel):
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

"""The OpenAI request bodies this front accepts, and the error it answers with.

Parameters the engine cannot honour are refused with a 400 naming them rather than ignored:
a client that asks for logit_bias or a suffix must not silently get something else.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator

from splitfuse.openai_api.response_format import JsonObjectFormat, JsonSchemaFormat, ResponseFormat, format_guide
from splitfuse.openai_api.tools import MAX_TOOLS, NamedToolChoice, Tool, ToolCall, ToolChoice, forced_call_schema, \
    tools_problem
from splitfuse.engine.sequence import MAX_CACHE_SALT_LENGTH, MAX_PRIORITY, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS
from splitfuse.structured.guide import MAX_GUIDE_LENGTH


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with an HTTP status (and headers,
    e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The `llm` model's integer inputs are INT32: a larger value must be refused here, not wrapped.
INT32_MAX = 2**31 - 1
# Choices of one request (`n`): each is a generation of its own, sharing the prompt's KV.
MAX_CHOICES = 16
# OpenAI's limit for /v1/completions' `logprobs`.
MAX_COMPLETION_LOGPROBS = 5


def _doc(*schemas: dict, nullable: bool = True) -> WithJsonSchema:
    """A field's schema in the OpenAPI document when its validator accepts less than its type
    says (n=1 only, no logit_bias, ...); validation and its messages stay the validator's."""
    options = [*schemas, {"type": "null"}] if nullable else list(schemas)
    return WithJsonSchema(options[0] if len(options) == 1 else {"anyOf": options})


_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields common to both endpoints (OpenAI's ranges), plus vLLM-style extensions."""

    # allow_inf_nan: 1e400 decodes to inf, which would pass `gt=0` (repetition_penalty) unbounded.
    # strict: a wrong JSON type is a 400 (as OpenAI's), not coerced ("true" -> True, "5" -> 5).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices, each its own generation; with a seed, choice i samples with seed + i (mod 2**64)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _doc(_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4})] = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    logit_bias: Annotated[dict[str, float] | None, _doc({"type": "object", "maxProperties": 0})] = None
    # Extensions (vLLM's names), passed to the engine as they are.
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_LENGTH)
    """Keys the prefix cache (vLLM's name): cached KV is shared only between requests with the same salt."""
    priority: int | None = Field(default=None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Scheduling class (vLLM's name, the opposite sense): HIGHER is served first; absent: 0."""
    # Accepted, no effect.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_Sampling):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      _doc(_TEXT, _TOKEN_IDS, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 1},
                           {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1}, nullable=False)]
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """k > 0: each token's k most likely alternatives too (top_logprobs)."""
    echo: bool = False
    best_of: Annotated[int | None, _doc({"type": "integer", "minimum": 1, "maximum": 1})] = None
    suffix: Annotated[str | None, _doc({"type": "string", "maxLength": 0})] = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request is supported (send a string or one token list)")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt is empty")
        return v


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: string extras are passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None,
                       _doc({"type": "string"}, {"type": "array", "items": _TEXT_PART})] = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message's answer to this call."""

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Each token's k most likely alternatives (needs logprobs: true)."""
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    """Default: "auto" with tools, "none" without."""
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        """What the fields allow alone but not together: a 400 naming the parameter."""
        self.check_stream_options()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        problem = tools_problem(self.tools, self.tool_choice)
        if problem is not None:
            raise ApiError(400, problem[1], param=problem[0])
        if self.tool_mode() == "forced" and isinstance(self.response_format, (JsonObjectFormat, JsonSchemaFormat)):
            raise ApiError(400, "response_format cannot constrain the output of a forced tool call (tool_choice "
                                "'required' or a named function)", param="response_format")

    def tool_mode(self) -> Literal["none", "auto", "forced"]:
        """none: plain content; auto: the model may write <tool_call> blocks; forced: the whole
        output is one call."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice in ("none", "auto"):
            return "none" if not self.tools else choice
        return "forced"

    def guide(self) -> tuple[str, str] | None:
        """(guide type, guide) constraining the output, or None."""
        if self.tool_mode() == "forced":
            assert self.tools
            only = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            text = json.dumps(forced_call_schema(self.tools, only), ensure_ascii=False, separators=(",", ":"))
            if len(text) > MAX_GUIDE_LENGTH:
                raise ApiError(400, f"the tools' parameters schemas together are longer than {MAX_GUIDE_LENGTH} "
                                    "characters as JSON: a forced call cannot be constrained by them", param="tools")
            return "json_schema", text
        return format_guide(self.response_format)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = loc[0] if loc else None
        if err.get("type") == "extra_forbidden":
            raise ApiError(400, f"unsupported parameter: {'.'.join(loc)}", param=param) from None
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        where = ".".join(loc)
        raise ApiError(400, f"{where}: {msg}" if where else msg, param=param) from None

"""The front's OpenAPI document: request bodies, answers and errors as the routes produce them.

The routes read their bodies themselves (bounded, see body.py; refused with OpenAI's error
shape, not FastAPI's 422), so FastAPI cannot infer the schemas from their signatures. They are
declared here from the pydantic models: the requests of protocol.py (what is validated), and
models of the answers that responses.py builds as plain dicts (the served fuzz test checks
every answer against them, so the two cannot drift apart unnoticed).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from splitfuse.openai_api.auth import OPEN_PATHS
from splitfuse.openai_api.embeddings import EmbeddingRequest
from splitfuse.openai_api.openapi_responses import ResponseObject, ResponseStreamEvent
from splitfuse.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from splitfuse.openai_api.responses_request import ResponsesRequest

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Answer):
    error: ErrorDetail


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    """With logprobs=k > 0: per token, its k most likely tokens and the sampled one."""
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionResponse(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatTopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Answer):
    content: list[ChatTokenLogprob]


class AnswerFunction(_Answer):
    name: str
    arguments: str
    """A JSON object, as text."""


class AnswerToolCall(_Answer):
    id: str
    type: Literal["function"]
    function: AnswerFunction


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    """None when the message only calls tools."""
    tool_calls: list[AnswerToolCall] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(_Answer):
    """One event of a streamed completion; the usage chunk has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallDelta(AnswerToolCall):
    """A whole call in one delta; `index` numbers the choice's calls."""

    index: int


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Answer):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    """The served name (never a folder of the server)."""
    parent: str | None
    """A LoRA adapter's base model (null for the base model itself)."""
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Answer):
    triton_llm_ready: bool


class Embedding(_Answer):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str
    """The vector, or with encoding_format base64 its little-endian float32 bytes in base64."""


class EmbeddingUsage(_Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Answer):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


_REQUESTS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest)
_ANSWERS = (ErrorResponse, CompletionResponse, ChatCompletionResponse, CompletionChunk, ChatCompletionChunk, ModelCard,
            ModelList, Health, ResponseObject, ResponseStreamEvent, EmbeddingResponse)
_REFS, _DEFS = models_json_schema([(m, "validation") for m in _REQUESTS] + [(m, "serialization") for m in _ANSWERS],
                                  ref_template="#/components/schemas/{model}")


def _ref(model: type[BaseModel]) -> dict:
    mode = "validation" if model in _REQUESTS else "serialization"
    return _REFS[(model, mode)]


def _json(model: type[BaseModel], description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


ERRORS = {
    400: "a parameter that is invalid or not supported (named in `param`), a body that is not JSON, a request "
         "asking for more log-prob entries than --max-logprob-entries, or a request the engine refuses (e.g. "
         "prompt + max_tokens beyond max_model_len)",
    401: "no valid API key (only when the server has one: `Authorization: Bearer <key>`)",
    404: "no such model",
    413: "the request body is larger than --max-body-bytes",
    429: "the server is busy (the engine's waiting queue is full): retry after `Retry-After` seconds",
    503: "a fault of the server, not of the request (Triton's llm model unavailable or not loaded, the server "
         "restarting or shutting down, its engine broken): retry after `Retry-After` seconds",
}


def error_responses(*codes: int) -> dict[int, dict]:
    """Documented error answers (ErrorResponse bodies) for the status `codes`."""
    return _errors(*codes)


def _errors(*codes: int) -> dict[int, dict]:
    return {c: _json(ErrorResponse, ERRORS[c]) for c in codes}


def _events(chunk: type[BaseModel], done: bool = True) -> dict:
    """A server-sent event of a stream (Open API 3.1: `schema` describes each event): a chunk, an
    error that ended the generation mid-stream, or the closing `[DONE]`; a Responses stream's
    events are named (`event:`) by their type and end with a terminal event, not `[DONE]`."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]} if done else _ref(chunk)}
    if not done:
        return {"type": "object", "required": ["event", "data"],
                "properties": {"event": {"type": "string"}, "data": json_data}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def responses_route() -> dict[str, Any]:
    """Keyword arguments of POST /v1/responses."""
    route = generation_route(ResponsesRequest, ResponseObject, ResponseStreamEvent)
    route["responses"][200] = {
        "description": "the response object, or with `stream: true` server-sent events: response.created, "
                       "response.in_progress, the output items' events, then response.completed (or "
                       "response.incomplete / response.failed)",
        "content": {"application/json": {"schema": _ref(ResponseObject)},
                    "text/event-stream": {"schema": _events(ResponseStreamEvent, done=False)}}}
    return route


def generation_route(request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """Keyword arguments of a POST route that runs one generation."""
    return {
        "response_model": None,
        "openapi_extra": {"requestBody": {"required": True,
                                          "content": {"application/json": {"schema": _ref(request)}}}},
        "responses": {
            200: {"description": "the whole answer, or with `stream: true` server-sent events: one chunk "
                                 "per engine step, then `data: [DONE]`",
                  "content": {"application/json": {"schema": _ref(answer)},
                              "text/event-stream": {"schema": _events(chunk)}}},
            **_errors(400, 401, 404, 413, 429, 503),
        },
    }


def embeddings_route() -> dict[str, Any]:
    """Keyword arguments of POST /v1/embeddings (no stream)."""
    return {
        "response_model": None,
        "openapi_extra": {"requestBody": {"required": True,
                                          "content": {"application/json": {"schema": _ref(EmbeddingRequest)}}}},
        "responses": {200: _json(EmbeddingResponse, "one vector per input, in input order (pooled final hidden "
                                                    "states, L2-normalised)"),
                      **_errors(400, 401, 404, 413, 429, 503)},
    }


# response_model=None: the answers are declared above, not inferred from the return types.
MODELS_ROUTE = {"response_model": None, "responses": {200: _json(ModelList, "the served model"), **_errors(401)}}
MODEL_ROUTE = {"response_model": None,
               "responses": {200: _json(ModelCard, "the served model"), **_errors(401, 404)}}
HEALTH_ROUTE = {"response_model": None, "responses": {200: _json(Health, "Triton's llm model is ready"),
                                                      503: _json(Health, "Triton's llm model is not ready")}}


def _drop_validation_errors(doc: dict[str, Any]) -> None:
    """FastAPI documents a 422 for every route with a parameter; the only one here is a model
    name taken as any string, which cannot fail validation, so no 422 is ever answered."""
    for operations in doc["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(name, None)


def install(app: FastAPI, api_key: bool) -> None:
    """Serve the document with the models' schemas as components (and, with an API key, the
    bearer scheme every route but auth.OPEN_PATHS asks for)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_validation_errors(doc)
            components = doc.setdefault("components", {})
            components.setdefault("schemas", {}).update(_DEFS["$defs"])
            if api_key:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in doc["paths"].items():
                    if path not in OPEN_PATHS:
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

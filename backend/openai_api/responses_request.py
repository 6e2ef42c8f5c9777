"""The body of POST /v1/responses (OpenAI's Responses API, stateless) and the chat request it
is answered as.

A Responses request says what a chat request says in other words: `input` and `instructions`
are the messages, `text.format` the response_format, flat function tools the nested ones,
`max_output_tokens` max_completion_tokens. It becomes a `ChatCompletionRequest`, so the prompt,
guide, tool mode and sampling are the chat route's own, and the answer is its output in the
Responses shape (response_output.py). Nothing is stored: what needs a stored response
(`previous_response_id`, `store: true`, `background: true`, `conversation`) is refused naming
the field, as is every field not built (unknown fields, built-in tools, `reasoning`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, WithJsonSchema, field_validator

from splitfuse.openai_api.protocol import INT32_MAX, ApiError, ChatCompletionRequest, ChatMessage, parse
from splitfuse.openai_api.response_format import NAME_PATTERN, JsonObjectFormat, JsonSchemaFormat, JsonSchemaSpec, \
    TextFormat
from splitfuse.openai_api.strict import Strict
from splitfuse.openai_api.tools import MAX_TOOLS, CalledFunction, FunctionDefinition, FunctionName, \
    NamedToolChoice, Tool, ToolCall

# Fields of OpenAI's Responses API this server refuses with a reason (other unknown fields get
# "unsupported parameter"); a null value is taken as absent.
REFUSED = {
    "previous_response_id": "this server stores no responses: send the whole conversation as `input`",
    "conversation": "this server stores no conversations: send the whole conversation as `input`",
    "reasoning": "the served models have no reasoning settings",
    "include": "no extra output data can be included",
    "prompt": "this server stores no prompt templates",
}
# The chat request's parameter names as a Responses client knows them (errors name these).
CHAT_TO_RESPONSES = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}
ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")
_FALSE_OR_NULL = WithJsonSchema({"anyOf": [{"type": "boolean", "enum": [False]}, {"type": "null"}]})


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    """output_text: an earlier answer's text, sent back as part of the conversation."""
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    """An earlier answer's item id, sent back: ignored."""
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """An earlier answer's call, sent back: an assistant message's tool call."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """The caller's result of a call: a tool message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    # A message item may leave out its type (OpenAI's "easy input message").
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    """Responses' flat function tool: {type, name, description, parameters, strict}."""

    type: Literal["function"]

    def chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition.model_validate(self.model_dump(exclude={"type"})))


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)


class FlatJsonSchemaFormat(JsonSchemaSpec):
    """Responses' json_schema format: the chat one's `json_schema` fields, flat."""

    type: Literal["json_schema"]


class TextConfig(Strict):
    format: Annotated[TextFormat | JsonObjectFormat | FlatJsonSchemaFormat, Field(discriminator="type")] | None = None


class ResponsesRequest(Strict):
    # allow_inf_nan: 1e400 decodes to inf, which a bound alone would not refuse.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)

    model: str
    input: Annotated[Annotated[list[InputItem], Field(min_length=1)] | Annotated[str, Field(min_length=1)],
                     Field(union_mode="left_to_right")]
    instructions: str | None = None
    """A system message before the input."""
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    """Accepted, no effect: a forced call is one call, free output may hold several."""
    store: Annotated[bool | None, _FALSE_OR_NULL] = None
    background: Annotated[bool | None, _FALSE_OR_NULL] = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_items(cls, v: Any) -> Any:
        """Clear words for what is not built (the union's own errors name its members)."""
        if v == "" or v == []:
            raise ValueError("input is empty")
        for i, item in enumerate(v if isinstance(v, list) else []):
            kind = _item_type(item)
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}] has type {kind!r}: only {', '.join(ITEM_TYPES)} items are supported")
            content = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in PART_TYPES:
                    raise ValueError(f"input[{i}].content[{j}] has type {kind!r}: only text parts "
                                     f"({', '.join(PART_TYPES)}) are supported")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}] has type {kind!r}: only function tools are supported (no built-in "
                                 "tools such as web_search or file_search)")
        return v

    @field_validator("store", "background")
    @classmethod
    def _nothing_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("this server stores no responses and runs none in the background: only false")
        return v

    def messages(self) -> list[ChatMessage]:
        """`instructions` as a system message, then the input; a call sent back joins the assistant
        message before it (the text and calls of one answer are one chat message)."""
        out = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                out.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            else:
                call = ToolCall(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
                if not (out and out[-1].role == "assistant"):
                    out.append(ChatMessage(role="assistant"))
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
        return out

    def chat_request(self) -> ChatCompletionRequest:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, FlatJsonSchemaFormat):
            spec = JsonSchemaSpec.model_validate(fmt.model_dump(by_alias=True, exclude={"type"}))
            fmt = JsonSchemaFormat(type="json_schema", json_schema=spec)
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        # Validated as a chat body is (a field this model let through that chat refuses is a 400
        # naming it, see responses_names), its parts already models.
        return parse(ChatCompletionRequest, {
            "model": self.model, "messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "tools": [t.chat_tool() for t in self.tools] if self.tools else None, "tool_choice": choice,
            "response_format": fmt})


def parse_responses(body: Any) -> ResponsesRequest:
    """A decoded body -> the request; a field that needs what is not built is a 400 naming it."""
    if isinstance(body, dict):
        for name, why in REFUSED.items():
            if body.get(name) is not None:
                raise ApiError(400, f"{name} is not supported: {why}", param=name)
        body = {k: v for k, v in body.items() if k not in REFUSED}  # null: as if absent
    return parse(ResponsesRequest, body)


def responses_param(name: str | None) -> str | None:
    """A chat request's parameter name as the Responses field it comes from."""
    return CHAT_TO_RESPONSES.get(name, name) if name is not None else None


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """An ApiError raised on the chat request names the Responses field it came from."""
    try:
        yield
    except ApiError as e:
        if e.param in CHAT_TO_RESPONSES:
            e.param = responses_param(e.param)
            e.message = e.message.replace("response_format", "text.format")
        raise

"""The OpenAPI document's models of /v1/responses' answers: the response object and the events
of a stream, as response_output.py builds them (the served fuzz test checks every whole answer
against them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(_Answer):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOutput(_Answer):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    arguments: str
    """A JSON object, as text."""


OutputItem = Annotated[OutputMessage | FunctionCallOutput, Field(discriminator="type")]


class InputTokensDetails(_Answer):
    cached_tokens: int
    """Not reported: always 0."""


class OutputTokensDetails(_Answer):
    reasoning_tokens: int
    """Always 0 (no reasoning)."""


class ResponsesUsage(_Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"] | None


class ResponseFailure(_Answer):
    code: Literal["server_error"]
    message: str


class ResponseObject(_Answer):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseFailure | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None
    store: Literal[False]
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    metadata: dict[str, str] | None
    usage: ResponsesUsage | None
    """None until the response ends (response.created, response.in_progress)."""


class _Event(_Answer):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ResponseStreamEvent(RootModel):
    root: Annotated[LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                    | ArgumentsDeltaEvent | ArgumentsDoneEvent, Field(discriminator="type")]

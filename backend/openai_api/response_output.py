"""A Responses API answer built from the chat choice's deltas: its output items (assistant
messages and function calls, in the order the model wrote them), the events of a stream, and
the response object. The whole answer is the same builder fed every step, its events dropped,
so a streamed answer and a whole one cannot disagree.

Events follow OpenAI's: response.created and response.in_progress; per message item
output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done; per call output_item.added,
function_call_arguments.delta (the whole arguments: a call is parsed once complete) and .done,
output_item.done; then response.completed, or response.incomplete when max_output_tokens cut
the output (response.failed when the generation failed). `sequence_number` counts from 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from splitfuse.openai_api.choice_output import ChatChoiceOutput
from splitfuse.openai_api.responses import Meta
from splitfuse.openai_api.responses_request import ResponsesRequest
from splitfuse.openai_api.triton_llm import GenerationError, Step

log = logging.getLogger("splitfuse.openai_api")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


@dataclass
class Echo:
    """What the response object repeats of its request (the values the generation used)."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    parallel_tool_calls: bool
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, req: ResponsesRequest) -> Echo:
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return cls(instructions=req.instructions, max_output_tokens=req.max_output_tokens,
                   temperature=1.0 if req.temperature is None else req.temperature,
                   top_p=1.0 if req.top_p is None else req.top_p,
                   text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                   tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
                   tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                   parallel_tool_calls=req.parallel_tool_calls is not False, metadata=req.metadata)


@dataclass
class ResponseOutput:
    """One response's output, fed the `llm` steps of its (only) choice."""

    meta: Meta
    echo: Echo
    chat: ChatChoiceOutput
    items: list[dict] = field(default_factory=list, init=False)
    _message: dict | None = field(default=None, init=False)
    """The message item text goes to, while no call has followed it."""
    _seq: int = field(default=0, init=False)

    @property
    def tokens(self):
        return self.chat.tokens

    def _event(self, type_: str, **fields: Any) -> dict:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def body(self, status: str, usage: tuple[int, int] | None = None, error: str | None = None) -> dict:
        """The response object; `usage`: (input tokens, output tokens)."""
        e = self.echo
        incomplete = {"reason": "max_output_tokens" if self.chat.finish_reason == "length" else None}
        return {
            "id": self.meta.id, "object": "response", "created_at": self.meta.created, "status": status,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": incomplete if status == "incomplete" else None,
            "instructions": e.instructions, "max_output_tokens": e.max_output_tokens, "model": self.meta.model,
            "output": [dict(i) for i in self.items] if status != "in_progress" else [],
            "parallel_tool_calls": e.parallel_tool_calls, "previous_response_id": None, "store": False,
            "temperature": e.temperature, "top_p": e.top_p, "text": e.text, "tool_choice": e.tool_choice,
            "tools": e.tools, "metadata": e.metadata,
            "usage": None if usage is None else {
                "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage[0] + usage[1]},
        }

    def opening(self) -> list[dict]:
        body = self.body("in_progress")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def step(self, step: Step) -> list[dict]:
        """The events of one `llm` step (none when it completes nothing)."""
        choice = self.chat.step(step)
        delta = choice["delta"] if choice is not None else {}
        events: list[dict] = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._close_message("completed")
            events += self._call(call["id"], call["function"]["name"], call["function"]["arguments"])
        if step.final:
            if not self.items:  # an answer always has its message, if empty
                events += self._text("")
            events += self._close_message("incomplete" if self.status() == "incomplete" else "completed")
        return events

    def status(self) -> str:
        return "completed" if self.chat.finish_reason in ("stop", "tool_calls") else "incomplete"

    def closing(self, usage: tuple[int, int]) -> list[dict]:
        status = self.status()
        return [self._event(f"response.{status}", response=self.body(status, usage))]

    def whole(self, usage: tuple[int, int]) -> dict:
        """The answer of a request that did not stream, once every step was fed."""
        return self.body(self.status(), usage)

    def failed(self, message: str) -> list[dict]:
        return [self._event("response.failed", response=self.body("failed", error=message))]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._message is None:
            self._message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self.items.append(self._message)
            index = len(self.items) - 1
            events.append(self._event("response.output_item.added", output_index=index, item=self._copy(index)))
            self._message["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                      content_index=0, part=dict(self._message["content"][0])))
        self._message["content"][0]["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _close_message(self, status: str) -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self.items.index(message)
        part = message["content"][0]
        message["status"] = status
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=self._copy(index))]

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=index, item=self._copy(index))
        item.update(arguments=arguments, status="completed")
        where = {"item_id": item["id"], "output_index": index}
        return [added, self._event("response.function_call_arguments.delta", **where, delta=arguments),
                self._event("response.function_call_arguments.done", **where, arguments=arguments),
                self._event("response.output_item.done", output_index=index, item=self._copy(index))]

    def _copy(self, index: int) -> dict:
        """Item `index` as it is now (the item goes on changing after its event)."""
        return json.loads(json.dumps(self.items[index]))


async def response_events(output: ResponseOutput, items: AsyncIterator[tuple[int, Step]],
                          first: tuple[int, Step], prompt_len: int) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, from its choice's responses."""
    n_in = first[1].num_input_tokens
    try:
        async with contextlib.aclosing(items):
            for event in output.opening():
                yield sse_event(event)
            item: tuple[int, Step] | None = first
            while item is not None:
                n_in = item[1].num_input_tokens or n_in
                for event in output.step(item[1]):
                    yield sse_event(event)
                item = await anext(items, None)
    except GenerationError as e:
        log.warning("%s: generation failed mid-stream: %s", output.meta.id, e.message)
        for event in output.failed(e.message):
            yield sse_event(event)
        return
    for event in output.closing((n_in or prompt_len, output.tokens.num_output)):
        yield sse_event(event)

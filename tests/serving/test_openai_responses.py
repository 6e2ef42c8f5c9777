"""POST /v1/responses (OpenAI's Responses API, stateless) against the real tritonserver, driven
with the `openai` SDK's `client.responses`: the same greedy text as the chat route for the same
messages, whole and streamed (every event type in order, sequence numbers as the SDK's stream
helper takes them), a JSON schema followed, a forced function call parsed into a
`function_call` item, and what is not built refused with a 400 naming the field."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

from openai_helpers import SCHEMA, TIME, WEATHER  # noqa: E402

pytestmark = pytest.mark.serving

INSTRUCTIONS = "you are terse"
QUESTION = "hello world"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather forecast", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
PARAMETERS = {t["name"]: t["parameters"] for t in TOOLS}
# The events of a streamed answer of one message, in order (deltas: one or more).
MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]


def _create(api, **kw):
    return api.client().responses.create(model=api.model, **kw)


def _final_streamed(api, **kw):
    """The SDK's own accumulation of a streamed response (its stream helper checks the events'
    order and output indexes, and needs response.completed)."""
    with api.client().responses.stream(model=api.model, **kw) as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def _collapsed(types: list[str]) -> list[str]:
    """Event types with each run of text deltas as one."""
    return [t for i, t in enumerate(types) if not (t == "response.output_text.delta" and types[i - 1] == t)]


def test_greedy_text_is_the_chat_routes_whole_and_streamed(openai_front):
    api = openai_front
    chat = api.client().chat.completions.create(model=api.model, messages=MESSAGES, max_tokens=10, temperature=0)
    text, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
    status = "incomplete" if reason == "length" else "completed"

    whole = _create(api, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=10, temperature=0)
    assert whole.output_text == text and whole.status == status
    assert whole.id.startswith("resp") and whole.object == "response" and whole.instructions == INSTRUCTIONS
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    if reason == "length":
        assert whole.incomplete_details.reason == "max_output_tokens"
    use = whole.usage
    assert (use.input_tokens, use.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert use.total_tokens == use.input_tokens + use.output_tokens

    # The same conversation as input items (a system message, text parts), streamed.
    items = [{"role": "system", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    events = list(_create(api, input=items, max_output_tokens=10, temperature=0, stream=True))
    assert _collapsed([e.type for e in events]) == MESSAGE_EVENTS + [f"response.{status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.output_text == text and final.status == status and final.usage == use
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_a_json_schema_is_followed_whole_and_streamed(openai_front):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    kw = dict(input=QUESTION, text=fmt, temperature=0, max_output_tokens=120)
    whole = _create(openai_front, **kw)
    assert whole.status == "completed", whole.output_text
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert whole.text.format.type == "json_schema"
    streamed = _final_streamed(openai_front, **kw)
    assert streamed.output_text == whole.output_text and streamed.status == "completed"


def _call(response, names: set[str]) -> tuple[str, dict]:
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.name in names
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.name])
    return call.name, arguments


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "function", "name": "get_weather"}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_a_forced_function_call_is_a_function_call_item(openai_front, tool_choice, names):
    kw = dict(input="what is the weather in paris?", tools=TOOLS, tool_choice=tool_choice, temperature=0,
              max_output_tokens=120)
    whole = _call(_create(openai_front, **kw), names)
    assert _call(_final_streamed(openai_front, **kw), names) == whole
    # The call and its output sent back (nothing is stored): the answer goes on from them.
    name, arguments = whole
    back = [{"role": "user", "content": "what is the weather in paris?"},
            {"type": "function_call", "call_id": "call_1", "name": name, "arguments": json.dumps(arguments)},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    answer = _create(openai_front, input=back, tools=TOOLS, max_output_tokens=2, temperature=0)
    first = _create(openai_front, input=back[:1], tools=TOOLS, max_output_tokens=2, temperature=0)
    assert answer.usage.input_tokens > first.usage.input_tokens
    assert answer.usage.output_tokens == 2


@pytest.mark.parametrize("kwargs, param", [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(store=True), "store"),
    (dict(background=True), "background"),
    (dict(reasoning={"effort": "low"}), "reasoning"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "no_such_tool"}), "tool_choice"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input"),
    (dict(text={"format": {"type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}}), "text"),
])
def test_what_is_not_built_is_a_400_naming_the_field(openai_front, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        _create(openai_front, **{"input": QUESTION, "max_output_tokens": 4, **kwargs})
    assert e.value.body["param"] == param, e.value.body
    assert param in e.value.body["message"], e.value.body

"""/v1/responses without a server: the request checked (what is not built refused naming the
field) and said as a chat request, and the answer built from a chat choice's `llm` responses:
events the `openai` SDK's own stream accumulation turns into the whole answer, for text, a
call after text and a cut-off output."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi is in the serve extra")
openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")

from splitfuse.openai_api.choice_output import ChatChoiceOutput  # noqa: E402
from splitfuse.openai_api.protocol import ApiError, NamedToolChoice  # noqa: E402
from splitfuse.openai_api.response_format import JsonSchemaFormat  # noqa: E402
from splitfuse.openai_api.response_output import Echo, ResponseOutput  # noqa: E402
from splitfuse.openai_api.responses import Meta  # noqa: E402
from splitfuse.openai_api.responses_request import parse_responses, responses_names  # noqa: E402
from splitfuse.openai_api.triton_llm import Step  # noqa: E402

BODY = {"model": "m", "input": "hi"}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize("body, param, words", [
    ({**BODY, "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({**BODY, "conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({**BODY, "store": True}, "store", "only false"),
    ({**BODY, "background": True}, "background", "only false"),
    ({**BODY, "reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
    ({**BODY, "tools": [{"type": "web_search_preview"}]}, "tools", "'web_search_preview'"),
    ({**BODY, "tools": [TOOL, {"type": "file_search", "vector_store_ids": []}]}, "tools", "tools[1]"),
    ({**BODY, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice"),
    ({**BODY, "tool_choice": {"type": "function", "name": "a b"}}, "tool_choice", "tool_choice"),
    ({**BODY, "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({**BODY, "max_output_tokens": "8"}, "max_output_tokens", "max_output_tokens"),
    ({**BODY, "temperature": 3}, "temperature", "temperature"),
    ({**BODY, "input": ""}, "input", "input is empty"),
    ({**BODY, "input": []}, "input", "input is empty"),
    ({**BODY, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0] has type 'input_image'"),
    ({**BODY, "input": [{"type": "reasoning", "summary": []}]}, "input", "input[0] has type 'reasoning'"),
    ({**BODY, "top_logprobs": 2}, "top_logprobs", "unsupported parameter"),
    ({**BODY, "text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "name"),
])
def test_refused_requests_name_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_responses(body)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    assert words in e.value.message


def test_nothing_stored_nothing_in_the_background_and_null_fields_are_taken():
    req = parse_responses({**BODY, "store": False, "background": False, "previous_response_id": None})
    assert req.chat_request().messages[0].content == "hi"


def test_the_request_is_said_as_a_chat_request():
    req = parse_responses({
        "model": "m", "instructions": "be terse", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "stream": True, "tools": [TOOL], "tool_choice": {"type": "function", "name": "f"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_text", "text": "b"}]},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "thinking", "annotations": []}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "2"}]})
    chat = req.chat_request()
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be terse"), ("user", "ab"), ("assistant", "thinking"), ("tool", "2")]
    # The call joins the assistant message that came before it.
    assert [c.function.name for c in chat.messages[2].tool_calls] == ["f"]
    assert chat.messages[3].tool_call_id == "c1"
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.stream) == (7, 0.5, 0.9, True)
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.parameters == TOOL["parameters"]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "f"
    assert chat.tool_mode() == "forced"
    schema = {"type": "object"}
    fmt = parse_responses({**BODY, "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    chat = fmt.chat_request()
    assert isinstance(chat.response_format, JsonSchemaFormat) and chat.response_format.json_schema.schema_ == schema
    assert chat.guide() == ("json_schema", json.dumps(schema, separators=(",", ":")))


def test_errors_of_the_chat_request_name_the_responses_field():
    req = parse_responses({**BODY, "tools": [TOOL], "tool_choice": "required",
                           "text": {"format": {"type": "json_object"}}})
    with pytest.raises(ApiError) as e, responses_names():
        req.chat_request().check()
    assert e.value.param == "text" and "text.format cannot constrain" in e.value.message


# ---- the answer ------------------------------------------------------------------------------


def _output(req_body: dict, mode: str) -> ResponseOutput:
    req = parse_responses(req_body)
    return ResponseOutput(Meta("resp-1", "m", created=5), Echo.of(req),
                          ChatChoiceOutput(0, mode, False, lambda ids: [str(i) for i in ids]))


def _steps(texts: list[str], reason: str) -> list[Step]:
    return [Step(text=t, token_ids=[i], logprobs=None, finish_reason=reason if i == len(texts) - 1 else None,
                 num_input_tokens=3, num_output_tokens=i + 1, final=i == len(texts) - 1)
            for i, t in enumerate(texts)]


def _run(out: ResponseOutput, texts: list[str], reason: str) -> list[dict]:
    events = out.opening()
    for step in _steps(texts, reason):
        events += out.step(step)
    return events + out.closing((3, len(texts)))


def _sdk_accumulated(events: list[dict]):
    """What the SDK's stream helper makes of the events (it checks their order and indexes)."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in json.loads(json.dumps(events)):  # as they go over the wire
        state.handle_event(construct_type(value=event, type_=ResponseStreamEvent))
    return state


def test_text_streams_as_one_message_and_adds_up_to_the_whole_answer():
    out = _output(BODY, "none")
    events = _run(out, ["he", "llo", " you"], "stop")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    body = events[-1]["response"]
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "hello you"
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    assert body == out.whole((3, 3))
    final = _sdk_accumulated(events)._completed_response
    assert final.output_text == "hello you" and final.id == "resp-1"


def test_a_call_after_text_closes_the_message_and_is_its_own_item():
    out = _output({**BODY, "tools": [TOOL]}, "auto")
    events = _run(out, ["let me see", " <tool_call>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>"], "stop")
    body = events[-1]["response"]
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    message, call = body["output"]
    assert message["content"][0]["text"] == "let me see" and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("f", {"a": 1}, "completed")
    assert call["call_id"].startswith("call_") and body["status"] == "completed"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1] and added[1]["item"]["arguments"] == ""
    final = _sdk_accumulated(events)._completed_response
    assert [i.type for i in final.output] == ["message", "function_call"] and final.output[1].arguments == \
        call["arguments"]
    assert body["tools"] == [TOOL] and body["tool_choice"] == "auto"


def test_a_cut_off_output_is_incomplete_and_an_empty_one_still_has_its_message():
    out = _output({**BODY, "max_output_tokens": 2}, "none")
    events = _run(out, ["a", "b"], "length")
    body = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["max_output_tokens"] == 2
    assert body["output"][0]["status"] == "incomplete"
    empty = _output(BODY, "none")
    events = _run(empty, [""], "stop")
    assert [i["content"][0]["text"] for i in events[-1]["response"]["output"]] == [""]
    assert "response.output_text.delta" not in [e["type"] for e in events]


def test_a_failed_generation_ends_the_stream_with_response_failed():
    out = _output(BODY, "none")
    events = out.opening() + out.step(_steps(["a", "b"], "stop")[0]) + out.failed("engine broke")
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "engine broke"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_route_is_behind_the_api_key_and_the_body_bound(tiny_llama):
    """In process, no Triton: what is refused before a generation starts."""
    from fastapi.testclient import TestClient

    from splitfuse.openai_api.app import build_app
    from splitfuse.openai_api.config import ApiConfig

    config = ApiConfig(model_dir=tiny_llama, api_key="k", max_body_bytes=4096)
    with TestClient(build_app(config)) as client:
        body = {**BODY, "previous_response_id": "resp_1"}
        assert client.post("/v1/responses", json=body).status_code == 401
        keyed = {"Authorization": "Bearer k"}
        refused = client.post("/v1/responses", json=body, headers=keyed)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
        big = client.post("/v1/responses", json={**BODY, "input": "x" * 5000}, headers=keyed)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        doc = client.get("/openapi.json").json()
        assert doc["paths"]["/v1/responses"]["post"]["security"] == [{"bearer": []}]

"""The OpenAI front's tools without a server: the `<tool_call>` parser (streamed == whole), the
schema of a forced call (xgrammar compiles it; it takes exactly the calls it should), schema
bounds, and tools / earlier calls rendered into chat prompts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi is in the serve extra")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from splitfuse.openai_api.json_schemas import MAX_SCHEMA_DEPTH, check_schema, rebase_refs  # noqa: E402
from splitfuse.openai_api.prompts import Prompts  # noqa: E402
from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, parse  # noqa: E402
from splitfuse.openai_api.tool_parser import ParsedCall, ToolCallParser, parse_call  # noqa: E402
from splitfuse.openai_api.tools import Tool, forced_call_schema  # noqa: E402


def _parse(chunks: list[str]) -> list[str | ParsedCall]:
    parser = ToolCallParser()
    out: list[str | ParsedCall] = []
    for c in chunks:
        out += parser.feed(c)
    return out + parser.finish()


def _merged(pieces: list[str | ParsedCall]) -> list[str | ParsedCall]:
    """Adjacent content pieces joined (how they are split depends on the chunks)."""
    out: list[str | ParsedCall] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("text, expected", [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
     ["Let me look.", WEATHER]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
     '<tool_call>{"name": "f", "parameters": {}}</tool_call>', [WEATHER, ParsedCall("f", "{}")]),
    ('<tool_call>{"name": "f"}</tool_call> and then text', [ParsedCall("f", "{}"), "and then text"]),
    # Not calls: kept as written.
    ("a <tool_call>{not json}</tool_call> b", ["a <tool_call>{not json}</tool_call> b"]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ['<tool_call>{"name": "f", "arguments": [1]}'
                                                               '</tool_call>']),
    # Cut off: a whole call inside is still one; anything else stays text.
    ('x <tool_call>{"name": "f", "arguments": {}}', ["x", ParsedCall("f", "{}")]),
    ('x <tool_call>{"name": "f", "argu', ['x <tool_call>{"name": "f", "argu']),
    ("1 < 2 and <tool_ca", ["1 < 2 and <tool_ca"]),
    ("trailing space stays  \n", ["trailing space stays  \n"]),
])
def test_tool_call_blocks_are_parsed_alike_whole_and_streamed(text, expected):
    assert _merged(_parse([text])) == expected
    assert _merged(_parse(list(text))) == expected  # one character at a time


@given(st.text(alphabet=st.sampled_from(list("ab <>/_tolcal\n{}\":")), max_size=60),
       st.lists(st.integers(0, 60), max_size=6))
@settings(max_examples=300, deadline=None)
def test_text_without_a_whole_call_is_the_content_exactly(text, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    pieces = _parse(chunks)
    if not any(isinstance(p, ParsedCall) for p in pieces):
        assert "".join(pieces) == text
    assert _merged(pieces) == _merged(_parse([text]))


def test_parse_call_takes_only_calls():
    assert parse_call('{"name": "f", "arguments": {"a": [1, "é"]}}') == ParsedCall("f", '{"a": [1, "é"]}')
    for bad in ('{"name": ""}', '{"arguments": {}}', "[1]", '{"name": "f", "arguments": "x"}', "{", "[" * 5000):
        assert parse_call(bad) is None, bad


# ---- schemas --------------------------------------------------------------------------------

REFS = {"type": "object", "properties": {"when": {"$ref": "#/$defs/day"}, "const": {"type": "integer"},
                                         "again": {"$ref": "#"}},
        "$defs": {"day": {"enum": ["mon", "tue"]}}, "required": ["when", "const"], "additionalProperties": False}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "plan", "parameters": REFS}}),
         Tool.model_validate({"type": "function", "function": {"name": "ping"}})]


def test_rebased_references_point_under_their_new_place():
    moved = rebase_refs(REFS, "/$defs/t0")
    assert moved["properties"]["when"] == {"$ref": "#/$defs/t0/$defs/day"}
    assert moved["properties"]["again"] == {"$ref": "#/$defs/t0"}
    assert moved["properties"]["const"] == {"type": "integer"}  # a property, not the keyword
    data = {"const": {"$ref": "#/x"}}
    assert rebase_refs(data, "/p") == data  # data under "const" is not a reference


def test_a_forced_call_schema_takes_exactly_the_calls_of_its_tools(tiny_llama):
    jsonschema = pytest.importorskip("jsonschema")
    from transformers import AutoTokenizer

    from splitfuse.structured.grammars import GrammarCache
    from splitfuse.structured.guide import Guide

    good = {"name": "plan", "arguments": {"when": "mon", "const": 3, "again": {"when": "tue", "const": 1}}}
    required, named = forced_call_schema(TOOLS), forced_call_schema(TOOLS, only="ping")
    jsonschema.validate(good, required)
    jsonschema.validate({"name": "ping", "arguments": {}}, required)
    jsonschema.validate({"name": "ping", "arguments": {}}, named)
    for bad, schema in (({"name": "plan", "arguments": {"when": "sun", "const": 1}}, required),
                        ({"name": "ping", "arguments": {"x": 1}}, required),
                        ({"name": "other", "arguments": {}}, required), (good, named)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    cache = GrammarCache(tok, len(tok))
    for schema in (required, named):
        cache.compile(Guide("json_schema", json.dumps(schema)))


def test_schemas_are_bounded():
    deep: dict = {}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"items": deep}
    with pytest.raises(ValueError, match="deeper"):
        check_schema(deep, "the schema")
    with pytest.raises(ValueError, match="longer"):
        check_schema({"enum": ["x" * 70_000]}, "the schema")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}}
    with pytest.raises(ApiError) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == "response_format" and "deeper" in e.value.message


# ---- rendering ------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture
def prompts(tiny_llama):
    from transformers import AutoTokenizer

    return Prompts(AutoTokenizer.from_pretrained(tiny_llama), max_model_len=4096)


def _text(prompts: Prompts, **body) -> str:
    req = parse(ChatCompletionRequest, {"model": "m", **body})
    return prompts.tokenizer.decode(prompts.chat(req))


def test_a_template_without_tools_gets_them_in_the_system_message(prompts):
    text = _text(prompts, messages=CONVERSATION, tools=[TOOL])
    system = text[:text.index("user:")]
    assert "be brief" in system and json.dumps(TOOL["function"]["parameters"]) in system
    assert "<tool_call>" in system and system.count("system:") == 1  # merged into the one system message
    # The earlier call, in the format the model is told to use, and the tool's answer.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "tool: sunny" in text and "None" not in text
    alone = _text(prompts, messages=CONVERSATION[1:2], tools=[TOOL])
    assert alone.startswith("<s>system: You can use tools")


def test_a_template_that_renders_tools_gets_them_as_data(prompts):
    prompts.tokenizer.chat_template = (
        "{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
        "{% endfor %}\n{% endfor %}")
    text = _text(prompts, messages=CONVERSATION, tools=[TOOL])
    assert text.startswith("TOOLS=get_weather") and "system: be brief" in text and "You can use tools" not in text
    assert 'CALL get_weather {"city": "Paris"}' in text and "<tool_call>" not in text


@pytest.mark.parametrize("message, words", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "assistant"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}, "arguments"),
])
def test_malformed_tool_messages_are_400(message, words):
    with pytest.raises(ApiError) as e:
        parse(ChatCompletionRequest, {"model": "m", "messages": [message]})
    assert e.value.param == "messages" and words in e.value.message

"""Structured outputs, tool calls, n > 1 and top log-probs through the OpenAI front, against a real
tritonserver with one `llm` instance (so a request's choices share one prefix cache), driven with
the `openai` SDK. The random-weight model samples freely: every output must still follow its
schema, every forced call must name a tool and carry arguments valid for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openai_helpers import SCHEMA, TIME, WEATHER, start_api, stop_api
from triton_helpers import finished_requests, metric_sum, settled, wait_for

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extra")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

pytestmark = pytest.mark.serving

MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16  # the engine's default
MESSAGES = [{"role": "user", "content": "what is the weather in paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    from conftest import one_instance_server

    with one_instance_server(tiny_llama, {}, tmp_path_factory.mktemp("triton-structured")) as (_, srv):
        yield srv


@pytest.fixture(scope="module")
def api(server, tiny_llama, tmp_path_factory):
    a = start_api(tiny_llama, server.grpc_url, tmp_path_factory.mktemp("openai-structured"), "api",
                  "--max-model-len", str(MAX_MODEL_LEN))
    yield a
    stop_api(a)


def _chat(api, **kw):
    return api.client().chat.completions.create(model=api.model, **{"messages": MESSAGES, **kw})


def _streamed_content(api, **kw) -> tuple[str, str | None]:
    chunks = list(_chat(api, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1, reasons
    return content, reasons[0]


def _final_streamed(api, **kw):
    """The SDK's own accumulation of a streamed answer (its stream helper)."""
    with api.client().chat.completions.stream(model=api.model, **{"messages": MESSAGES, **kw}) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def _accumulated(api, **kw):
    """The SDK's accumulation of a stream that may end by length (get_final_completion refuses those)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in _chat(api, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


# ---- response_format ------------------------------------------------------------------------


def test_json_schema_outputs_follow_the_schema_whole_and_streamed(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kw = dict(response_format=fmt, temperature=1.0, seed=seed, max_tokens=120)
        whole = _chat(api, **kw).choices[0]
        assert whole.finish_reason == "stop", whole.message.content
        jsonschema.validate(json.loads(whole.message.content), SCHEMA)
        content, reason = _streamed_content(api, **kw)
        assert (content, reason) == (whole.message.content, "stop")  # seeded: the same tokens


def test_json_object_outputs_are_json(api):
    # Any JSON: the random model may run out of tokens inside it; an output the grammar ended
    # must parse, and some of them end.
    ended = 0
    for seed in range(6):
        kw = dict(response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=60)
        whole = _chat(api, **kw).choices[0]
        content, reason = _streamed_content(api, **kw)
        assert (content, reason) == (whole.message.content, whole.finish_reason)
        if whole.finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(whole.message.content), (dict, list)), whole.message.content
        else:
            assert whole.finish_reason == "length"
    assert ended >= 1


# ---- tools ----------------------------------------------------------------------------------


def _check_call(choice, names: set[str]) -> tuple[str, dict]:
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return call.function.name, arguments


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_forced_tool_calls_whole_and_streamed(api, tool_choice, names):
    for seed in range(3):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=120)
        whole = _check_call(_chat(api, **kw).choices[0], names)
        final = _final_streamed(api, **kw)
        assert _check_call(final.choices[0], names) == whole  # seeded: the same call


def test_tools_and_earlier_calls_are_rendered_into_the_prompt(api):
    plain = _chat(api, max_tokens=2, temperature=0)
    with_tools = _chat(api, max_tokens=2, temperature=0, tools=TOOLS, tool_choice="none")
    # The demo template ignores tools: they go into a system message, with the call format.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    assert with_tools.choices[0].message.tool_calls is None
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    answer = _chat(api, messages=conversation, tools=TOOLS, max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_tools_client_example_calls_and_answers(api):
    example = Path(__file__).resolve().parents[2] / "client_examples" / "openai_tools.py"
    run = subprocess.run([sys.executable, str(example), "--base-url", api.base_url + "/v1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[call get_weather({'city': " in run.stderr and "[finish: " in run.stderr, run.stderr[-2000:]


# ---- n > 1 ----------------------------------------------------------------------------------


def _computed(server) -> tuple[float, float]:
    return (metric_sum(server.metrics_url, "splitfuse_prompt_tokens_total"),
            metric_sum(server.metrics_url, "splitfuse_prefix_cache_hits_total"))


def test_n_choices_share_the_prompt_and_follow_their_seeds(api, server):
    client = api.client()
    prompt = "a long shared prompt, " * 30
    kw = dict(model=api.model, prompt=prompt, max_tokens=8, temperature=1.0, seed=77,
              extra_body={"cache_salt": "n-choices-test"})
    before = settled(lambda: _computed(server))
    three = client.completions.create(n=3, **kw)
    prompt_tokens = three.usage.prompt_tokens
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert three.usage.completion_tokens == 24 and three.usage.total_tokens == prompt_tokens + 24
    # The prompt computed once: the other two choices found all its full blocks but the last.
    cached = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached > 0
    expected = (before[0] + 3 * prompt_tokens - 2 * cached, before[1] + 2 * cached)
    assert wait_for(lambda: _computed(server) == expected), (_computed(server), expected)
    # Choice i samples with seed + i.
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    singles = [client.completions.create(**{**kw, "seed": 77 + i}).choices[0].text for i in range(3)]
    assert texts == singles
    # Streamed: chunks of the three interleave, each with its index; usage counts all.
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == prompt_tokens


def test_n_chat_choices_whole_and_streamed(api):
    kw = dict(n=3, temperature=1.0, seed=5, max_tokens=6)
    whole = _chat(api, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 6
    final = _accumulated(api, **kw)
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]
    assert [c.index for c in final.choices] == [0, 1, 2]
    forced = _chat(api, n=2, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=120)
    for choice in forced.choices:
        _check_call(choice, set(PARAMETERS))


def test_a_client_that_leaves_cancels_every_choice(api, server):
    def used() -> float:
        return metric_sum(server.metrics_url, "splitfuse_kv_cache_blocks", state="used")

    assert wait_for(lambda: used() == 0), "blocks still in use from an earlier test"
    aborted, ended = settled(lambda: (finished_requests(server.metrics_url, "abort"),
                                      finished_requests(server.metrics_url, "length")))
    stream = _chat(api, n=3, stream=True, max_tokens=4000, temperature=0, extra_body={"ignore_eos": True})
    producing = set()
    for chunk in stream:  # until all three generate
        producing |= {c.index for c in chunk.choices if c.delta.content}
        if len(producing) == 3:
            break
    stream.close()
    assert wait_for(lambda: used() == 0, timeout=15.0), "KV blocks still used after the client left"
    assert wait_for(lambda: finished_requests(server.metrics_url, "abort") == aborted + 3), \
        ("not every choice was aborted", aborted, finished_requests(server.metrics_url, "abort"))
    assert finished_requests(server.metrics_url, "length") == ended


# ---- log-probs ------------------------------------------------------------------------------


def _check_top(entry, k: int) -> None:
    top = entry.top_logprobs
    assert len(top) == k
    values = [t.logprob for t in top]
    assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
    # Greedy: the chosen token is the most likely one.
    assert top[0].token == entry.token and top[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert all(t.bytes == list(t.token.encode()) for t in top)


def test_top_logprobs_whole_and_streamed(api):
    kw = dict(logprobs=True, top_logprobs=5, temperature=0, max_tokens=6)
    whole = _chat(api, **kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        _check_top(entry, 5)
    chunks = list(_chat(api, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for entry in streamed:
        _check_top(entry, 5)
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
           [(e.token, [t.token for t in e.top_logprobs]) for e in content]


def test_tokens_a_grammar_rules_out_read_minus_9999(api):
    # A schema's output starts with "{": the other alternatives of the first token have -inf.
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for stream in (False, True):
        r = _chat(api, response_format=fmt, logprobs=True, top_logprobs=20, temperature=0, max_tokens=3, stream=stream)
        choices = [r.choices[0]] if not stream else [c.choices[0] for c in r if c.choices and c.choices[0].logprobs]
        first = choices[0].logprobs.content[0]
        assert first.token.startswith("{") and first.top_logprobs[0].token == first.token
        assert len(first.top_logprobs) == 20 and first.top_logprobs[-1].logprob == -9999.0


def test_completion_logprobs_list_the_top_tokens(api):
    r = api.client().completions.create(model=api.model, prompt="the quick brown fox", max_tokens=5, temperature=0,
                                        logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The sampled token is added when it is not among the three; tokens that read the same
        # (pieces of one character, shown as U+FFFD) share an entry.
        assert 1 <= len(top) <= 4
        assert top[token] == pytest.approx(value, abs=1e-5) and value == pytest.approx(max(top.values()), abs=1e-5)
    assert max(len(top) for top in lp.top_logprobs) >= 3


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(
        '{"items": ' * 40 + "{}" + "}" * 40)}}), "response_format"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "no_such_tool"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(n=17), "n"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_structured_requests_are_400_naming_the_parameter(api, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(api, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body
    assert _chat(api, max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_refusals_by_llm_are_400s_that_leave_triton_unharmed(api, server):
    """llm's error responses carry their status in the message (errors.ERROR_CODE_PARAMETER), not
    through Triton's triton_grpc_error header, on whose error endings Triton 2.51 logged a
    HandleCancellation error every time and now and then crashed (SIGSEGV): none is logged now."""
    import concurrent.futures

    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}

    def refused(i: int) -> str:
        try:
            answer = _chat(api, max_tokens=4, response_format=fmt, stream=bool(i % 2))
            list(answer) if i % 2 else None
        except openai.BadRequestError as e:
            return e.body["param"]
        return "answered"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert set(pool.map(refused, range(40))) == {"response_format"}
    assert _chat(api, max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert "HandleCancellation" not in Path(server.log_file).read_text()


def test_a_schema_that_does_not_compile_is_400(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(api, max_tokens=4, response_format=fmt, stream=stream)
        assert "does not compile" in e.value.body["message"], e.value.body
        assert e.value.body["param"] == "response_format"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(api, max_tokens=4, tools=[bad_tool], tool_choice="required")
    assert e.value.body["param"] == "tools" and "does not compile" in e.value.body["message"]
    assert _chat(api, max_tokens=2, temperature=0).usage.completion_tokens == 2

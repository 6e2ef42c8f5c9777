"""The OpenAI front fuzzed from its own OpenAPI document (schemathesis), against the real
tritonserver: every operation, with requests valid and invalid by the document, must answer
without a 5xx, with a status code, content type and body the document declares, and must refuse
what the document says is invalid. A failure here is a bug in the front or in its document."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.serving

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# Each operation, fuzzed one by one (schemathesis' pytest loader, from_fixture, does not run
# under pytest 9); the first test keeps this list equal to the document's.
OPERATIONS = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/{name}"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/embeddings")]
EXAMPLES = 40


def _subnormals_flushed() -> bool:
    tiny = float.fromhex("0x1p-1022")  # the smallest normal double: half of it is subnormal
    return tiny / 2 == 0.0


@pytest.fixture(autouse=True)
def ieee_floats():
    """Hypothesis refuses to draw floats while subnormals are flushed to zero, which an engine
    built on this thread earlier in the session turned on (model_runner: torch.set_flush_denormal);
    off for these tests, then as it was."""
    import torch

    flushed = _subnormals_flushed()
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(flushed)


@pytest.fixture(scope="module")
def fuzzed_api(openai_front):
    return openai_front


@pytest.fixture(scope="module")
def api_schema(fuzzed_api):
    return schemathesis.openapi.from_url(fuzzed_api.base_url + "/openapi.json")


def test_the_document_declares_every_route_with_its_bodies(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in operations) == sorted(OPERATIONS)
    for op in operations:
        declared = op.definition.raw
        assert {"200"} <= set(declared["responses"]), op.label
        if op.method.upper() == "POST":
            assert declared["requestBody"]["required"], op.label
            assert {"400", "404", "413", "429", "503"} <= set(declared["responses"]), op.label


# Generated max_tokens are capped to this many (a valid request could ask for up to
# max_model_len tokens; this bounds the test's time, not what the requests may be).
FUZZ_MAX_TOKENS = 32


def _for_served_model(case, model: str):
    """`case` asking for the served model (a random name gets a 404 before anything else runs)."""
    if isinstance(case.path_parameters, dict) and "name" in case.path_parameters:
        case.path_parameters["name"] = model
    if isinstance(case.body, dict):
        case.body["model"] = model
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(name)
            # The document's integers include 1.0-style floats, which the front takes as ints.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                case.body[name] = min(value, FUZZ_MAX_TOKENS)
    return case


# Requests invalid by the document exist only where it constrains something: the bodies.
RUNS = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
       [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method, path, mode", RUNS, ids=[f"{m} {p} {g.value}" for m, p, g in RUNS])
def test_every_operation_answers_as_its_document_says(api_schema, fuzzed_api, method, path, mode):
    operation = api_schema[path][method]
    cases = operation.as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:  # half of them for the served model, so that some generate
        cases = st.tuples(cases, st.booleans()).map(
            lambda pair: _for_served_model(pair[0], fuzzed_api.model) if pair[1] else pair[0])

    @given(case=cases)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        case.call_and_validate(base_url=fuzzed_api.base_url, checks=CHECKS, timeout=120)

    fuzz()


PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
FLAT_TOOL = {"type": "function", **TOOL["function"]}  # the Responses API's shape


def test_answers_that_generate_match_the_document(api_schema, fuzzed_api):
    """The same checks on requests that surely generate (the fuzzed ones may all be refused),
    whole and streamed, with every optional part of an answer (logprobs and top log-probs, echo,
    usage, several choices, tool calls)."""
    forced = {"messages": MESSAGES, "max_tokens": 40, "tools": [TOOL], "tool_choice": "required"}
    bodies = {
        "/v1/completions": [
            {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0},
            {"prompt": [[1, 2, 3]], "max_tokens": 4, "echo": True, "ignore_eos": True, "n": 2},
            {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
             "logprobs": 3, "n": 2},
        ],
        "/v1/chat/completions": [
            {"messages": MESSAGES, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 0},
            {"messages": MESSAGES, "max_tokens": 4, "stream": True, "stop": ["\n"], "logprobs": True,
             "top_logprobs": 2, "n": 2},
            forced, {**forced, "stream": True},
            {"messages": MESSAGES, "max_tokens": 8, "response_format": {"type": "json_object"}},
        ],
        "/v1/responses": [
            {"input": "hello", "instructions": "be terse", "max_output_tokens": 4, "metadata": {"k": "v"}},
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
             "max_output_tokens": 4, "stream": True},
            {"input": "hello", "max_output_tokens": 40, "tools": [FLAT_TOOL], "tool_choice": "required"},
            {"input": "hello", "max_output_tokens": 8, "text": {"format": {"type": "json_object"}}},
        ],
        "/v1/embeddings": [
            {"input": ["hello", PROMPT]},
            {"input": [[1, 2, 3]], "encoding_format": "base64"},
        ],
    }
    statuses = []
    for path, path_bodies in bodies.items():
        for body in path_bodies:
            case = api_schema[path]["POST"].Case(body={"model": fuzzed_api.model, **body})
            statuses.append(case.call_and_validate(base_url=fuzzed_api.base_url, checks=CHECKS, timeout=120)
                            .status_code)
    card = api_schema["/v1/models/{name}"]["GET"].Case(path_parameters={"name": fuzzed_api.model})
    statuses.append(card.call_and_validate(base_url=fuzzed_api.base_url, checks=CHECKS, timeout=60).status_code)
    assert statuses == [200] * len(statuses)

"""The OpenAI front's request checking, parameter mapping and response bodies, without a server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi is in the serve extra")

from splitfuse.openai_api import responses as R  # noqa: E402
from splitfuse.openai_api.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs  # noqa: E402
from splitfuse.openai_api.app import sampling_inputs  # noqa: E402
from splitfuse.openai_api.http_errors import generation_http_error  # noqa: E402
from splitfuse.openai_api.body import DEFAULT_MAX_BODY_BYTES, decode_json, default_body_limit  # noqa: E402
from splitfuse.openai_api.prompts import Prompts  # noqa: E402
from splitfuse.openai_api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse  # noqa: E402
from splitfuse.openai_api.triton_llm import GenerationError, build_inputs  # noqa: E402

GOOD = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param, words", [
    ({**GOOD, "n": 17}, "n", "less than or equal to 16"),
    ({**GOOD, "best_of": 3}, "best_of", "best_of=1"),
    ({**GOOD, "logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({**GOOD, "temperature": 2.5}, "temperature", "temperature"),
    ({**GOOD, "top_p": 0}, "top_p", "top_p"),
    ({**GOOD, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({**GOOD, "seed": -5}, "seed", "seed"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({**GOOD, "logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias"),
    ({**GOOD, "suffix": "x"}, "suffix", "suffix"),
    ({**GOOD, "prompt": ["a", "b"]}, "prompt", "one prompt"),
    ({**GOOD, "prompt": ""}, "prompt", "empty"),
    ({**GOOD, "mystery": 1}, "mystery", "unsupported parameter: mystery"),
    ({"prompt": "hi"}, "model", "model"),
])
def test_completion_requests_that_are_refused_name_their_parameter(body, param, words):
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param
    assert words in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({**CHAT, "n": 17}, "n"),
    ({**CHAT, "logprobs": "true"}, "logprobs"),  # wrong JSON types are refused, not coerced
    ({**CHAT, "max_tokens": "5"}, "max_tokens"),
    ({**CHAT, "seed": 5.0}, "seed"),
    ({**CHAT, "stream": 1}, "stream"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_chat_requests_that_are_refused(body, param):
    with pytest.raises(ApiError) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param


def test_not_an_object_and_stream_options_without_stream():
    with pytest.raises(ApiError, match="JSON object"):
        parse(CompletionRequest, ["a"])
    req = parse(CompletionRequest, {**GOOD, "stream_options": {"include_usage": True}})
    with pytest.raises(ApiError, match="stream_options"):
        req.check_stream_options()


def test_accepted_forms():
    assert parse(CompletionRequest, {**GOOD, "temperature": 1}).temperature == 1.0  # JSON has one number type
    assert parse(CompletionRequest, {**GOOD, "prompt": ["only one"]}).prompt == "only one"
    assert parse(CompletionRequest, {**GOOD, "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert parse(CompletionRequest, {**GOOD, "prompt": [5, 6]}).prompt == [5, 6]
    chat = parse(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 7, "max_tokens": 3,
                                         "messages": [{"role": "user", "content": [
                                             {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert chat.max_new_tokens() == 7 and chat.messages[0].text() == "ab"
    image = parse(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(ApiError, match="text content"):
        image.messages[0].text()


def test_sampling_inputs_always_carry_openai_defaults():
    req = parse(CompletionRequest, GOOD)
    inputs = sampling_inputs(req, 16, logprobs=False)
    assert inputs["temperature"] == 1.0 and inputs["top_p"] == 1.0 and inputs["max_tokens"] == 16
    assert "seed" not in inputs and "stop_words" not in inputs and "presence_penalty" not in inputs
    req = parse(CompletionRequest, {**GOOD, "temperature": 0, "seed": 9, "stop": "x", "presence_penalty": 1.5,
                                    "frequency_penalty": -1, "top_k": 5, "ignore_eos": True, "min_tokens": 2})
    inputs = sampling_inputs(req, 8, logprobs=True)
    assert inputs["temperature"] == 0.0 and inputs["seed"] == 9 and inputs["stop_words"] == ["x"]
    assert inputs["presence_penalty"] == 1.5 and inputs["frequency_penalty"] == -1
    assert inputs["top_k"] == 5 and inputs["ignore_eos"] is True and inputs["min_tokens"] == 2
    assert inputs["return_log_probs"] is True
    # Every value becomes a typed [1, n] tensor the llm model declares.
    tensors = {t.name(): t for t in build_inputs({"input_ids": [1, 2, 3], **inputs})}
    assert tensors["input_ids"].shape() == [1, 3] and tensors["input_ids"].datatype() == "INT32"
    assert tensors["seed"].datatype() == "UINT64" and tensors["stop_words"].datatype() == "BYTES"


BAD = "INVALID_ARGUMENT"  # the gRPC status of what llm refuses as TritonError.INVALID_ARG


def test_engine_errors_split_by_status_not_by_words():
    assert GenerationError("prompt (3 tokens) + max_tokens (9) exceeds max_model_len", BAD).is_client_error
    # The status decides, whatever the words: a refusal that quotes "internal error" is the
    # request's; a fault whose words sound like a bad request is the server's.
    assert GenerationError("stop string 'internal error' is too long", BAD).is_client_error
    assert not GenerationError("invalid input: the stub is not healthy", "INTERNAL").is_client_error
    assert not GenerationError("the server is shutting down", "UNAVAILABLE").is_client_error
    # No status: Triton refused before any model saw the request (the model is not loaded).
    assert not GenerationError("Request for unknown model: 'llm' is not found").is_client_error


def test_a_busy_engine_is_429_server_faults_503_with_retry_after_and_bad_requests_400():
    busy = generation_http_error(GenerationError(
        "server busy: 8 requests are waiting (max_waiting_requests=8); retry later", "UNAVAILABLE"))
    assert busy.status == 429 and busy.headers == {"Retry-After": "1"}
    assert busy.body()["error"] == {"message": "server busy: 8 requests are waiting (max_waiting_requests=8); "
                                               "retry later", "type": "rate_limit_error", "param": None,
                                    "code": "rate_limit_exceeded"}
    for message, code in (("the server is shutting down", "UNAVAILABLE"),
                          ("the engine failed and serves no more requests: RuntimeError: boom", "UNAVAILABLE"),
                          ("engine step failed: RuntimeError: boom", "INTERNAL"),
                          ("Stub process 'llm_0_0' is not healthy.", None),
                          ("Request for unknown model: 'llm' has no available versions", None),
                          ("failed to connect to all addresses", "UNAVAILABLE")):
        down = generation_http_error(GenerationError(message, code))
        assert (down.status, down.type, down.headers) == (503, "server_error", {"Retry-After": "1"}), message
    refused = generation_http_error(GenerationError("prompt (3 tokens) + max_tokens (9) exceeds max_model_len", BAD))
    assert (refused.status, refused.type, refused.headers) == (400, "invalid_request_error", {})
    # Only a message that starts so: a prompt quoting the words is the request's own problem.
    quoted = generation_http_error(GenerationError("stop string 'server busy: ' is too long", BAD))
    assert quoted.status == 400
    # A guide llm could not compile: named by the parameter it came from.
    guide = generation_http_error(GenerationError("guided_decoding_guide (json_schema) does not compile: x", BAD),
                                  "tools")
    assert (guide.status, guide.param) == (400, "tools") and "does not compile" in guide.message
    assert generation_http_error(GenerationError("prompt too long", BAD), "tools").param is None


@pytest.mark.parametrize("raw, words", [
    (b'{"model": "m", "prompt": "a\\ud800b"}', "surrogate"),
    (b'{"model": "m", "prompt": "a", "stop": ["\\udc00"]}', "surrogate"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "name": "\\ud83d"}]}', "surrogate"),
    (b'{"model": "m", "temperature": NaN}', "NaN"),
    (b'{"model": "m", "top_p": -Infinity}', "Infinity"),
    (b"\xff\xfe{", "not valid JSON"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_bodies_no_tokenizer_or_engine_could_take_are_400(raw, words):
    with pytest.raises(ApiError, match=words) as e:
        decode_json(raw)
    assert e.value.status == 400


def test_paired_surrogate_escapes_and_big_numbers_decode():
    assert decode_json(b'{"prompt": "\\ud83d\\ude00 ok"}') == {"prompt": "\U0001F600 ok"}
    # 1e400 decodes to inf: the request models refuse it by field rather than pass it on.
    with pytest.raises(ApiError, match="repetition_penalty") as e:
        parse(CompletionRequest, {**GOOD, **decode_json(b'{"repetition_penalty": 1e400}')})
    assert e.value.param == "repetition_penalty"


def test_the_default_body_limit_holds_the_longest_accepted_prompt():
    assert default_body_limit(1000) == DEFAULT_MAX_BODY_BYTES == 4 * 2**20
    # A context of 131072 tokens x 128-character entries: 16M characters, each up to 6 bytes of JSON.
    big = default_body_limit(131072 * 128)
    assert big >= 6 * 131072 * 128 > DEFAULT_MAX_BODY_BYTES


def test_response_bodies():
    meta = R.Meta("cmpl-1", "m", created=5)
    strings = {1: "ab", 2: "c", 3: "de", 4: "é"}
    lp = completion_logprobs(TokenLogprobs([1, 2, 3], [-0.1, -0.2, -0.3]), lambda ids: [strings[i] for i in ids],
                             text_start=4, want_top=False)
    assert lp["text_offset"] == [4, 6, 7] and lp["tokens"] == ["ab", "c", "de"] and lp["top_logprobs"] is None
    choice = {"index": 0, "text": "abcde", "logprobs": lp, "finish_reason": "length"}
    body = R.completion(meta, [choice], R.usage(3, 3))
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "text_completion"
    chat_lp = chat_logprobs(TokenLogprobs([4], [-1.0]), lambda ids: [strings[i] for i in ids])
    assert chat_lp["content"][0]["bytes"] == [0xC3, 0xA9] and chat_lp["content"][0]["top_logprobs"] == []
    event = R.sse(R.chat_chunk(meta, [{"index": 0, "delta": {"content": "é"}, "logprobs": None,
                                       "finish_reason": None}]))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:])["choices"][0]["delta"]["content"] == "é"
    assert R.sse("[DONE]") == "data: [DONE]\n\n"


def test_prompts_with_the_demo_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = Prompts(tok, max_model_len=64)
    ids, text = prompts.completion(parse(CompletionRequest, {**GOOD, "prompt": "hello world"}))
    # A text no 64 tokens could hold is refused before tokenizing, naming the parameter.
    huge = "x" * (prompts.limit.max_chars + 1)
    with pytest.raises(ApiError, match="it was not tokenized") as e:
        prompts.completion(parse(CompletionRequest, {**GOOD, "prompt": huge}))
    assert e.value.param == "prompt"
    with pytest.raises(ApiError, match="a message has") as e:
        prompts.chat(parse(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": huge}]}))
    assert e.value.param == "messages"
    assert ids == tok("hello world").input_ids and ids[0] == tok.bos_token_id and text == "hello world"
    with pytest.raises(ApiError, match="outside the vocabulary"):
        prompts.completion(parse(CompletionRequest, {**GOOD, "prompt": [1, 10**6]}))
    assert prompts.has_chat_template  # the demo checkpoint carries one
    chat_ids = prompts.chat(parse(ChatCompletionRequest, CHAT))
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat_ids == tok(rendered, add_special_tokens=False).input_ids
    tok.chat_template = None
    with pytest.raises(ApiError) as e:
        prompts.chat(parse(ChatCompletionRequest, CHAT))
    assert e.value.status == 400 and e.value.code == "no_chat_template"


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_log_prob_token_strings_keep_their_leading_space(tmp_path, kind):
    from splitfuse.tools.demo_model import build_sentencepiece_tokenizer, build_tokenizer

    tok = build_sentencepiece_tokenizer(tmp_path, 512) if kind == "sentencepiece" else build_tokenizer(tmp_path, 512)
    prompts = Prompts(tok, max_model_len=64)
    ids = tok.encode("hello world", add_special_tokens=False)
    strings = prompts.token_strings(ids + [tok.eos_token_id])
    # Joined, the strings are the text; sentencepiece's first piece carries the space it encodes.
    assert "".join(strings[:-1]) == ("" if kind == "byte_level" else " ") + "hello world"
    assert strings[-2] == " world" and strings[-1] == tok.eos_token
    assert prompts.token_strings(ids) == strings[:-1]  # remembered, the same
    cjk = tok.encode("\u4e16", add_special_tokens=False)  # a character split over byte tokens
    pieces = [s for s in prompts.token_strings(cjk) if s.strip()]  # (sentencepiece: after a lone space)
    assert len(pieces) > 1 and all(s.strip() == "\ufffd" for s in pieces)


@pytest.mark.parametrize("model, body", [(CompletionRequest, GOOD), (ChatCompletionRequest, CHAT)])
def test_priority_goes_to_the_llm_input_and_is_bounded_as_in_the_engine(model, body):
    inputs = sampling_inputs(parse(model, {**body, "priority": -1000}), 8, logprobs=False)
    (tensor,) = [t for t in build_inputs(inputs) if t.name() == "priority"]
    assert inputs["priority"] == -1000 and tensor.datatype() == "INT32" and tensor.shape() == [1, 1]
    assert "priority" not in sampling_inputs(parse(model, body), 8, logprobs=False)  # the server's default, 0
    for bad in (1001, -1001, 1.5, "1"):
        with pytest.raises(ApiError, match="priority") as e:
            parse(model, {**body, "priority": bad})
        assert e.value.status == 400 and e.value.param == "priority"


def test_repetition_penalty_is_bounded_at_the_front_as_in_the_engine():
    # Above the engine's ceiling: refused here (400 naming it), not after a round trip to Triton.
    with pytest.raises(ApiError, match="repetition_penalty") as e:
        parse(CompletionRequest, {**GOOD, "repetition_penalty": 2.5})
    assert e.value.status == 400 and e.value.param == "repetition_penalty"
    assert parse(CompletionRequest, {**GOOD, "repetition_penalty": 2.0}).repetition_penalty == 2.0

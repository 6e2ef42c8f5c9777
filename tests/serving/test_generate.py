"""Generation through the real server: gRPC streaming and HTTP, ensemble and llm."""

from __future__ import annotations

import json

import pytest
from triton_helpers import grpc_generate, http_generate, http_generate_stream

from splitfuse.engine.sequence import SamplingParams

pytestmark = pytest.mark.serving

MODELS = ("ensemble", "llm")


def _is_multibyte(text: str) -> bool:
    return any(ord(c) > 127 and c != "\ufffd" for c in text)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_streaming_deltas_in_order(served, model):
    """The first token alone, then the tokens produced since the last response (several when
    the engine steps faster than responses are sent: they are merged, not queued), in order,
    the final flag and finish reason on the last."""
    prompt = "hello world"
    r = grpc_generate(served.grpc_url, model, {
        "text_input": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "return_num_input_tokens": True, "return_num_output_tokens": True,
    })
    assert r.error is None
    assert r.responses[-1].final and not any(x.final for x in r.responses[:-1])
    sizes = [len(x.output_ids) for x in r.responses]
    assert sizes[0] == 1 and all(n >= 1 for n in sizes) and sum(sizes) == 12
    assert [x.finish_reason for x in r.responses] == [""] * (len(sizes) - 1) + ["length"]
    assert [x.num_output_tokens for x in r.responses] == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert r.responses[0].num_input_tokens >= 2


@pytest.mark.parametrize("model", MODELS)
def test_grpc_non_streaming_sends_one_response(served, model):
    r = grpc_generate(served.grpc_url, model, {"text_input": "hello world", "max_tokens": 10, "temperature": 0.0,
                                               "ignore_eos": True})
    assert r.error is None
    assert len(r.responses) == 1 and r.responses[0].final
    assert len(r.output_ids) == 10 and r.finish_reason == "length"
    # Outputs not asked for are not sent.
    assert r.responses[0].num_input_tokens is None and r.responses[0].log_probs is None


def test_http_generate_and_generate_stream(served):
    body = {"text_input": "the quick brown fox", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    for model in MODELS:
        whole = http_generate(served.http_url, model, body)
        assert "error" not in whole, whole
        assert whole["finish_reason"] == "length"
        events = http_generate_stream(served.http_url, model, {**body, "stream": True})
        assert 1 <= len(events) <= 16  # tokens made while a response is in flight go out merged
        assert "".join(e["text_output"] for e in events) == whole["text_output"]
        assert events[-1]["finish_reason"] == "length"


def test_greedy_matches_offline_llm(served, offline_llm):
    for prompt in ("hello world", "servers stream tokens 你好 😀"):
        ref = offline_llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
        for model in MODELS:
            for stream in (False, True):
                r = grpc_generate(served.grpc_url, model, {"text_input": prompt, "max_tokens": 32,
                                                           "temperature": 0.0, "ignore_eos": True, "stream": stream})
                assert r.error is None
                assert r.output_ids == ref.token_ids, (model, stream)
                assert r.text == ref.text.encode("utf-8"), (model, stream)


def test_requests_without_sampling_inputs_are_greedy(served, offline_llm):
    """default_temperature = 0 (as TensorRT-LLM's ensemble): no `temperature` input, greedy."""
    ref = offline_llm.generate(["the sea"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    for model in MODELS:
        for seed in (1, 2):  # a seed alone does not make it sample
            r = grpc_generate(served.grpc_url, model, {"text_input": "the sea", "max_tokens": 24, "ignore_eos": True,
                                                       "seed": seed})
            assert r.error is None and r.output_ids == ref.token_ids, (model, seed)


def test_seeded_sampling_matches_offline_llm(served, offline_llm):
    params = dict(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    ref = offline_llm.generate(["the sea and the mountains"], SamplingParams(**params))[0]
    r = grpc_generate(served.grpc_url, "ensemble", {
        "text_input": "the sea and the mountains", "max_tokens": 24, "temperature": 0.9, "top_k": 50, "top_p": 0.95,
        "random_seed": 1234, "ignore_eos": True, "stream": True,
    })
    assert r.output_ids == ref.token_ids


def test_streamed_deltas_are_byte_exact_with_multibyte_text(served):
    """Joined deltas == the non-streamed text, byte for byte, and every delta is whole UTF-8.

    Sampling with a seed walks over the tiny byte-level vocabulary; pick the first seed whose
    output has real multi-byte characters and a token that completed no character on its
    own (a delta with ids but no text), the case stateless per-chunk decoding garbles.
    """
    prompt = "你好世界 😀 hello"
    base = {"text_input": prompt, "max_tokens": 48, "temperature": 1.0, "ignore_eos": True}
    for seed in range(40):
        stream = grpc_generate(served.grpc_url, "ensemble", {**base, "seed": seed, "stream": True})
        assert stream.error is None
        text = stream.text.decode("utf-8")
        held_back = any(x.output_ids and not x.text for x in stream.responses)
        if _is_multibyte(text) and held_back:
            break
    else:
        pytest.fail("no seed produced multi-byte output with a split character")
    for x in stream.responses:
        x.text.decode("utf-8")  # strict: raises on a split character
    whole = grpc_generate(served.grpc_url, "ensemble", {**base, "seed": seed})
    assert stream.text == whole.text
    assert stream.output_ids == whole.output_ids
    # The same over HTTP: JSON strings of every event, joined.
    events = http_generate_stream(served.http_url, "ensemble", {**base, "seed": seed, "stream": True})
    assert "".join(e["text_output"] for e in events).encode("utf-8") == whole.text
    assert http_generate(served.http_url, "llm", {**base, "seed": seed})["text_output"].encode() == whole.text


def test_request_options(served, offline_llm):
    g = served.grpc_url
    base = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    ref = offline_llm.generate(["hello world"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                               logprobs=True))[0]
    # exclude_input_in_output=false puts the prompt first; log_probs only when asked.
    r = grpc_generate(g, "ensemble", {"text_input": "hello world", **base, "exclude_input_in_output": False,
                                      "return_log_probs": True})
    assert r.text.decode() == "hello world" + ref.text
    assert r.output_ids == ref.prompt_token_ids + ref.token_ids
    assert r.responses[0].log_probs == pytest.approx(ref.logprobs, abs=1e-4)
    # Prompt as token ids, straight to llm.
    r = grpc_generate(g, "llm", {"input_ids": ref.prompt_token_ids, **base})
    assert r.output_ids == ref.token_ids
    # Echoed, a prompt of ids is decoded (by the stub's tokenizer, loaded for it on first use).
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(served.model_dir).decode(ref.prompt_token_ids, skip_special_tokens=True)
    r = grpc_generate(g, "llm", {"input_ids": ref.prompt_token_ids, **base, "exclude_input_in_output": False})
    assert r.text.decode() == prompt + ref.text and prompt.strip()
    # stop_words: the output ends before the first occurrence of a stop string.
    word = ref.text[5:8]
    r = grpc_generate(g, "ensemble", {"text_input": "hello world", **base, "stop_words": [word, "zzzzqq"]})
    assert r.finish_reason == "stop"
    assert r.text.decode() == ref.text[:ref.text.index(word)]
    # end_id stops on that token; min_length is accepted as min_tokens.
    end = ref.token_ids[3]
    r = grpc_generate(g, "ensemble", {"text_input": "hello world", **base, "end_id": end})
    assert r.finish_reason == "stop" and r.output_ids == ref.token_ids[:ref.token_ids.index(end) + 1]
    r = grpc_generate(g, "ensemble", {"text_input": "hello world", "max_tokens": 8, "min_length": 8,
                                      "temperature": 0.0})
    assert len(r.output_ids) == 8


def test_chat_template_in_preprocessing(served, offline_llm):
    messages = [{"role": "user", "content": "hello world"}]
    prompt_ids = offline_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys"):
        prompt_ids = prompt_ids["input_ids"]
    ref = offline_llm.generate([list(prompt_ids)], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True))[0]
    for text in (json.dumps(messages), "hello world"):  # plain text is one user message
        r = grpc_generate(served.grpc_url, "ensemble", {"text_input": text, "apply_chat_template": True,
                                                        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                                                        "return_num_input_tokens": True})
        assert r.error is None
        assert r.responses[0].num_input_tokens == len(prompt_ids)
        assert r.output_ids == ref.token_ids

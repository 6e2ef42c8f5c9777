"""Structured outputs through the real server, with TensorRT-LLM's tensor names
(`guided_decoding_guide_type`, `guided_decoding_guide`), through `llm` and through the ensemble:
sampled freely by a random-weight model, every output still follows its guide; a guide that does
not compile is an INVALID_ARG error naming it, and nothing else is disturbed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from triton_helpers import grpc_generate, metric_sum, wait_for

pytestmark = pytest.mark.serving

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def _guided(served, model: str, kind: str, guide: str, seed: int, **extra):
    values = {"max_tokens": 120, "temperature": 1.0, "seed": seed, "ignore_eos": True,
              "guided_decoding_guide_type": kind, "guided_decoding_guide": guide, **extra}
    if model == "llm":
        values["input_ids"] = [1, 17, 33, 49]
    else:
        values["text_input"] = "the answer is"
    return grpc_generate(served.grpc_url, model, values)


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_outputs_follow_their_guides(served, model):
    before = metric_sum(served.metrics_url, "splitfuse_constrained_requests_total")
    compiles = metric_sum(served.metrics_url, "splitfuse_grammar_compile_seconds_count")
    for seed in range(3):
        r = _guided(served, model, "json_schema", json.dumps(SCHEMA), seed, stream=True)
        assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(r.text.decode()), SCHEMA)
        r = _guided(served, model, "regex", "[a-z]{2}-[0-9]{3}", seed)
        assert r.error is None and re.fullmatch("[a-z]{2}-[0-9]{3}", r.text.decode()), r.text
        r = _guided(served, model, "choice", json.dumps(["alpha", "beta"]), seed)
        assert r.error is None and r.text.decode() in ("alpha", "beta")
    # Nine constrained requests, each with its compile time (cached after the first per guide).
    assert wait_for(lambda: metric_sum(served.metrics_url, "splitfuse_constrained_requests_total") - before == 9)
    assert metric_sum(served.metrics_url, "splitfuse_grammar_compile_seconds_count") - compiles == 9
    assert metric_sum(served.metrics_url, "splitfuse_grammar_mask_seconds_total") > 0


def test_a_guide_that_does_not_compile_is_invalid_arg(served):
    bad = _guided(served, "llm", "regex", "([a-z", 0)
    assert bad.error is not None and "does not compile" in bad.error
    bad = _guided(served, "ensemble", "yaml", "a: 1", 0)
    assert bad.error is not None and "guided_decoding_guide_type" in bad.error
    ok = grpc_generate(served.grpc_url, "llm", {"input_ids": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert ok.error is None and len(ok.output_ids) == 3

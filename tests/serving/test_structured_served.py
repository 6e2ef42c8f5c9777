"""Structured outputs through the real server, with TensorRT-LLM's tensor names
(`guided_decoding_guide_type`, `guided_decoding_guide`), through `llm` and through the ensemble:
sampled freely by a random-weight model, every output still follows its guide; a guide that does
not compile is an INVALID_ARG error naming it, and nothing else is disturbed."""

from __future__ import annotations

import json
import re
import uuid
import time

import jsonschema
import pytest
from triton_helpers import GrpcStream, grpc_generate, metric_sum, wait_for

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


# ---- bounds: compiles after admission, off the request path ----------------------------------
def _slow_schema(tag: str) -> str:
    """A genuinely slow guide: 500 properties of pattern [a-z]{1,20} keep the replica's compiler
    process busy ~7 s on 2 shared AMD Zen 4 cores, and then (xgrammar 0.2.9) exhaust its 4 GiB
    address-space bound: the request ends with a contained error, or compiles where memory
    allows. `tag` keeps it uncached."""
    return json.dumps({"type": "object", "properties": {f"{tag}{i}": {"type": "string", "pattern": "[a-z]{1,20}"}
                                                        for i in range(500)}}, separators=(",", ":"))


FIRST_TOKEN_S = 2.0


def test_a_plain_request_is_not_behind_slow_compiles(served):
    tag = uuid.uuid4().hex[:6]
    slow = [GrpcStream(served.grpc_url) for _ in range(2 * served.instances)]
    try:
        for i, stream in enumerate(slow):  # spread over the replicas: each compiler busy for seconds
            stream.send("llm", {"input_ids": [1, 17, 33], "max_tokens": 1, "guided_decoding_guide_type": "json_schema",
                                "guided_decoding_guide": _slow_schema(f"{tag}_{i}_")})
        time.sleep(0.5)  # the compiles are under way
        firsts = []
        for i in range(2 * served.instances):
            with GrpcStream(served.grpc_url) as plain:
                start = time.monotonic()
                plain.send("llm", {"input_ids": [1, 2, 3 + i], "max_tokens": 4, "ignore_eos": True, "stream": True})
                response, error = plain.next(timeout=60)
                firsts.append(time.monotonic() - start)
                assert error is None and response.output_ids, error
                assert plain.collect().error is None
        still_compiling = sum(stream.events.empty() for stream in slow)
        print(f"plain first tokens {[round(f, 2) for f in firsts]} s; {still_compiling} slow guides still compiling")
        assert still_compiling > 0, ("the slow guides ended before the plain requests: nothing was measured",
                                     slow[0].collect(timeout=5).error)
        assert max(firsts) < FIRST_TOKEN_S, firsts
        for stream in slow:  # each guided request then ends: generated, or refused alone
            result = stream.collect(timeout=300)
            assert (result.error is None and result.finish_reason in ("stop", "length")) or (
                result.error.startswith("guided_decoding_guide refused")), result.error
        after = grpc_generate(served.grpc_url, "llm", {"input_ids": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert after.error is None and len(after.output_ids) == 3
    finally:
        for stream in slow:
            stream.close()


# ---- bounds: the compiled-grammar cache ------------------------------------------------------
SMALL_CACHE_MB = 4


@pytest.fixture(scope="module")
def small_cache(tiny_llama, tmp_path_factory):
    """One replica whose compiled-grammar budget (grammar_cache_mb) is small enough to be passed
    many times over by a loop of distinct schemas (each ~180 KB compiled for the tiny vocabulary)."""
    from conftest import one_instance_server

    settings = {"grammar_cache_mb": str(SMALL_CACHE_MB)}
    with one_instance_server(tiny_llama, settings, tmp_path_factory.mktemp("triton_grammars")) as (_, server):
        yield server


def _llm_stub_rss(server) -> int:
    """RSS (bytes) of the `llm` model's Python stub, a child of tritonserver (from /proc)."""
    from triton_helpers import child_pids

    for pid in child_pids(server.process.pid):
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if any(arg.endswith(b"triton_python_backend_stub") for arg in cmdline) and any(
                arg.rstrip(b"/").endswith(b"/llm") or b"/llm/" in arg for arg in cmdline):
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    raise AssertionError("no llm stub under tritonserver")


def _distinct_schema(i: int) -> str:
    # Bounded patterns are what makes a compiled grammar large for its compile time (~90 KB and
    # ~5 ms a property here): the loop is cheap, the cache's budget passed many times over.
    return json.dumps({"type": "object", "properties": {f"k{i}_{j}": {"type": "string", "pattern": "[a-z]{1,99}"}
                                                        for j in range(2)}, "required": [f"k{i}_0"]})


def _send_schemas(server, first: int, count: int, window: int = 8) -> None:
    """One token each (the cheapest constrained request), on one stream, `window` in flight (under
    max_pending_guides): request overhead, not the loop, would otherwise dominate."""
    with GrpcStream(server.grpc_url) as stream:
        sent = done = 0
        while done < count:
            while sent < count and sent - done < window:
                stream.send("llm", {"input_ids": [1, 17, 33], "max_tokens": 1,
                                    "guided_decoding_guide_type": "json_schema",
                                    "guided_decoding_guide": _distinct_schema(first + sent)})
                sent += 1
            response, error = stream.next(timeout=120)
            assert error is None, error
            done += response.final


def _rss_growth(server, count: int) -> tuple[int, float]:
    _send_schemas(server, 0, 40)  # warm: allocator pools, first compiles, the cache filled past its budget
    before = _llm_stub_rss(server)
    start = time.monotonic()
    _send_schemas(server, 1000, count)
    return _llm_stub_rss(server) - before, time.monotonic() - start


# Distinct schemas without eviction would keep ~180 KB each (~360 MB for 2,000); the cache keeps
# at most SMALL_CACHE_MB, plus allocator slack.
RSS_SLACK_MB = 20


def test_2000_distinct_schemas_leave_the_stub_rss_bounded(small_cache):
    growth, seconds = _rss_growth(small_cache, 2000)
    print(f"llm stub RSS growth over 2000 distinct schemas: {growth / 2**20:.1f} MiB in {seconds:.1f} s")
    assert growth < (SMALL_CACHE_MB + RSS_SLACK_MB) << 20, f"{growth / 2**20:.1f} MiB"

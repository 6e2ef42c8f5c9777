"""Admission control on a real server: a flood past `max_waiting_requests` is refused at once
(gRPC UNAVAILABLE "server busy"; the OpenAI front's 429 with Retry-After), counted in
`splitfuse_requests_refused_total`; every accepted request finishes, none hangs, and once the
flood passes the server is ready with an empty KV pool and queue.

Two slowed blockers (fault_model's `fault-slow` ids: 20 ms a step) fill both running slots, so
each request of the flood waits: exactly `max_waiting_requests` of them are taken, the rest refused.
The same blockers make a queue for request priority: a high-priority request overtakes it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from conftest import fault_server
from openai_helpers import start_api, stop_api
from triton_helpers import GrpcStream, grpc_generate, metric_sum, wait_for

pytestmark = pytest.mark.serving

MAX_WAITING = 3
PARAMS = {"device": "cpu", "dtype": "float32", "num_kv_blocks": "512", "block_size": "16", "token_budget": "64",
          "num_threads": "1", "max_num_seqs": "2", "max_waiting_requests": str(MAX_WAITING)}
FLOOD = 12


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with fault_server(tiny_llama, PARAMS, tmp_path_factory.mktemp("admission")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server, tiny_llama, tmp_path_factory):
    a = start_api(tiny_llama, server.grpc_url, tmp_path_factory.mktemp("admission-api"), "admission-api",
                  "--served-model-name", "m")
    yield a
    stop_api(a)


def _waiting(server) -> float:
    return metric_sum(server.metrics_url, "splitfuse_requests", state="waiting")


def _refused(server, reason: str = "queue_full") -> float:
    return metric_sum(server.metrics_url, "splitfuse_requests_refused_total", reason=reason)


class Blockers:
    """Two long slowed generations that hold both running slots until closed (cancelled)."""

    def __init__(self, server) -> None:
        self.streams = [GrpcStream(server.grpc_url) for _ in range(2)]
        for i, s in enumerate(self.streams):
            s.send("llm", {"text_input": "hold the line", "max_tokens": 2000, "ignore_eos": True, "stream": True},
                   request_id=f"fault-slow-blocker-{i}")
        for s in self.streams:
            resp, err = s.next()
            assert err is None and resp.output_ids, err

    def release(self) -> None:
        for s in self.streams:
            s.close(cancel=True)


def test_grpc_flood_past_max_waiting_is_refused_and_nothing_is_lost(server):
    refused_before = _refused(server)
    blockers = Blockers(server)
    try:
        with ThreadPoolExecutor(FLOOD) as pool:
            futures = [pool.submit(grpc_generate, server.grpc_url, "llm",
                                   {"text_input": f"flood {i}", "max_tokens": 4, "ignore_eos": True, "stream": True},
                                   f"flood-{i}", None, 120) for i in range(FLOOD)]
            # The refusals come at once, while the blockers still hold the engine.
            assert wait_for(lambda: _refused(server) - refused_before == FLOOD - MAX_WAITING, timeout=60)
            blockers.release()
            results = [f.result(timeout=120) for f in futures]
    finally:
        blockers.release()
    busy = [r for r in results if r.error is not None]
    served = [r for r in results if r.error is None]
    assert len(busy) == FLOOD - MAX_WAITING and len(served) == MAX_WAITING
    for r in busy:
        assert "server busy" in r.error and f"max_waiting_requests={MAX_WAITING}" in r.error, r.error
        assert r.output_ids == []
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in served)
    assert wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_kv_cache_blocks", state="used") == 0)
    assert wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_requests", state="waiting") == 0)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready() and client.is_model_ready("llm")
    after = grpc_generate(server.grpc_url, "llm", {"text_input": "after the flood", "max_tokens": 4, "stream": True})
    assert after.error is None and len(after.output_ids) == 4


def _openai_completion(base_url: str, prompt: str, stream: bool) -> tuple[int, dict, str]:
    """(status, headers, body) of one /v1/completions request."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                       "stream": stream}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def test_openai_flood_past_max_waiting_gets_429_with_retry_after(server, api):
    refused_before = _refused(server)
    blockers = Blockers(server)
    try:
        with ThreadPoolExecutor(FLOOD) as pool:
            futures = [pool.submit(_openai_completion, api.base_url, f"flood {i}", i % 2 == 0) for i in range(FLOOD)]
            assert wait_for(lambda: _refused(server) - refused_before == FLOOD - MAX_WAITING, timeout=60)
            blockers.release()
            results = [f.result(timeout=120) for f in futures]
    finally:
        blockers.release()
    busy = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert len(busy) == FLOOD - MAX_WAITING and len(served) == MAX_WAITING, [r[0] for r in results]
    for status, headers, body in busy:
        assert headers.get("retry-after") == "1"
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and "server busy" in error["message"]
    for status, headers, body in served:
        if body.startswith("data:"):
            assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in body.replace(" ", "")
        else:
            assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    assert wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_kv_cache_blocks", state="used") == 0)
    assert wait_for(lambda: metric_sum(server.metrics_url, "splitfuse_requests", state="waiting") == 0)


# ---- request priority ----------------------------------------------------------------------


def _high_by_ensemble(server, api) -> None:
    r = grpc_generate(server.grpc_url, "ensemble", {"text_input": "an urgent request", "max_tokens": 2,
                                                    "ignore_eos": True, "priority": 5})
    assert r.error is None and len(r.output_ids) == 2, r.error


def _high_by_openai(server, api) -> None:
    out = api.client().completions.create(model="m", prompt="an urgent request", max_tokens=2, temperature=0,
                                          extra_body={"ignore_eos": True, "priority": 5})
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize("send_high", [_high_by_ensemble, _high_by_openai], ids=["ensemble", "openai"])
def test_a_high_priority_request_overtakes_a_queue_of_ordinary_ones(server, api, send_high):
    """Both running slots held, two ordinary requests (priority 0) queue, then one of priority 5,
    through the ensemble or the OpenAI front. When the slots free, the high one is admitted first
    and, asking for 2 tokens where the others ask for 24 slowed ones, finishes first. Without its
    priority (dropped on the way, or ignored) it would be admitted only once an ordinary one had
    finished, so it could not finish first."""
    finished: list[str] = []

    def ordinary(i: int) -> None:
        r = grpc_generate(server.grpc_url, "llm", {"text_input": f"an ordinary request {i}", "max_tokens": 24,
                                                   "ignore_eos": True}, f"fault-slow-ordinary-{i}")
        assert r.error is None and len(r.output_ids) == 24, r.error
        finished.append(f"ordinary{i}")

    def high() -> None:
        send_high(server, api)
        finished.append("high")

    blockers = Blockers(server)
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(ordinary, i) for i in range(2)]
            assert wait_for(lambda: _waiting(server) == 2, timeout=60)
            futures.append(pool.submit(high))
            assert wait_for(lambda: _waiting(server) == 3, timeout=60)
            blockers.release()
            for f in futures:
                f.result(timeout=120)
    finally:
        blockers.release()
    assert finished[0] == "high" and sorted(finished) == ["high", "ordinary0", "ordinary1"], finished


def test_openai_priority_is_accepted_in_range_and_refused_outside_naming_it(api):
    openai = pytest.importorskip("openai", reason="the openai SDK is in the dev extra")
    client = api.client()
    messages = [{"role": "user", "content": "hello"}]
    for priority in (-1000, 1000):
        out = client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                             extra_body={"priority": priority})
        assert out.choices[0].finish_reason in ("stop", "length")
    for bad in (1001, -1001, "high"):
        for create, body in ((client.chat.completions.create, {"messages": messages}),
                             (client.completions.create, {"prompt": "hello"})):
            with pytest.raises(openai.BadRequestError, match="priority") as e:
                create(model="m", max_tokens=2, extra_body={"priority": bad}, **body)
            assert e.value.status_code == 400 and e.value.body["param"] == "priority", e.value.body

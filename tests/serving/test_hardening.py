"""A real tritonserver whose llm model has faults injected (fault_model.py): an exception in
one request's add, abort or sampling fails that request alone while the others finish and the
model stays ready; a broken engine fails every pending and later request at once, nothing
hangs, the health gauge drops, and the server still shuts down cleanly.

Triton 2.51 ties a model's readiness to its load state only (a dead stub still reports ready),
so a broken engine unloads its own model (explicit model control, the launcher's default); the
last test checks that the model and the server then report not ready.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from conftest import fault_server
from triton_helpers import (
    GrpcStream,
    InferenceServerException,
    finished_requests,
    grpc_generate,
    metric_sum,
    metrics,
    settled,
    wait_for,
)

pytestmark = pytest.mark.serving

# One replica, a KV pool of 24 blocks x 16 = 384 tokens: four 120-token generations preempt.
PARAMS = {"device": "cpu", "dtype": "float32", "num_kv_blocks": "24", "block_size": "16", "token_budget": "64",
          "num_threads": "1", "kv_watermark": "0"}
GREEDY = {"max_tokens": 16, "ignore_eos": True, "stream": True}  # no temperature: greedy by default
PROMPTS = ["hello world", "the quick brown fox", "a lazy dog sleeps"]


@pytest.fixture(scope="module", params=["true", "false"], ids=["engine_process", "in_process"])
def server(request, tiny_llama, tmp_path_factory):
    """Both homes of the engine: its own process (the default), and the stub's (engine_process=false)."""
    params = {**PARAMS, "engine_process": request.param}
    with fault_server(tiny_llama, params, tmp_path_factory.mktemp("faults"), exit_timeout_s=10) as srv:
        yield srv
        code = srv.stop()
    # finalize() returned and Triton unloaded the model even after the engine broke.
    assert code == 0 and not srv.killed, f"tritonserver exit code {code}; log: {srv.log_file}"


def _used(server) -> float:
    return metric_sum(server.metrics_url, "splitfuse_kv_cache_blocks", state="used")


def _generate(server, prompt: str, request_id: str = "", **extra):
    return grpc_generate(server.grpc_url, "llm", {"text_input": prompt, **GREEDY, **extra}, request_id=request_id,
                         timeout=120)


def test_one_request_failing_in_add_abort_sampling_or_its_response_fails_alone(server):
    alone = {p: _generate(server, p) for p in PROMPTS}
    assert all(r.error is None and len(r.output_ids) == 16 for r in alone.values())
    errors_before = finished_requests(server.metrics_url, "error")

    def aborted_with_fault():
        # The stop's stream is open before the generation starts: opening one takes long enough
        # for the tiny model to make many of the 300 tokens.
        with GrpcStream(server.grpc_url) as stop, GrpcStream(server.grpc_url) as s:
            s.send("llm", {"text_input": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True,
                           "return_stop_handle": True}, request_id="fault-abort-1")
            first, err = s.next()
            assert err is None and first.stop_handle  # generating
            stop.send("llm", {"stop": True, "stop_handle": first.stop_handle})
            assert stop.collect(timeout=30).finish_reason == "abort"
            return s.collect(timeout=60)

    with ThreadPoolExecutor(7) as pool:
        normal = {p: pool.submit(_generate, server, p) for p in PROMPTS}
        add = pool.submit(_generate, server, "hello", "fault-add-1")
        sample = pool.submit(_generate, server, "hello", "fault-sample-1")
        respond = pool.submit(_generate, server, "hello", "fault-respond-1")
        abort = pool.submit(aborted_with_fault)
        for p, f in normal.items():
            r = f.result(timeout=180)
            assert r.error is None and r.finish_reason == "length"
            assert r.output_ids == alone[p].output_ids  # not disturbed by the failures beside it
        assert "add failed" in (add.result(timeout=60).error or "")
        assert "injected sampling fault" in (sample.result(timeout=60).error or "")
        assert "abort failed" in (abort.result(timeout=60).error or "")
        responded = respond.result(timeout=60)  # its first delta went out, then its error
        assert "could not build the response" in (responded.error or "") and len(responded.output_ids) == 1
    assert wait_for(lambda: finished_requests(server.metrics_url, "error") - errors_before == 3)
    assert wait_for(lambda: _used(server) == 0), "a failed request kept its KV blocks"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_model_ready("llm") and client.is_server_ready()
    with pytest.raises(InferenceServerException, match="restricted"):  # explicit mode, yet not for clients
        client.unload_model("llm")
    assert metric_sum(server.metrics_url, "splitfuse_engine_healthy") == 1
    assert _generate(server, PROMPTS[0]).output_ids == alone[PROMPTS[0]].output_ids


def test_new_metrics_on_the_metrics_port(server):
    """Preemptions (four generations that cannot all fit the pool), KV usage ratio, end-to-end
    latency, prompt / generation length histograms, requests finished by reason."""
    names = ("splitfuse_preemptions_total", "splitfuse_e2e_request_latency_seconds_count",
             "splitfuse_request_prompt_tokens_sum", "splitfuse_request_generation_tokens_sum")
    before = settled(lambda: {n: metric_sum(server.metrics_url, n) for n in names}, quiet_s=0.7)
    length_before = finished_requests(server.metrics_url, "length")
    prompt_ids = [1, 5, 9, 13, 17, 21, 25, 29]
    # Slowed (fault-slow) so that all four are in the engine together: the tiny model alone makes
    # 120 tokens in about the time it takes the next client to connect.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: grpc_generate(server.grpc_url, "llm", {
            "input_ids": prompt_ids, "max_tokens": 120, "ignore_eos": True}, request_id=f"fault-slow-m{i}",
            timeout=300), range(4)))
    assert all(r.error is None and len(r.output_ids) == 120 for r in results)
    after = lambda n: metric_sum(server.metrics_url, n) - before[n]  # noqa: E731
    assert wait_for(lambda: after("splitfuse_request_generation_tokens_sum") == 4 * 120), {n: after(n) for n in names}
    assert after("splitfuse_request_prompt_tokens_sum") == 4 * len(prompt_ids)
    assert after("splitfuse_e2e_request_latency_seconds_count") == 4
    assert finished_requests(server.metrics_url, "length") - length_before == 4
    assert after("splitfuse_preemptions_total") > 0
    reasons = {lab.get("reason") for n, lab, _ in metrics(server.metrics_url)
               if n == "splitfuse_requests_finished_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_kv_usage_ratio(server):
    """Used blocks / pool, published every 0.5 s: long generations until it was seen non-zero."""
    ratio = lambda: metric_sum(server.metrics_url, "splitfuse_kv_cache_usage_ratio")  # noqa: E731
    seen: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        for _ in range(10):
            # Slowed (fault-slow: 20 ms a step): the tiny model alone can finish 360 tokens between
            # two of the metric's 0.5 s updates.
            run = pool.submit(grpc_generate, server.grpc_url, "llm", {
                "input_ids": [1, 5, 9, 13], "max_tokens": 360, "ignore_eos": True}, timeout=300,
                request_id="fault-slow-ratio")
            while not run.done():
                seen.append(ratio())
                time.sleep(0.05)
            assert run.result().error is None
            if max(seen) > 0:
                break
    busy = [r for r in seen if r > 0]
    assert busy, "the ratio never left 0 while a generation held KV blocks"
    blocks = int(PARAMS["num_kv_blocks"])
    assert all(r <= 1.0 and r * blocks == pytest.approx(round(r * blocks)) for r in busy)  # k / 24 blocks
    assert wait_for(lambda: ratio() == 0.0)


def test_broken_engine_fails_pending_and_later_requests_at_once(server):
    # The long generations are slowed (fault-slow: 20 ms a step, so 360 tokens take over 7 s):
    # the tiny model alone can finish one before a loaded test process sends the breaker.
    streams = []
    for i, p in enumerate(PROMPTS[:2]):  # two long generations in flight (together more than the pool holds)
        s = GrpcStream(server.grpc_url)
        s.send("llm", {"text_input": p, "max_tokens": 360, "ignore_eos": True, "stream": True},
               request_id=f"fault-slow-{i}")
        assert s.next()[1] is None
        streams.append(s)
    breaker = _generate(server, "hello", "fault-break-1", max_tokens=2)
    results = [s.collect(timeout=120) for s in streams]  # a hang fails here, not forever
    for s in streams:
        s.close()
    for r in [breaker, *results]:
        assert r.error is not None and "engine failed" in r.error and "injected block pool fault" in r.error, r
    # Not ready: Triton 2.51 ties readiness to the load state alone, so the model unloads itself.
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert wait_for(lambda: not client.is_model_ready("llm"), timeout=60)
    assert not client.is_server_ready() and client.is_server_live()
    later = _generate(server, "hello")
    assert later.error is not None and "llm" in later.error  # unknown model / no available versions

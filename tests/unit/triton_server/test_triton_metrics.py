"""What the llm model records for its metrics (the Triton publishing half runs in
tests/serving/test_concurrency_metrics.py against the real metrics port)."""

import pytest

from splitfuse.engine.llm_engine import StepStats
from splitfuse.engine.sequence import RequestOutput
from splitfuse.triton_server.metrics import MetricsRecorder


def step(prompt: int, generated: int, preempted: int) -> StepStats:
    return StepStats(num_tokens=prompt + generated, num_prompt_tokens=prompt, num_generated_tokens=generated,
                     num_running=1, num_waiting=0, kv_blocks_used=1, kv_blocks_free=1, duration_s=0.01,
                     forward_s=0.01, num_preemptions=preempted)


def final(reason: str, prompt: list[int], tokens: list[int]) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=prompt, delta_token_ids=[], delta_text="", finished=True,
                         finish_reason=reason, seq_token_ids=prompt + tokens, num_tokens=len(prompt) + len(tokens))


def test_recorder_batches_and_drains():
    r = MetricsRecorder()
    r.step(step(10, 0, 0))
    r.step(step(2, 3, 2))
    r.tokens(arrival=1.0, last_token=None, num_tokens=1, now=1.5)
    r.tokens(arrival=1.0, last_token=1.5, num_tokens=2, now=1.7)
    r.finished(final("length", [1, 2, 3], [4, 5, 6]), arrival=1.0, now=1.75)
    r.finished(final("error", [], []), arrival=1.0, now=2.0)  # failed before the engine held it
    r.balance_wait(0.005)
    b = r.drain()
    assert (b.prompt_tokens, b.generation_tokens, b.preemptions) == (12, 3, 2)
    assert b.first_token_latencies == [pytest.approx(0.5)]
    assert b.inter_token_latencies == [pytest.approx(0.1), pytest.approx(0.1)]
    done, failed = b.finished
    assert (done.reason, done.prompt_tokens, done.generation_tokens) == ("length", 3, 3)
    assert done.latency_s == pytest.approx(0.75)
    assert failed.reason == "error" and failed.prompt_tokens is None and failed.latency_s == pytest.approx(1.0)
    assert b.balance_waits == [0.005]
    empty = r.drain()
    assert not (empty.steps or empty.finished or empty.first_token_latencies or empty.inter_token_latencies
                or empty.balance_waits)


def test_kv_tier_counts_and_bytes_are_published(monkeypatch):
    """The tier counters add up the steps' counts; the tier gauges follow EngineStats (through a
    stand-in for Triton's pb_utils)."""
    import sys
    import types

    from splitfuse.engine.stats import EngineStats
    from splitfuse.triton_server.metrics import MetricsBatch, TritonMetrics

    published: dict[tuple, float] = {}

    class Metric:
        def __init__(self, name, labels, **_):
            self.key = (name, labels.get("tier"))

        def increment(self, value):
            published[self.key] = published.get(self.key, 0) + value

        def set(self, value):
            published[self.key] = value

        def observe(self, value):
            pass

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, **kw):  # noqa: N802 (pb_utils' name)
            return Metric(self.name, labels, **kw)

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(MetricFamily=MetricFamily))
    metrics = TritonMetrics({"model": "llm"})
    s = step(16, 1, 0)
    s.kv_tier_memory_hits, s.kv_tier_disk_hits, s.kv_tier_restored_tokens = 3, 1, 64
    s.kv_tier_offloaded_bytes, s.kv_tier_corrupt_blocks, s.kv_tier_saved_s = 1000, 1, 0.25
    stats = EngineStats(kv_blocks_used=1, kv_blocks_free=1, kv_blocks_total=2, num_running=0, num_waiting=0,
                        kv_tier_memory_bytes=5000, kv_tier_disk_bytes=7000)
    metrics.publish(MetricsBatch(steps=[s, s]), stats, healthy=True)
    assert published[("splitfuse_kv_tier_memory_hits_total", None)] == 6
    assert published[("splitfuse_kv_tier_disk_hits_total", None)] == 2
    assert published[("splitfuse_kv_tier_restored_tokens_total", None)] == 128
    assert published[("splitfuse_kv_tier_offloaded_bytes_total", None)] == 2000
    assert published[("splitfuse_kv_tier_corrupt_blocks_total", None)] == 2
    assert published[("splitfuse_kv_tier_saved_seconds_total", None)] == 0.5
    assert published[("splitfuse_kv_tier_bytes", "memory")] == 5000
    assert published[("splitfuse_kv_tier_bytes", "disk")] == 7000

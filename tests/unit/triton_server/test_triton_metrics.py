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

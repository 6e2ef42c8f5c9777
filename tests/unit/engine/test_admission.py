"""Admission control in the serving loop: past `max_waiting_requests` a request is refused at
once (ServerBusyError, nothing queued, nothing tokenized); `max_queue_time_s` ends requests not
started in time with a "server busy" error; both leave the KV pool empty once the work passes."""

from __future__ import annotations

import threading

import pytest

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine.loop import EngineLoop
from splitfuse.errors import SERVER_BUSY, ServerBusyError
from splitfuse.engine.sequence import SamplingParams

GREEDY = dict(ignore_eos=True, temperature=0.0)


class Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self.first: dict[str, threading.Event] = {}
        self.done: dict[str, threading.Event] = {}

    def callback(self, request_id: str):
        self.outputs[request_id] = []
        self.first[request_id], self.done[request_id] = threading.Event(), threading.Event()

        def on_output(out) -> None:
            self.outputs[request_id].append(out)
            self.first[request_id].set()
            if out.finished:
                self.done[request_id].set()
        return on_output

    def final(self, request_id: str):
        assert self.done[request_id].wait(60), f"{request_id} never finished"
        return self.outputs[request_id][-1]


def _loop(tiny_llama, **kwargs) -> EngineLoop:
    # One sequence runs at a time: every other request waits.
    loop = EngineLoop(EngineConfig(model=tiny_llama, token_budget=16, block_size=4, max_num_seqs=1,
                                   attention_backend="torch"), server=ServerConfig(**kwargs))
    loop.start()
    return loop


def test_requests_past_max_waiting_are_refused_at_once_and_the_rest_finish(tiny_llama):
    loop = _loop(tiny_llama, max_waiting_requests=2)
    c = Collector()
    try:
        loop.submit("runs", "hello", SamplingParams(max_tokens=3000, **GREEDY), c.callback("runs"))
        assert c.first["runs"].wait(60)  # running: the next two wait behind it
        for rid in ("w1", "w2"):
            loop.submit(rid, "hello world", SamplingParams(max_tokens=4, **GREEDY), c.callback(rid))
        assert loop.num_waiting == 2
        with pytest.raises(ServerBusyError, match=r"server busy: 2 requests are waiting \(max_waiting_requests=2\)"):
            loop.submit("refused", "hello", SamplingParams(max_tokens=4, **GREEDY), c.callback("refused"))
        # A refusal is checked before the prompt is tokenized: even an invalid prompt gets it.
        with pytest.raises(ServerBusyError):
            loop.submit("refused-2", "", SamplingParams(max_tokens=4, **GREEDY), c.callback("refused-2"))
        loop.abort("runs")
        assert c.final("runs").finish_reason == "abort"
        for rid in ("w1", "w2"):
            out = c.final(rid)
            assert out.error is None and len(out.token_ids) == 4
        assert not c.first["refused"].is_set()
        # Room again once they ran.
        loop.submit("later", "hello", SamplingParams(max_tokens=2, **GREEDY), c.callback("later"))
        assert len(c.final("later").token_ids) == 2
        assert loop.num_waiting == 0
        assert loop.engine.blocks.num_used_blocks == 0
    finally:
        loop.shutdown(timeout=30)


def test_zero_means_no_bound(tiny_llama):
    loop = _loop(tiny_llama, max_waiting_requests=0)
    c = Collector()
    try:
        loop.submit("runs", "hello", SamplingParams(max_tokens=3000, **GREEDY), c.callback("runs"))
        assert c.first["runs"].wait(60)
        for i in range(20):
            loop.submit(f"w{i}", "hi", SamplingParams(max_tokens=1, **GREEDY), c.callback(f"w{i}"))
        loop.abort("runs")
        assert all(c.final(f"w{i}").error is None for i in range(20))
    finally:
        loop.shutdown(timeout=30)


def test_requests_not_started_within_max_queue_time_end_busy(tiny_llama):
    loop = _loop(tiny_llama, max_queue_time_s=0.3)
    c = Collector()
    try:
        # "runs" is under the same deadline: on a loaded machine the engine thread may take it
        # up later than 0.3 s after submit, and then it rightly ends busy. Submit again until
        # one starts (the behaviour under test is the queued request behind it).
        for attempt in range(10):
            runs = f"runs-{attempt}"
            loop.submit(runs, "hello", SamplingParams(max_tokens=3000, **GREEDY), c.callback(runs))
            assert c.first[runs].wait(60)
            first = c.outputs[runs][0]
            if first.error is None:
                break
            assert first.error.startswith(SERVER_BUSY), first.error
        assert first.error is None and first.token_ids, "no request started within 10 tries"
        loop.submit("late", "hello world", SamplingParams(max_tokens=4, **GREEDY), c.callback("late"))
        late = c.final("late")  # still behind "runs" 0.3 s later
        assert late.finish_reason == "error" and late.error.startswith(SERVER_BUSY)
        assert "max_queue_time_s=0.3" in late.error and late.token_ids == []
        assert not c.done[runs].is_set()  # the running request is not touched
        loop.abort(runs)
        assert c.final(runs).finish_reason == "abort"
        loop.submit("fresh", "hello", SamplingParams(max_tokens=2, **GREEDY), c.callback("fresh"))
        assert len(c.final("fresh").token_ids) == 2
        assert loop.engine.blocks.num_used_blocks == 0
    finally:
        loop.shutdown(timeout=30)


@pytest.mark.parametrize("field,value", [("max_waiting_requests", -1), ("max_queue_time_s", -0.5),
                                         ("max_queue_time_s", float("inf"))])
def test_bad_admission_settings_are_refused(tiny_llama, field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})

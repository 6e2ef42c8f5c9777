"""RemoteEngine (the stub's side of an engine in its own process) without Triton: a real child
process on the tiny model. Greedy outputs match the in-process EngineLoop's token for token and
text for text; a killed child ends its requests at once with ENGINE_FAULT and a new one serves."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine.core_process import ENGINE_TEST_HOOK
from splitfuse.engine.loop import EngineLoop
from splitfuse.engine.remote import RemoteEngine
from splitfuse.errors import ENGINE_FAULT
from splitfuse.engine.sequence import SamplingParams

PROMPTS = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12], [7] * 20]


def _collect(loop, request_id: str, prompt, params: SamplingParams) -> tuple[threading.Event, list]:
    done, outs = threading.Event(), []

    def on_output(out) -> None:
        outs.append(out)
        if out.finished:
            done.set()

    loop.submit(request_id, prompt, params, on_output)
    return done, outs


def _run_all(loop, params: SamplingParams) -> list[tuple[list[int], str, list[int], str]]:
    started = [_collect(loop, f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    # An embedding request among them: its vector crosses in the final record (float32).
    embedded = _collect(loop, "embed", PROMPTS[2], SamplingParams(embed=True))
    started.append(embedded)
    results = []
    for done, outs in started:
        assert done.wait(120)
        last = outs[-1]
        streamed = [t for o in outs for t in o.delta_token_ids]
        results.append((last.token_ids, last.text, streamed, last.finish_reason, last.logprobs, last.top_logprobs,
                        last.prompt_token_ids, None if last.embedding is None else last.embedding.tolist()))
    return results


@pytest.fixture(scope="module")
def config(tiny_llama) -> EngineConfig:
    return EngineConfig(model=tiny_llama, device="cpu", dtype="float32", num_kv_blocks=64, num_threads=1)


def test_outputs_match_the_in_process_loop(config):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    server = ServerConfig(stream_interval=1)
    local = EngineLoop(config, server=server)
    local.start()
    try:
        expected = _run_all(local, params)
    finally:
        local.shutdown(30)
    remote = RemoteEngine(config, server=server, name="test")
    facts = remote.start()
    try:
        assert facts.pid != os.getpid() and facts.max_model_len > 0
        got = _run_all(remote, params)
        # Tokens, text and finish exactly; the floats (log-probs, the embedding) within float32
        # rounding: which requests share a step differs with timing, and so do the matmuls' sums.
        assert [(r[0], r[1], r[2], r[3], r[6]) for r in got] == [(r[0], r[1], r[2], r[3], r[6]) for r in expected]
        for g, e in zip(got, expected):
            assert g[4] == pytest.approx(e[4], abs=1e-4)
            assert [[t for t, _ in top] for top in g[5] or []] == [[t for t, _ in top] for top in e[5] or []]
            assert g[7] == pytest.approx(e[7], abs=1e-5) if e[7] is not None else g[7] is None
        assert all(len(r[0]) == 12 and len(r[4]) == 12 and len(r[5]) == 12 for r in got[:-1])
        assert got[-1][0] == [] and len(got[-1][7]) == facts_hidden(config)
        with pytest.raises(ValueError):  # the child's validation reaches the caller as itself
            remote.submit("bad", [1, 2], SamplingParams(max_tokens=0), lambda out: None)
    finally:
        remote.shutdown(30)


def facts_hidden(config: EngineConfig) -> int:
    from splitfuse.models.args import ModelArgs
    from splitfuse.models.loader import read_hf_config

    return ModelArgs.from_hf_config(read_hf_config(config.model)).hidden_size


SLOW_HOOK = """
import time

def slow(loop):  # 20 ms a step: the tiny model would finish a generation before the kill
    sample = loop.engine.sampler
    def sampler(logits, seqs):
        time.sleep(0.02)
        return sample(logits, seqs)
    loop.engine.sampler = sampler
"""


def test_a_killed_engine_process_ends_its_requests_and_restarts(config, tmp_path, monkeypatch):
    hook = tmp_path / "slow_hook.py"
    hook.write_text(SLOW_HOOK)
    monkeypatch.setenv(ENGINE_TEST_HOOK, f"{hook}:slow")  # the seam the serving tests use
    remote = RemoteEngine(config, server=ServerConfig(stream_interval=1), name="test")
    first = remote.start()
    try:
        long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        done, outs = _collect(remote, "long", [1, 2, 3], long)
        while not outs:
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
        assert done.wait(5)
        assert outs[-1].finish_reason == "error" and outs[-1].error.startswith(ENGINE_FAULT)
        assert "SIGKILL" in outs[-1].error
        deadline = time.monotonic() + 60
        while remote.restarting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.facts.pid != first.pid and remote.restarts == 1 and remote.fault_failed_requests == 1
        again, outs = _collect(remote, "after", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True))
        assert again.wait(60) and outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 4
    finally:
        remote.shutdown(30)


def test_past_its_restart_budget_the_replica_fails_for_good(config):
    """engine_restarts=0: the first fault spends the budget; the replica then refuses as a broken
    engine does (EngineFailedError, whose reason names the budget)."""
    from splitfuse.errors import EngineFailedError

    remote = RemoteEngine(config, server=ServerConfig(engine_restarts=0), name="test")
    first = remote.start()
    try:
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while remote.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.failure is not None and "engine_restarts=0" in remote.failure
        with pytest.raises(EngineFailedError):
            remote.submit("late", [1, 2, 3], SamplingParams(max_tokens=2), lambda out: None)
        assert remote.restarts == 0
    finally:
        remote.shutdown(30)


def test_a_stream_rebuilds_outputs_from_deltas_and_takes_the_final_text():
    from splitfuse.engine.wire import Stream

    stream = Stream()
    first = stream.apply(("r", [5, 6], "ab", False, None, None, [-0.1, -0.2], None, 3, [1, 2], None, None))
    assert (first.prompt_token_ids, first.token_ids, first.text, first.num_cached_tokens) == ([1, 2], [5, 6], "ab", 3)
    assert first.is_first and first.logprobs == [-0.1, -0.2]
    # The final record's text is the whole text (a stop string may cut what the deltas carried).
    last = stream.apply(("r", [7], "c</s", True, "stop", None, [-0.3], None, 3, None, "abc", None))
    assert (last.token_ids, last.text, last.logprobs, last.finish_reason) == ([5, 6, 7], "abc", [-0.1, -0.2, -0.3],
                                                                              "stop")
    assert not last.is_first and last.delta_token_ids == [7]
    assert first.token_ids == [5, 6] and first.text == "ab"  # an earlier output keeps its own length

"""Tensor parallelism with the engine in its own process (issue 59): rank 0 is the engine process
(RemoteEngine's child), rank 1 that process's child. One engine start serves every test here
(each leaves it serving): its greedy outputs equal the single-rank engine's; a SIGKILL of the
engine process ends its requests with ENGINE_FAULT at once, takes rank 1 with it and a new pair
serves; a hung rank 1 (SIGSTOP) ends the requests with an error naming the tensor-parallel rank
within tensor_parallel_timeout_s, and a new pair serves.

The bounds below are liveness checks (the error comes at all, instead of a wedged replica), set
with room for a loaded 2-core machine; they say nothing about speed."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from splitfuse import LLM
from splitfuse.config import EngineConfig, ServerConfig
from splitfuse.engine.core_process import ENGINE_TEST_HOOK
from splitfuse.engine.remote import RemoteEngine
from splitfuse.engine.sequence import RequestOutput, SamplingParams
from splitfuse.errors import ENGINE_FAULT

from process_waits import alive, wait_until
from test_remote_engine import SLOW_HOOK  # 20 ms a step: generations still stream when the fault comes

PROMPTS = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12], [7] * 20]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TP_TIMEOUT_S = 3.0
RESTART_S = 90.0  # a new interpreter imports torch and builds two ranks, on a busy machine
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=128, num_threads=1)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """The in-process single-rank engine's greedy tokens."""
    with LLM(tiny_llama, **ENGINE) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def remote(tiny_llama, tmp_path_factory):
    hook = tmp_path_factory.mktemp("tp_hook") / "slow_hook.py"
    hook.write_text(SLOW_HOOK)
    saved = os.environ.get(ENGINE_TEST_HOOK)
    os.environ[ENGINE_TEST_HOOK] = f"{hook}:slow"  # read by each engine process as it starts
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, tensor_parallel_timeout_s=TP_TIMEOUT_S, **ENGINE)
    engine = RemoteEngine(config, server=ServerConfig(stream_interval=1), name="tp-test")
    try:
        engine.start()
        yield engine
    finally:
        engine.shutdown(30)
        if saved is None:
            os.environ.pop(ENGINE_TEST_HOOK, None)
        else:
            os.environ[ENGINE_TEST_HOOK] = saved


def _children(pid: int) -> list[int]:
    pids = []
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(p) for p in tasks.read_text().split()]
        except OSError:
            pass
    return pids


def _rank_pids(engine_pid: int) -> list[int]:
    """The tensor-parallel rank processes the engine process started."""
    ranks = []
    for pid in _children(engine_pid):
        try:
            if b"splitfuse.parallel.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            pass
    return ranks




def _serving_pair(engine: RemoteEngine) -> tuple[int, int]:
    """(engine process pid, its rank-1 pid) once the replica serves."""
    assert engine.wait_serving(RESTART_S) and engine.failure is None
    pid = engine.engine_pid
    assert pid is not None
    assert wait_until(lambda: len(_rank_pids(pid)) == 1, 10), _children(pid)
    return pid, _rank_pids(pid)[0]


def _submit(engine: RemoteEngine, request_id: str, prompt: list[int], params: SamplingParams,
            finals: dict[str, RequestOutput], streaming: threading.Event, done: threading.Event, count: int) -> None:
    def on_output(out: RequestOutput) -> None:
        if out.delta_token_ids:
            streaming.set()
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == count:
                done.set()

    engine.submit(request_id, prompt, params, on_output)


def _greedy(engine: RemoteEngine, tag: str) -> list[list[int]]:
    finals: dict[str, RequestOutput] = {}
    streaming, done = threading.Event(), threading.Event()
    for i, prompt in enumerate(PROMPTS):
        _submit(engine, f"{tag}{i}", prompt, GREEDY, finals, streaming, done, len(PROMPTS))
    assert done.wait(60)
    assert all(finals[f"{tag}{i}"].finish_reason == "length" for i in range(len(PROMPTS))), finals
    return [finals[f"{tag}{i}"].token_ids for i in range(len(PROMPTS))]


def _fault_mid_stream(engine: RemoteEngine, tag: str, fault, bound_s: float) -> list[RequestOutput]:
    """Three long generations stream, then `fault()`: their final outputs, within `bound_s`."""
    finals: dict[str, RequestOutput] = {}
    streaming, done = threading.Event(), threading.Event()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(3):
        _submit(engine, f"{tag}{i}", [1, 5 + i, 9, 13], long, finals, streaming, done, 3)
    assert streaming.wait(60)
    fault()
    assert done.wait(bound_s), f"requests still pending {bound_s} s after the fault"
    return list(finals.values())


@pytest.mark.slow  # starts engine processes and their rank processes
def test_greedy_outputs_equal_the_single_rank_engine(remote, reference):
    pid, rank = _serving_pair(remote)
    assert pid != os.getpid() and rank not in _children(os.getpid())
    assert _greedy(remote, "parity") == reference


@pytest.mark.slow  # starts engine processes and their rank processes
def test_a_killed_engine_process_takes_its_rank_and_a_new_pair_serves(remote, reference):
    pid, rank = _serving_pair(remote)
    restarts, failed = remote.restarts, remote.fault_failed_requests
    finals = _fault_mid_stream(remote, "kill", lambda: os.kill(pid, signal.SIGKILL), 5)
    for out in finals:
        assert out.finish_reason == "error" and out.error.startswith(ENGINE_FAULT) and "SIGKILL" in out.error, out
    assert wait_until(lambda: not alive(rank), 5), "rank 1 outlived its engine process"
    new_pid, new_rank = _serving_pair(remote)
    assert new_pid != pid and new_rank != rank
    assert (remote.restarts, remote.fault_failed_requests) == (restarts + 1, failed + 3)
    assert _greedy(remote, "after-kill") == reference


@pytest.mark.slow  # starts engine processes and their rank processes
def test_a_hung_rank_ends_the_requests_naming_it_and_a_new_pair_serves(remote, reference):
    pid, rank = _serving_pair(remote)
    restarts, failed = remote.restarts, remote.fault_failed_requests
    try:
        finals = _fault_mid_stream(remote, "hang", lambda: os.kill(rank, signal.SIGSTOP), TP_TIMEOUT_S + 10)
        for out in finals:  # a fault (UNAVAILABLE, retry), not "serves no more requests"
            assert out.finish_reason == "error" and out.error.startswith(ENGINE_FAULT), out
            assert "tensor-parallel group failed" in out.error and "rank 1" in out.error, out
        new_pid, new_rank = _serving_pair(remote)
        assert new_pid != pid and new_rank != rank
        assert (remote.restarts, remote.fault_failed_requests) == (restarts + 1, failed + 3)
        assert wait_until(lambda: not alive(rank), 10), "the hung rank outlived its engine process"
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGCONT)
            os.kill(rank, signal.SIGKILL)
    assert _greedy(remote, "after-hang") == reference

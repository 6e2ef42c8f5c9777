"""Served with tensor parallelism: a real tritonserver started with `--param tensor_parallel_size=2`
(one Triton instance per tensor-parallel group; its second rank is a process the instance's
engine process starts) answers greedy requests with the tokens of the offline engine with one
rank. Then its second rank is killed: requests fail with an error naming it, the replica starts a
new engine process with a new rank (engine_process, the default), the model stays ready and
serves the same tokens again, and the killed rank is not left behind."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from conftest import ENGINE_PARAMS, offline_greedy, one_instance_server, served_greedy
from triton_helpers import GrpcStream, wait_for

pytestmark = pytest.mark.serving

TP_SETTINGS = {"tensor_parallel_size": "2", "num_threads": "2", "tensor_parallel_timeout_s": "10"}


def _descendants(pid: int) -> dict[int, bytes]:
    """{pid: command line} of every process below `pid`."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = cmdlines.get(child, b"")
            todo.append(child)
    return found


def _ranks(server_pid: int) -> list[int]:
    return [p for p, cmd in _descendants(server_pid).items() if b"splitfuse.parallel.worker" in cmd]


@pytest.fixture(scope="module")
def tp_server(tiny_llama, tmp_path_factory):
    with one_instance_server(tiny_llama, TP_SETTINGS, tmp_path_factory.mktemp("triton-tp")) as (_, server):
        yield server


def test_served_with_two_ranks_matches_one_rank_offline(tp_server, tiny_llama):
    assert len(_ranks(tp_server.process.pid)) == 1, "the instance should have started one more rank"
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 400) for _ in range(n)] for n in (4, 37, 90)]
    one_rank = {**ENGINE_PARAMS, "num_threads": TP_SETTINGS["num_threads"]}
    want = offline_greedy(tiny_llama, one_rank, prompts, max_tokens=12)
    for prompt, expected in zip(prompts, want):
        r = served_greedy(tp_server.grpc_url, prompt, max_tokens=12)
        assert r.error is None, r.error
        assert r.output_ids == expected


def test_killed_rank_fails_requests_and_a_new_engine_process_serves(tp_server, tiny_llama):
    client = grpcclient.InferenceServerClient(tp_server.grpc_url)
    assert client.is_model_ready("llm")
    [rank] = _ranks(tp_server.process.pid)
    with GrpcStream(tp_server.grpc_url) as stream:
        stream.send("llm", {"input_ids": [1, 5, 9], "max_tokens": 400, "ignore_eos": True, "stream": True},
                    dtypes={"input_ids": "INT32"})
        assert stream.next()[1] is None  # generating
        os.kill(rank, signal.SIGKILL)
        result = stream.collect(timeout=120)  # a hang fails here, not forever
    assert result.error is not None and "rank 1" in result.error and "exited with code -9" in result.error, result
    # A new engine process (its ranks were lost, not its bookkeeping) with a new rank 1.
    assert wait_for(lambda: _ranks(tp_server.process.pid) not in ([], [rank]), timeout=120), "no new rank started"
    assert len(_ranks(tp_server.process.pid)) == 1 and client.is_model_ready("llm")
    prompt = [1, 17, 30, 44, 2, 3]
    one_rank = {**ENGINE_PARAMS, "num_threads": TP_SETTINGS["num_threads"]}
    [expected] = offline_greedy(tiny_llama, one_rank, [prompt], max_tokens=12)
    # UNAVAILABLE ("restarting; retry") until the new engine process says it serves.
    served = wait_for(lambda: (r := served_greedy(tp_server.grpc_url, prompt, max_tokens=12)).error is None and r,
                      timeout=120, interval=0.5)
    assert served and served.output_ids == expected

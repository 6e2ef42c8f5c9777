"""Tensor-parallel ranks as processes: started apart through torchrun's variables, and failing.

A tensor-parallel rank that dies or hangs fails the engine with a clear error within the
configured bound (`tensor_parallel_timeout_s`), never a hang; no rank process outlives its
engine or the process that started it.

The bounds below are liveness checks (the error comes at all, instead of a wedged engine), set
at several times the configured timeout; they say nothing about speed."""

import os
import subprocess
import sys
import textwrap

import pytest

from splitfuse import LLMEngine
from splitfuse.config import EngineConfig
from splitfuse.engine.loop import EngineLoop

from process_waits import alive, wait_until
from rank_processes import greedy, kill_a_rank_mid_generation, stop_a_rank_mid_step, worker_pids

TIMEOUT_S = 5.0
# Liveness bound of each wait below: the configured timeout plus room for a loaded machine.
BOUND_S = 4 * TIMEOUT_S + 10


def _config(path: str, **overrides) -> EngineConfig:
    values = dict(dtype="float32", tensor_parallel_size=2, num_kv_blocks=256, block_size=4,
                  tensor_parallel_timeout_s=TIMEOUT_S, num_threads=2)
    return EngineConfig(model=path, **(values | overrides))


@pytest.mark.slow  # starts rank processes
def test_killed_rank_fails_the_served_engine_and_every_request(tiny_llama):
    """SIGKILL rank 1 mid-generation under EngineLoop (what the Triton model runs): every request
    ends with an error naming the rank, the loop is broken (so the model reports not ready) and
    no process is left once it shuts down."""
    loop = EngineLoop(_config(tiny_llama))
    loop.start()
    for out in kill_a_rank_mid_generation(loop, BOUND_S):
        assert "rank 1" in out.error and "exited with code -9" in out.error, out.error
    assert loop.failure is not None and "tensor-parallel" in loop.failure


@pytest.mark.slow  # starts rank processes
def test_hung_rank_fails_the_step_within_the_timeout(tiny_llama):
    """A rank that stops answering (SIGSTOP) fails the step at the all-reduce timeout; later steps
    fail at once; shutdown leaves no process behind. The error names the rank whichever wait ran
    out: the send of the step names it, a collective's timeout does not (the leader adds it)."""
    message = stop_a_rank_mid_step(LLMEngine(_config(tiny_llama)), BOUND_S)
    assert "tensor-parallel group failed" in message and "rank 1" in message, message


@pytest.mark.slow  # starts rank processes
def test_ranks_leave_with_their_parent(tiny_llama, tmp_path):
    """The engine's process killed with SIGKILL (no shutdown runs): its ranks exit on their own."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from splitfuse import LLM
        llm = LLM({tiny_llama!r}, dtype="float32", tensor_parallel_size=2, num_kv_blocks=16, num_threads=2)
        print("READY", flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        ranks = worker_pids(proc.pid)
        assert len(ranks) == 1
    finally:
        proc.kill()
        proc.wait()
    # Orphaned, the rank is re-parented (to init); it must notice and exit.
    assert wait_until(lambda: not alive(ranks[0]), BOUND_S), "a rank outlived its engine's process"


def test_shapes_that_do_not_split_are_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLMEngine(_config(tiny_llama, tensor_parallel_size=3))
    assert not worker_pids()


@pytest.mark.parametrize("bad", [dict(tensor_parallel_size=0), dict(tensor_parallel_timeout_s=0),
                                 dict(tensor_parallel_launch="mpi")])
def test_config_rejects_bad_tensor_parallel_values(tiny_llama, bad):
    with pytest.raises(ValueError):
        EngineConfig(model=tiny_llama, **bad)


@pytest.mark.slow  # starts rank processes
def test_ranks_started_apart_meet_through_env_variables(tiny_llama, monkeypatch):
    """tensor_parallel_launch="env": rank 1 started on its own (as torchrun would, possibly on
    another machine) with MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK, the engine as rank 0;
    rank 1 takes its config from rank 0, the tokens equal one rank's, and it exits cleanly when
    the engine shuts down."""
    from splitfuse.utils.ports import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    rank1 = subprocess.Popen([sys.executable, "-m", "splitfuse.parallel.worker"], env=dict(env, RANK="1"))
    try:
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.setenv("RANK", "0")
        prompts = [[1, 5, 9], [1, 17, 30, 44, 2, 3], [1] + list(range(10, 40))]
        engine = LLMEngine(_config(tiny_llama, tensor_parallel_launch="env"))
        try:
            assert engine.runner.leader.processes == []  # nothing spawned: rank 1 came on its own
            two = greedy(engine, prompts)
        finally:
            engine.shutdown()
        assert rank1.wait(30) == 0
        one = greedy(LLMEngine(_config(tiny_llama, tensor_parallel_size=1, num_threads=1)), prompts)
        assert two == one
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()

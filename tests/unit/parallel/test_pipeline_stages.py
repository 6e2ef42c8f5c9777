"""Pipeline stages as processes: a stage that dies or hangs fails the engine with an error naming
its stage and rank within `tensor_parallel_timeout_s`, never a hang, and no rank outlives the
engine; a stage started apart (torchrun's variables) meets the engine; the configurations not
built are refused before any rank starts; pp=2 x tp=2 (four ranks) gives one rank's tokens,
and so does n-gram speculation over two stages.

The bounds below are liveness checks (the error comes at all, instead of a wedged engine), set
at several times the configured timeout; they say nothing about speed."""

import json
import os
import re
import subprocess
import sys

import pytest

from splitfuse import LLMEngine, SamplingParams
from splitfuse.config import EngineConfig
from splitfuse.engine.loop import EngineLoop
from rank_processes import greedy, kill_a_rank_mid_generation, stop_a_rank_mid_step, worker_pids

TIMEOUT_S = 3.0
BOUND_S = 4 * TIMEOUT_S + 10


def _config(path: str, **overrides) -> EngineConfig:
    values = dict(dtype="float32", pipeline_parallel_size=2, num_kv_blocks=256, block_size=4,
                  tensor_parallel_timeout_s=TIMEOUT_S, num_threads=2)
    return EngineConfig(model=path, **(values | overrides))


@pytest.mark.slow  # starts rank processes
def test_killed_stage_fails_the_served_engine_and_every_request(tiny_llama):
    """SIGKILL the second stage's rank mid-generation under EngineLoop (what the Triton model
    runs): every request ends with an error naming the rank and its stage, the loop is broken and
    no process is left once it shuts down."""
    loop = EngineLoop(_config(tiny_llama))
    loop.start()
    for out in kill_a_rank_mid_generation(loop, BOUND_S):
        assert "rank 1 (stage 1)" in out.error and "exited with code -9" in out.error, out.error
    assert loop.failure is not None and "pipeline-parallel group failed" in loop.failure


@pytest.mark.slow  # starts rank processes
def test_hung_stage_fails_the_step_within_the_timeout(tiny_llama):
    """The second stage stops answering (SIGSTOP): the step fails when rank 0's wait on it (its
    tokens of the step in flight, or taking the next step) runs out of time, naming its rank and
    stage; later steps fail at once; shutdown leaves no process behind."""
    message = stop_a_rank_mid_step(LLMEngine(_config(tiny_llama)), BOUND_S)
    assert "pipeline-parallel group failed" in message
    assert re.search(r"rank 1 \(pipeline stage 1\) took no step message within 3 s|"
                     r"pipeline stage 1 \(rank 1\) sent no sampled tokens within tensor_parallel_timeout_s=3 s",
                     message), message


@pytest.mark.slow  # four rank processes
def test_two_stages_of_two_ranks_match_one_rank(tiny_model_factory):
    """pp=2 x tp=2: each stage's all-reduces within its own two ranks, hidden states from each
    tensor-parallel rank to its peer in the next stage; greedy tokens equal one rank's."""
    path = tiny_model_factory("llama", num_hidden_layers=3)
    vocab = json.loads(open(f"{path}/config.json").read())["vocab_size"]
    prompts = [[1, 5, 9], [1, 17, 30, 44, 2, 3], [1] + [(7 * i) % (vocab - 3) + 3 for i in range(30)]]
    grid = LLMEngine(_config(path, tensor_parallel_size=2, token_budget=16, num_threads=1))
    try:
        group = grid.runner.group
        assert (group.world_size, group.tp_size, group.stage, group.tp_rank) == (4, 2, 0, 0)
        four = greedy(grid, prompts)
    finally:
        grid.shutdown()
    assert not worker_pids()
    one = greedy(LLMEngine(_config(path, pipeline_parallel_size=1, token_budget=16, num_threads=1)), prompts)
    assert four == one


@pytest.mark.slow  # starts a rank process
def test_a_stage_started_apart_meets_the_engine_through_env_variables(tiny_llama, monkeypatch):
    """tensor_parallel_launch="env" (what deploy/k8s/multinode and torchrun on other machines use):
    the second stage started on its own with MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK takes
    its config from rank 0, gives one stage's tokens and exits cleanly at shutdown."""
    from splitfuse.utils.ports import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    stage1 = subprocess.Popen([sys.executable, "-m", "splitfuse.parallel.worker"], env=dict(env, RANK="1"))
    try:
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.setenv("RANK", "0")
        prompts = [[1, 5, 9], [1] + list(range(10, 40))]
        engine = LLMEngine(_config(tiny_llama, tensor_parallel_launch="env"))
        try:
            assert engine.runner.leader.processes == []
            two = greedy(engine, prompts)
        finally:
            engine.shutdown()
        assert stage1.wait(30) == 0
        assert two == greedy(LLMEngine(_config(tiny_llama, pipeline_parallel_size=1, num_threads=1)), prompts)
    finally:
        if stage1.poll() is None:
            stage1.kill()
            stage1.wait()


def test_more_stages_than_layers_are_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLMEngine(_config(tiny_llama, pipeline_parallel_size=3))
    assert not worker_pids()


@pytest.mark.parametrize("bad, match", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be"),
    (dict(lora_load_dir="/tmp"), "lora_load_dir cannot be combined with pipeline_parallel_size > 1"),
    (dict(kv_cache_memory_gb="auto"), "kv_cache_memory_gb=auto cannot be combined with .*pipeline_parallel_size"),
    (dict(quantization="q4_0", tensor_parallel_size=2), "quantization='q4_0' cannot run with tensor_parallel_size > 1"),
])
def test_config_refuses_what_pipeline_parallelism_does_not_build(tiny_llama, bad, match):
    with pytest.raises(ValueError, match=match):
        _config(tiny_llama, **bad)


@pytest.mark.slow  # starts a rank process
def test_two_stages_with_ngram_speculation_match_one_stage(tiny_model_factory):
    """n-gram speculation under pipeline parallelism: the proposals ride in the step's batch, the
    last stage returns the logits of every verified row and rank 0 verifies them; greedy tokens
    equal one stage's with speculation, and proposals are accepted (repetitive prompts)."""
    path = tiny_model_factory("llama", num_hidden_layers=3)
    prompts = [[1] + [5, 6, 7, 8] * 6, [1] + [9, 10, 11] * 8 + [9]]
    spec = dict(dtype="float32", token_budget=12, block_size=4, num_kv_blocks=64, num_threads=2,
                speculative_method="ngram", num_speculative_tokens=3)

    def run(engine: LLMEngine) -> tuple[list[list[int]], int]:
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=16, temperature=0.0))
        out, accepted = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
            accepted += engine.last_step.spec_accepted_tokens if engine.last_step else 0
        return [out[f"s{i}"] for i in range(len(prompts))], accepted

    pp2 = LLMEngine(EngineConfig(model=path, pipeline_parallel_size=2, **spec))
    try:
        two, accepted = run(pp2)
    finally:
        pp2.shutdown()
    one, _ = run(LLMEngine(EngineConfig(model=path, **(spec | dict(num_threads=1)))))
    assert two == one
    assert accepted > 0, "the repetitive prompts were meant to have proposals accepted"


@pytest.mark.slow  # starts rank processes
def test_two_steps_are_in_flight_and_a_split_prompt_goes_on_while_its_chunk_is(tiny_model_factory):
    """With two stages two steps are in the pipe at once (pipeline_steps_in_flight defaults to the
    stage count): a step is scheduled while the one before it is in flight, takes the sequences not
    waiting on its token, and goes on with a prompt being split (its previous chunk still in the
    pipe); greedy tokens equal one step at a time (each step cut into two micro-batches) and one
    stage's."""
    path = tiny_model_factory("llama", num_hidden_layers=3)
    spec = dict(dtype="float32", token_budget=12, block_size=4, num_kv_blocks=64)
    prompts = {"long": [1] + [3 + i % 400 for i in range(57)], "a": [1, 5, 6, 7], "b": [1, 9, 10], "c": [1, 11]}

    def run(engine: LLMEngine) -> tuple[dict, list[tuple[set, int]], int]:
        schedules: list[tuple[set, int]] = []
        schedule, launch = engine.scheduler.schedule, engine.runner.launch

        def recording(*args, **kwargs):
            out = schedule(*args, **kwargs)
            schedules.append(({c.seq.request_id for c in out.chunks}, engine.num_steps_in_flight))
            return out

        def launching(batch):
            parts.append(len(batch.parts) if hasattr(batch, "parts") else 1)
            return launch(batch)

        parts: list[int] = []
        engine.scheduler.schedule, engine.runner.launch = recording, launching
        try:
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            tokens: dict = {}
            while engine.has_unfinished_requests():
                tokens.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            assert engine.blocks.num_used_blocks == 0 and engine.num_steps_in_flight == 0
        finally:
            engine.shutdown()
        return tokens, schedules, max(parts)

    overlapped, schedules, overlapped_parts = run(LLMEngine(EngineConfig(model=path, pipeline_parallel_size=2, num_threads=2, **spec)))
    serial, serial_schedules, serial_parts = run(LLMEngine(EngineConfig(model=path, pipeline_parallel_size=2, num_threads=2,
                                                          pipeline_steps_in_flight=1, **spec)))
    one, _, _ = run(LLMEngine(EngineConfig(model=path, num_threads=1, **spec)))
    assert overlapped == serial == one
    # One step at a time, a step is cut into a micro-batch per stage; two in flight, not.
    assert (serial_parts, overlapped_parts) == (2, 1)
    assert max(in_flight for _, in_flight in schedules) == 1  # one step in the pipe as the next is scheduled
    assert max(in_flight for _, in_flight in serial_schedules) == 0
    assert any("long" in ids and "long" in schedules[k - 1][0] and in_flight == 1
               for k, (ids, in_flight) in enumerate(schedules) if k), "the split prompt was meant to go on in flight"

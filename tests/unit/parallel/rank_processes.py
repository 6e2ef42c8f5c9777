"""The rank processes of the tensor-parallel and pipeline tests: finding them, watching them,
killing or stopping one mid-generation, and the greedy tokens of an engine over them."""

import os
import signal
import threading
from pathlib import Path

import pytest
from process_waits import alive

from splitfuse import LLMEngine, SamplingParams
from splitfuse.engine.loop import EngineLoop
from splitfuse.errors import EngineFailedError
from splitfuse.engine.sequence import RequestOutput
from splitfuse.errors import FatalEngineError


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Each prompt's greedy tokens, stepping the engine until all are done."""
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[f"g{i}"] for i in range(len(prompts))]


def worker_pids(parent: int | None = None) -> list[int]:
    """Processes running a tensor-parallel rank, children of `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"splitfuse.parallel.worker" in cmdline:
            pids.append(int(entry.name))
    return pids




def kill_a_rank_mid_generation(loop: EngineLoop, bound_s: float) -> list[RequestOutput]:
    """SIGKILL the loop's first other rank once three long generations stream: each ends with an
    error within `bound_s`, the loop refuses what comes next, and it shuts down leaving no rank
    process. Returns the three final outputs (the caller checks what their errors name)."""
    worker = loop.engine.runner.leader.processes[0]
    finals: dict[str, RequestOutput] = {}
    first_token = threading.Event()
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.delta_token_ids:
            first_token.set()
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == 3:
                done.set()

    for i in range(3):
        loop.submit(f"r{i}", [1, 5 + i, 9, 13], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                    on_output)
    assert first_token.wait(60)
    os.kill(worker.pid, signal.SIGKILL)
    assert done.wait(bound_s), "requests still pending after a rank was killed"
    assert all(out.finish_reason == "error" for out in finals.values()), finals
    with pytest.raises(EngineFailedError):
        loop.submit("late", [1, 2, 3], SamplingParams(max_tokens=2), on_output)
    loop.shutdown(timeout=bound_s)
    assert not worker_pids()
    return list(finals.values())


def stop_a_rank_mid_step(engine: LLMEngine, bound_s: float) -> str:
    """SIGSTOP the engine's first other rank after a step: the next step fails with a
    FatalEngineError within `bound_s`, later steps fail at once, and shutdown leaves no rank
    process. Returns the failed step's message."""
    worker = engine.runner.leader.processes[0]
    engine.add_request("a", [1, 7, 8, 9], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        result: dict = {}

        def step() -> None:
            try:
                engine.step()
            except BaseException as e:
                result["error"] = e

        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(bound_s)
        assert not thread.is_alive(), "a step with a stopped rank did not end"
        assert isinstance(result.get("error"), FatalEngineError), result
        with pytest.raises(FatalEngineError):
            engine.step()
    finally:
        if alive(worker.pid):
            os.kill(worker.pid, signal.SIGCONT)
    engine.shutdown()
    assert not alive(worker.pid) and not worker_pids()
    return str(result["error"])

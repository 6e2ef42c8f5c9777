"""The rank processes of the tensor-parallel and pipeline tests: finding them, watching them, and
the greedy tokens of an engine over them."""

import os
import time
from pathlib import Path

from splitfuse import LLMEngine, SamplingParams


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


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()

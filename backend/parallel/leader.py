"""Rank 0's side of tensor and pipeline parallelism: starting the other ranks, sending them
each step, noticing when one of them died or hangs, and stopping them.

The engine (scheduler, block manager, sampler) runs on rank 0 only. Each step rank 0 sends
the step's batch to every rank, then every rank runs its part of the forward pass (its shard of
its stage's layers); the all-reduces and stage-to-stage transfers inside it are bounded by
`tensor_parallel_timeout_s`. Any failure there leaves the ranks out of step for good, so it is
fatal: the other ranks are killed and `FatalEngineError` is raised (and raised again by every
later step).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from typing import Callable

import torch

from splitfuse.config import EngineConfig
from splitfuse.errors import FatalEngineError
from splitfuse.parallel.group import RankGroup, StepSendError, join
from splitfuse.utils.ports import free_port
from splitfuse.parallel.step_message import StepMessage, to_device
from splitfuse.utils.children import python_executable

log = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


class RankFailedError(FatalEngineError):
    """A rank died, hangs, or its collective or transfer failed."""


class Leader:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """Start (spawn) or meet (env) the other ranks, send them `config` (rank 0's, with the
        KV block count resolved, so every rank builds the same cache) and build the all-reduce
        group."""
        self.tp_size = config.tensor_parallel_size
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        # The failure messages' name for the group (tests and operators grep for it).
        self.kind = "tensor-parallel" if config.pipeline_parallel_size == 1 else "pipeline-parallel"
        self.timeout_s = config.tensor_parallel_timeout_s
        self.processes: list[subprocess.Popen] = []
        self.failure: str | None = None
        self.send_s = 0.0
        """Time spent sending steps to the other ranks, for benchmarks."""
        self._closed = False
        if config.tensor_parallel_launch == "spawn":
            addr, port = "127.0.0.1", free_port()
            self.processes = _spawn_workers(self.world_size, addr, port)
        else:
            addr, port = _env_rendezvous(self.world_size)
        self.group: RankGroup | None = None
        try:
            self.group = join(0, self.world_size, addr, port, check=self.check_alive)
            self.group.broadcast(config)
            self.group.open_compute(device, config.tensor_parallel_timeout_s, self.tp_size)
        except BaseException:
            self._kill_workers()
            if self.group is not None:
                self.group.destroy()
            raise

    # ---- steps ----------------------------------------------------------------------------
    def run_step(self, forward: Callable, batch, wait: bool = True):
        """Send `batch` to the other ranks and run rank 0's part, `forward(batch)`. With
        `wait=False` the step message's sends are waited for at the next one (a pipeline stage
        still running an earlier step takes it when done)."""

        def step():
            self.check_alive()
            start = time.perf_counter()
            self.group.broadcast(StepMessage("step", to_device(batch, torch.device("cpu"))), self.timeout_s, wait)
            self.send_s += time.perf_counter() - start
            return forward(batch)

        return self.guard(step)

    def check(self) -> None:
        """Raise RankFailedError when the group has failed (every step after the failure does)."""
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def guard(self, fn: Callable):
        """`fn()`, rank 0's part of a step; its failure (or any earlier one) fails the group."""
        self.check()
        try:
            return fn()
        except Exception as e:
            self._fail(e)
            raise RankFailedError(self.failure) from e

    def check_alive(self) -> None:
        """Raise RankFailedError when a spawned rank has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise RankFailedError(f"{self.kind} {self._name(rank)} (pid {process.pid}) exited with code "
                                      f"{process.returncode}")

    def _name(self, rank: int) -> str:
        """"rank r", with its pipeline stage when there are several."""
        return f"rank {rank}" + (f" (stage {rank // self.tp_size})" if self.tp_size < self.world_size else "")

    def _fail(self, error: BaseException) -> None:
        # A rank killed mid-step shows up at rank 0 as a closed connection; give its exit a
        # moment to be recorded so the message names it.
        for process in self.processes:
            _wait(process, 0.5)
        named = [f"{self._name(r)} (pid {p.pid}) exited with code {p.returncode}"
                 for r, p in enumerate(self.processes, start=1) if p.poll() is not None]
        if not named and self.processes and not isinstance(error, StepSendError):
            # A collective's timeout names no rank: the hung one is among those still running.
            named = ["still running: " + ", ".join(f"{self._name(r)} (pid {p.pid})"
                                                   for r, p in enumerate(self.processes, start=1))]
        # gloo's messages go on with generic advice after their first sentence.
        first_line = str(error).splitlines()[0].split(" This is typically")[0] if str(error) else ""
        cause = f"{type(error).__name__}: {first_line}"
        self.failure = (f"{self.kind} group failed (a rank died, or gave no answer within "
                        f"tensor_parallel_timeout_s={self.timeout_s:g} s): "
                        + ("; ".join(named) + "; " if named else "") + cause)[:500]
        log.error("splitfuse: %s; stopping the other ranks", self.failure)
        self._kill_workers()

    # ---- shutdown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the other ranks (asking first when they are healthy) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                self.group.broadcast(StepMessage("stop"), self.timeout_s)
            except Exception:
                log.exception("splitfuse: could not send stop to the %s ranks", self.kind)
        for process in self.processes:
            _wait(process, _STOP_GRACE_S)
        self._kill_workers()
        self.group.destroy()

    def abort(self, reason: str) -> None:
        """Stop the other ranks without asking (they may be inside a collective)."""
        if self.failure is None:
            self.failure = reason
        self.shutdown()

    def _kill_workers(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            _wait(process, _STOP_GRACE_S)


def _spawn_workers(world_size: int, addr: str, port: int) -> list[subprocess.Popen]:
    """One fresh interpreter per rank running `python -m splitfuse.parallel.worker`, given the
    rendezvous as torchrun would give it. A fresh interpreter rather than a multiprocessing
    child: a spawned child re-runs the parent's `__main__` (a user's script without a main
    guard would start engines recursively) and, inside Triton's Python backend, sys.executable
    is the backend stub, not a Python."""
    env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               SPLITFUSE_PARENT_PID=str(os.getpid()))
    env.pop("LOCAL_RANK", None)
    processes = []
    for rank in range(1, world_size):
        env["RANK"] = str(rank)
        processes.append(subprocess.Popen([python_executable(), "-m", "splitfuse.parallel.worker"], env=env,
                                          stdin=subprocess.DEVNULL))
    return processes


def _wait(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def _env_rendezvous(world_size: int) -> tuple[str, int]:
    """MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK as torchrun sets them; the engine is rank 0."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in os.environ]
    if missing:
        raise ValueError(f"tensor_parallel_launch='env' needs {', '.join(missing)} in the environment")
    if int(os.environ["RANK"]) != 0:
        raise ValueError(f"the engine runs on rank 0; RANK={os.environ['RANK']} should run "
                         "`python -m splitfuse.parallel.worker`")
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} != tensor_parallel_size x pipeline_parallel_size "
                         f"= {world_size}")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

"""The ranks of one engine over torch.distributed: rendezvous, the all-reduce, step messages.

The ranks form a grid of pipeline stages by tensor-parallel ranks: rank = stage * tp_size +
tp_rank; rank 0 (stage 0) runs the engine. Process groups:
* `compute` (gloo on CPU, NCCL on CUDA), one per stage over its tp_size ranks, carries the
  layers' all-reduces, with the engine's `tensor_parallel_timeout_s`: a rank that died or hangs
  turns into an error within that bound.
* `p2p` (same backend and bound, every rank; with more than one stage) carries the hidden states
  from stage to stage and the logits back to rank 0 (parallel/pipeline.py).
* the default group (gloo, CPU) carries rank 0's step messages (pickled objects). Between steps
  the other ranks wait on it for as long as the server is idle, so its timeout is long; they
  leave when rank 0's connection closes (or, when spawned, when their parent dies).

Rendezvous goes through a TCPStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT; rank 0 waits
for the others in short slices so that a rank that failed to start is noticed (`check` raises)
rather than waited on.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

# How long the other ranks may wait for rank 0's next step (an idle server sends none).
IDLE_TIMEOUT = timedelta(days=365)
_ARRIVED_KEY = "splitfuse/arrived/{}"


class StepSendError(RuntimeError):
    """Rank 0 could not hand a step message to a rank within the bound (it hangs or is gone)."""


@dataclass
class RankGroup:
    rank: int
    world_size: int
    compute: Any = None  # this stage's all-reduce process group (`open_compute`)
    p2p: Any = None  # the stage-to-stage process group (`open_compute`, with more than one stage)
    tp_size: int = 0
    """Ranks per pipeline stage (`open_compute`; until then all of them)."""
    all_reduce_s: float = 0.0
    """Time spent in all-reduces (moving data, and waiting for the slowest rank), for benchmarks."""
    all_reduce_calls: int = 0
    _sends: list = field(default_factory=list)
    """Rank 0's sends of its last broadcast not yet waited for: (rank, work, tensor)."""

    @property
    def stage(self) -> int:
        return self.stage_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % (self.tp_size or self.world_size)

    def open_compute(self, device: torch.device, timeout_s: float, tp_size: int | None = None) -> None:
        """Build the stages' all-reduce groups of `tp_size` ranks each (default: one stage) and,
        with more than one stage, the stage-to-stage group. Collective: every rank calls it, once
        it knows the config, and creates every group in the same order (keeping its own)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        self.tp_size = tp_size or self.world_size
        for stage in range(self.world_size // self.tp_size):
            ranks = list(range(stage * self.tp_size, (stage + 1) * self.tp_size))
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if stage == self.stage:
                self.compute = group
        if self.tp_size < self.world_size:
            self.p2p = dist.new_group(list(range(self.world_size)), timeout=timeout, backend=backend)

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        start = time.perf_counter()
        dist.all_reduce(t, group=self.compute)
        self.all_reduce_s += time.perf_counter() - start
        self.all_reduce_calls += 1
        return t

    def broadcast(self, obj: Any = None, timeout_s: float | None = None, wait: bool = True) -> Any:
        """Rank 0's `obj`, on every rank (pickled, sent to each rank point to point over the
        default group). On rank 0 the sends wait at most `timeout_s` (a gloo send waits for the
        receiver, so a hung rank would otherwise hold it for the group's long idle timeout), and
        one that runs out names its rank; the others wait for it unbounded. With `wait=False`
        rank 0 goes on at once: the sends are waited for at its next broadcast (or `settle`),
        so a pipeline stage still busy with an earlier step takes the message when it is done."""
        if self.rank != 0:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src=0)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, src=0)
            return pickle.loads(data.numpy().tobytes())
        self.settle(timeout_s)
        payload = pickle.dumps(obj)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        # The tensors must live until their sends are done.
        self._sends = [(r, dist.isend(t, r), t) for r in range(1, self.world_size) for t in (size, data)]
        if wait:
            self.settle(timeout_s)
        return obj

    def settle(self, timeout_s: float | None = None) -> None:
        """On rank 0: wait for the last broadcast's sends, at most `timeout_s` in all."""
        sends, self._sends = self._sends, []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for r, work, _ in sends:
            try:
                if deadline is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
            except Exception as e:
                several = self.tp_size and self.tp_size < self.world_size
                stage = f" (pipeline stage {self.stage_of(r)})" if several else ""
                raise StepSendError(f"rank {r}{stage} took no step message within {timeout_s:g} s") from e

    def stage_of(self, rank: int) -> int:
        return rank // (self.tp_size or self.world_size)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join(rank: int, world_size: int, master_addr: str, master_port: int, startup_timeout_s: float = 300.0,
         check: Callable[[], None] | None = None) -> RankGroup:
    """Meet the other ranks and build the default group. On rank 0, `check` is called while waiting
    for the others (it raises when one of them has died); the wait is bounded by
    `startup_timeout_s`."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group "
                           "(one parallel engine per process)")
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=startup_timeout_s), wait_for_workers=False)
    store.set(_ARRIVED_KEY.format(rank), "1")
    if rank == 0:
        _wait_for_ranks(store, world_size, startup_timeout_s, check)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    return RankGroup(rank, world_size)


def _wait_for_ranks(store, world_size: int, timeout_s: float, check: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout_s
    keys = [_ARRIVED_KEY.format(r) for r in range(1, world_size)]
    while not store.check(keys):
        if check is not None:
            check()
        time.sleep(0.05)
        if time.monotonic() > deadline:
            raise TimeoutError(f"parallel ranks: not every rank of {world_size} joined within {timeout_s:.0f} s")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's own GPU (LOCAL_RANK under torchrun, else its rank) when `device` names none."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device

"""Ranks 1..N-1 of a tensor- and/or pipeline-parallel group: take rank 0's config, load this
rank's part of the weights (its stage's layers, its shard of them) and KV cache, then run its
part of the forward pass of every step rank 0 sends, until told to stop.

Started by the engine (one process per rank on this machine, which also sets
SPLITFUSE_PARENT_PID so the rank leaves with it), or apart, e.g. by torchrun on other machines:

    MASTER_ADDR=host0 MASTER_PORT=29500 WORLD_SIZE=4 RANK=2 python -m splitfuse.parallel.worker
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from splitfuse.engine.model_runner import ModelRunner
from splitfuse.parallel.group import join
from splitfuse.parallel.step_message import StepMessage, to_device

log = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def serve(rank: int, world_size: int, addr: str, port: int) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    group = join(rank, world_size, addr, port)
    config = group.broadcast()
    runner = ModelRunner(config, group=group)  # opens the all-reduce group, loads the shard, meets the others
    log.info("splitfuse: parallel rank %d/%d (pipeline stage %d) ready (threads=%d)", rank, world_size,
             group.stage, torch.get_num_threads())
    while True:
        message: StepMessage = group.broadcast()
        if message.kind == "stop":
            group.destroy()
            return 0
        runner.run_stage(to_device(message.batch, runner.device))


def _exit_with_parent(parent_pid: int) -> None:
    """No orphans: leave as soon as the process that spawned this one is gone (even killed with
    SIGKILL, when nothing gets to send a stop)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(3)

    threading.Thread(target=watch, name="splitfuse-parent-watch", daemon=True).start()


def main() -> int:
    env = os.environ
    if "SPLITFUSE_PARENT_PID" in env:
        _exit_with_parent(int(env["SPLITFUSE_PARENT_PID"]))
    return serve(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]))


if __name__ == "__main__":
    sys.exit(main())

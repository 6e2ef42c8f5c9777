"""Pipeline parallelism's transfers: a step's hidden states from stage to stage, point to point,
and the sampled tokens from the last stage back to rank 0 (engine/stage_sampling.py: the last
stage samples what rank 0, which keeps the requests' state, describes with each micro-batch).

Each tensor-parallel rank of stage s sends to the same tensor-parallel rank of stage s + 1 (every
rank holds the full hidden state after its stage's all-reduces); the last stage's rank of
tensor-parallel rank 0 sends the sampled tokens. Shapes need no message of their own: every rank
has the step's batch, so it knows the token and sampling-row counts. Sends do not wait: a stage
goes on with its next micro-batch, or its next step, while its output travels, and `flush` waits
for them later (rank 0 when it collects that step's tokens, the other ranks at their next step).
Every wait is bounded by the group's `tensor_parallel_timeout_s`; a failure names the stage and
rank it waited on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from splitfuse.parallel.group import RankGroup


class StageTransferError(RuntimeError):
    """A pipeline stage sent or took nothing within the bound, or its connection closed."""


@dataclass
class StageLink:
    group: RankGroup
    timeout_s: float
    transfer_s: float = 0.0
    """Time spent sending and waiting for hidden states and sampled tokens, for benchmarks."""
    step: int = 0
    """The step the sends are made for (rank 0 numbers its launches: several may be in flight)."""
    _pending: list[tuple[int, Any, torch.Tensor, int, str]] = field(default_factory=list)
    """Sends not yet waited for: (step, work, the tensor it reads, peer, what)."""

    @property
    def _bound(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def num_stages(self) -> int:
        return self.group.world_size // self.group.tp_size

    def _rank(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.group.tp_size + (self.group.tp_rank if tp_rank is None else tp_rank)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        self._send(hidden.contiguous(), self._rank(self.group.stage + 1), "hidden states")

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's output: [num_tokens, hidden_size]."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        self._recv(hidden, self._rank(self.group.stage - 1), "hidden states")
        return hidden

    def send_sampled(self, reply: torch.Tensor) -> None:
        """The last stage's sampled rows (StageSampling.sample's reply), to rank 0."""
        if reply.numel():
            self._send(reply.contiguous(), 0, "sampled tokens")

    def recv_sampled(self, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """On rank 0: the last stage's reply [rows, width] (float64)."""
        reply = torch.empty(rows, width, dtype=torch.float64, device=device)
        if rows:
            self._recv(reply, self._rank(self.num_stages - 1, 0), "sampled tokens")
        return reply

    def flush(self, through: int | None = None) -> None:
        """Wait for the sends of the steps up to `through` (every step's by default) to be taken."""
        due = [through is None or p[0] <= through for p in self._pending]
        done = [p for p, d in zip(self._pending, due) if d]
        self._pending = [p for p, d in zip(self._pending, due) if not d]
        for _, work, _, peer, what in done:
            self._wait(lambda: work.wait(self._bound), "took no", peer, what)

    def _send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        work = self._wait(lambda: dist.isend(tensor, peer, group=self.group.p2p), "took no", peer, what)
        self._pending.append((self.step, work, tensor, peer, what))  # the tensor must live until the send is done

    def _recv(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        self._wait(lambda: dist.irecv(tensor, peer, group=self.group.p2p).wait(self._bound), "sent no", peer, what)

    def _wait(self, op: Callable[[], Any], verb: str, peer: int, what: str) -> Any:
        """`op()` (its waits bounded by timeout_s), its time counted, its failure naming `peer`."""
        start = time.perf_counter()
        try:
            return op()
        except Exception as e:  # gloo: a timeout or a closed connection
            stage = peer // self.group.tp_size
            first_line = str(e).splitlines()[0].split(" This is typically")[0] if str(e) else type(e).__name__
            raise StageTransferError(f"pipeline stage {stage} (rank {peer}) {verb} {what} within "
                                     f"tensor_parallel_timeout_s={self.timeout_s:g} s or closed: {first_line}") from e
        finally:
            self.transfer_s += time.perf_counter() - start

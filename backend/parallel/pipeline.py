"""Pipeline parallelism's transfers: a step's hidden states from stage to stage, point to point,
and the sampling rows' logits from the last stage back to rank 0 (which samples: the sampler's
per-request state, grammar masks and speculation's verification live there with the scheduler).

Each tensor-parallel rank of stage s sends to the same tensor-parallel rank of stage s + 1 (every
rank holds the full hidden state after its stage's all-reduces); the last stage's rank of
tensor-parallel rank 0 sends the logits. Shapes need no message of their own: every rank has the
step's batch, so it knows the token and sampling-row counts. Every wait is bounded by the
group's `tensor_parallel_timeout_s`; a failure names the stage and rank it waited on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    """Time spent sending and waiting for hidden states and logits, for benchmarks."""

    @property
    def num_stages(self) -> int:
        return self.group.world_size // self.group.tp_size

    def _rank(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.group.tp_size + (self.group.tp_rank if tp_rank is None else tp_rank)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        self._move("send", hidden.contiguous(), self._rank(self.group.stage + 1), "hidden states")

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's output: [num_tokens, hidden_size]."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        self._move("recv", hidden, self._rank(self.group.stage - 1), "hidden states")
        return hidden

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's float32 logits of the sampling rows, to rank 0."""
        if logits.numel():
            self._move("send", logits.contiguous(), 0, "logits")

    def recv_logits(self, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """On rank 0: the last stage's logits [rows, vocab_size] (float32)."""
        logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        if rows:
            self._move("recv", logits, self._rank(self.num_stages - 1, 0), "logits")
        return logits

    def _move(self, direction: str, tensor: torch.Tensor, peer: int, what: str) -> None:
        start = time.perf_counter()
        try:
            op = dist.isend if direction == "send" else dist.irecv
            op(tensor, peer, group=self.group.p2p).wait()
        except Exception as e:  # gloo: a timeout or a closed connection
            stage = peer // self.group.tp_size
            first_line = str(e).splitlines()[0].split(" This is typically")[0] if str(e) else type(e).__name__
            verb = "took no" if direction == "send" else "sent no"
            raise StageTransferError(f"pipeline stage {stage} (rank {peer}) {verb} {what} within "
                                     f"tensor_parallel_timeout_s={self.timeout_s:g} s or closed: {first_line}") from e
        finally:
            self.transfer_s += time.perf_counter() - start

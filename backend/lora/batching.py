"""Applying many adapters in one ragged batch, without merging any into the base weights.

Per step the batch says which rows (tokens) each adapter owns (`LoraRows`, built with the
batch). Every adapted projection then adds, per adapter present, `(x[rows] @ A) @ B` to its
base output at those rows: one gather, two small products and one scatter-add per adapter
(S-LoRA / punica's idea, grouped by adapter rather than per token). Rows of sequences without
an adapter get nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitfuse.lora.adapter import LoraAdapter


@dataclass
class LoraRows:
    """The rows of a step's batch each adapter owns (None: every row)."""

    names: list[str]
    rows: list[torch.Tensor | None]
    num_rows: int
    kept_rows: list[torch.Tensor | None] | None
    """The same over the last layer's kept rows (the sample rows), when it keeps fewer rows."""
    num_kept: int

    @classmethod
    def build(cls, seq_names: list[str | None], query_lens: np.ndarray, sample_rows: np.ndarray | None,
              device: torch.device) -> "LoraRows | None":
        """From each sequence's adapter (None: the base) and its rows in the batch; `sample_rows`
        are the last layer's kept rows when it keeps fewer than all. None without any adapter."""
        names = sorted({n for n in seq_names if n is not None})
        if not names:
            return None
        index = {n: i for i, n in enumerate(names)}
        seq_adapter = np.fromiter((-1 if n is None else index[n] for n in seq_names), dtype=np.int64,
                                  count=len(seq_names))
        row_adapter = np.repeat(seq_adapter, query_lens)
        kept = None if sample_rows is None else _groups(row_adapter[sample_rows], len(names), device)
        return cls(names=names, rows=_groups(row_adapter, len(names), device), num_rows=len(row_adapter),
                   kept_rows=kept, num_kept=0 if sample_rows is None else len(sample_rows))


def _groups(row_adapter: np.ndarray, num_adapters: int, device: torch.device) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for i in range(num_adapters):
        rows = np.flatnonzero(row_adapter == i)
        # Every row one adapter's: the projection adds in place, no gather or scatter.
        out.append(None if len(rows) == len(row_adapter) else torch.from_numpy(rows).to(device, non_blocking=True))
    return out


class LoraState:
    """The current step's adapters and their rows, shared by every adapted projection."""

    def __init__(self) -> None:
        self._full: list[tuple[LoraAdapter, torch.Tensor | None]] = []
        self._kept: list[tuple[LoraAdapter, torch.Tensor | None]] = []
        self._num_rows = self._num_kept = 0

    @property
    def active(self) -> bool:
        """Whether the step has any row with an adapter."""
        return bool(self._full)

    def set_step(self, adapters: list[LoraAdapter], rows: LoraRows | None) -> None:
        if rows is None:
            self.clear()
            return
        self._full = [(a, r) for a, r in zip(adapters, rows.rows) if r is None or r.numel()]
        kept = rows.kept_rows or []
        self._kept = [(a, r) for a, r in zip(adapters, kept) if r is None or r.numel()]
        self._num_rows, self._num_kept = rows.num_rows, rows.num_kept

    def clear(self) -> None:
        self._full, self._kept = [], []
        self._num_rows = self._num_kept = 0

    def groups(self, num_rows: int) -> list[tuple[LoraAdapter, torch.Tensor | None]]:
        """The adapters and rows of an input of `num_rows` rows: the step's rows, or (the last
        layer after attention) its kept rows, which are fewer by construction."""
        if num_rows == self._num_rows:
            return self._full
        if num_rows == self._num_kept:
            return self._kept
        raise RuntimeError(f"LoRA: an input of {num_rows} rows in a step of {self._num_rows} rows "
                           f"({self._num_kept} kept)")


class LoraProjection:
    """The hook of one projection in one layer (`Linear.lora`): adds the step's adapters' deltas
    to its base output."""

    def __init__(self, layer: int, projection: str, state: LoraState) -> None:
        self.key = (layer, projection)
        self.state = state

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if not self.state.active:
            return out
        for adapter, rows in self.state.groups(x.shape[0]):
            weights = adapter.projections.get(self.key)
            if weights is None:  # this adapter leaves this projection alone
                continue
            xs = x if rows is None else x.index_select(0, rows)
            xa = xs @ weights.a
            if weights.covers_output:
                _add(out, rows, xa @ weights.parts[0].b)
                continue
            for part in weights.parts:  # q / k / v or gate / up: each its own output columns
                _add(out[:, part.out_start:part.out_end], rows, xa[:, part.rank_start:part.rank_end] @ part.b)
        return out


def _add(out: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> None:
    if rows is None:
        out += delta
    else:
        out.index_add_(0, rows, delta)

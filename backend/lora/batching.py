"""Applying many adapters in one ragged batch, without merging any into the base weights.

Per step the batch says which rows (tokens) each adapter owns (`LoraRows`, built with the
batch). Every adapted projection then adds each row's `(x @ A) @ B` (its own adapter's) to its
base output; rows of sequences without an adapter get nothing. Two ways, same sums:

* grouped (many rows, e.g. prompt chunks): per adapter present, its rows (a view when they
  are one run, as a prompt chunk's are; else gathered and scatter-added), two small products
  (S-LoRA / punica's grouping, by adapter rather than per token): `add_grouped`;
* stacked (few rows, e.g. decodes): every resident adapter at once through the slot stacks
  (stacks.py), a mask keeping each row's own slot: a few calls whatever the adapter count:
  `add_stacked`, the plain `(x, slots, A, B) -> delta` entry point a device kernel replaces.

In the grouped path each projection's parts (q / k / v, gate / up) go through one B product:
their B side by side in one [rank, out_features] matrix (adapter.fused_b), so a projection adds
one contiguous delta (torch's index_add_ into a column slice is several times slower).

Where the decoder layers run as one C++ call (kernels/cpu/decoder.py), that call adds the deltas
itself from each row's slot (`_Rows.row_slot`) in steps of any size; these paths then serve the
layers it leaves to Python (a last layer keeping only the sampling rows) and other backends.

With the Triton-lang kernels (attention backends triton / flash_attn: GPUs, or the CPU
interpreter) every projection's parts go through `lora_delta` instead (kernels/triton_lang/lora.py:
shrink and expand grouped by slot on the device, no host sync), straight from the stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitfuse.lora.adapter import LoraAdapter, ProjectionLora
from splitfuse.lora.stacks import LoraStacks, StackedProjection

# Inputs of at most this many rows take the stacked path. Measured on the bench model (hidden
# 512, 8 layers), 16 decodes over 4 adapters of rank 16 on all seven projections, 2 cores:
# grouped 9.5 ms per step against the base's 4.1 ms; the stacked path's extra products (every
# row through every slot's A) stay small next to the base product up to a few dozen rows.
STACKED_MAX_ROWS = 64
# In a step of more rows, an adapter's run of at least this many rows (a prompt chunk) takes the
# grouped path as a view of the input; shorter runs join the stacked rows.
RUN_MIN_ROWS = 8

Rows = slice | torch.Tensor  # one adapter's rows in a step: a run, or their indices
Groups = list[tuple[LoraAdapter, Rows]]


@dataclass
class LoraRows:
    """The rows of a step's batch each adapter owns."""

    names: list[str]
    row_adapter: np.ndarray  # int64 [rows]: index into `names`, -1 for the base
    kept_adapter: np.ndarray | None
    """The same over the last layer's kept rows (the sample rows), when it keeps fewer rows."""

    @classmethod
    def build(cls, seq_names: list[str | None], query_lens: np.ndarray,
              sample_rows: np.ndarray | None) -> "LoraRows | None":
        """From each sequence's adapter (None: the base) and its rows in the batch; `sample_rows`
        are the last layer's kept rows when it keeps fewer than all. None without any adapter."""
        names = sorted({n for n in seq_names if n is not None})
        if not names:
            return None
        index = {n: i for i, n in enumerate(names)}
        seq_adapter = np.fromiter((-1 if n is None else index[n] for n in seq_names), dtype=np.int64,
                                  count=len(seq_names))
        row_adapter = np.repeat(seq_adapter, query_lens)
        return cls(names=names, row_adapter=row_adapter,
                   kept_adapter=None if sample_rows is None else row_adapter[sample_rows])


class _Rows:
    """One input size's rows (the step's, or the last layer's kept ones) for both paths."""

    def __init__(self, row_adapter: np.ndarray, adapters: list[LoraAdapter], slots: list[int],
                 device: torch.device, stacked: bool | None = None) -> None:
        self.num_rows = len(row_adapter)
        if stacked is None:  # one adapter over every row goes grouped: in place, its own rank, no mask
            stacked = self.num_rows <= STACKED_MAX_ROWS and not (len(adapters) == 1 and (row_adapter == 0).all())
        self.stacked = stacked
        self.groups: Groups = []
        self.scattered: tuple[_Rows, torch.Tensor] | None = None
        """Rows outside the groups' runs (decodes beside prompt chunks), through the stacks."""
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._segments = None  # the Triton-lang kernel's grouping by slot, made once per step
        # Each row's slot: the stacked path's mask, and the fused C++ decoder's input (any step).
        slot_of = np.asarray(slots, dtype=np.int64)
        row_slot = np.where(row_adapter >= 0, slot_of[row_adapter], -1)
        self.row_slot: torch.Tensor = torch.from_numpy(row_slot).to(device, non_blocking=True)
        if self.stacked:
            return
        # Runs of one adapter's rows (prompt chunks) are views; the other rows, a few decodes each
        # of its own adapter, go through the stacks together: gathered once, whatever the adapters.
        left = np.zeros(self.num_rows, dtype=bool)
        for i, adapter in enumerate(adapters):
            rows = np.flatnonzero(row_adapter == i)
            for run in np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1) if len(rows) else ():
                if len(run) >= RUN_MIN_ROWS or len(run) == self.num_rows:
                    self.groups.append((adapter, slice(int(run[0]), int(run[-1]) + 1)))
                else:
                    left[run] = True
        rest = np.flatnonzero(left)
        if len(rest) <= STACKED_MAX_ROWS:
            if len(rest):
                self.scattered = (_Rows(row_adapter[rest], adapters, slots, device, stacked=True),
                                  torch.from_numpy(rest).to(device, non_blocking=True))
            return
        for i, adapter in enumerate(adapters):  # too many for the stacks: gathered by adapter
            rows = rest[row_adapter[rest] == i]
            if len(rows):
                self.groups.append((adapter, torch.from_numpy(rows).to(device, non_blocking=True)))

    def segments(self, num_slots: int):
        if self._segments is None:
            from splitfuse.kernels.triton_lang.lora import lora_segments

            self._segments = lora_segments(self.row_slot, num_slots)
        return self._segments

    def mask(self, stacked: StackedProjection, dtype: torch.dtype) -> torch.Tensor:
        """[rows, columns]: 1 where the column is the row's own slot's; shared by the projections
        of one layout within the step."""
        mask = self._masks.get(stacked.layout)
        if mask is None:
            mask = (self.row_slot[:, None] == stacked.col_slot[None, :]).to(dtype)
            self._masks[stacked.layout] = mask
        return mask


class LoraState:
    """The current step's adapters and their rows, shared by every adapted projection."""

    def __init__(self, stacks: LoraStacks | None = None, device_kernel: bool = False) -> None:
        self.stacks = stacks
        self.device_kernel = device_kernel
        """Whether the projections add their deltas with the Triton-lang kernel (`add_on_device`)."""
        self._full: _Rows | None = None
        self._kept: _Rows | None = None

    @property
    def active(self) -> bool:
        """Whether the step has any row with an adapter."""
        return self._full is not None

    def set_step(self, adapters: list[LoraAdapter], slots: list[int], rows: LoraRows | None,
                 device: torch.device) -> None:
        """`adapters` (resident, in `slots` of the stacks) in the order of `rows.names`."""
        if rows is None:
            self.clear()
            return
        self._full = _Rows(rows.row_adapter, adapters, slots, device)
        self._kept = None if rows.kept_adapter is None else _Rows(rows.kept_adapter, adapters, slots, device)

    def clear(self) -> None:
        self._full = self._kept = None

    @property
    def step_rows(self) -> _Rows:
        """The rows of the whole step (active steps only)."""
        return self._full

    def rows(self, num_rows: int) -> _Rows:
        """The rows of an input of `num_rows` rows: the step's, or (the last layer after
        attention) its kept rows, which are fewer by construction."""
        for rows in (self._full, self._kept):
            if rows is not None and rows.num_rows == num_rows:
                return rows
        raise RuntimeError(f"LoRA: an input of {num_rows} rows in a step of "
                           f"{self._full.num_rows if self._full else 0} rows")


class LoraProjection:
    """The hook of one projection in one layer (`Linear.lora`): adds the step's adapters' deltas
    to its base output."""

    def __init__(self, layer: int, projection: str, state: LoraState) -> None:
        self.key = (layer, projection)
        self.state = state

    def through(self, kernel, x: torch.Tensor) -> torch.Tensor:
        """`kernel(x)` with the step's deltas added to its sums before they are stored: a
        `CpuLinear` whose fused SwiGLU must see them (the deltas are made into zeros first, then
        handed to the kernel: the same sums and roundings as adding them to its plain product)."""
        if not self.state.active:
            return kernel(x)
        deltas = self(x, torch.zeros(x.shape[0], kernel.addend_features, dtype=x.dtype, device=x.device))
        return kernel.with_addend(x, deltas)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if not self.state.active:
            return out
        rows = self.state.rows(x.shape[0])
        if self.state.device_kernel:
            stacked = self.state.stacks.projections.get(self.key)
            if stacked is not None:
                add_on_device(x, out, stacked, rows, self.state.stacks.max_loras)
            return out
        if rows.stacked:
            stacked = self.state.stacks.projections.get(self.key)
            if stacked is not None:
                add_stacked(x, out, stacked, rows.mask(stacked, x.dtype))
            return out
        for adapter, group in rows.groups:
            weights = adapter.projections.get(self.key)
            if weights is not None:  # else this adapter leaves this projection alone
                add_grouped(x, out, group, weights)
        if rows.scattered is not None:
            stacked = self.state.stacks.projections.get(self.key)
            if stacked is not None:
                sub, index = rows.scattered
                add_stacked(x, out, stacked, sub.mask(stacked, x.dtype), index)
        return out


def add_grouped(x: torch.Tensor, out: torch.Tensor, rows: Rows, weights: ProjectionLora) -> None:
    """out[rows] += (x[rows] @ A) @ B for one adapter's rows (a slice when they are one run, as a
    prompt chunk's are: no gather or scatter), every part of the projection in one product."""
    if isinstance(rows, slice):
        out[rows] += weights.b_kernel(weights.a_kernel(x[rows]))
    else:
        out.index_add_(0, rows, weights.b_kernel(weights.a_kernel(x.index_select(0, rows))))


def add_stacked(x: torch.Tensor, out: torch.Tensor, stacked: StackedProjection, mask: torch.Tensor,
                rows: torch.Tensor | None = None) -> None:
    """out += ((x @ A_all) * mask) @ B_all: every row through its own slot of the stacks (the
    mask's [rows, columns] zeros elsewhere; base rows have none), as one delta
    `(x, slots, A, B) -> (x @ A_slot) @ B_slot` per row with the scale folded into B. With `rows`,
    those rows of x and out only (the mask's rows are theirs)."""
    xa = stacked.a_kernel(x if rows is None else x.index_select(0, rows)).mul_(mask)
    if rows is not None and len(stacked.parts) > 1:  # index_add_ into column slices is slow: one delta
        delta = torch.zeros(xa.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
        for part in stacked.parts:
            delta[:, part.out_start:part.out_end] = part.b_kernel(xa[:, part.col_start:part.col_end])
        out.index_add_(0, rows, delta)
        return
    for part in stacked.parts:
        delta = part.b_kernel(xa[:, part.col_start:part.col_end])
        target = out if part.out_end - part.out_start == out.shape[1] else out[:, part.out_start:part.out_end]
        if rows is None:
            target += delta
        else:
            target.index_add_(0, rows, delta)


def add_on_device(x: torch.Tensor, out: torch.Tensor, stacked: StackedProjection, rows: _Rows,
                  num_slots: int) -> None:
    """out += each row's own slot's delta, part by part, through the Triton-lang kernel reading
    the stacks in place (scale folded into B; base rows, slot -1, get nothing)."""
    from splitfuse.kernels.triton_lang.lora import lora_delta, slot_views

    for part in stacked.parts:
        a, b = slot_views(stacked.a[:, part.col_start:part.col_end], part.b, num_slots)
        lora_delta(x, rows.row_slot, a, b, out=out[:, part.out_start:part.out_end],
                   segments=rows.segments(num_slots))

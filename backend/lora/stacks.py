"""The resident adapters' weights stacked by slot, per projection, for steps of few rows.

A decode step of 16 sequences over 4 adapters, applied adapter by adapter, is hundreds of tiny
torch calls per step (gather, two products, scatter per adapter per projection) and their
dispatch costs more than their arithmetic. Stacked, every projection costs the same few calls
whatever the number of adapters: `x @ A_all` (every slot's A side by side), a mask keeping for
each row only its own slot's columns, and per output part one product with that part's B of
every slot stacked (not one product over a B padded with zeros to every output column: decodes
read the weights at memory speed, and the padding would triple the bytes of qkv's). The extra
arithmetic (each row through every slot's A) is small next to the base product at such row
counts; steps of many rows take the grouped path instead.

Layout of one projection: a slot's rank for part j is R_j, the largest rank any configured
adapter has there (shorter ones zero-padded); A's columns are part-major, slot-minor:
part j's block holds max_loras runs of R_j columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitfuse.lora.adapter import MLP_TARGETS, TARGETS, BaseShape, Kernel, LoraAdapter, MakeKernel, plain_kernel


@dataclass
class StackedPart:
    out_start: int
    out_end: int
    col_start: int  # part's block of A's columns / B's rows
    col_end: int
    rank: int  # R_j: columns per slot
    b: torch.Tensor  # [max_loras * R_j, out_end - out_start]
    b_kernel: Kernel | None = None


@dataclass
class StackedProjection:
    a: torch.Tensor  # [in, sum_j max_loras * R_j]
    parts: list[StackedPart]
    col_slot: torch.Tensor  # int64 [columns]: the slot each column belongs to
    layout: tuple[int, ...]  # the R_j: projections of equal layout share a step's mask
    a_kernel: Kernel | None = None


class LoraStacks:
    def __init__(self, adapters: list[LoraAdapter], base: BaseShape, max_loras: int, dtype: torch.dtype,
                 device: torch.device, make_kernel: MakeKernel = plain_kernel, reserve_rank: int = 0) -> None:
        """Zeroed stacks shaped for `adapters` (every configured one: a projection's layout holds
        the largest rank any of them has for each part), and with `reserve_rank` > 0 for an
        adapter of that rank on every projection (adapters loaded at run time: sized once here,
        so memory stays bounded whatever is loaded later)."""
        self.max_loras = max_loras
        self.make_kernel = make_kernel
        self._dirty = True
        self.version = 0  # counts the packs: holders of the kernels' addresses refresh on a change
        ranks: dict[tuple[int, str], dict[tuple[int, int], int]] = {}
        in_features: dict[tuple[int, str], int] = {}
        for adapter in adapters:
            for key, p in adapter.projections.items():
                in_features[key] = p.a.shape[0]
                for part in p.parts:
                    span = (part.out_start, part.out_end)
                    ranks.setdefault(key, {})[span] = max(ranks.get(key, {}).get(span, 0),
                                                         part.rank_end - part.rank_start)
        if reserve_rank > 0:
            _reserve(ranks, in_features, base, reserve_rank)
        self.projections: dict[tuple[int, str], StackedProjection] = {}
        for key, part_ranks in ranks.items():
            parts, col = [], 0
            for (start, end), r in sorted(part_ranks.items()):
                width = max_loras * r
                parts.append(StackedPart(start, end, col, col + width, r,
                                         torch.zeros(width, end - start, dtype=dtype, device=device)))
                col += width
            col_slot = torch.cat([torch.arange(max_loras, device=device).repeat_interleave(p.rank) for p in parts])
            self.projections[key] = StackedProjection(
                a=torch.zeros(in_features[key], col, dtype=dtype, device=device), parts=parts, col_slot=col_slot,
                layout=tuple(p.rank for p in parts))

    def pack(self) -> None:
        """Build the products' kernels from the stacks, if a write changed them."""
        if not self._dirty:
            return
        for stacked in self.projections.values():
            stacked.a_kernel = self.make_kernel(stacked.a.t().contiguous())
            for part in stacked.parts:
                part.b_kernel = self.make_kernel(part.b.t().contiguous())
        self._dirty = False
        self.version += 1

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` (weights already in the stacks' dtype and device) in `slot`; its parts
        shorter than the slot's are zero-padded, and projections it lacks are zeroed there. Call
        `pack` before the next product."""
        self._dirty = True
        for key, stacked in self.projections.items():
            mine = adapter.projections.get(key)
            by_span = {} if mine is None else {(p.out_start, p.out_end): p for p in mine.parts}
            for part in stacked.parts:
                cols = slice(part.col_start + slot * part.rank, part.col_start + (slot + 1) * part.rank)
                rows = slice(slot * part.rank, (slot + 1) * part.rank)
                stacked.a[:, cols] = 0
                part.b[rows] = 0
                src = by_span.get((part.out_start, part.out_end))
                if src is None:
                    continue
                r = src.rank_end - src.rank_start
                if r > part.rank:  # the folder changed since the start shaped the stacks
                    raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}): rank {r} at {key} is larger "
                                     f"than when the engine started ({part.rank}); restart to serve it")
                stacked.a[:, cols.start:cols.start + r] = mine.a[:, src.rank_start:src.rank_end]
                part.b[rows.start:rows.start + r] = src.b


def _reserve(ranks: dict[tuple[int, str], dict[tuple[int, int], int]], in_features: dict[tuple[int, str], int],
             base: BaseShape, rank: int) -> None:
    """Grow every part of every projection an adapter may adapt to at least `rank`."""
    for target, (projection, part) in TARGETS.items():
        if base.moe and target in MLP_TARGETS:
            continue  # refused by load_adapter on such a base
        offsets = base.part_offsets(projection)
        span = (offsets[part], offsets[part + 1])
        for layer in range(base.num_layers):
            key = (layer, projection)
            in_features[key] = base.in_out(target)[0]
            ranks.setdefault(key, {})[span] = max(ranks.get(key, {}).get(span, 0), rank)

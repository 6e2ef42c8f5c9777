"""What rank 0 sends the other ranks each step, and moving it between devices.

A step is described by its RaggedBatch (token ids, positions, the attention metadata: slot
mapping, block tables, query starts, context lengths, sampling rows, plus scalars). It is
sent as it is, pickled, rather than as a fixed list of fields, so fields added to
RaggedBatch or AttentionMetadata later travel without changes here. Tensors go as CPU
tensors and are moved to each rank's own device on arrival.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMessage:
    kind: str  # "step" | "stop"
    batch: Any = None


def to_device(obj: Any, device: torch.device) -> Any:
    """A copy of `obj` with every tensor inside it (dataclass fields, lists, tuples, dicts) on
    `device`; other values are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
